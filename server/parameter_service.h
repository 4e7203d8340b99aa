// The parameter service (proto/pstrain/v1/parameters.proto): raw chunk
// frames in, raw chunk frames out, and no thread held while a push waits
// for its step's barrier. Three carriers serve the same streams, each in
// files of its own over the same request handling (parameter_streams.h):
// gRPC (grpc_streams.h), direct connections through shared memory or TCP
// (direct_peers.h), and calls from this process's own worker
// (in_process_sessions.h).
#ifndef PSTRAIN_SERVER_PARAMETER_SERVICE_H_
#define PSTRAIN_SERVER_PARAMETER_SERVICE_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/direct_connection.h"
#include "common/in_process_service.h"
#include "grpcpp/generic/async_generic_service.h"
#include "server/direct_peers.h"
#include "server/parameter_streams.h"
#include "server/shard_store.h"

namespace pstrain::server {

// Register with ServerBuilder::RegisterCallbackGenericService. The store
// and the roster must outlive the gRPC server. A stream ends OK once the
// client has half-closed and every request has been answered; a bad frame
// ends it with INVALID_ARGUMENT (NOT_FOUND for a job not held) and the
// message. Over TLS every frame is checked against the roster first.
// Hello is answered with `hello` (SetHello), whoever asks.
//
// The same service is offered to processes of this machine over shared
// memory (ServeSharedMemory): the same streams, limits and errors, with
// the frames in memory both processes map instead of in gRPC messages.
//
// And to the worker of this very process, if it has one (colocated), by
// direct calls (InProcessService).
class ParameterService final : public grpc::CallbackGenericService, public InProcessService {
 public:
  ParameterService(ShardStore* store, const WorkerRoster* roster, ClientLimits limits = {});
  ~ParameterService() override;  // StopDirectConnections()

  // What Hello answers from now on. Thread-safe.
  void SetHello(const v1::HelloReply& hello);

  // Takes shared-memory connections at abstract socket `name` from clients
  // that ask for `instance` (plaintext only: no certificate is checked).
  // UNAVAILABLE if the name cannot be bound.
  absl::Status ServeSharedMemory(const std::string& name, uint64_t instance,
                                 const ShmOptions& options);
  // Takes direct TCP connections (the same messages over a socket, no
  // gRPC) on a free port of `host` from clients that ask for `instance`
  // (plaintext only). Returns the port.
  absl::StatusOr<int> ServeDirectTcp(const std::string& host, uint64_t instance,
                                     const ShmOptions& options);
  // Stops taking either and ends those open (their streams end as a gone
  // client's do). Idempotent.
  void StopDirectConnections();

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

  // InProcessService; sessions must not outlive the service.
  uint64_t instance() const override;
  std::unique_ptr<Session> OpenSession() override;

 private:
  ShardStore* const store_;
  const WorkerRoster* const roster_;
  ClientLoad load_;
  DirectPeers direct_;
  mutable absl::Mutex hello_mu_;
  std::string hello_ ABSL_GUARDED_BY(hello_mu_);  // serialized v1::HelloReply
  uint64_t instance_ ABSL_GUARDED_BY(hello_mu_) = 0;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_PARAMETER_SERVICE_H_
