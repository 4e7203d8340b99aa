// The coordinator's request validation: any bytes as the request of any
// unary method of the control API and the membership service, sent over
// real gRPC on loopback to an in-process coordinator (no TLS, no tokens:
// every handler is reached). Whatever a request says, it is answered (OK or
// an error status) and the coordinator keeps serving; state accumulates
// across inputs as it would from a stream of hostile clients, held within
// the coordinator's limits.
//
// Input: one byte that picks the method, then the request's bytes.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/rpc.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/coordinator.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr const char* kMethods[] = {
    "/pstrain.v1.Control/SubmitJob",         "/pstrain.v1.Control/GetJob",
    "/pstrain.v1.Control/ListJobs",          "/pstrain.v1.Control/CancelJob",
    "/pstrain.v1.Control/ListNodes",         "/pstrain.v1.Control/CheckpointJob",
    "/pstrain.v1.Membership/Register",       "/pstrain.v1.Membership/Heartbeat",
    "/pstrain.v1.Membership/ReportProgress",
};
constexpr size_t kNumMethods = sizeof(kMethods) / sizeof(kMethods[0]);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static pstrain::server::Coordinator* const coordinator = [] {
    absl::StatusOr<std::unique_ptr<pstrain::server::Coordinator>> c =
        pstrain::server::Coordinator::Create({});
    if (!c.ok()) abort();
    return c->release();
  }();
  static grpc::GenericStub* const stub =
      new grpc::GenericStub(pstrain::MakeChannel(coordinator->address()));
  if (size < 1) return 0;
  const grpc::Slice slice(data + 1, size - 1);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  // A request that is never answered is a failure; the deadline is long
  // enough for any machine.
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  absl::Notification done;
  grpc::Status status;
  stub->UnaryCall(&context, kMethods[data[0] % kNumMethods], grpc::StubOptions(), &request,
                  &response, [&](grpc::Status s) {
                    status = std::move(s);
                    done.Notify();
                  });
  done.WaitForNotification();
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
      status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::UNKNOWN) {
    abort();
  }
  return 0;
}
