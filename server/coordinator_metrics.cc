#include "server/coordinator_metrics.h"

namespace pstrain::server {
absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> CoordinatorMetrics::Create(
    prometheus::Registry& r, absl::Duration grace) {
  std::unique_ptr<CoordinatorMetrics> m(new CoordinatorMetrics(grace));
  absl::Status s = BuildMetrics([&] {
    m->jobs = &prometheus::BuildGauge()
                   .Name("pstrain_jobs")
                   .Help("Jobs the coordinator knows, by state.")
                   .Register(r);
    m->jobs_ended = &prometheus::BuildCounter()
                         .Name("pstrain_jobs_ended_total")
                         .Help("Jobs that ended, by final state.")
                         .Register(r);
    m->jobs_submitted = &prometheus::BuildCounter()
                             .Name("pstrain_jobs_submitted_total")
                             .Help("Jobs accepted by SubmitJob.")
                             .Register(r)
                             .Add({});
    m->nodes = &prometheus::BuildGauge()
                    .Name("pstrain_nodes")
                    .Help("Registered nodes, by role and state.")
                    .Register(r);
    m->job_running = &prometheus::BuildGauge()
                          .Name("pstrain_job_running")
                          .Help("1 while a job runs, 0 once it has ended.")
                          .Register(r);
    m->job_steps = &prometheus::BuildGauge()
                        .Name("pstrain_job_progress_steps")
                        .Help("Steps a running job has completed (its slowest worker).")
                        .Register(r);
    m->job_accuracy = &prometheus::BuildGauge()
                           .Name("pstrain_job_test_accuracy")
                           .Help("Test-set accuracy of a job's latest evaluation: during "
                                 "training (eval_every_steps), then of the final model.")
                           .Register(r);
    m->job_test_loss = &prometheus::BuildGauge()
                            .Name("pstrain_job_test_loss")
                            .Help("Mean test-set loss of a job's latest evaluation.")
                            .Register(r);
    m->job_checkpoint = &prometheus::BuildGauge()
                             .Name("pstrain_job_last_checkpoint_step")
                             .Help("The step of a job's latest complete checkpoint.")
                             .Register(r);
    m->job_generation = &prometheus::BuildGauge()
                             .Name("pstrain_job_generation")
                             .Help("A running job's generation: one more per recovery.")
                             .Register(r);
    m->job_recoveries = &prometheus::BuildGauge()
                             .Name("pstrain_job_recoveries")
                             .Help("Recoveries of a job from the loss of a node so far.")
                             .Register(r);
    m->log_append_seconds = &prometheus::BuildHistogram()
                                 .Name("pstrain_job_log_append_seconds")
                                 .Help("Writing and syncing one record of the job log.")
                                 .Register(r)
                                 .Add({}, LatencyBuckets());
    for (v1::JobState state :
         {v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED,
          v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
      m->jobs_by_state[state] = &m->jobs->Add({{"state", EnumName(state)}});
      if (state >= v1::JOB_STATE_SUCCEEDED) {
        m->ended_by_state[state] = &m->jobs_ended->Add({{"state", EnumName(state)}});
      }
    }
    for (v1::NodeRole role : {v1::NODE_ROLE_SERVER, v1::NODE_ROLE_WORKER}) {
      for (v1::NodeState state :
           {v1::NODE_STATE_ALIVE, v1::NODE_STATE_LOST, v1::NODE_STATE_AWAITED}) {
        m->nodes_by_role_state[{role, state}] =
            &m->nodes->Add({{"role", EnumName(role)}, {"state", EnumName(state)}});
      }
    }
  });
  if (!s.ok()) return s;
  return m;
}

CoordinatorMetrics::Job CoordinatorMetrics::BindJob(const std::string& job_id) {
  const prometheus::Labels labels = {{"job_id", job_id}};
  Job j{&job_running->Add(labels),    &job_steps->Add(labels),
        &job_accuracy->Add(labels),   &job_test_loss->Add(labels),
        &job_checkpoint->Add(labels), &job_generation->Add(labels),
        &job_recoveries->Add(labels)};
  j.running->Set(1);
  expiring.Add(job_id, [this, j] {
    job_running->Remove(j.running);
    job_steps->Remove(j.steps);
    job_accuracy->Remove(j.accuracy);
    job_test_loss->Remove(j.test_loss);
    job_checkpoint->Remove(j.last_checkpoint);
    job_generation->Remove(j.generation);
    job_recoveries->Remove(j.recoveries);
  });
  return j;
}

}  // namespace pstrain::server
