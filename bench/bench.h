// pstrain-bench's sub-commands. Each prints a table and one JSON line per
// row, and returns the process's exit code.
#ifndef PSTRAIN_BENCH_BENCH_H_
#define PSTRAIN_BENCH_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "worker/transport.h"

namespace pstrain::bench {

struct TransportBenchOptions {
  std::vector<int> model_mib = {4, 16, 64, 256};
  std::vector<int> servers = {1, 2, 4};
  std::vector<int> workers = {1, 2, 4};
  int64_t chunk_bytes = 1 << 20;
  // The workers' gRPC transports; metrics are not used.
  worker::GrpcTransportOptions grpc;
  // Each configuration runs enough steps to move about this much.
  double bytes_per_config = 4.0 * (1 << 30);
};
int RunTransportBench(const TransportBenchOptions& options);

struct ApplyBenchOptions {
  int mib = 64;
  std::vector<int> workers = {1, 4};
  int64_t chunk_bytes = 1 << 20;
  int steps = 5;
};
int RunApplyBench(const ApplyBenchOptions& options);

struct TrainBenchOptions {
  int batch = 512;
  int steps = 300;
  // 256 KiB: the first layer's weight (0.77 MiB) in 4 chunks, spread over
  // 2 servers, each message large enough that gRPC's per-message costs stay
  // small.
  int64_t chunk_bytes = 256 << 10;
  std::string bin_dir;  // where pstrain-local is
};
int RunTrainBench(const TrainBenchOptions& options);

}  // namespace pstrain::bench

#endif  // PSTRAIN_BENCH_BENCH_H_
