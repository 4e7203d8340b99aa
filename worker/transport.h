// How a worker reaches the parameter servers. The real transport is gRPC;
// tests wrap it to drop, duplicate or delay frames.
#ifndef PSTRAIN_WORKER_TRANSPORT_H_
#define PSTRAIN_WORKER_TRANSPORT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"

namespace pstrain {
class RpcMetrics;
}

namespace pstrain::worker {

enum class ParameterMethod { kPush, kPull, kPushPull };

// One stream to one server: requests go out in order, then the stream is
// half-closed; on_sent runs once the last request is written; every reply
// is handed to on_reply; on_done runs last, once, with the stream's final
// status. Callbacks run on transport threads.
class ParameterTransport {
 public:
  using SentFn = std::function<void()>;
  using ReplyFn = std::function<void(const grpc::ByteBuffer& reply)>;
  using DoneFn = std::function<void(absl::Status status)>;

  virtual ~ParameterTransport() = default;

  virtual int num_servers() const = 0;

  virtual void StartExchange(int server, ParameterMethod method,
                             std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                             SentFn on_sent, ReplyFn on_reply, DoneFn on_done) = 0;

  // Cancels every exchange in flight (they end with CANCELLED).
  virtual void CancelAll() = 0;
};

// The gRPC transport: one channel per server address, measured by `metrics`
// if set. INVALID_ARGUMENT on an empty address list.
absl::StatusOr<std::unique_ptr<ParameterTransport>> CreateGrpcTransport(
    const std::vector<std::string>& server_addresses, RpcMetrics* metrics = nullptr);

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_TRANSPORT_H_
