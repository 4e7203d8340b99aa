#include "server/job_table.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "glog/logging.h"

namespace pstrain::server {

bool IsTerminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

absl::Status UnknownJob(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("job_id: no job '", id, "'"));
}

absl::StatusOr<v1::PartitionPlan> PlanFor(const v1::JobSpec& spec) {
  return ComputePartitionPlan(JobTensors(spec), spec.chunk_bytes(), spec.num_servers());
}

// ---- Txn ----

const v1::Job& Txn::Get(const std::string& id) const {
  if (auto it = changed_.find(id); it != changed_.end()) return it->second.job;
  return table_->at(id).job;
}

const v1::PartitionPlan& Txn::Plan(const std::string& id) const {
  if (const JobRecord* record = table_->Find(id)) return record->plan;
  return changed_.at(id).plan;
}

std::vector<std::string> Txn::Ids() const {
  std::vector<std::string> ids = table_->order();
  ids.insert(ids.end(), added_.begin(), added_.end());
  return ids;
}

v1::Job* Txn::Mutable(const std::string& id) {
  Change& c = Touch(id);
  c.durable = true;
  return &c.job;
}

v1::Job* Txn::MutableVolatile(const std::string& id) { return &Touch(id).job; }

void Txn::Add(v1::Job job, v1::PartitionPlan plan) {
  const std::string id = job.id();
  Change& c = changed_[id];
  c.job = std::move(job);
  c.plan = std::move(plan);
  c.added = true;
  c.durable = true;
  added_.push_back(id);
}

void Txn::SetState(const std::string& id, v1::JobState state, const std::string& reason) {
  v1::Job& job = *Mutable(id);
  job.set_state(state);
  job.set_reason(reason);
  if (state == v1::JOB_STATE_RUNNING) job.set_start_time_ms(now_ms_);
  if (IsTerminal(state)) job.set_end_time_ms(now_ms_);
}

void Txn::Publish(const std::string& id, v1::JobEvent event) {
  events_.emplace_back(id, std::move(event));
}

v1::JobEvent Txn::Event() const {
  v1::JobEvent event;
  event.set_time_ms(now_ms_);
  return event;
}

std::vector<const v1::Job*> Txn::Durable() const {
  std::vector<const v1::Job*> jobs;
  for (const auto& [id, c] : changed_) {
    if (c.durable) jobs.push_back(&c.job);
  }
  return jobs;
}

Txn::Change& Txn::Touch(const std::string& id) {
  auto [it, inserted] = changed_.try_emplace(id);
  if (inserted) it->second.job = table_->at(id).job;
  return it->second;
}

// ---- JobTable ----

const JobRecord* JobTable::Find(const std::string& id) const {
  auto it = records_.find(id);
  return it == records_.end() ? nullptr : &it->second;
}

JobRecord* JobTable::Find(const std::string& id) {
  auto it = records_.find(id);
  return it == records_.end() ? nullptr : &it->second;
}

const std::string* JobTable::JobOfRequest(const std::string& request_id) const {
  if (request_id.empty()) return nullptr;
  auto it = request_ids_.find(request_id);
  return it == request_ids_.end() ? nullptr : &it->second;
}

std::string JobTable::NextId(const std::string& prefix) const {
  return absl::StrFormat("%s%06d", prefix, last_number_ + 1);
}

int64_t JobTable::JobNumber(const std::string& id) {
  int64_t number = 0;
  return absl::SimpleAtoi(id.substr(id.rfind('-') + 1), &number) ? number : 0;
}

std::vector<std::string> JobTable::Install(Txn& txn) {
  std::vector<std::pair<std::string, v1::JobState>> transitions;  // id, old state
  for (const std::string& id : txn.added_) {
    Txn::Change& c = txn.changed_.at(id);
    JobRecord& record = records_[id];
    record.job = std::move(c.job);
    record.plan = std::move(c.plan);
    order_.push_back(id);
    last_number_ = std::max(last_number_, JobNumber(id));
    if (!record.job.request_id().empty()) request_ids_[record.job.request_id()] = id;
    if (metrics_ != nullptr) metrics_->jobs_submitted->Increment();
    LOG(INFO) << "job " << id << " submitted";
    transitions.emplace_back(id, v1::JOB_STATE_UNSPECIFIED);
  }
  for (auto& [id, c] : txn.changed_) {
    if (c.added) continue;
    JobRecord& record = records_.at(id);
    const v1::JobState old = record.job.state();
    const int64_t old_generation = record.job.generation();
    record.job = std::move(c.job);
    if (record.job.state() != old || record.job.generation() != old_generation) {
      transitions.emplace_back(id, old);
    }
  }
  for (auto& [id, event] : txn.events_) Publish(records_.at(id), event, false);
  std::vector<std::string> changed;
  for (const auto& [id, old] : transitions) {
    OnStateChange(id, old, txn.now_ms());
    changed.push_back(id);
  }
  return changed;
}

void JobTable::OnStateChange(const std::string& id, v1::JobState old, int64_t now_ms) {
  JobRecord& record = records_.at(id);
  const v1::JobState state = record.job.state();
  auto generation_gauges = [&] {
    if (!record.metrics.has_value()) return;
    record.metrics->generation->Set(static_cast<double>(record.job.generation()));
    record.metrics->recoveries->Set(record.job.recoveries());
  };
  v1::JobEvent event;
  event.set_time_ms(now_ms);
  if (state == old) {  // a new generation
    generation_gauges();
    *event.mutable_recovery() = record.job.history(record.job.history_size() - 1);
    Publish(record, event, false);
    return;
  }
  if (old == v1::JOB_STATE_PENDING) std::erase(pending_, id);
  if (old == v1::JOB_STATE_RUNNING) std::erase(running_, id);
  if (state == v1::JOB_STATE_PENDING) pending_.push_back(id);
  if (state == v1::JOB_STATE_RUNNING) running_.push_back(id);
  if (state == v1::JOB_STATE_SUCCEEDED && !record.job.spec().checkpoint().dir().empty()) {
    settling_.push_back(id);
  }
  if (metrics_ != nullptr) {
    if (state == v1::JOB_STATE_RUNNING && !record.metrics.has_value()) {
      record.metrics = metrics_->BindJob(id);
    }
    generation_gauges();
    if (IsTerminal(state)) {
      if (record.metrics.has_value()) {
        record.metrics->running->Set(0);
        if (record.job.result().test_accuracy() > 0) {
          record.metrics->accuracy->Set(record.job.result().test_accuracy());
        }
      }
      record.metrics.reset();  // the series expire after the grace period
      metrics_->ended_by_state[state]->Increment();
      metrics_->expiring.JobEnded(id);
    }
  }
  if (old == v1::JOB_STATE_UNSPECIFIED) return;  // submitted: no event yet
  const std::string& reason = record.job.reason();
  LOG(INFO) << "job " << id << " " << EnumName(old) << " -> " << EnumName(state)
            << (reason.empty() ? "" : ": ") << reason;
  event.mutable_state()->set_state(state);
  event.mutable_state()->set_reason(reason);
  Publish(record, event, IsTerminal(state));
  if (IsTerminal(state)) record.watchers.clear();
}

void JobTable::Publish(JobRecord& record, const v1::JobEvent& event, bool last) {
  std::erase_if(record.watchers, [](const auto& w) { return w->Gone(); });
  for (auto& w : record.watchers) w->Publish(event, last);
}

void JobTable::SetScriptMetrics(JobRecord& record, const v1::Progress& progress) {
  if (metrics_ == nullptr || !record.metrics.has_value()) return;
  for (const auto& [name, value] : progress.metrics()) {
    metrics_->SetScriptMetric(*record.metrics, name, value);
  }
}

JobRecord& JobTable::Restore(v1::Job job) {
  last_number_ = std::max(last_number_, JobNumber(job.id()));
  const std::string id = job.id();
  JobRecord& record = records_[id];
  record.job = std::move(job);
  order_.push_back(id);
  if (!record.job.request_id().empty()) request_ids_[record.job.request_id()] = id;
  if (absl::StatusOr<v1::PartitionPlan> plan = PlanFor(record.job.spec()); plan.ok()) {
    record.plan = std::move(*plan);
  }
  if (record.job.state() == v1::JOB_STATE_PENDING) pending_.push_back(id);
  if (record.job.state() == v1::JOB_STATE_RUNNING) {
    running_.push_back(id);
    if (metrics_ != nullptr) record.metrics = metrics_->BindJob(id);
  }
  return record;
}

std::vector<std::string> JobTable::ForgetOldFinished(int64_t keep) {
  std::vector<std::string> forgotten;
  if (static_cast<int64_t>(records_.size()) <= keep) return forgotten;
  int64_t finished = std::count_if(records_.begin(), records_.end(), [](const auto& entry) {
    return IsTerminal(entry.second.job.state());
  });
  if (finished <= keep) return forgotten;
  std::vector<std::string> kept;
  for (const std::string& id : order_) {
    auto it = records_.find(id);
    if (finished <= keep || !IsTerminal(it->second.job.state())) {
      kept.push_back(id);
      continue;
    }
    --finished;
    if (const std::string& request_id = it->second.job.request_id(); !request_id.empty()) {
      request_ids_.erase(request_id);
    }
    records_.erase(it);
    std::erase(settling_, id);
    forgotten.push_back(id);
  }
  order_ = std::move(kept);
  return forgotten;
}

absl::Status JobTable::List(const v1::ListJobsRequest& request,
                            v1::ListJobsResponse* response) const {
  const int page_size = request.page_size() > 0 ? std::min(request.page_size(), 1000) : 50;
  const std::set<int> states(request.states().begin(), request.states().end());
  int64_t next = static_cast<int64_t>(order_.size()) - 1;
  if (!request.page_token().empty()) {
    int64_t number = 0;
    if (!absl::SimpleAtoi(request.page_token(), &number) || number < 1) {
      return absl::InvalidArgumentError("page_token: not a token from a previous response");
    }
    // Job numbers grow along order_.
    next = std::upper_bound(order_.begin(), order_.end(), number,
                            [](int64_t n, const std::string& id) { return n < JobNumber(id); }) -
           order_.begin() - 1;
  }
  for (; next >= 0 && response->jobs_size() < page_size; --next) {
    const v1::Job& job = records_.at(order_[next]).job;
    if (states.empty() || states.contains(job.state())) *response->add_jobs() = job;
  }
  if (next >= 0) response->set_next_page_token(absl::StrCat(JobNumber(order_[next])));
  return absl::OkStatus();
}

void JobTable::Watch(const std::string& id, const std::shared_ptr<WatchQueue>& queue,
                     size_t max_watchers, int64_t now_ms) {
  auto it = records_.find(id);
  if (it == records_.end()) {
    queue->End(ToGrpcStatus(UnknownJob(id)));
    return;
  }
  JobRecord& record = it->second;
  v1::JobEvent snapshot;
  snapshot.set_time_ms(now_ms);
  *snapshot.mutable_snapshot() = record.job;
  queue->Publish(snapshot, IsTerminal(record.job.state()));
  if (IsTerminal(record.job.state())) return;
  std::erase_if(record.watchers, [](const auto& w) { return w->Gone(); });
  if (record.watchers.size() >= max_watchers) {
    queue->End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat(max_watchers, " watchers already follow ", id)));
  } else {
    record.watchers.push_back(queue);
  }
}

void JobTable::EndWatches(const grpc::Status& status) {
  for (auto& [id, record] : records_) {
    for (auto& w : record.watchers) w->End(status);
  }
}

}  // namespace pstrain::server
