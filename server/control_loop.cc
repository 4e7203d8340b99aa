#include "server/control_loop.h"

#include <algorithm>
#include <optional>
#include <string>

#include "glog/logging.h"
#include "server/recovery.h"
#include "server/scheduler.h"

namespace pstrain::server {

ControlLoop::ControlLoop(CoordinatorState* state)
    : state_(state), targets_(state->fs, state->options.prometheus_sd_file) {}

void ControlLoop::Start() {
  WriteTargets();
  thread_ = std::thread([this] { Run(); });
}

void ControlLoop::Wake() {
  {
    absl::MutexLock lock(&wake_mu_);
    wake_ = true;
  }
  wake_cv_.NotifyAll();
}

void ControlLoop::Stop() {
  Wake();
  if (thread_.joinable()) thread_.join();
}

void ControlLoop::Run() {
  const absl::Duration tick = std::max(absl::Milliseconds(100), state_->options.lease / 20);
  while (true) {
    {
      absl::MutexLock lock(&wake_mu_);
      wake_cv_.AwaitWithTimeout(
          wake_mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wake_mu_) { return wake_; }, tick);
      wake_ = false;
    }
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->shut_down) return;
    }
    absl::Status s = state_->Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
      state_->registry.ExpireLeases();
      state_->registry.ForgetLongLost();
      for (const std::string& id : RecoverJobs(txn, state_->registry, state_->clock->Now())) {
        state_->jobs.at(id).load_failures.clear();  // answered by the new generation
      }
      CompleteCheckpoints(txn);
      ScheduleJobs(txn, state_->registry);
      return absl::OkStatus();
    });
    if (!s.ok()) {
      LOG_EVERY_N(WARNING, 20) << "control loop: " << s;
    }
    WriteTargets();
    absl::MutexLock write_lock(&state_->write_mu);
    absl::MutexLock lock(&state_->mu);
    state_->ForgetOldFinished();
    state_->uploads.CancelStalled(state_->clock->Now(), state_->options.limits.upload_timeout);
    state_->UpdateGauges();
  }
}

void ControlLoop::CompleteCheckpoints(Txn& txn) {
  // A succeeded job's last checkpoints for a minute after its end.
  std::vector<std::string> settled;
  for (const std::string& id : state_->jobs.settling()) {
    if (txn.now_ms() - txn.Get(id).end_time_ms() > 60'000) settled.push_back(id);
  }
  for (const std::string& id : settled) state_->jobs.StopSettling(id);
  std::vector<std::string> jobs = state_->jobs.running();
  jobs.insert(jobs.end(), state_->jobs.settling().begin(), state_->jobs.settling().end());
  for (const std::string& id : jobs) {
    const v1::Job& job = txn.Get(id);
    if (job.state() != v1::JOB_STATE_RUNNING && job.state() != v1::JOB_STATE_SUCCEEDED) continue;
    JobRecord& record = state_->jobs.at(id);
    std::optional<v1::CheckpointRecord> complete = NewlyComplete(job, record.reports);
    if (!complete.has_value()) continue;
    complete->set_time_ms(txn.now_ms());
    VLOG(1) << "job " << id << ": checkpoint of step " << complete->step() << " complete";
    RecordCheckpoint(txn.Mutable(id), *complete, record.reports);
    // The states of steps up to it are no longer needed.
    std::erase_if(record.reports.states,
                  [&](const auto& e) { return e.first.first <= complete->step(); });
    if (record.metrics.has_value()) {
      record.metrics->last_checkpoint->Set(static_cast<double>(complete->step()));
    }
  }
}

void ControlLoop::WriteTargets() {
  if (state_->options.prometheus_sd_file.empty()) return;
  std::string text;
  {
    absl::MutexLock lock(&state_->mu);
    text = TargetsText(state_->options.metrics_address, state_->registry);
  }
  targets_.Write(text);
}

}  // namespace pstrain::server
