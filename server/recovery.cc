#include "server/recovery.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "glog/logging.h"
#include "server/coordinator_metrics.h"
#include "server/job_table.h"
#include "server/scheduler.h"
#include "server/shard_store.h"

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

absl::StatusOr<int64_t> RequestedCheckpointStep(const v1::Job& job) {
  const std::string& id = job.id();
  if (job.state() != v1::JOB_STATE_RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is not running (it is ", EnumName(job.state()), ")"));
  }
  if (job.spec().checkpoint().dir().empty()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " has no checkpoint.dir"));
  }
  if (job.spec().mode() != v1::MODE_SYNC) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is ", EnumName(job.spec().mode()),
                     ": it checkpoints every checkpoint.every_steps steps only"));
  }
  int64_t furthest = 0;
  for (const v1::WorkerStatus& w : job.workers()) furthest = std::max(furthest, w.step());
  const double steps_per_second =
      job.progress().samples_per_second() /
      static_cast<double>(std::max<int64_t>(1, GlobalBatch(job.spec())));
  const int64_t step = furthest + 20 + static_cast<int64_t>(steps_per_second * 3);
  if (step >= job.progress().total_steps()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " ends before a checkpoint could be taken"));
  }
  return step;
}

const NodeRegistry::Node* ColocatedServerOf(const NodeRegistry& registry,
                                            const std::string& worker_id) {
  for (const auto& [id, node] : registry.nodes()) {
    if (node.info.role() == v1::NODE_ROLE_SERVER && node.info.state() == v1::NODE_STATE_ALIVE &&
        node.info.colocated_with() == worker_id) {
      return &node;
    }
  }
  return nullptr;
}

const NodeRegistry::Node* SpareServer(const Txn& txn, const NodeRegistry& registry,
                                      const v1::Job& job, int64_t need) {
  if (job.spec().colocated_servers()) return nullptr;
  const std::map<std::string, int64_t> reserved = ReservedBytes(txn);
  const std::set<std::string> own(job.server_nodes().begin(), job.server_nodes().end());
  const NodeRegistry::Node* best = nullptr;
  for (const auto& [id, node] : registry.nodes()) {
    if (node.info.role() != v1::NODE_ROLE_SERVER || node.info.state() != v1::NODE_STATE_ALIVE ||
        !node.info.colocated_with().empty() || own.contains(id) ||
        RoomOn(node.info, reserved) < need) {
      continue;
    }
    if (best == nullptr || RoomOn(node.info, reserved) > RoomOn(best->info, reserved)) {
      best = &node;
    }
  }
  return best;
}

namespace {

// Nodes not free to take a job's slot: the workers of running jobs.
std::set<std::string> BusyWorkers(const Txn& txn) {
  std::set<std::string> busy;
  for (const std::string& id : txn.Ids()) {
    const v1::Job& job = txn.Get(id);
    if (job.state() == v1::JOB_STATE_RUNNING) {
      busy.insert(job.worker_nodes().begin(), job.worker_nodes().end());
    }
  }
  return busy;
}

}  // namespace

std::vector<std::string> RecoverJobs(Txn& txn, const NodeRegistry& registry, absl::Time now) {
  std::vector<std::string> new_generations;
  // How long the node has been silent; infinite if it is unknown.
  auto silent = [&](const NodeRegistry::Node* node) {
    return node == nullptr ? absl::InfiniteDuration() : now - node->last_heard;
  };
  auto alive = [&](const std::string& node_id) {
    const NodeRegistry::Node* node = registry.Find(node_id);
    return node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE;
  };
  std::set<std::string> taken;  // nodes given to a job in this pass
  for (const std::string& id : txn.table().running()) {
    const v1::Job& current = txn.Get(id);
    if (current.state() != v1::JOB_STATE_RUNNING) continue;
    const JobRecord& record = txn.table().at(id);
    const v1::RecoverySpec& policy = current.spec().recovery();
    const absl::Duration replace_after = absl::Seconds(policy.replace_after_seconds());
    const absl::Duration wait_timeout = absl::Seconds(policy.wait_timeout_seconds());
    v1::Job next = current;
    std::vector<std::string> why;  // of a new generation
    std::optional<std::string> failure;
    if (!record.server_errors.empty()) {
      const auto& [s, error] = *record.server_errors.begin();
      failure = absl::StrCat("server ", s, ": ", error);
    }

    // A server that could not load this generation's checkpoint.
    for (const auto& [s, error] : record.load_failures) {
      why.push_back(absl::StrCat("server ", s, " could not load step ", current.resume_step(),
                                 ": ", error));
    }
    if (!record.load_failures.empty()) {
      if (std::optional<v1::CheckpointRecord> from = ResumeCheckpoint(current)) {
        DropCheckpoint(&next, from->step(), from->generation());
      } else {
        failure = why.front();  // nothing older to go back to
      }
    }

    for (int s = 0; s < next.server_nodes_size() && !failure; ++s) {
      const NodeRegistry::Node* node = registry.Find(next.server_nodes(s));
      const std::string slot = absl::StrCat("server ", s, " (node ", next.server_nodes(s), ")");
      if (node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE) {
        if (node->incarnation != next.server_incarnations(s)) {
          why.push_back(absl::StrCat(slot, " was restarted"));
          next.set_server_incarnations(s, node->incarnation);
          next.set_server_addresses(s, node->info.address());
        }
        continue;
      }
      if (node != nullptr && node->info.state() == v1::NODE_STATE_AWAITED) continue;
      if (silent(node) < replace_after) continue;
      const NodeRegistry::Node* spare = SpareServer(
          txn, registry, next, ShardStore::BytesNeeded(next.spec(), txn.Plan(id), s));
      if (spare != nullptr && !taken.contains(spare->info.id())) {
        why.push_back(absl::StrCat(slot, " lost; ", spare->info.id(), " takes its place"));
        taken.insert(spare->info.id());
        next.set_server_nodes(s, spare->info.id());
        next.set_server_addresses(s, spare->info.address());
        next.set_server_incarnations(s, spare->incarnation);
      } else if (silent(node) >= wait_timeout) {
        failure = absl::StrCat(slot, " lost and not replaced within ",
                               absl::FormatDuration(wait_timeout), " (no free server with room)");
      }
    }

    const std::set<std::string> busy = BusyWorkers(txn);
    const int64_t worker_need = WorkerBytesNeeded(next.spec());
    const bool colocated = next.spec().colocated_servers();
    // An idle worker to take a lost one's place; a colocated job's also
    // has a server of its own, which takes the same place among the
    // job's servers.
    auto idle_worker = [&]() -> const NodeRegistry::Node* {
      for (const auto& [node_id, node] : registry.nodes()) {
        if (node.info.role() == v1::NODE_ROLE_WORKER &&
            node.info.state() == v1::NODE_STATE_ALIVE && !busy.contains(node_id) &&
            WorksOn(node.info, id, next.spec()) && !taken.contains(node_id) &&
            RoomOn(node.info, {}) >= worker_need &&
            (!colocated || ColocatedServerOf(registry, node_id) != nullptr)) {
          return &node;
        }
      }
      return nullptr;
    };
    std::vector<int> dropped;  // elastic
    for (int w = 0; w < next.worker_nodes_size() && !failure; ++w) {
      const NodeRegistry::Node* node = registry.Find(next.worker_nodes(w));
      const std::string slot = absl::StrCat("worker ", w, " (node ", next.worker_nodes(w), ")");
      if (node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE) {
        if (node->incarnation != next.worker_incarnations(w)) {
          why.push_back(absl::StrCat(slot, " was restarted"));
          next.set_worker_incarnations(w, node->incarnation);
        }
        continue;
      }
      if (next.workers(w).finished() ||
          (node != nullptr && node->info.state() == v1::NODE_STATE_AWAITED)) {
        continue;
      }
      const std::string lost =
          node != nullptr && !node->lost_reason.empty() ? node->lost_reason : slot + " lost";
      switch (policy.on_worker_loss()) {
        case v1::WORKER_LOSS_POLICY_FAIL:
          failure = absl::StrCat(slot, ": ", lost);
          break;
        case v1::WORKER_LOSS_POLICY_ELASTIC:
          if (next.worker_nodes_size() - static_cast<int>(dropped.size()) > 1) {
            dropped.push_back(w);
            why.push_back(absl::StrCat(slot, " lost; the job goes on without it"));
            break;
          }
          [[fallthrough]];  // the last worker: wait for one to take its place
        default:
          if (silent(node) < replace_after) break;
          if (const NodeRegistry::Node* idle = idle_worker()) {
            why.push_back(absl::StrCat(slot, " lost; ", idle->info.id(), " takes its place"));
            taken.insert(idle->info.id());
            next.set_worker_nodes(w, idle->info.id());
            next.set_worker_incarnations(w, idle->incarnation);
            if (colocated) {
              const NodeRegistry::Node* server = ColocatedServerOf(registry, idle->info.id());
              next.set_server_nodes(w, server->info.id());
              next.set_server_addresses(w, server->info.address());
              next.set_server_incarnations(w, server->incarnation);
            }
          } else if (silent(node) >= wait_timeout) {
            failure = absl::StrCat(slot, " lost and not replaced within ",
                                   absl::FormatDuration(wait_timeout), " (no idle worker)");
          }
      }
    }
    if (!dropped.empty()) {
      v1::Job kept = next;
      kept.clear_worker_nodes();
      kept.clear_worker_incarnations();
      for (int w = 0; w < next.worker_nodes_size(); ++w) {
        if (std::find(dropped.begin(), dropped.end(), w) != dropped.end()) continue;
        kept.add_worker_nodes(next.worker_nodes(w));
        kept.add_worker_incarnations(next.worker_incarnations(w));
      }
      next = std::move(kept);
    }
    if (!failure && policy.on_worker_loss() == v1::WORKER_LOSS_POLICY_ELASTIC) {
      while (next.worker_nodes_size() < next.spec().num_workers()) {
        const NodeRegistry::Node* idle = idle_worker();
        if (idle == nullptr) break;
        why.push_back(absl::StrCat(idle->info.id(), " joins"));
        taken.insert(idle->info.id());
        next.add_worker_nodes(idle->info.id());
        next.add_worker_incarnations(idle->incarnation);
      }
    }

    // A colocated job's process holds a worker and a server: the next
    // generation starts once both are back (alive, and both new or both
    // not), not twice.
    bool whole = true;
    for (int s = 0; colocated && s < next.server_nodes_size(); ++s) {
      const bool server_new = next.server_incarnations(s) != current.server_incarnations(s);
      const bool worker_new = s < next.worker_nodes_size() &&
                              next.worker_incarnations(s) != current.worker_incarnations(s);
      whole = whole && alive(next.server_nodes(s)) && s < next.worker_nodes_size() &&
              alive(next.worker_nodes(s)) && server_new == worker_new;
    }
    if (failure.has_value()) {
      txn.SetState(id, v1::JOB_STATE_FAILED, *failure);
    } else if (!why.empty() && whole) {
      const std::string reason = absl::StrJoin(why, "; ");
      LOG(WARNING) << "job " << id << ": " << reason << ": generation " << next.generation() + 1
                   << " starts";
      StartGeneration(&next, reason, txn.now_ms());
      LOG(INFO) << "job " << id << " generation " << next.generation() << " starts at step "
                << next.resume_step() << " with " << next.worker_nodes_size() << " worker(s)";
      *txn.Mutable(id) = std::move(next);
      new_generations.push_back(id);
    }
  }
  return new_generations;
}

}  // namespace pstrain::server
