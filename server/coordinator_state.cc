#include "server/coordinator_state.h"

#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/node_session.h"

namespace pstrain::server {

int64_t WallMs() { return absl::ToUnixMillis(absl::Now()); }

CoordinatorState::CoordinatorState(const Coordinator::Options& options)
    : options(options),
      fs(options.fs != nullptr ? options.fs : PosixFileSystem()),
      clock(options.clock != nullptr ? options.clock : MonotonicClock()),
      models(fs, options.state_dir.empty() ? "" : options.state_dir + "/models"),
      job_id_prefix(options.state_dir.empty()
                        ? absl::StrFormat("job-%08x-", std::random_device{}())
                        : "job-"),
      rng(std::random_device{}()),
      registry({.lease = options.lease,
                .max_lost_nodes = options.limits.lost_nodes,
                .max_registrations_per_minute = options.limits.registrations_per_minute},
               clock,
               [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return static_cast<uint32_t>(rng()); }),
      jobs(options.metrics) {}

absl::Status CoordinatorState::Recover() {
  if (options.state_dir.empty()) return absl::OkStatus();
  std::vector<v1::Job> recovered;
  absl::MutexLock write_lock(&write_mu);
  PSTRAIN_ASSIGN_OR_RETURN(store_, JobStore::Open(fs, options.state_dir, &recovered));
  PSTRAIN_RETURN_IF_ERROR(models.Init());
  absl::MutexLock lock(&mu);
  for (v1::Job& job : recovered) {
    const JobRecord& record = jobs.Restore(std::move(job));
    if (record.job.state() != v1::JOB_STATE_RUNNING) continue;
    const v1::Job& j = record.job;
    for (int s = 0; s < j.server_nodes_size(); ++s) {
      registry.Await(j.server_nodes(s), v1::NODE_ROLE_SERVER,
                     s < j.server_addresses_size() ? j.server_addresses(s) : "",
                     s < j.server_incarnations_size() ? j.server_incarnations(s) : 0);
    }
    for (int w = 0; w < j.worker_nodes_size(); ++w) {
      if (!j.workers(w).finished()) {
        registry.Await(j.worker_nodes(w), v1::NODE_ROLE_WORKER, "",
                       w < j.worker_incarnations_size() ? j.worker_incarnations(w) : 0);
      }
    }
  }
  // Jobs forgotten before a crash that the log still had come back here,
  // and are forgotten again.
  ForgetOldFinished();
  LOG(INFO) << "recovered " << jobs.records().size() << " jobs (" << jobs.pending().size()
            << " pending, " << jobs.running().size() << " running) from " << options.state_dir;
  return absl::OkStatus();
}

absl::Status CoordinatorState::Commit(absl::FunctionRef<absl::Status(Txn&)> decide) {
  absl::MutexLock write_lock(&write_mu);
  Txn txn(&jobs, WallMs());
  {
    absl::MutexLock lock(&mu);
    if (shut_down) return absl::UnavailableError("coordinator shutting down");
    PSTRAIN_RETURN_IF_ERROR(decide(txn));
  }
  if (txn.empty()) return absl::OkStatus();
  const std::vector<const v1::Job*> durable = txn.Durable();
  if (store_ != nullptr && !durable.empty()) {
    const absl::Time start = MonotonicNow();
    absl::Status s = store_->Write(durable);
    if (options.metrics != nullptr) {
      options.metrics->log_append_seconds->Observe(absl::ToDoubleSeconds(MonotonicNow() - start));
    }
    if (!s.ok()) {
      LOG(ERROR) << "cannot record a change of job " << durable.front()->id() << ": " << s;
      if (s.code() == absl::StatusCode::kInvalidArgument) return s;
      return absl::UnavailableError(absl::StrCat("cannot record the change: ", s.message()));
    }
  }
  absl::MutexLock lock(&mu);
  // The nodes of a job that changed state heartbeat now to learn it.
  for (const std::string& id : jobs.Install(txn)) NudgeNodesOf(jobs.at(id).job);
  UpdateGauges();
  return absl::OkStatus();
}

void CoordinatorState::ForgetOldFinished() {
  for (const std::string& id : jobs.ForgetOldFinished(options.limits.finished_jobs)) {
    if (store_ != nullptr) store_->Forget(id);
    models.Remove(id);
  }
}

void CoordinatorState::NudgeNodesOf(const v1::Job& job) {
  std::set<std::string> nodes(job.server_nodes().begin(), job.server_nodes().end());
  nodes.insert(job.worker_nodes().begin(), job.worker_nodes().end());
  for (const std::string& node : nodes) {
    if (auto it = sessions.find(node); it != sessions.end()) it->second->Nudge();
  }
}

void CoordinatorState::UpdateGauges() {
  CoordinatorMetrics* m = options.metrics;
  if (m == nullptr) return;
  std::map<v1::JobState, int> by_state;
  for (const auto& [id, record] : jobs.records()) ++by_state[record.job.state()];
  for (auto& [state, gauge] : m->jobs_by_state) gauge->Set(by_state[state]);
  std::map<std::pair<v1::NodeRole, v1::NodeState>, int> nodes;
  for (const auto& [id, node] : registry.nodes()) ++nodes[{node.info.role(), node.info.state()}];
  for (auto& [key, gauge] : m->nodes_by_role_state) gauge->Set(nodes[key]);
  m->expiring.Sweep();
}

}  // namespace pstrain::server
