// Sends a worker's progress reports to the coordinator on a thread of their
// own, so that a slow coordinator never slows training.
#ifndef PSTRAIN_WORKER_PROGRESS_REPORTER_H_
#define PSTRAIN_WORKER_PROGRESS_REPORTER_H_

#include <functional>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/membership_client.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::worker {

class ProgressReporter {
 public:
  // on_inactive runs on the reporter's thread when the coordinator answers
  // that a report's job is no longer active. `membership` must outlive the
  // reporter.
  ProgressReporter(MembershipClient* membership,
                   std::function<void(const v1::ReportProgressRequest&)> on_inactive);
  ~ProgressReporter();  // Stop()

  // Queues a report. Only the newest one not sent yet is kept, but the
  // resume states it carries go with the newer one (a checkpoint needs
  // them), and so does its evaluation unless the newer one has its own.
  void Enqueue(const v1::ReportProgressRequest& report);

  // Waits until every queued report was sent (or failed to be).
  void Flush();

  // Drops what is not sent yet and stops the thread; waits for it.
  void Stop();

 private:
  void Loop();

  MembershipClient* const membership_;
  const std::function<void(const v1::ReportProgressRequest&)> on_inactive_;
  absl::Mutex mu_;
  std::optional<v1::ReportProgressRequest> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_PROGRESS_REPORTER_H_
