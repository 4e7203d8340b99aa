// What every carrier of the parameter service shares: the session
// interface a stream implements (ReplyingStream), the handling of a
// stream's requests (StreamRequests: each frame checked and handed to the
// shard store), the clients' budgets (ClientLoad) and who may send what
// (WorkerRoster). The carriers: grpc_streams.h (gRPC reactors),
// direct_peers.h (shared memory and TCP), in_process_sessions.h (this
// process's own worker).
#ifndef PSTRAIN_SERVER_PARAMETER_STREAMS_H_
#define PSTRAIN_SERVER_PARAMETER_STREAMS_H_

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/chunk_codec.h"
#include "common/status.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/shard_store.h"

namespace pstrain::server {

using Method = ParameterMethod;

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

// The replies a stream owes its client, counted in the client's budget: one
// more for each request (Owe), one fewer for each reply (Pay); what is
// still owed when the stream goes (waits the store dropped) is paid then.
// Not thread-safe: a stream calls it under its own lock.
class OwedReplies {
 public:
  OwedReplies(ClientLoad* load, std::string client) : load_(load), client_(std::move(client)) {}
  ~OwedReplies() { load_->Paid(client_, owed_); }
  // RESOURCE_EXHAUSTED past the client's limit (nothing owed then).
  absl::Status Owe() {
    PSTRAIN_RETURN_IF_ERROR(load_->Owe(client_));
    ++owed_;
    return absl::OkStatus();
  }
  void Pay() {
    --owed_;
    load_->Paid(client_, 1);
  }
  int64_t count() const { return owed_; }

 private:
  ClientLoad* const load_;
  const std::string client_;
  int64_t owed_ = 0;
};

// A stream as the store and the request handling see it, whatever carries
// it (gRPC, a direct connection, a call in this process): the session
// interface each carrier implements. Every request owes one reply, which
// the store's waits or an ACK pay.
class ReplyingStream : public ChunkWaiter {
 public:
  // Called for every request before it is handled: it owes one reply.
  // RESOURCE_EXHAUSTED past the client's limit.
  virtual absl::Status ExpectReply() = 0;
  virtual void Reply(grpc::ByteBuffer frame) = 0;
  // Ends the stream with `status`; later replies are dropped.
  virtual void Fail(const absl::Status& status) = 0;

  // The values a wait asked for, sent as a VALUES reply.
  void OnValues(const v1::ChunkHeader& request, const ChunkValues& values) final;
  void OnAbort(const absl::Status& status) final { Fail(status); }
};

// The requests of one stream: each frame checked and handed to the store,
// which answers through the stream. The stream's carrier calls it from one
// thread at a time.
class StreamRequests {
 public:
  // `caller`: the node id of the client's certificate, checked against
  // `roster` for every frame; nullopt: plaintext, not checked.
  StreamRequests(ShardStore* store, Method method, const WorkerRoster* roster,
                 std::optional<std::string> caller)
      : store_(store), method_(method), roster_(roster), caller_(std::move(caller)) {}

  // An error ends the stream (nothing was handed to the store).
  // `borrowed`: the request lies in memory the peer may change and that is
  // this process's only during the call (ShardStore::Push).
  absl::Status Handle(const grpc::ByteBuffer& request,
                      const std::shared_ptr<ReplyingStream>& stream, bool borrowed = false);

  // The stream is gone: its waits are dropped now, which releases the
  // client's budget.
  void DropWaits();

 private:
  ShardStore* const store_;
  const Method method_;
  const WorkerRoster* const roster_;
  const std::optional<std::string> caller_;
  // The chunks where the stream's requests may wait, by job.
  std::set<std::pair<std::string, uint32_t>> parked_;
};

// What a carrier's streams are served by. Everything must outlive them.
struct StreamContext {
  ShardStore* store = nullptr;
  const WorkerRoster* roster = nullptr;
  ClientLoad* load = nullptr;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_PARAMETER_STREAMS_H_
