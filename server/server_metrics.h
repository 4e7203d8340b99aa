// What a parameter server measures, declared in one place and built once.
#ifndef PSTRAIN_SERVER_SERVER_METRICS_H_
#define PSTRAIN_SERVER_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace pstrain::server {

struct ServerMetrics {
  // Per-job series stay this long after the server releases the job.
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(prometheus::Registry& registry,
                                                               absl::Duration grace);

  // name                                           labels   type
  prometheus::Family<prometheus::Counter>* pushes;          // job_id  pstrain_server_pushes_total
  prometheus::Family<prometheus::Counter>* received_bytes;  // job_id  pstrain_server_received_bytes_total
  prometheus::Family<prometheus::Counter>* sent_bytes;      // job_id  pstrain_server_sent_bytes_total
  prometheus::Family<prometheus::Counter>* updates;         // job_id  pstrain_server_updates_total
  prometheus::Family<prometheus::Counter>* skipped;         // job_id  pstrain_server_skipped_updates_total
  prometheus::Family<prometheus::Gauge>* learning_rate;     // job_id  pstrain_server_learning_rate
  prometheus::Family<prometheus::Histogram>* barrier_wait;  // job_id  pstrain_server_barrier_wait_seconds
  prometheus::Family<prometheus::Histogram>* apply;         // job_id  pstrain_server_apply_seconds
  prometheus::Family<prometheus::Histogram>* staleness;     // job_id  pstrain_server_gradient_staleness
  prometheus::Family<prometheus::Histogram>* step_staleness;  // job_id  pstrain_server_step_staleness
  prometheus::Family<prometheus::Histogram>* slowest_wait;  // job_id  pstrain_server_slowest_worker_wait_seconds
  prometheus::Family<prometheus::Histogram>* checkpoint;    // job_id  pstrain_server_checkpoint_seconds
  prometheus::Family<prometheus::Histogram>* checkpoint_copy;  // job_id  pstrain_server_checkpoint_copy_seconds
  prometheus::Family<prometheus::Counter>* checkpoint_bytes;   // job_id  pstrain_server_checkpoint_bytes_total
  prometheus::Family<prometheus::Gauge>* last_checkpoint;      // job_id  pstrain_server_last_checkpoint_step
  prometheus::Family<prometheus::Gauge>* stragglers;     // job_id,worker  pstrain_server_straggler
  prometheus::Gauge* held_bytes;                            //         pstrain_server_held_bytes
  prometheus::Gauge* jobs;                                  //         pstrain_server_jobs
  prometheus::Gauge* open_waits;                            //         pstrain_server_open_waits

  // One job's series, bound once when the server starts holding it.
  struct Job {
    prometheus::Counter* pushes;
    prometheus::Counter* received_bytes;
    prometheus::Counter* sent_bytes;
    prometheus::Counter* updates;
    prometheus::Counter* skipped;
    prometheus::Gauge* learning_rate;
    prometheus::Histogram* barrier_wait;
    prometheus::Histogram* apply;
    prometheus::Histogram* staleness;
    prometheus::Histogram* step_staleness;
    prometheus::Histogram* slowest_wait;
    prometheus::Histogram* checkpoint;
    prometheus::Histogram* checkpoint_copy;
    prometheus::Counter* checkpoint_bytes;
    prometheus::Gauge* last_checkpoint;
  };
  // The job's series; they expire `grace` after JobEnded.
  Job BindJob(const std::string& job_id);
  // The straggler gauge of one worker of a job; it expires with the job's
  // other series.
  prometheus::Gauge* BindStraggler(const std::string& job_id, uint32_t worker);

  ExpiringSeries expiring;

 private:
  explicit ServerMetrics(absl::Duration grace) : expiring(grace) {}
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SERVER_METRICS_H_
