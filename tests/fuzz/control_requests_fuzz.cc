// The coordinator's request validation: any bytes as the request of any
// method of the control API and the membership service, sent over
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

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/coordinator.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

struct Method {
  const char* name;
  bool streaming;  // a stream of replies, or of requests
};
constexpr Method kMethods[] = {
    {"/pstrain.v1.Control/SubmitJob", false},        {"/pstrain.v1.Control/GetJob", false},
    {"/pstrain.v1.Control/ListJobs", false},         {"/pstrain.v1.Control/CancelJob", false},
    {"/pstrain.v1.Control/ListNodes", false},        {"/pstrain.v1.Control/CheckpointJob", false},
    {"/pstrain.v1.Membership/Register", false},      {"/pstrain.v1.Membership/Heartbeat", false},
    {"/pstrain.v1.Membership/ReportProgress", false}, {"/pstrain.v1.Control/WatchJob", true},
    {"/pstrain.v1.Control/ExportModel", true},       {"/pstrain.v1.Membership/Session", true},
    {"/pstrain.v1.Membership/UploadModel", true},
};
constexpr size_t kNumMethods = sizeof(kMethods) / sizeof(kMethods[0]);

// A call's end, shared by the caller and gRPC's callback (which may still be
// returning when the caller goes on).
struct CallEnd {
  grpc::ClientContext context;
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  grpc::Status status ABSL_GUARDED_BY(mu);

  void Set(const grpc::Status& s) {
    absl::MutexLock lock(&mu);
    status = s;
    done = true;
  }
  // The status, waiting at most `patience` for it (then the call is
  // cancelled and its end awaited).
  grpc::Status Await(absl::Duration patience) {
    mu.Lock();
    if (!mu.AwaitWithTimeout(absl::Condition(&done), patience)) {
      mu.Unlock();
      context.TryCancel();
      mu.Lock();
      mu.Await(absl::Condition(&done));
    }
    grpc::Status s = status;
    mu.Unlock();
    return s;
  }
};

// A streaming call with one request message: its first reply (or its end)
// shows the request was handled; a stream that goes on (a watch, a node's
// session) is cancelled after a short while. Deletes itself when done.
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamCall(grpc::GenericStub* stub, const char* method, const grpc::ByteBuffer& request,
             std::shared_ptr<CallEnd> end)
      : request_(request), end_(std::move(end)) {
    stub->PrepareBidiStreamingCall(&end_->context, method, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&reply_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (ok) end_->context.TryCancel();
  }
  void OnDone(const grpc::Status& status) override {
    end_->Set(status);
    delete this;
  }

 private:
  const grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
  const std::shared_ptr<CallEnd> end_;
};

grpc::Status Call(grpc::GenericStub* stub, const Method& method, const grpc::ByteBuffer& request) {
  auto end = std::make_shared<CallEnd>();
  // A request never answered is a failure; the deadline is long enough for
  // any machine.
  end->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (method.streaming) {
    new StreamCall(stub, method.name, request, end);
    return end->Await(absl::Milliseconds(50));
  }
  auto response = std::make_shared<grpc::ByteBuffer>();
  stub->UnaryCall(&end->context, method.name, grpc::StubOptions(), &request, response.get(),
                  [end, response](grpc::Status s) { end->Set(s); });
  return end->Await(absl::InfiniteDuration());
}

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
  const grpc::Status status = Call(stub, kMethods[data[0] % kNumMethods], request);
  // A request never answered (60 s), a coordinator gone or an exception
  // escaping a handler is a failure; every other status is an answer.
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
      status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::UNKNOWN) {
    abort();
  }
  return 0;
}
