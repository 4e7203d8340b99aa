// The coordinator's control loop: one thread that, at every tick (a
// twentieth of the lease, at least 100 ms) or when woken, expires leases,
// recovers running jobs whose nodes were lost or restarted (recovery.h),
// records the checkpoints that became complete, starts the pending jobs
// that now fit (scheduler.h), rewrites the Prometheus targets file,
// forgets old finished jobs, cancels stalled model uploads and refreshes
// the gauges. Each pass is one Commit.
#ifndef PSTRAIN_SERVER_CONTROL_LOOP_H_
#define PSTRAIN_SERVER_CONTROL_LOOP_H_

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "server/coordinator_state.h"
#include "server/targets_file.h"

namespace pstrain::server {

class ControlLoop {
 public:
  // `state` must outlive the loop.
  explicit ControlLoop(CoordinatorState* state);
  ~ControlLoop() { Stop(); }

  // Writes the targets file, then starts the thread.
  void Start();
  // Asks for a pass now: a node came, went or reported news. Thread-safe.
  void Wake() ABSL_LOCKS_EXCLUDED(wake_mu_);
  // Ends the loop, once the state is shut down, and waits for it.
  // Idempotent.
  void Stop();

 private:
  void Run();
  // Records every running job's newly complete checkpoint.
  void CompleteCheckpoints(Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // The targets file is written without the lock: it syncs the disk.
  void WriteTargets() ABSL_LOCKS_EXCLUDED(state_->mu);

  CoordinatorState* const state_;
  TargetsFile targets_;  // written by one thread at a time (Start, then the loop)
  std::thread thread_;

  absl::Mutex wake_mu_;
  bool wake_ ABSL_GUARDED_BY(wake_mu_) = false;
  MonotonicCondVar wake_cv_;  // wake_ set
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_CONTROL_LOOP_H_
