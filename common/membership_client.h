// A node's side of membership: register with the coordinator, heartbeat
// under the lease, hand each heartbeat reply to the node, report progress.
#ifndef PSTRAIN_COMMON_MEMBERSHIP_CLIENT_H_
#define PSTRAIN_COMMON_MEMBERSHIP_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/retry.h"
#include "pstrain/v1/membership.grpc.pb.h"

namespace pstrain {

class RpcMetrics;
class TransportSecurity;

class MembershipClient {
 public:
  struct Options {
    std::string coordinator_address;  // host:port
    v1::NodeRole role = v1::NODE_ROLE_UNSPECIFIED;
    // The node's id (--node_id): a process that starts under the id of a
    // lost node takes its place. Empty: the node names itself at random.
    std::string node_id;
    std::string address;  // what the node serves on, if anything
    int64_t max_memory_bytes = 0;  // capacity for jobs; 0 = unlimited
    std::string metrics_address;   // host:port of the node's /metrics, if any
    // Workers: the only job the node works on (RegisterRequest.join_job).
    std::string join_job;
    // Servers: the worker node whose process this is
    // (RegisterRequest.colocated_with).
    std::string colocated_with;
    // Servers: where a job's checkpoint.dir must lie; empty: anywhere
    // (RegisterRequest.checkpoint_root).
    std::string checkpoint_root;
    RpcMetrics* rpc = nullptr;     // measures the calls to the coordinator
    // Mutual TLS to the coordinator; null: plaintext. Must outlive the client.
    const TransportSecurity* security = nullptr;
    // Used until the coordinator suggests its own interval at registration.
    absl::Duration heartbeat_interval = absl::Seconds(1);
    absl::Duration rpc_timeout = absl::Seconds(5);
    // What ReportProgress and UploadModel retry (their patience is given per
    // call). NOT_FOUND is an unknown job: permanent.
    RetryPolicy retry = RetryPolicy::Transient();
    // If positive: call on_coordinator_lost once the coordinator has not
    // answered for this long. Zero: keep trying forever.
    absl::Duration coordinator_loss_timeout = absl::ZeroDuration();
  };
  struct Callbacks {
    // The jobs the node holds or runs now (sent with every heartbeat).
    std::function<std::vector<v1::HeldJob>()> held_jobs;
    // Every heartbeat reply, on the heartbeat thread.
    std::function<void(const v1::HeartbeatResponse&)> on_heartbeat;
    std::function<void()> on_coordinator_lost;
    // Another process holds the node's id now: this one must stop. Called
    // once, on the heartbeat thread, which then ends.
    std::function<void(const absl::Status&)> on_fenced;
  };

  MembershipClient(Options options, Callbacks callbacks);
  ~MembershipClient();  // Stop()

  // Starts the heartbeat thread (which registers first).
  void Start();
  // Stops the thread; waits for it.
  void Stop();

  // Sends one progress report; retries transient errors until the
  // coordinator answers or `patience` runs out. Returns whether the job is
  // still active there.
  absl::StatusOr<bool> ReportProgress(v1::ReportProgressRequest request, absl::Duration patience);

  // Uploads a job's model file (worker 0, at the end of a job); retries
  // transient errors (and ALREADY_EXISTS: an earlier try still being
  // received) until the coordinator answers or `patience` runs out.
  absl::Status UploadModel(const std::string& job_id, const std::string& file,
                           absl::Duration patience);

  // The node's id: given or chosen at construction, confirmed by the
  // coordinator.
  std::string node_id() const;
  // Whether the coordinator has this node registered: from its first
  // answer to Register until it forgets the node, fences it or Stop().
  bool registered() const { return registered_; }
  // This process's incarnation: random, never 0.
  uint64_t incarnation() const { return incarnation_; }

 private:
  class SessionReader;

  void Loop();
  absl::Status Register();
  absl::Status Heartbeat();
  // Opens the session stream if it is not open (the loop's thread only).
  void KeepSessionOpen();
  void CloseSession();
  // Called by the session: heartbeat now / the stream ended.
  void Nudge();
  void SessionEnded();
  // Retries `call` by `policy` until it succeeds, fails for good, runs out
  // of patience, or Stop().
  absl::Status Retry(const RetryPolicy& policy, absl::FunctionRef<absl::Status()> call);

  const Options options_;
  const Callbacks callbacks_;
  std::unique_ptr<v1::Membership::Stub> stub_;
  const uint64_t incarnation_;
  mutable absl::Mutex mu_;
  std::string node_id_ ABSL_GUARDED_BY(mu_);
  absl::Duration interval_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool nudged_ ABSL_GUARDED_BY(mu_) = false;  // the coordinator asked for a heartbeat
  MonotonicCondVar wake_;                        // stopping_ or nudged_ set
  // The session stream (the loop's thread opens and destroys it).
  std::unique_ptr<SessionReader> session_;
  bool session_ended_ ABSL_GUARDED_BY(mu_) = true;
  std::atomic<bool> registered_{false};
  std::thread thread_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_MEMBERSHIP_CLIENT_H_
