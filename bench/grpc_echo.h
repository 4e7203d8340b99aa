// The transport bench's plain-gRPC baseline: the exchanges of a sync step
// made by a program with no pstrain code in it, to tell what gRPC itself
// costs from what pstrain adds. Per step each worker opens one bidi stream
// to each server (gRPC's generic callback API, default channel and server
// options) and sends the server's share of the model in chunk-sized
// messages, which the server echoes as it reads them, then a small message
// (the step end) on a stream of its own; the step ends when every echo is
// back.
#ifndef PSTRAIN_BENCH_GRPC_ECHO_H_
#define PSTRAIN_BENCH_GRPC_ECHO_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pstrain::bench {

// `n` echo servers on 127.0.0.1 (free ports), until destroyed.
class GrpcEchoServers {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcEchoServers>> Start(int n);
  ~GrpcEchoServers();
  const std::vector<std::string>& addresses() const { return addresses_; }

  struct Impl;

 private:
  GrpcEchoServers() = default;
  std::vector<std::unique_ptr<Impl>> servers_;
  std::vector<std::string> addresses_;
};

// Bytes moved (sent and echoed) per second by `workers` workers, each
// sending share_bytes[s] to server s per step in messages of at most
// chunk_bytes, for `duration`; *steps: worker 0's steps.
absl::StatusOr<double> GrpcEchoRate(const std::vector<std::string>& addresses,
                                    const std::vector<int64_t>& share_bytes, int workers,
                                    int64_t chunk_bytes, absl::Duration duration, int64_t* steps);

}  // namespace pstrain::bench

#endif  // PSTRAIN_BENCH_GRPC_ECHO_H_
