// pstrain-bench's sub-commands. Each prints a table and one JSON line per
// row, and returns the process's exit code.
#ifndef PSTRAIN_BENCH_BENCH_H_
#define PSTRAIN_BENCH_BENCH_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/job_spec.h"
#include "worker/transport.h"

namespace pstrain::bench {

struct TransportBenchOptions {
  std::vector<int> model_mib = {1, 4, 16, 64};
  // (workers, servers)
  std::vector<std::pair<int, int>> shapes = {{1, 1}, {2, 2}, {4, 4}};
  int64_t chunk_bytes = 1 << 20;
  // The workers' gRPC transports (same_machine_sockets is set per row);
  // metrics are not used.
  worker::GrpcTransportOptions grpc;
  // How long each configuration is timed, pstrain and the plain sockets.
  absl::Duration duration = absl::Seconds(4);
  // Which carriers run: any of "tcp", "grpc-tcp", "unix", "shm".
  std::vector<std::string> transports = {"tcp", "grpc-tcp", "unix", "shm"};
};
int RunTransportBench(const TransportBenchOptions& options);

// The servers of one transport configuration, in a process of their own
// (pstrain-bench transport_servers, started by the transport bench): a job
// of JobOfSize(floats, servers, workers, chunk_bytes), its addresses
// written to address_file, until SIGTERM.
struct TransportServersOptions {
  int64_t floats = 0;
  int servers = 1;
  int workers = 1;
  int64_t chunk_bytes = 1 << 20;
  std::string address_file;
  // Plain gRPC echo servers instead (bench/grpc_echo.h).
  bool echo = false;
  // Not 0: the sparse bench's job (SparseJobOf) with a table of this dim.
  int table_dim = 0;
};
int RunTransportServers(const TransportServersOptions& options);

// sparse (bench/sparse_bench.cc): rows per second of sparse pull and push
// at `keys` distinct keys per worker and step, against plain TCP.
struct SparseBenchOptions {
  std::vector<int> keys = {1024, 4096, 16384, 65536};
  std::vector<std::pair<int, int>> shapes = {{1, 1}, {2, 2}};
  int dim = 16;
  absl::Duration duration = absl::Seconds(4);
};
int RunSparseBench(const SparseBenchOptions& options);
// The sync click-model job the sparse bench's servers hold: one table of
// `dim`, a dense part of a few floats.
v1::JobSpec SparseJobOf(int workers, int servers, int dim);

// tables (bench/table_bench.cc): a table's step at its cap, at server
// sizes of `rows` rows: its time, that of its row updates alone, and the
// difference (admission, eviction and TTL).
struct TableBenchOptions {
  std::vector<int64_t> rows = {1'000'000, 10'000'000, 50'000'000};
  int keys = 4096;  // a step's distinct keys: a click job's per table and server
  std::string policy = "lru";
  int warmup_steps = 20;
  int steps = 200;
};
int RunTableBench(const TableBenchOptions& options);

// rows (bench/row_update_bench.cc): a table's row updates a second, for
// each compact-row option, on a table ten times the last-level cache (or
// `rows` rows), against memcpy's bandwidth.
struct RowUpdateBenchOptions {
  int64_t rows = 0;  // 0: ten times the last-level cache
  int warmup_steps = 20;
  int steps = 200;
};
int RunRowUpdateBench(const RowUpdateBenchOptions& options);

struct ApplyBenchOptions {
  int mib = 64;
  std::vector<int> workers = {1, 4};
  int64_t chunk_bytes = 1 << 20;
  int steps = 5;
};
int RunApplyBench(const ApplyBenchOptions& options);

struct TrainBenchOptions {
  // Per worker; the quick-start job's batch and chunks.
  int batch = 64;
  int steps = 2000;
  int64_t chunk_bytes = 64 << 10;
  std::string bin_dir;  // where pstrain-local is
};
int RunTrainBench(const TrainBenchOptions& options);

struct CheckpointBenchOptions {
  int pairs = 5;             // runs with and without checkpoints, one after the other
  int64_t every_steps = 100;
  int64_t steps = 0;         // 0: the quick start's 3 epochs
  std::string bin_dir;       // where pstrain-local is
};
int RunCheckpointBench(const CheckpointBenchOptions& options);

struct TlsBenchOptions {
  int pairs = 5;        // runs of the quick-start job with and without --tls, one after the other
  int64_t steps = 0;    // 0: the quick start's 3 epochs
  std::string bin_dir;  // where pstrain-local is
};
int RunTlsBench(const TlsBenchOptions& options);

struct RecoveryBenchOptions {
  int kills = 10;             // of a server, then of a worker, restarted under their ids
  int spare_kills = 3;        // of servers that stay dead (a spare takes over)
  int64_t every_steps = 100;  // the job's checkpoints
  absl::Duration spare_lease = absl::Seconds(4);
  int replace_after_seconds = 3;
  std::string bin_dir;  // where pstrain-coordinator, -server, -worker are
};
int RunRecoveryBench(const RecoveryBenchOptions& options);

struct ConvBenchOptions {
  std::vector<int> conv = {32, 64};  // the shape of examples/fashion_cnn.yaml
  std::vector<int> hidden = {128};
  int batch = 64;
  double seconds = 8;  // per layer, both passes and both sides
  int rounds = 4;      // alternations of the two sides
};
int RunConvBench(const ConvBenchOptions& options);

struct SspBenchOptions {
  // Staleness bounds, one job each; kUnboundedStaleness: a bound past the
  // job's steps. Ratios are against the first.
  std::vector<int64_t> staleness = {0, 1, 4, kUnboundedStaleness};
  int batch = 64;     // per worker, as the quick start
  int steps = 1000;   // per worker
};
int RunSspBench(const SspBenchOptions& options);

}  // namespace pstrain::bench

#endif  // PSTRAIN_BENCH_BENCH_H_
