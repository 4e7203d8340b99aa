// What the coordinator measures, declared in one place and built once.
#ifndef PSTRAIN_SERVER_COORDINATOR_METRICS_H_
#define PSTRAIN_SERVER_COORDINATOR_METRICS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/enum_names.h"
#include "common/metrics.h"
#include "pstrain/v1/control.pb.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::server {

struct CoordinatorMetrics {
  // Per-job series stay this long after the job ends.
  static absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> Create(
      prometheus::Registry& registry, absl::Duration grace);

  // name                                                 labels      type
  prometheus::Family<prometheus::Gauge>* jobs;               // state       pstrain_jobs
  prometheus::Family<prometheus::Counter>* jobs_ended;       // state       pstrain_jobs_ended_total
  prometheus::Counter* jobs_submitted;                       //             pstrain_jobs_submitted_total
  prometheus::Family<prometheus::Gauge>* nodes;              // role,state  pstrain_nodes
  prometheus::Family<prometheus::Gauge>* job_running;        // job_id      pstrain_job_running
  prometheus::Family<prometheus::Gauge>* job_steps;          // job_id      pstrain_job_progress_steps
  prometheus::Family<prometheus::Gauge>* job_accuracy;       // job_id      pstrain_job_test_accuracy
  prometheus::Family<prometheus::Gauge>* job_test_loss;      // job_id      pstrain_job_test_loss
  prometheus::Family<prometheus::Gauge>* job_checkpoint;     // job_id      pstrain_job_last_checkpoint_step
  prometheus::Family<prometheus::Gauge>* job_generation;     // job_id      pstrain_job_generation
  prometheus::Family<prometheus::Gauge>* job_recoveries;     // job_id      pstrain_job_recoveries
  prometheus::Histogram* log_append_seconds;                 //             pstrain_job_log_append_seconds

  // Children bound at start-up for every state and role.
  std::map<v1::JobState, prometheus::Gauge*> jobs_by_state;
  std::map<v1::JobState, prometheus::Counter*> ended_by_state;
  std::map<std::pair<v1::NodeRole, v1::NodeState>, prometheus::Gauge*> nodes_by_role_state;

  // One job's series, bound when it starts.
  struct Job {
    prometheus::Gauge* running;
    prometheus::Gauge* steps;
    prometheus::Gauge* accuracy;
    prometheus::Gauge* test_loss;
    prometheus::Gauge* last_checkpoint;
    prometheus::Gauge* generation;
    prometheus::Gauge* recoveries;
  };
  Job BindJob(const std::string& job_id);

  ExpiringSeries expiring;

 private:
  explicit CoordinatorMetrics(absl::Duration grace) : expiring(grace) {}
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_COORDINATOR_METRICS_H_
