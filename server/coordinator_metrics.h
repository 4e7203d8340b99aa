// What the coordinator measures.
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

#define PSTRAIN_COORDINATOR_METRICS(JOB_COUNTER, JOB_GAUGE, JOB_HISTOGRAM, COUNTER, GAUGE,     \
                                    HISTOGRAM, FAMILY_COUNTER, FAMILY_GAUGE)                   \
  FAMILY_GAUGE(jobs, "pstrain_jobs", "Jobs the coordinator knows, by state.")                  \
  FAMILY_COUNTER(jobs_ended, "pstrain_jobs_ended_total", "Jobs that ended, by final state.")   \
  COUNTER(jobs_submitted, "pstrain_jobs_submitted_total", "Jobs accepted by SubmitJob.")       \
  FAMILY_GAUGE(nodes, "pstrain_nodes", "Registered nodes, by role and state.")                 \
  JOB_GAUGE(running, "pstrain_job_running", "1 while a job runs, 0 once it has ended.")        \
  JOB_GAUGE(steps, "pstrain_job_progress_steps",                                               \
            "Steps a running job has completed (its slowest worker).")                         \
  JOB_GAUGE(accuracy, "pstrain_job_test_accuracy",                                             \
            "Test-set accuracy of a job's latest evaluation: during training "                 \
            "(eval_every_steps), then of the final model.")                                    \
  JOB_GAUGE(test_loss, "pstrain_job_test_loss", "Mean test-set loss of a job's latest evaluation.") \
  FAMILY_GAUGE(script_metrics, "pstrain_job_metric",                                           \
               "A job's own metric, given by its script (label name): the mean over its "      \
               "workers of their latest values.")                                              \
  JOB_GAUGE(last_checkpoint, "pstrain_job_last_checkpoint_step",                               \
            "The step of a job's latest complete checkpoint.")                                 \
  JOB_GAUGE(generation, "pstrain_job_generation",                                              \
            "A running job's generation: one more per recovery.")                              \
  JOB_GAUGE(recoveries, "pstrain_job_recoveries",                                              \
            "Recoveries of a job from the loss of a node so far.")                             \
  HISTOGRAM(log_append_seconds, "pstrain_job_log_append_seconds",                              \
            "Writing and syncing one record of the job log.", LatencyBuckets())

// What the coordinator measures, declared once in the table above
// (common/metrics.h).
struct CoordinatorMetrics {
  // Per-job series stay this long after the job ends.
  static absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> Create(
      prometheus::Registry& registry, absl::Duration grace);

  PSTRAIN_METRIC_FIELDS(PSTRAIN_COORDINATOR_METRICS)

  // Children bound at start-up for every state and role.
  std::map<v1::JobState, prometheus::Gauge*> jobs_by_state;
  std::map<v1::JobState, prometheus::Counter*> ended_by_state;
  std::map<std::pair<v1::NodeRole, v1::NodeState>, prometheus::Gauge*> nodes_by_role_state;

  // One job's series, bound when it starts (running set to 1).
  struct Job {
    PSTRAIN_JOB_METRIC_FIELDS(PSTRAIN_COORDINATOR_METRICS)
    std::string job_id;
    // pstrain_job_metric by name, bound as the script gives names; they
    // expire with the job's other series.
    std::map<std::string, prometheus::Gauge*> script;
  };
  Job BindJob(const std::string& job_id);
  void SetScriptMetric(Job& job, const std::string& name, double value);

  ExpiringSeries expiring;

 private:
  explicit CoordinatorMetrics(absl::Duration grace) : expiring(grace) {}
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_COORDINATOR_METRICS_H_
