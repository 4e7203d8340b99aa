// gRPC helpers: the one place where absl::Status and grpc::Status meet,
// channel construction with deliberate limits, and deadlines.
#ifndef PSTRAIN_COMMON_RPC_H_
#define PSTRAIN_COMMON_RPC_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace pstrain {

// Largest gRPC message any pstrain process sends or accepts: the largest
// chunk (64 MiB, the job-spec limit) plus room for the frame header.
inline constexpr int kMaxMessageBytes = 64 * 1024 * 1024 + 64 * 1024;

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// An insecure channel to `address` with pstrain's message limits and
// keepalive settings. `pool_index` makes channels with otherwise identical
// arguments distinct, so that they do not share one TCP connection.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, int pool_index = 0);

// Applies pstrain's limits to a server under construction.
void ConfigureServerBuilder(grpc::ServerBuilder& builder);

inline std::chrono::system_clock::time_point ToChronoTime(absl::Time t) {
  return absl::ToChronoTime(t);
}

// Sets the deadline of `context` to now + timeout.
inline void SetTimeout(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_H_
