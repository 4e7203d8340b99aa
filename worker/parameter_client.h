// A worker's view of the parameter servers: push a step's gradient, receive
// the new values, retry what was lost. Pushes are idempotent on the servers
// (identified by job, worker, step and chunk), so a retry is always safe.
#ifndef PSTRAIN_WORKER_PARAMETER_CLIENT_H_
#define PSTRAIN_WORKER_PARAMETER_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/retry.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/parameters.pb.h"
#include "worker/transport.h"

namespace pstrain::worker {

class ParameterClient {
 public:
  struct Options {
    std::string job_id;
    uint32_t worker = 0;
    // The job's generation this client works in: servers refuse requests
    // of a generation that is over (ABORTED, permanent) and hold back those
    // of one they have not loaded yet (UNAVAILABLE, retried).
    int64_t generation = 0;
    v1::Mode mode = v1::MODE_SYNC;
    v1::PartitionPlan plan;
    // How pushed gradients travel: fp32, or rounded to bf16 or fp16 (half
    // the bytes). Replies come in the job's wire dtype, whatever this is.
    v1::DType wire_dtype = v1::DTYPE_FP32;
    // A server's chunks of one exchange take one stream per this many
    // bytes of values, up to the transport's channels per server.
    int64_t bytes_per_stream = 1 << 20;
    // Longest one stream may take, barrier waits included.
    absl::Duration exchange_timeout = absl::Minutes(10);
    // What is retried and how: the transient codes and NOT_FOUND (the
    // server has not loaded the job yet); the client gives up when no reply
    // at all arrived for the policy's patience.
    RetryPolicy retry = DefaultRetryPolicy();
  };

  struct Stats {
    int64_t retries = 0;        // exchanges repeated for lost or failed replies
    int64_t bytes_pushed = 0;   // payload bytes sent
    int64_t bytes_pulled = 0;   // payload bytes received and used
    // PushPull time: sending every push, waiting for the first reply (the
    // servers' barrier), receiving the rest.
    double push_seconds = 0;
    double wait_seconds = 0;
    double pull_seconds = 0;
  };

  static RetryPolicy DefaultRetryPolicy() {
    return RetryPolicy::Transient()
        .AlsoRetrying({absl::StatusCode::kNotFound})
        .WithBackoff(absl::Milliseconds(20), absl::Seconds(1))
        .WithPatience(absl::Seconds(60));
  }

  // An exchange in flight: started by Start*, completed by Finish.
  class Pending;
  // A part of the flat parameter space in memory: data[i] holds float
  // offset + i. (A tensor of the client library's: its own memory.)
  struct FlatSpan {
    float* data = nullptr;
    int64_t offset = 0;
  };
  using RequestFn = std::function<grpc::ByteBuffer(uint32_t chunk)>;

  // The transport must outlive the client.
  ParameterClient(Options options, ParameterTransport* transport);
  // Cancels (the transport's calls too), and waits for this client's
  // streams to end: no reply is written anywhere after it returns, even for
  // exchanges never Finished.
  ~ParameterClient();

  // Fills params (plan.total_floats() floats, host memory) with every
  // chunk's values once every worker has had `steps_applied` steps applied
  // to it (0: the values the servers have now).
  absl::Status PullAll(float* params, int64_t steps_applied);

  // Pushes this worker's gradient of `step` for `chunks` (ids of the plan;
  // all of them if empty) and writes the answered values into params at the
  // chunks' offsets: version step+1 in sync mode; async and ssp, the values
  // the job's staleness bound lets step+1 be computed from. The gradient (flat, host memory) must not change until Finish.
  // An fp32 push sends slices of `grad` itself; a 16-bit one casts the
  // chunks once into a buffer the client reuses for every step, so the
  // exchanges of one step must be Finished before the next step's start.
  std::unique_ptr<Pending> StartPushPull(int64_t step,
                                         const std::shared_ptr<std::vector<float>>& grad,
                                         float* params, std::vector<uint32_t> chunks = {});
  // The same for gradient and values anywhere in memory: `grad` holds the
  // gradient of the floats from grad.offset on, kept alive by `owner` until
  // the frames that reference it are gone; the replies land in `params`.
  // `chunks` must lie inside both spans.
  std::unique_ptr<Pending> StartPushPull(int64_t step, FlatSpan grad,
                                         std::shared_ptr<const void> owner, FlatSpan params,
                                         std::vector<uint32_t> chunks);

  // External models (worker 0): sends `values` as the initial values of
  // `chunks` (INIT frames; fp32 whatever the wire dtype). A server keeps the
  // first it gets of each chunk. `values` must stay unchanged until Finish.
  std::unique_ptr<Pending> StartInit(FlatSpan values, std::shared_ptr<const void> owner,
                                     std::vector<uint32_t> chunks);

  // Pulls `chunks` into `params` as PullAll does.
  std::unique_ptr<Pending> StartPull(FlatSpan params, int64_t steps_applied,
                                     std::vector<uint32_t> chunks);
  // Waits for the replies of an exchange, retrying what was lost.
  absl::Status Finish(std::unique_ptr<Pending> pending);
  // Waits until the reply for `chunk` (one of exchanges[which]'s chunks)
  // has landed in its params: true. False as soon as any of `exchanges`
  // needs Finish (a stream ended without some chunk: a retry; or
  // cancelled). Retries nothing itself: Finish must follow for every one
  // in any case.
  bool AwaitReply(absl::Span<const std::unique_ptr<Pending>> exchanges, size_t which,
                  uint32_t chunk);

  // Tells every server that this worker has pushed all of `step` and that
  // no value it pushed exceeds `gradient_max_abs` (infinity: one was a NaN
  // or an infinity). The servers apply a worker's pushes of a step only
  // once they have its step end: sync, the step's updates wait for every
  // worker's, and are skipped on every server if one is not finite. A node
  // with several devices sends one, for all of them, once each device has
  // started its pushes. The servers acknowledge it at once: Finish it
  // before the step's pushes, whose replies wait for it (a lost step end is
  // sent again only by its own Finish).
  std::unique_ptr<Pending> StartEndStep(int64_t step, float gradient_max_abs);

  // The largest magnitude among the values this client has pushed for
  // `step` (as they went on the wire); infinity if one was a NaN or an
  // infinity. 0 if it pushed nothing of `step`.
  float PushedMaxAbs(int64_t step) const;

  // StartPushPull of every chunk + StartEndStep + Finish.
  absl::Status PushPull(int64_t step, const std::shared_ptr<std::vector<float>>& grad,
                        float* params);

  // The version of each chunk's values last written to params.
  int64_t chunk_version(uint32_t chunk) const;
  const v1::PartitionPlan& plan() const { return options_.plan; }
  Stats stats() const;

  // Makes the current and every later call return CANCELLED. Thread-safe.
  void Cancel();

 private:
  struct Exchange;

  v1::ChunkHeader Header(v1::FrameKind kind, uint32_t chunk) const;
  // The dtype chunk `c`'s pushes travel in: the wire's; fp32 for a buffer.
  v1::DType PushDType(uint32_t c) const {
    return buffer_chunk_[c] ? v1::DTYPE_FP32 : options_.wire_dtype;
  }
  std::vector<uint32_t> AllChunks() const;
  std::unique_ptr<Pending> Start(ParameterMethod method, std::vector<uint32_t> chunks,
                                 RequestFn make_request, int64_t min_version, FlatSpan params);
  // Sends `chunks` of the exchange: per server, on as many of its channels
  // as options_.bytes_per_stream asks for, each stream carrying its chunks
  // in ascending id order. (With every stream of every
  // worker in ascending order, whatever their windows and channels, a window
  // always holds the lowest chunk its stream still waits for, so a sync
  // barrier can always complete the lowest chunk that any worker waits for:
  // no deadlock.) A chunk whose streams all ended without its reply is sent
  // again by Finish at once, while the exchange's other streams go on: a
  // worker that waited for all of them first could wait for a barrier that
  // waits for a chunk another worker holds back the same way.
  void Send(const std::shared_ptr<Exchange>& exchange, std::vector<uint32_t> chunks);
  bool cancelled() const;
  // False if cancelled before `duration` passed.
  bool SleepUnlessCancelled(absl::Duration duration);

  const Options options_;
  ParameterTransport* const transport_;
  const int channels_;  // per server
  // Where step ends go: the lowest chunk of each server that has any.
  std::vector<uint32_t> step_end_chunks_;
  // By chunk: a piece of an external model's buffer, pushed as fp32 words
  // whatever the wire, and not a gradient (no part of the step end's bound).
  std::vector<bool> buffer_chunk_;
  // 16-bit wire dtype: the pushed gradient, cast; null for fp32.
  std::shared_ptr<std::vector<uint16_t>> wire_grad_;
  // Written from transport threads, each chunk by the one reply that claims it.
  std::vector<int64_t> chunk_versions_;
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  MonotonicCondVar cancelled_cv_;  // cancelled_ set
  int streams_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Per server: the channel the next exchange's first stream takes.
  std::vector<int> next_channel_ ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex pushed_mu_;
  int64_t pushed_step_ ABSL_GUARDED_BY(pushed_mu_) = -1;
  float pushed_max_abs_ ABSL_GUARDED_BY(pushed_mu_) = 0;  // of pushed_step_
  mutable absl::Mutex stats_mu_;
  Stats stats_ ABSL_GUARDED_BY(stats_mu_);
};

class ParameterClient::Pending {
 private:
  friend class ParameterClient;
  std::shared_ptr<Exchange> exchange;  // null if cancelled before it started
};

// The exchanges of one step still in flight, in the order they are
// Finished (the node's step end first: the pushes' replies wait for it),
// and which one carries each chunk: the next forward pass awaits each
// chunk's values as it reaches them, and once one was lost (a retry to
// send) every exchange is Finished at once. Used by one thread at a time;
// movable.
class StepExchanges {
 public:
  // Exchanges of `client`, which must outlive them.
  explicit StepExchanges(ParameterClient* client)
      : client_(client), exchange_of_chunk_(client->plan().chunks_size(), 0) {}

  bool empty() const { return pending_.empty(); }
  // An exchange that carries `chunks`.
  void Add(std::unique_ptr<ParameterClient::Pending> exchange, absl::Span<const uint32_t> chunks);
  // An exchange Finished before the others (a step end), carrying none.
  void AddFirst(std::unique_ptr<ParameterClient::Pending> exchange);

  // Waits until the values of `chunk` have landed: true (also with no
  // exchange in flight). False as soon as any exchange needs FinishAll.
  bool Await(uint32_t chunk);
  // Awaits, in chunk order, the chunks of [first, last) that start before
  // float offset `end`, from the first one not awaited since Rewind. False
  // as Await.
  bool AwaitInOrder(uint32_t first, uint32_t last, int64_t end);
  // The next step's values are awaited from the first chunk again.
  void Rewind() { next_awaited_ = 0; }

  // Finishes the exchanges in order, retrying what was lost, and leaves
  // none: the first error ends it (the rest are dropped; the client's
  // destruction waits for their streams).
  absl::Status FinishAll();
  // The exchanges in order, for the caller to finish; leaves none.
  std::vector<std::unique_ptr<ParameterClient::Pending>> Take() {
    return std::exchange(pending_, {});
  }

 private:
  ParameterClient* client_;
  std::vector<std::unique_ptr<ParameterClient::Pending>> pending_;
  std::vector<size_t> exchange_of_chunk_;  // by chunk: its exchange in pending_
  uint32_t next_awaited_ = 0;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_PARAMETER_CLIENT_H_
