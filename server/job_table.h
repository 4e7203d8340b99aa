// The coordinator's jobs in memory: a record per job, in submission order,
// with the pending queue and the running list (JobTable), and the one way
// they change (Txn).
//
// A change is decided on a Txn: copies of the jobs it touches, which its
// reads see. The coordinator then writes the jobs it changed to the job
// store and only then installs the change (JobTable::Install): nothing is
// shown to a node or acknowledged before it is durable (coordinator_state.h
// holds the lock and the write).
//
// Not thread-safe: the coordinator calls it under its lock. Nothing here
// reads a clock: a Txn carries the wall time its changes are stamped with.
#ifndef PSTRAIN_SERVER_JOB_TABLE_H_
#define PSTRAIN_SERVER_JOB_TABLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "pstrain/v1/control.pb.h"
#include "server/coordinator_metrics.h"
#include "server/recovery.h"
#include "server/watch_queue.h"

namespace pstrain::server {

// Succeeded, failed or cancelled: the job will not change any more.
bool IsTerminal(v1::JobState state);

// NOT_FOUND naming the job.
absl::Status UnknownJob(const std::string& id);

// The partition plan of a job with this (normalized) spec.
absl::StatusOr<v1::PartitionPlan> PlanFor(const v1::JobSpec& spec);

// A job as the coordinator holds it. `job` changes only through a
// committed Txn; the rest is in memory only.
struct JobRecord {
  v1::Job job;
  v1::PartitionPlan plan;
  std::vector<std::shared_ptr<WatchQueue>> watchers;
  std::optional<CoordinatorMetrics::Job> metrics;  // while running, if measured
  // What the nodes reported of the running job's checkpoints, and servers
  // that could not load the current generation (by server index).
  CheckpointReports reports;
  std::map<int, std::string> load_failures;
  // Servers that say the job cannot go on (HeldJob.error), by index.
  std::map<int, std::string> server_errors;
};

class JobTable;

// One change to the jobs. A job changed only through MutableVolatile
// (progress, a pending job's reason) is installed without being written.
class Txn {
 public:
  // `now_ms`: the wall time of the change (Unix milliseconds), stamped on
  // the events it publishes and the times of the states it sets.
  Txn(const JobTable* table, int64_t now_ms) : table_(table), now_ms_(now_ms) {}

  int64_t now_ms() const { return now_ms_; }
  const JobTable& table() const { return *table_; }

  // The job as this change sees it. The job must exist.
  const v1::Job& Get(const std::string& id) const;
  // The job's partition plan (an added job's too).
  const v1::PartitionPlan& Plan(const std::string& id) const;
  // The ids of every job this change sees: the table's in submission
  // order, then the added ones.
  std::vector<std::string> Ids() const;

  // A copy of the job to change, written to the job store on commit.
  v1::Job* Mutable(const std::string& id);
  // A copy to change that is installed without being written.
  v1::Job* MutableVolatile(const std::string& id);
  void Add(v1::Job job, v1::PartitionPlan plan);
  // Sets the job's state and reason, and its start time (running) or end
  // time (terminal).
  void SetState(const std::string& id, v1::JobState state, const std::string& reason);
  // An event for the job's watchers, published when the change is installed.
  void Publish(const std::string& id, v1::JobEvent event);
  // An event stamped with the change's time.
  v1::JobEvent Event() const;

  bool empty() const { return changed_.empty() && events_.empty(); }
  // The jobs to write to the job store.
  std::vector<const v1::Job*> Durable() const;

 private:
  friend class JobTable;
  struct Change {
    v1::Job job;
    v1::PartitionPlan plan;  // added jobs
    bool added = false;
    bool durable = false;
  };
  Change& Touch(const std::string& id);

  const JobTable* const table_;
  const int64_t now_ms_;
  std::map<std::string, Change> changed_;
  std::vector<std::string> added_;
  std::vector<std::pair<std::string, v1::JobEvent>> events_;
};

class JobTable {
 public:
  // `metrics` may be null (not measured); it must outlive the table.
  explicit JobTable(CoordinatorMetrics* metrics) : metrics_(metrics) {}

  // Null if there is no such job.
  const JobRecord* Find(const std::string& id) const;
  JobRecord* Find(const std::string& id);
  bool contains(const std::string& id) const { return records_.contains(id); }
  // The job must exist.
  JobRecord& at(const std::string& id) { return records_.at(id); }
  const JobRecord& at(const std::string& id) const { return records_.at(id); }
  const std::map<std::string, JobRecord>& records() const { return records_; }

  const std::vector<std::string>& order() const { return order_; }      // by submission
  const std::vector<std::string>& pending() const { return pending_; }  // oldest first
  const std::vector<std::string>& running() const { return running_; }
  // Jobs that succeeded with a checkpoint.dir: their last checkpoints may
  // complete after their last step (the servers report them as they are
  // written), until StopSettling.
  const std::vector<std::string>& settling() const { return settling_; }
  void StopSettling(const std::string& id) { std::erase(settling_, id); }

  // The job that a SubmitJob with this request id made; null if none.
  const std::string* JobOfRequest(const std::string& request_id) const;
  // The id of the next job: `prefix` and the number after the highest yet.
  std::string NextId(const std::string& prefix) const;
  // The number at the end of a job id ("job-000012": 12); 0 if none.
  static int64_t JobNumber(const std::string& id);

  // Installs a committed change: the jobs it added and changed, the lists
  // of pending and running jobs, each job's metrics, and the events for
  // their watchers (the change's own, then those of every new state or
  // generation). Returns the jobs whose state or generation changed.
  std::vector<std::string> Install(Txn& txn);

  // A running job's script metrics as Prometheus series
  // (pstrain_job_metric), from its progress.
  void SetScriptMetrics(JobRecord& record, const v1::Progress& progress);

  // Adds a job read back from the job store at start-up (its plan
  // recomputed) and returns its record.
  JobRecord& Restore(v1::Job job);

  // Forgets the oldest finished jobs beyond `keep` finished ones; returns
  // their ids (the caller forgets their files).
  std::vector<std::string> ForgetOldFinished(int64_t keep);

  // A page of ListJobs: newest first; a token is the number of the job
  // where the next page starts (going back), so new jobs do not shift it
  // and it still works if that job was forgotten in between.
  // INVALID_ARGUMENT for a token that is not one.
  absl::Status List(const v1::ListJobsRequest& request, v1::ListJobsResponse* response) const;

  // Follows the job with `queue`: the job as it is now, then its events
  // until it ends. The queue is ended with NOT_FOUND for an unknown job,
  // RESOURCE_EXHAUSTED past `max_watchers` of one job.
  void Watch(const std::string& id, const std::shared_ptr<WatchQueue>& queue,
             size_t max_watchers, int64_t now_ms);
  // Ends every watch with `status`.
  void EndWatches(const grpc::Status& status);

 private:
  // Keeps the lists, metrics and watchers in step with a job's new state
  // (or generation).
  void OnStateChange(const std::string& id, v1::JobState old, int64_t now_ms);
  void Publish(JobRecord& record, const v1::JobEvent& event, bool last);

  CoordinatorMetrics* const metrics_;
  std::map<std::string, JobRecord> records_;
  std::vector<std::string> order_;
  std::vector<std::string> pending_;
  std::vector<std::string> running_;
  std::vector<std::string> settling_;
  std::map<std::string, std::string> request_ids_;  // SubmitJobRequest.request_id -> job
  int64_t last_number_ = 0;                         // the highest job number yet
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_JOB_TABLE_H_
