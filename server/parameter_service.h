// The parameter service (proto/pstrain/v1/parameters.proto) on gRPC's
// generic callback API: raw chunk frames in, raw chunk frames out, and no
// thread held while a push waits for its step's barrier.
#ifndef PSTRAIN_SERVER_PARAMETER_SERVICE_H_
#define PSTRAIN_SERVER_PARAMETER_SERVICE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/chunk_codec.h"
#include "common/direct_connection.h"
#include "common/in_process_service.h"
#include "grpcpp/generic/async_generic_service.h"
#include "server/shard_store.h"

namespace pstrain::server {

// Which node runs which worker of each job the server holds, as the
// coordinator said: over TLS a frame is accepted only from its worker's
// certificate. Thread-safe.
class WorkerRoster {
 public:
  // Job `job_id` runs at `generation` on `workers` (node ids by index). The
  // previous generation's list is kept for the frames of that generation
  // that arrive while the new one loads.
  void Set(const std::string& job_id, int64_t generation, std::vector<std::string> workers);
  void Remove(const std::string& job_id);

  // OK if node `caller` may send `header`: a PUSH or STEP_END only as the
  // worker it is, a PULL as any worker of the job. PERMISSION_DENIED
  // otherwise; NOT_FOUND for a job not held; UNAVAILABLE for a generation
  // not known yet (the client retries), ABORTED for one that is over.
  absl::Status Check(const std::string& caller, const v1::ChunkHeader& header) const;

 private:
  struct Generation {
    int64_t generation = 0;
    std::vector<std::string> workers;
  };
  struct Job {
    Generation current, previous;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
};

// What one client may hold open on a server: streams, and the replies they
// owe it (pulls, and pushes waiting for their step's values; each parks in
// the shard store until answered). A client is the node of its certificate,
// or, in plaintext, its IP address: every process of one host shares a
// budget. Past either, the stream (or the request) is refused with
// RESOURCE_EXHAUSTED naming the limit, before anything reaches the store.
struct ClientLimits {
  int streams = 256;
  int64_t owed_replies = 16384;
};

// The streams and owed replies of every client. Thread-safe.
class ClientLoad {
 public:
  explicit ClientLoad(ClientLimits limits) : limits_(limits) {}
  // RESOURCE_EXHAUSTED if the client has limits.streams open already.
  absl::Status OpenStream(const std::string& client);
  void CloseStream(const std::string& client);
  // RESOURCE_EXHAUSTED if the client is owed limits.owed_replies already.
  absl::Status Owe(const std::string& client);
  void Paid(const std::string& client, int64_t replies);

 private:
  struct Load {
    int streams = 0;
    int64_t owed = 0;
  };
  void Forget(std::map<std::string, Load>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClientLimits limits_;
  absl::Mutex mu_;
  std::map<std::string, Load> clients_ ABSL_GUARDED_BY(mu_);
};

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
  class DirectPeer;
  class InProcessSession;

  // Starts a peer for each connection `listener` accepts.
  absl::Status AddListener(absl::StatusOr<std::unique_ptr<DirectListener>> listener);
  void Accept(std::unique_ptr<DirectConnection> connection);

  ShardStore* const store_;
  const WorkerRoster* const roster_;
  ClientLoad load_;
  mutable absl::Mutex hello_mu_;
  std::string hello_ ABSL_GUARDED_BY(hello_mu_);  // serialized v1::HelloReply
  uint64_t instance_ ABSL_GUARDED_BY(hello_mu_) = 0;
  absl::Mutex direct_mu_;
  std::vector<std::unique_ptr<DirectListener>> direct_listeners_ ABSL_GUARDED_BY(direct_mu_);
  std::vector<std::unique_ptr<DirectPeer>> direct_peers_ ABSL_GUARDED_BY(direct_mu_);
  bool direct_stopped_ ABSL_GUARDED_BY(direct_mu_) = false;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_PARAMETER_SERVICE_H_
