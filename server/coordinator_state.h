// What the coordinator's parts share: the jobs, the nodes, their sessions
// and the model uploads, under one lock (`mu`), and Commit, the one way the
// jobs change.
//
// Reads never wait on the disk: a change that must be durable is decided
// under `mu` on a Txn (job_table.h), written to the job store with `mu`
// released, and only then installed and acknowledged. Commits are
// serialized by `write_mu`, so what was decided still holds when it is
// installed. The parts that use it: the control service (the control API),
// the membership service (nodes), the control loop (leases, recovery,
// scheduling); coordinator.cc builds them around one CoordinatorState.
#ifndef PSTRAIN_SERVER_COORDINATOR_STATE_H_
#define PSTRAIN_SERVER_COORDINATOR_STATE_H_

#include <map>
#include <memory>
#include <random>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/file_system.h"
#include "server/coordinator.h"
#include "server/job_store.h"
#include "server/job_table.h"
#include "server/model_store.h"
#include "server/node_registry.h"

namespace pstrain::server {

class NodeSession;  // node_session.h

class CoordinatorState {
 public:
  // `options` must outlive the state.
  explicit CoordinatorState(const Coordinator::Options& options);

  // Opens the state directory, if any, and rebuilds the jobs from it:
  // pending jobs queue again, running jobs wait for their nodes to come
  // back (for one lease). The job store's error if it cannot be opened.
  absl::Status Recover() ABSL_LOCKS_EXCLUDED(write_mu, mu);

  // Runs `decide` on a new Txn under `mu`; if it succeeds, writes the jobs
  // it changed durably (with `mu` released), then installs the change and
  // asks the nodes of every job that changed state to heartbeat. On error
  // nothing changed: decide's own error, INVALID_ARGUMENT for a record too
  // large to keep, UNAVAILABLE when the disk refuses or the coordinator is
  // shutting down.
  absl::Status Commit(absl::FunctionRef<absl::Status(Txn&)> decide)
      ABSL_LOCKS_EXCLUDED(write_mu, mu);

  // Forgets the oldest finished jobs beyond limits.finished_jobs: their
  // records, request ids, log records and model files.
  void ForgetOldFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu, mu);
  // Asks every node of the job with an open session to heartbeat now.
  void NudgeNodesOf(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Refreshes the gauges of jobs and nodes by state.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  const Coordinator::Options& options;
  FileSystem* const fs;      // options.fs, or the machine's
  const Clock* const clock;  // options.clock, or the monotonic clock
  ModelStore models;         // thread-safe
  // Job ids are this and a number. Without a state directory the numbers
  // start again at every start: a random part keeps the ids of one process
  // from naming the jobs of another, which nodes may still hold.
  const std::string job_id_prefix;

  // Serializes durable changes (Commit); taken before mu.
  absl::Mutex write_mu ABSL_ACQUIRED_BEFORE(mu);
  absl::Mutex mu;
  bool shut_down ABSL_GUARDED_BY(mu) = false;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
  NodeRegistry registry ABSL_GUARDED_BY(mu);
  JobTable jobs ABSL_GUARDED_BY(mu);
  UploadTable uploads ABSL_GUARDED_BY(mu);
  std::map<std::string, NodeSession*> sessions ABSL_GUARDED_BY(mu);  // open, by node

 private:
  std::unique_ptr<JobStore> store_ ABSL_GUARDED_BY(write_mu);  // null without a state directory
};

// The wall clock in Unix milliseconds: the times of jobs and events.
int64_t WallMs();

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_COORDINATOR_STATE_H_
