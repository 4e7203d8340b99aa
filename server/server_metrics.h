// What a parameter server measures, declared once: the table below gives
// every metric's name, help and kind; the fields, registration, binding and
// removal follow from it (common/metrics.h).
#ifndef PSTRAIN_SERVER_SERVER_METRICS_H_
#define PSTRAIN_SERVER_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace pstrain::server {

#define PSTRAIN_SERVER_METRICS(JOB_COUNTER, JOB_GAUGE, JOB_HISTOGRAM, COUNTER, GAUGE,          \
                               HISTOGRAM, FAMILY_COUNTER, FAMILY_GAUGE)                        \
  JOB_COUNTER(pushes, "pstrain_server_pushes_total", "Gradient pushes received, retries included.") \
  JOB_COUNTER(received_bytes, "pstrain_server_received_bytes_total",                          \
              "Gradient payload bytes received.")                                             \
  JOB_COUNTER(sent_bytes, "pstrain_server_sent_bytes_total", "Parameter payload bytes sent.") \
  JOB_COUNTER(updates, "pstrain_server_updates_total", "Optimizer updates applied to chunks.") \
  JOB_COUNTER(skipped, "pstrain_server_skipped_updates_total",                                \
              "Updates of a chunk skipped because a worker's gradient of the step had a NaN "  \
              "or an infinity somewhere (sync: the step, on every chunk; async: that "         \
              "worker's push).")                                                              \
  JOB_GAUGE(learning_rate, "pstrain_server_learning_rate",                                    \
            "The learning rate of the last update applied (the job's schedule at its step).") \
  JOB_HISTOGRAM(barrier_wait, "pstrain_server_barrier_wait_seconds",                          \
                "Sync mode: from a chunk's first push of a step to its last.", LatencyBuckets()) \
  JOB_HISTOGRAM(apply, "pstrain_server_apply_seconds",                                        \
                "Summing a chunk's gradients and applying the optimizer.", LatencyBuckets())  \
  JOB_HISTOGRAM(staleness, "pstrain_server_gradient_staleness",                               \
                "Async and ssp: updates applied to a chunk since the values a gradient was "  \
                "computed from.",                                                             \
                CountBuckets())                                                               \
  JOB_HISTOGRAM(step_staleness, "pstrain_server_step_staleness",                              \
                "Steps of the slowest worker missing from the values a worker's next step "   \
                "is computed from, per worker and step (sync: 0; ssp: at most the job's "     \
                "staleness).",                                                                \
                CountBuckets())                                                               \
  JOB_HISTOGRAM(slowest_wait, "pstrain_server_slowest_worker_wait_seconds",                   \
                "How long a worker's push waited for other workers' steps before its reply, " \
                "per worker and step (sync: the barrier; ssp: the staleness bound; async: 0).", \
                LatencyBuckets())                                                             \
  JOB_HISTOGRAM(checkpoint, "pstrain_server_checkpoint_seconds",                              \
                "Writing one checkpoint of a job's chunks (in the background).",              \
                LatencyBuckets())                                                             \
  JOB_HISTOGRAM(checkpoint_copy, "pstrain_server_checkpoint_copy_seconds",                    \
                "Copying a chunk's values and optimizer state, or a job's table rows, at a "  \
                "checkpoint step (what training waits for).",                                 \
                LatencyBuckets())                                                             \
  JOB_COUNTER(checkpoint_bytes, "pstrain_server_checkpoint_bytes_total",                      \
              "Bytes of checkpoint files written.")                                           \
  JOB_GAUGE(last_checkpoint, "pstrain_server_last_checkpoint_step",                           \
            "The step of the server's newest checkpoint of a job.")                           \
  FAMILY_GAUGE(stragglers, "pstrain_server_straggler",                                        \
               "1 while a worker's pushes reach the barrier more than 3x the median lag of "  \
               "the others, 10 steps in a row.")                                              \
  FAMILY_GAUGE(table_rows, "pstrain_server_table_rows",                                      \
               "Rows of an embedding table this server holds.")                              \
  FAMILY_GAUGE(table_bytes, "pstrain_server_table_bytes",                                    \
               "Bytes of an embedding table on this server: rows, optimizer state, index "   \
               "and admission filter (what its cap bounds).")                                \
  FAMILY_GAUGE(table_max_bytes, "pstrain_server_table_max_bytes",                            \
               "An embedding table's cap on this server (max_memory_bytes; 0: none).")       \
  FAMILY_COUNTER(table_admitted, "pstrain_server_table_admitted_total",                      \
                 "Keys that became rows of an embedding table.")                             \
  FAMILY_COUNTER(table_evicted, "pstrain_server_table_evicted_total",                        \
                 "Rows evicted from an embedding table (by age or by its cap).")             \
  FAMILY_COUNTER(table_dropped_gradients, "pstrain_server_table_dropped_gradients_total",    \
                 "Row gradients dropped because their key was not admitted (yet).")          \
  FAMILY_COUNTER(table_rows_pulled, "pstrain_server_table_rows_pulled_total",                \
                 "Rows of an embedding table sent to workers (one per key a pull names).")   \
  FAMILY_COUNTER(table_rows_pushed, "pstrain_server_table_rows_pushed_total",                \
                 "Row gradients of an embedding table received (one per key a push names).") \
  FAMILY_GAUGE(table_hot_key_share, "pstrain_server_table_hot_key_share",                    \
               "The share of an embedding table's sightings on this server that its "        \
               "hottest 1% of keys took, over the steps since the last multiple of 100 "     \
               "(every 4th step, updated every 10; a bounded sketch that never overstates it).") \
  GAUGE(held_bytes, "pstrain_server_held_bytes", "Bytes of job state held.")                  \
  GAUGE(jobs, "pstrain_server_jobs", "Jobs held.")                                            \
  GAUGE(open_waits, "pstrain_server_open_waits",                                              \
        "Pushes and pulls waiting for a version (at the barrier).")

struct ServerMetrics {
  // Per-job series stay this long after the server releases the job.
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(prometheus::Registry& registry,
                                                               absl::Duration grace);

  PSTRAIN_METRIC_FIELDS(PSTRAIN_SERVER_METRICS)

  // One job's series, bound once when the server starts holding it.
  struct Job {
    PSTRAIN_JOB_METRIC_FIELDS(PSTRAIN_SERVER_METRICS)
  };
  // The job's series; they expire `grace` after JobEnded.
  Job BindJob(const std::string& job_id);
  // The straggler gauge of one worker of a job; it expires with the job's
  // other series.
  prometheus::Gauge* BindStraggler(const std::string& job_id, uint32_t worker);

  // One embedding table's series on this server.
  struct Table {
    prometheus::Gauge* rows = nullptr;
    prometheus::Gauge* bytes = nullptr;
    prometheus::Gauge* max_bytes = nullptr;
    prometheus::Counter* admitted = nullptr;
    prometheus::Counter* evicted = nullptr;
    prometheus::Counter* dropped_gradients = nullptr;
    prometheus::Counter* rows_pulled = nullptr;
    prometheus::Counter* rows_pushed = nullptr;
    prometheus::Gauge* hot_key_share = nullptr;
  };
  // The series of a job's table (labels job_id, table); they expire with
  // the job's other series.
  Table BindTable(const std::string& job_id, const std::string& table);

  ExpiringSeries expiring;

 private:
  explicit ServerMetrics(absl::Duration grace) : expiring(grace) {}
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SERVER_METRICS_H_
