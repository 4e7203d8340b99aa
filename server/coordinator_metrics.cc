#include "server/coordinator_metrics.h"

namespace pstrain::server {
absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> CoordinatorMetrics::Create(
    prometheus::Registry& r, absl::Duration grace) {
  std::unique_ptr<CoordinatorMetrics> m(new CoordinatorMetrics(grace));
  absl::Status s = BuildMetrics([&] {
    PSTRAIN_REGISTER_METRICS(PSTRAIN_COORDINATOR_METRICS)
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
  Job j;
  j.job_id = job_id;
  PSTRAIN_BIND_JOB_METRICS(PSTRAIN_COORDINATOR_METRICS)
  j.running->Set(1);
  expiring.Add(job_id, [this, j] { PSTRAIN_REMOVE_JOB_METRICS(PSTRAIN_COORDINATOR_METRICS) });
  return j;
}

void CoordinatorMetrics::SetScriptMetric(Job& job, const std::string& name, double value) {
  auto [it, added] = job.script.try_emplace(name, nullptr);
  if (added) {
    it->second = &script_metrics->Add({{"job_id", job.job_id}, {"name", name}});
    expiring.AddRemoval(job.job_id,
                        [family = script_metrics, gauge = it->second] { family->Remove(gauge); });
  }
  it->second->Set(value);
}

}  // namespace pstrain::server
