#include "server/recovery.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <set>

namespace pstrain::server {

std::optional<v1::CheckpointRecord> ResumeCheckpoint(const v1::Job& job) {
  if (job.spec().mode() != v1::MODE_SYNC || job.checkpoints().empty()) return std::nullopt;
  return job.checkpoints(job.checkpoints_size() - 1);
}

void StartGeneration(v1::Job* job, const std::string& reason, int64_t time_ms) {
  const bool sync = job->spec().mode() == v1::MODE_SYNC;
  const std::optional<v1::CheckpointRecord> from = ResumeCheckpoint(*job);
  if (job->generation() > 0) job->set_recoveries(job->recoveries() + 1);
  job->set_generation(job->generation() + 1);
  job->set_resume_step(from.has_value() ? from->step() : 0);

  // Every worker's progress back to where it goes on from: the resume step
  // (sync), or, async, the step it had reported (by node: an elastic job
  // renumbers its workers).
  std::map<std::string, int64_t> reached;
  for (const v1::WorkerStatus& w : job->workers()) reached[w.node_id()] = w.step();
  job->clear_workers();
  int64_t slowest = sync ? job->resume_step() : std::numeric_limits<int64_t>::max();
  for (int w = 0; w < job->worker_nodes_size(); ++w) {
    v1::WorkerStatus* status = job->add_workers();
    status->set_worker(w);
    status->set_node_id(job->worker_nodes(w));
    const int64_t step = sync ? job->resume_step() : reached[job->worker_nodes(w)];
    status->set_step(step);
    slowest = std::min(slowest, step);
  }
  if (job->worker_nodes_size() == 0) slowest = 0;
  job->mutable_progress()->set_step(slowest);
  // What the last generation had finished is done again.
  job->clear_result();
  job->set_has_model(false);
  job->set_checkpoint_request_step(0);

  v1::MembershipChange* change = job->add_history();
  change->set_generation(job->generation());
  change->set_step(job->resume_step());
  change->set_time_ms(time_ms);
  change->set_reason(reason);
  *change->mutable_servers() = job->server_nodes();
  *change->mutable_workers() = job->worker_nodes();
  *change->mutable_server_incarnations() = job->server_incarnations();
}

bool KeepsValues(const v1::Job& job, int server) {
  if (job.spec().mode() == v1::MODE_SYNC || job.history_size() < 2) return false;
  const v1::MembershipChange& now = job.history(job.history_size() - 1);
  const v1::MembershipChange& before = job.history(job.history_size() - 2);
  return server < now.servers_size() && server < before.servers_size() &&
         server < now.server_incarnations_size() && server < before.server_incarnations_size() &&
         now.servers(server) == before.servers(server) &&
         now.server_incarnations(server) == before.server_incarnations(server) &&
         now.workers_size() == before.workers_size();
}

void DropCheckpoint(v1::Job* job, int64_t step, int64_t generation) {
  auto* checkpoints = job->mutable_checkpoints();
  checkpoints->erase(std::remove_if(checkpoints->begin(), checkpoints->end(),
                                    [&](const v1::CheckpointRecord& r) {
                                      return r.step() == step && r.generation() == generation;
                                    }),
                     checkpoints->end());
  auto* states = job->mutable_worker_states();
  states->erase(std::remove_if(states->begin(), states->end(),
                               [&](const v1::WorkerResumeState& s) {
                                 return s.step() == step && s.generation() == generation;
                               }),
                states->end());
  job->set_last_checkpoint_step(
      job->checkpoints().empty() ? 0 : job->checkpoints(job->checkpoints_size() - 1).step());
}

std::optional<v1::CheckpointRecord> NewlyComplete(const v1::Job& job,
                                                  const CheckpointReports& reports) {
  if (job.spec().checkpoint().dir().empty() || job.server_nodes_size() == 0 ||
      static_cast<int>(reports.by_server.size()) < job.server_nodes_size()) {
    return std::nullopt;
  }
  const int64_t generation = job.generation();
  std::set<int64_t> common;
  for (int s = 0; s < job.server_nodes_size(); ++s) {
    std::set<int64_t> steps;
    for (const v1::CheckpointRecord& r : reports.by_server[s]) {
      if (r.generation() == generation) steps.insert(r.step());
    }
    if (s == 0) {
      common = std::move(steps);
    } else {
      std::set<int64_t> both;
      std::set_intersection(common.begin(), common.end(), steps.begin(), steps.end(),
                            std::inserter(both, both.begin()));
      common = std::move(both);
    }
  }
  const bool sync = job.spec().mode() == v1::MODE_SYNC;
  for (auto it = common.rbegin(); it != common.rend(); ++it) {
    if (*it <= std::max(job.last_checkpoint_step(), job.resume_step())) break;
    if (sync) {
      auto states = reports.states.find({*it, generation});
      if (states == reports.states.end()) continue;
      bool all = true;
      for (int w = 0; w < job.worker_nodes_size() && all; ++w) {
        all = states->second.contains(static_cast<uint32_t>(w));
      }
      if (!all) continue;
    }
    v1::CheckpointRecord record;
    record.set_step(*it);
    record.set_generation(generation);
    return record;
  }
  return std::nullopt;
}

void RecordCheckpoint(v1::Job* job, v1::CheckpointRecord record,
                      const CheckpointReports& reports) {
  if (auto states = reports.states.find({record.step(), record.generation()});
      states != reports.states.end()) {
    for (const auto& [worker, state] : states->second) *job->add_worker_states() = state;
  }
  job->set_last_checkpoint_step(record.step());
  *job->add_checkpoints() = std::move(record);
  const int keep = std::max(1, job->spec().checkpoint().keep());
  while (job->checkpoints_size() > keep) {
    const v1::CheckpointRecord oldest = job->checkpoints(0);
    DropCheckpoint(job, oldest.step(), oldest.generation());
  }
}

v1::WorkerResumeState ResumeStateOf(const v1::Job& job, int worker) {
  v1::WorkerResumeState empty;
  empty.set_worker(worker);
  empty.set_step(job.resume_step());
  const std::optional<v1::CheckpointRecord> from = ResumeCheckpoint(job);
  if (!from.has_value() || from->step() != job.resume_step()) return empty;
  // The generation that wrote the checkpoint must have had these workers.
  for (const v1::MembershipChange& change : job.history()) {
    if (change.generation() != from->generation()) continue;
    if (change.workers_size() != job.worker_nodes_size()) return empty;
  }
  for (const v1::WorkerResumeState& state : job.worker_states()) {
    if (state.step() == from->step() && state.generation() == from->generation() &&
        state.worker() == static_cast<uint32_t>(worker)) {
      return state;
    }
  }
  return empty;
}

}  // namespace pstrain::server
