#include "worker/worker_node.h"

#include <atomic>
#include <deque>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/dataset.h"
#include "common/membership_client.h"
#include "common/model_file.h"
#include "common/retry.h"
#include "glog/logging.h"
#include "worker/click_trainer.h"
#include "worker/generation.h"
#include "worker/progress_reporter.h"
#include "worker/trainer.h"

namespace pstrain::worker {
namespace {

class WorkerNodeImpl final : public WorkerNode {
 public:
  explicit WorkerNodeImpl(Options options)
      : options_(std::move(options)), data_(options_.data_root) {}
  ~WorkerNodeImpl() override { Shutdown(); }

  void Start() {
    MembershipClient::Options m;
    m.coordinator_address = options_.coordinator_address;
    m.role = v1::NODE_ROLE_WORKER;
    m.node_id = options_.node_id;
    m.coordinator_loss_timeout = options_.coordinator_loss_timeout;
    m.metrics_address = options_.metrics_address;
    m.max_memory_bytes = options_.max_memory_bytes;
    m.rpc = options_.rpc;
    m.security = options_.security;
    MembershipClient::Callbacks callbacks;
    callbacks.held_jobs = [this] {
      absl::MutexLock lock(&mu_);
      return HeldJobs(current_job_, current_generation_);
    };
    callbacks.on_heartbeat = [this](const v1::HeartbeatResponse& r) { Reconcile(r); };
    callbacks.on_coordinator_lost = [this] { RequestStop(); };
    callbacks.on_fenced = [this](const absl::Status&) {
      fenced_ = true;
      absl::MutexLock lock(&mu_);
      if (running_trainer_ != nullptr) running_trainer_->Cancel();
      stop_requested_ = true;
    };
    membership_ = std::make_unique<MembershipClient>(std::move(m), std::move(callbacks));
    membership_->Start();
    reporter_ = std::make_unique<ProgressReporter>(
        membership_.get(), [this](const v1::ReportProgressRequest& r) {
          absl::MutexLock lock(&mu_);
          if (running_trainer_ != nullptr && current_job_ == r.job_id() &&
              current_generation_ == r.generation()) {
            running_trainer_->Cancel();
          }
        });
  }

  void RequestStop() override {
    absl::MutexLock lock(&mu_);
    stop_requested_ = true;
  }

  void Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&stop_requested_));
  }
  bool fenced() const override { return fenced_; }

  absl::Status Readiness() const override {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return absl::UnavailableError("shutting down");
    }
    if (fenced_) return absl::UnavailableError("fenced: another process holds the node's id");
    if (!membership_->registered()) {
      return absl::UnavailableError(absl::StrCat("not registered with the coordinator at ",
                                                 options_.coordinator_address, " yet"));
    }
    return absl::OkStatus();
  }

  void Shutdown() override {
    std::thread job_thread;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
      stop_requested_ = true;
      if (running_trainer_ != nullptr) running_trainer_->Cancel();
      job_thread = std::move(job_thread_);
    }
    shut_down_cv_.NotifyAll();
    // Stopping membership first also cuts short a report being retried.
    if (membership_ != nullptr) membership_->Stop();
    if (job_thread.joinable()) job_thread.join();
    if (reporter_ != nullptr) reporter_->Stop();
    LOG(INFO) << "worker stopped";
  }

 private:
  void Reconcile(const v1::HeartbeatResponse& response) {
    if (options_.metrics != nullptr) options_.metrics->expiring.Sweep();
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    assigned_.clear();
    for (const v1::WorkerAssignment& a : response.worker_jobs()) assigned_.insert(a.job_id());
    const v1::WorkerAssignment* current = AssignmentOf(response, current_job_);
    if (!current_job_.empty() && running_trainer_ != nullptr) {
      if (current == nullptr) {
        LOG(INFO) << "job " << current_job_ << " is no longer assigned here; stopping it";
        running_trainer_->Cancel();
      } else if (current->generation() > current_generation_) {
        LOG(INFO) << "job " << current_job_ << " goes on at generation " << current->generation()
                  << " from step " << current->resume_step() << "; stopping generation "
                  << current_generation_;
        running_trainer_->Cancel();
      } else {
        running_trainer_->RequestCheckpointAt(current->checkpoint_request_step());
      }
    }
    if (!current_job_.empty() && !job_done_) return;  // busy
    for (const v1::WorkerAssignment& a : response.worker_jobs()) {
      if (!a.has_spec() || (a.job_id() == finished_job_ && a.generation() == finished_generation_)) {
        continue;
      }
      if (job_thread_.joinable()) job_thread_.join();
      current_job_ = a.job_id();
      current_generation_ = a.generation();
      job_done_ = false;
      job_thread_ = std::thread([this, a] { RunJob(a); });
      break;
    }
  }

  void RunJob(v1::WorkerAssignment assignment) {
    LOG(INFO) << "starting job " << assignment.job_id() << " as worker "
              << assignment.worker_index() << " at generation " << assignment.generation()
              << ", step " << assignment.resume_step();
    TrainerOptions t;
    t.assignment = assignment;
    t.data = &data_;
    t.report_interval = options_.report_interval;
    t.devices = options_.devices;
    t.metrics = options_.metrics;
    t.make_transport = options_.make_transport;
    // Servers out of reach are the coordinator's to recover from (or to
    // fail the job for): the worker keeps trying at least as long.
    const v1::RecoverySpec& recovery = assignment.spec().recovery();
    t.client.retry = t.client.retry.WithPatience(std::max(
        t.client.retry.patience(),
        absl::Seconds(recovery.replace_after_seconds() + recovery.wait_timeout_seconds() + 60)));
    v1::ReportProgressRequest final_report;
    bool finished = false;
    t.report = [this, &final_report, &finished](const v1::ReportProgressRequest& r) {
      if (r.finished()) {
        final_report = r;
        finished = true;
      } else {
        reporter_->Enqueue(r);
      }
    };
    absl::Status status;
    std::string final_model;
    absl::StatusOr<std::unique_ptr<JobTrainer>> trainer = CreateJobTrainer(std::move(t));
    if (trainer.ok()) {
      {
        absl::MutexLock lock(&mu_);
        running_trainer_ = trainer->get();
        if (shut_down_) running_trainer_->Cancel();
      }
      status = (*trainer)->Run();
      // Worker 0 ends with the final parameters: they become the job's model.
      if (status.ok() && assignment.worker_index() == 0) {
        final_model = EncodeModelFile(assignment.job_id(), (*trainer)->spec(),
                                      (*trainer)->params());
      }
      absl::MutexLock lock(&mu_);
      running_trainer_ = nullptr;
    } else {
      status = trainer.status();
    }
    if (status.ok() && finished) {
      LOG(INFO) << "job " << assignment.job_id() << " finished";
      Deliver(final_report, final_model);
    } else if (status.code() == absl::StatusCode::kCancelled) {
      LOG(INFO) << "job " << assignment.job_id() << " stopped: " << status;
    } else if (status.code() == absl::StatusCode::kAborted) {
      // The servers went on to a newer generation: not this worker's
      // failure; its next assignment says where to go on from.
      LOG(INFO) << "job " << assignment.job_id() << ": " << status.message();
    } else {
      LOG(ERROR) << "job " << assignment.job_id() << " failed: " << status;
      v1::ReportProgressRequest report;
      report.set_job_id(assignment.job_id());
      report.set_worker(assignment.worker_index());
      report.set_generation(assignment.generation());
      report.set_error(status.ToString());
      Deliver(report, "");
    }
    absl::MutexLock lock(&mu_);
    if (status.ok() && finished) {
      finished_job_ = current_job_;
      finished_generation_ = current_generation_;
    }
    current_job_.clear();
    job_done_ = true;
  }

  // Sends the job's last word (its model file, if any, then the final or
  // error report) until the coordinator has it, for as long as the job is
  // still assigned here: a coordinator that is down for a while, then comes
  // back, still learns how the job ended.
  void Deliver(const v1::ReportProgressRequest& report, const std::string& model) {
    const std::string& job = report.job_id();
    bool model_done = model.empty();
    while (true) {
      if (!model_done) {
        absl::Status s = membership_->UploadModel(job, model, absl::Seconds(30));
        const bool permanent = !s.ok() && !RetryPolicy::Transient().Retryable(s);
        if (!s.ok() && permanent) LOG(ERROR) << "model of " << job << " not kept: " << s;
        model_done = s.ok() || permanent;
      }
      if (model_done) {
        absl::StatusOr<bool> sent = membership_->ReportProgress(report, absl::Seconds(30));
        if (sent.ok()) return;
        LOG(WARNING) << "final report of " << job << " not delivered yet: " << sent.status();
      }
      absl::MutexLock lock(&mu_);
      if (shut_down_ || !assigned_.contains(job)) {
        LOG(WARNING) << "giving up reporting the end of " << job;
        return;
      }
      shut_down_cv_.AwaitWithTimeout(
          mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shut_down_; },
          absl::Seconds(1));
    }
  }

  const Options options_;
  DatasetCache data_;
  std::unique_ptr<MembershipClient> membership_;
  std::unique_ptr<ProgressReporter> reporter_;
  std::atomic<bool> fenced_{false};

  mutable absl::Mutex mu_;
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  MonotonicCondVar shut_down_cv_;  // shut_down_ set
  std::string current_job_ ABSL_GUARDED_BY(mu_);
  int64_t current_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // The job (and generation) this worker last finished: not run again.
  std::string finished_job_ ABSL_GUARDED_BY(mu_);
  int64_t finished_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // The jobs the last heartbeat reply assigned to this node.
  std::set<std::string> assigned_ ABSL_GUARDED_BY(mu_);
  bool job_done_ ABSL_GUARDED_BY(mu_) = true;
  // Owned by the job thread; set while Run() may be cancelled.
  JobTrainer* running_trainer_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread job_thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerNode>> WorkerNode::Create(Options options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("coordinator address is required");
  }
  auto node = std::make_unique<WorkerNodeImpl>(std::move(options));
  node->Start();
  return node;
}

}  // namespace pstrain::worker
