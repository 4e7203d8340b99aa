// A worker's exchanges with the servers' embedding tables: each step one
// SPARSE_PULL and one SPARSE_PUSH per server for all of the job's tables
// (common/sparse_frames.h), over the job's transport (every carrier takes
// them as they are), each retried per server as the dense exchanges are.
// Calls block until every server has answered.
#ifndef PSTRAIN_WORKER_SPARSE_CLIENT_H_
#define PSTRAIN_WORKER_SPARSE_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/retry.h"
#include "common/sparse_frames.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/membership.pb.h"
#include "worker/transport.h"

namespace pstrain::worker {

class SparseClient {
 public:
  struct Options {
    std::string job_id;
    uint32_t worker = 0;
    int64_t generation = 0;
    std::vector<int> dims;  // the tables'
    // Servers that own no dense chunk: they hear this worker's step ends
    // from EndStep (the dense client tells the others).
    std::vector<int> servers_without_chunks;
    RetryPolicy retry = RetryPolicy::Transient()
                            .AlsoRetrying({absl::StatusCode::kNotFound})
                            .WithBackoff(absl::Milliseconds(20), absl::Seconds(1))
                            .WithPatience(absl::Seconds(60));
  };
  // One table's keys of a step: distinct, each with its occurrences in the
  // batch and (for a push) its summed gradient, dim floats a key.
  struct TableKeys {
    std::vector<uint64_t> keys;
    std::vector<uint32_t> counts;
    std::vector<float> grads;
  };

  // The options of the worker that `assignment` places, for `spec`'s
  // tables (the servers without dense chunks from its plan).
  static Options OptionsFor(const v1::WorkerAssignment& assignment, const v1::JobSpec& spec,
                            RetryPolicy retry);

  // The transport must outlive the client.
  SparseClient(Options options, ParameterTransport* transport);

  // The rows of tables[t].keys into rows[t] (keys.size() x dim floats) once
  // the servers' tables have had `version` steps applied, every worker's
  // clock is at `pushed_steps`, and (async, SSP) this worker's at `step`.
  // Every server is asked, with keys there or none: sync, its answer is
  // what lets this worker's push and step end of the step in.
  absl::Status Pull(int64_t step, int64_t version, int64_t pushed_steps,
                    const std::vector<TableKeys>& tables, std::vector<std::vector<float>>& rows);

  // This worker's push of `step` to every server (one frame each, with the
  // sections of its keys there, or none); returns once all are
  // acknowledged.
  absl::Status Push(int64_t step, const std::vector<TableKeys>& tables);

  // A table's initial rows (its initial_rows, worker 0's): row k of `rows`
  // (dim floats each) is key k's.
  struct InitialRows {
    uint32_t table = 0;
    const float* rows = nullptr;
    int64_t count = 0;
  };
  // Sends the tables' initial rows to the servers that hold them
  // (SPARSE_INIT frames of about 4 MiB at most, a round at a time); returns
  // once every server has acknowledged all of its share.
  absl::Status Init(const std::vector<InitialRows>& tables);

  // The step end of `step` to the servers without dense chunks.
  absl::Status EndStep(int64_t step, float gradient_max_abs);

  // Ends the calls in flight and refuses new ones (CANCELLED).
  void Cancel();

 private:
  // Sends requests[s] to every server s that has one and waits for each
  // one's reply, retrying a server's failed exchange within the policy.
  absl::Status ExchangeAll(ParameterMethod method, const std::vector<grpc::ByteBuffer>& requests,
                           std::vector<std::optional<Frame>>* replies);
  v1::ChunkHeader Header(v1::FrameKind kind, int64_t step) const;

  const Options options_;
  ParameterTransport* const transport_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_SPARSE_CLIENT_H_
