#include "worker/parameter_client.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/chunk_codec.h"
#include "common/status.h"
#include "kernels/cpu/cpu_kernels.h"
#include "glog/logging.h"

namespace pstrain::worker {
// One exchange (a PushPull or a Pull of some chunks) and the streams that
// carry it, shared with the transport's callbacks.
struct ParameterClient::Exchange {
  ParameterMethod method = ParameterMethod::kPushPull;
  RequestFn make_request;
  int64_t min_version = 0;
  FlatSpan params;  // where the replies' values go

  absl::Mutex mu;
  std::vector<uint8_t> answered ABSL_GUARDED_BY(mu);  // by chunk id
  std::vector<uint8_t> landed ABSL_GUARDED_BY(mu);    // its values written (or acknowledged)
  std::vector<int> carriers ABSL_GUARDED_BY(mu);      // open streams carrying each chunk
  int unanswered ABSL_GUARDED_BY(mu) = 0;
  // Unanswered chunks that no open stream carries any more: to send again.
  std::vector<uint32_t> orphaned ABSL_GUARDED_BY(mu);
  // The first error of a stream since Finish last looked, and the first
  // permanent one, with the server named.
  absl::Status error ABSL_GUARDED_BY(mu);
  absl::Status permanent ABSL_GUARDED_BY(mu);
  absl::Time last_reply ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  int64_t bytes ABSL_GUARDED_BY(mu) = 0;
  absl::Time start;
  absl::Time all_sent ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  absl::Time first_reply ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  absl::Time last_landed ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();  // once all are in
  int streams_sending ABSL_GUARDED_BY(mu) = 0;  // of the first sending
};

ParameterClient::ParameterClient(Options options, ParameterTransport* transport)
    : options_(std::move(options)),
      transport_(transport),
      channels_(std::max(1, transport_->channels_per_server())),
      chunk_versions_(options_.plan.chunks_size(), -1),
      next_channel_(transport_->num_servers(), 0) {
  CHECK_EQ(static_cast<uint32_t>(transport_->num_servers()), options_.plan.num_servers())
      << "the transport does not reach the plan's servers";
  std::vector<bool> has_chunk(transport_->num_servers(), false);
  for (const v1::ChunkInfo& info : options_.plan.chunks()) {
    if (!has_chunk[info.server()]) step_end_chunks_.push_back(info.id());
    has_chunk[info.server()] = true;
    buffer_chunk_.push_back(options_.plan.tensors(static_cast<int>(info.tensor())).buffer());
  }
  if (DTypeBytes(options_.wire_dtype) == 2) {
    wire_grad_ = std::make_shared<std::vector<uint16_t>>(options_.plan.total_floats());
  }
}

ParameterClient::~ParameterClient() {
  Cancel();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* in_flight) { return *in_flight == 0; }, &streams_in_flight_));
}

ParameterClient::Stats ParameterClient::stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

int64_t ParameterClient::chunk_version(uint32_t chunk) const { return chunk_versions_[chunk]; }

void ParameterClient::Cancel() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  cancelled_cv_.NotifyAll();
  transport_->CancelAll();
}

bool ParameterClient::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool ParameterClient::SleepUnlessCancelled(absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  return !cancelled_cv_.AwaitWithTimeout(
      mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancelled_; }, duration);
}

v1::ChunkHeader ParameterClient::Header(v1::FrameKind kind, uint32_t chunk) const {
  v1::ChunkHeader h;
  h.set_kind(kind);
  h.set_job_id(options_.job_id);
  h.set_worker(options_.worker);
  h.set_generation(options_.generation);
  h.set_chunk(chunk);
  h.set_dtype(kind == v1::FRAME_KIND_PUSH ? PushDType(chunk) : v1::DTYPE_FP32);
  return h;
}

std::vector<uint32_t> ParameterClient::AllChunks() const {
  std::vector<uint32_t> chunks(options_.plan.chunks_size());
  std::iota(chunks.begin(), chunks.end(), 0);
  return chunks;
}

absl::Status ParameterClient::PullAll(float* params, int64_t steps_applied) {
  return Finish(StartPull({params, 0}, steps_applied, AllChunks()));
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::StartPull(
    FlatSpan params, int64_t steps_applied, std::vector<uint32_t> chunks) {
  auto make_request = [this, steps_applied](uint32_t c) {
    v1::ChunkHeader h = Header(v1::FRAME_KIND_PULL, c);
    h.set_pushed_steps(steps_applied);
    return EncodeFrame(h, nullptr);
  };
  return Start(ParameterMethod::kPull, std::move(chunks), make_request, 0, params);
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::StartInit(
    FlatSpan values, std::shared_ptr<const void> owner, std::vector<uint32_t> chunks) {
  auto make_request = [this, values, owner = std::move(owner)](uint32_t c) {
    const v1::ChunkInfo& info = options_.plan.chunks(c);
    v1::ChunkHeader h = Header(v1::FRAME_KIND_INIT, c);
    h.set_num_elements(static_cast<uint32_t>(info.size()));
    return EncodeFrameShared(h, values.data + (info.offset() - values.offset), owner);
  };
  return Start(ParameterMethod::kPush, std::move(chunks), make_request, 0, {});
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::StartPushPull(
    int64_t step, const std::shared_ptr<std::vector<float>>& grad, float* params,
    std::vector<uint32_t> chunks) {
  if (chunks.empty()) chunks = AllChunks();
  return StartPushPull(step, {grad->data(), 0}, grad, {params, 0}, std::move(chunks));
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::StartPushPull(
    int64_t step, FlatSpan grad, std::shared_ptr<const void> owner, FlatSpan params,
    std::vector<uint32_t> chunks) {
  const bool sync = options_.mode == v1::MODE_SYNC;
  // The payload: the gradient itself, or its cast for the wire (which is
  // indexed by flat offset), and where float `offset` of it lies.
  std::shared_ptr<const void> payload = owner;
  const char* base = reinterpret_cast<const char*>(grad.data);
  int64_t base_offset = grad.offset;
  if (wire_grad_ != nullptr) {
    for (uint32_t c : chunks) {
      if (buffer_chunk_[c]) continue;
      const v1::ChunkInfo& info = options_.plan.chunks(c);
      const float* from = grad.data + (info.offset() - grad.offset);
      if (options_.wire_dtype == v1::DTYPE_BF16) {
        kernels::CastToBf16(from, wire_grad_->data() + info.offset(), info.size());
      } else {
        kernels::CastToFp16(from, wire_grad_->data() + info.offset(), info.size());
      }
    }
    payload = wire_grad_;
    base = reinterpret_cast<const char*>(wire_grad_->data());
    base_offset = 0;
  }
  const size_t value_bytes = DTypeBytes(options_.wire_dtype);
  // By value: requests are made again on retries, after this returns.
  auto chunk_bytes = [base, base_offset, value_bytes](const v1::ChunkInfo& info) {
    return base + (info.offset() - base_offset) * static_cast<int64_t>(value_bytes);
  };
  auto make_request = [this, step, payload, chunk_bytes, sync, grad, owner](uint32_t c) {
    const v1::ChunkInfo& info = options_.plan.chunks(c);
    v1::ChunkHeader h = Header(v1::FRAME_KIND_PUSH, c);
    h.set_step(step);
    h.set_version(sync ? step : std::max<int64_t>(chunk_versions_[c], 0));
    h.set_num_elements(static_cast<uint32_t>(info.size()));
    if (buffer_chunk_[c]) {  // fp32 words, whatever the wire
      return EncodeFrameShared(h, grad.data + (info.offset() - grad.offset), owner);
    }
    return EncodeFrameShared(h, chunk_bytes(info), payload);
  };
  // Sync: exactly version step+1. Async: whatever the server has now.
  std::unique_ptr<Pending> pending = Start(ParameterMethod::kPushPull, chunks, make_request,
                                           sync ? step + 1 : 0, params);
  // The largest magnitude pushed, for the step end, while the pushes are
  // on their way (the payload is not written until they are finished).
  float max_abs = 0;
  for (uint32_t c : chunks) {
    if (buffer_chunk_[c]) continue;
    const v1::ChunkInfo& info = options_.plan.chunks(c);
    max_abs = std::max(max_abs, MaxAbsOf(options_.wire_dtype, chunk_bytes(info), info.size()));
  }
  absl::MutexLock lock(&pushed_mu_);
  if (pushed_step_ != step) pushed_max_abs_ = 0;
  pushed_step_ = step;
  pushed_max_abs_ = std::max(pushed_max_abs_, max_abs);
  return pending;
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::StartEndStep(int64_t step,
                                                                        float gradient_max_abs) {
  auto make_request = [this, step, gradient_max_abs](uint32_t c) {
    v1::ChunkHeader h = Header(v1::FRAME_KIND_STEP_END, c);
    h.set_step(step);
    h.set_gradient_max_abs(gradient_max_abs);
    return EncodeFrame(h, nullptr);
  };
  return Start(ParameterMethod::kPush, step_end_chunks_, make_request, 0, {});
}

float ParameterClient::PushedMaxAbs(int64_t step) const {
  absl::MutexLock lock(&pushed_mu_);
  return pushed_step_ == step ? pushed_max_abs_ : 0;
}

absl::Status ParameterClient::PushPull(int64_t step,
                                       const std::shared_ptr<std::vector<float>>& grad,
                                       float* params) {
  std::unique_ptr<Pending> pushed = StartPushPull(step, grad, params);
  // The step end first: the pushes' replies wait for it (see Trainer::Run).
  PSTRAIN_RETURN_IF_ERROR(Finish(StartEndStep(step, PushedMaxAbs(step))));
  return Finish(std::move(pushed));
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::Start(ParameterMethod method,
                                                                 std::vector<uint32_t> chunks,
                                                                 RequestFn make_request,
                                                                 int64_t min_version,
                                                                 FlatSpan params) {
  auto pending = std::make_unique<Pending>();
  if (cancelled()) return pending;
  auto exchange = std::make_shared<Exchange>();
  exchange->method = method;
  exchange->make_request = std::move(make_request);
  exchange->min_version = min_version;
  exchange->params = params;
  exchange->start = MonotonicNow();
  {
    absl::MutexLock lock(&exchange->mu);
    exchange->answered.assign(options_.plan.chunks_size(), 1);
    exchange->landed.assign(options_.plan.chunks_size(), 1);
    exchange->carriers.assign(options_.plan.chunks_size(), 0);
    for (uint32_t c : chunks) exchange->answered[c] = exchange->landed[c] = 0;
    exchange->unanswered = static_cast<int>(chunks.size());
  }
  pending->exchange = exchange;
  Send(exchange, std::move(chunks));
  return pending;
}

void ParameterClient::Send(const std::shared_ptr<Exchange>& exchange,
                           std::vector<uint32_t> chunks) {
  const v1::PartitionPlan& plan = options_.plan;
  const int num_servers = transport_->num_servers();
  std::sort(chunks.begin(), chunks.end());
  // Each server's chunks go on as few streams as carry their bytes (values
  // one way or both): a stream costs a call on both ends, which is most of
  // what a small exchange costs.
  std::vector<int64_t> server_bytes(num_servers, 0);
  for (uint32_t c : chunks) {
    server_bytes[plan.chunks(c).server()] += plan.chunks(c).size() * int64_t{sizeof(float)};
  }
  const int64_t per_stream = std::max<int64_t>(1, options_.bytes_per_stream);
  std::vector<int> server_streams(num_servers), first_channel(num_servers);
  {
    absl::MutexLock lock(&mu_);
    for (int s = 0; s < num_servers; ++s) {
      server_streams[s] = static_cast<int>(
          std::clamp<int64_t>((server_bytes[s] + per_stream - 1) / per_stream, 1, channels_));
      // Consecutive exchanges start on different channels.
      first_channel[s] = next_channel_[s];
      next_channel_[s] = (next_channel_[s] + server_streams[s]) % channels_;
    }
  }
  // By stream (server * channels_ + channel): its chunks and their requests,
  // the server's chunks round-robin over its streams.
  std::vector<std::vector<uint32_t>> stream_chunks(num_servers * channels_);
  std::vector<std::vector<grpc::ByteBuffer>> requests(num_servers * channels_);
  std::vector<int> chunks_placed(num_servers, 0);
  int64_t bytes = 0;
  for (uint32_t c : chunks) {
    const int s = static_cast<int>(plan.chunks(c).server());
    const int channel = (first_channel[s] + chunks_placed[s]++ % server_streams[s]) % channels_;
    const int stream = s * channels_ + channel;
    stream_chunks[stream].push_back(c);
    requests[stream].push_back(exchange->make_request(c));
    if (exchange->method == ParameterMethod::kPushPull) {
      bytes += plan.chunks(c).size() * static_cast<int64_t>(DTypeBytes(PushDType(c)));
    }
  }
  {
    absl::MutexLock lock(&stats_mu_);
    stats_.bytes_pushed += bytes;
  }
  {
    absl::MutexLock lock(&exchange->mu);
    for (uint32_t c : chunks) ++exchange->carriers[c];
    for (const auto& stream : stream_chunks) exchange->streams_sending += !stream.empty();
  }

  const std::string& job_id = options_.job_id;
  auto on_reply = [this, exchange, &plan, &job_id](const grpc::ByteBuffer& buffer) {
    absl::StatusOr<Frame> frame = Frame::Parse(buffer);
    if (!frame.ok()) {
      LOG(WARNING) << "dropping a malformed reply: " << frame.status();
      return;
    }
    const v1::ChunkHeader& h = frame->header();
    // A Push is answered with ACKs, the others with values.
    const bool acks = exchange->method == ParameterMethod::kPush;
    if (h.job_id() != job_id || h.chunk() >= static_cast<uint32_t>(plan.chunks_size()) ||
        (acks ? h.kind() != v1::FRAME_KIND_ACK
              : h.kind() != v1::FRAME_KIND_VALUES ||
                    h.num_elements() != plan.chunks(h.chunk()).size() ||
                    h.version() < exchange->min_version)) {
      LOG(WARNING) << "dropping an unexpected reply for chunk " << h.chunk();
      return;
    }
    {
      absl::MutexLock lock(&exchange->mu);
      const absl::Time now = MonotonicNow();
      exchange->first_reply = std::min(exchange->first_reply, now);
      if (exchange->answered[h.chunk()]) return;  // a duplicate, or not asked for
      exchange->answered[h.chunk()] = 1;
      exchange->last_reply = now;
      exchange->bytes += frame->payload_bytes();
    }
    // Each chunk is claimed once above, so copies never overlap. The count
    // goes down after the copy: Finish returns only once the values are in.
    if (!acks) {
      const FlatSpan& to = exchange->params;
      frame->ReadValues(0, h.num_elements(),
                        to.data + (plan.chunks(h.chunk()).offset() - to.offset));
      chunk_versions_[h.chunk()] = h.version();
    }
    absl::MutexLock lock(&exchange->mu);
    exchange->landed[h.chunk()] = 1;
    if (--exchange->unanswered == 0) exchange->last_landed = MonotonicNow();
  };
  // A wall-clock time: the streams' gRPC deadline.
  const absl::Time deadline = absl::Now() + options_.exchange_timeout;
  // The servers of other processes first: one of this process handles the
  // exchange on this thread (a step end may apply a whole step there).
  std::vector<int> servers(num_servers);
  std::iota(servers.begin(), servers.end(), 0);
  std::stable_partition(servers.begin(), servers.end(),
                        [this](int s) { return !transport_->in_process(s); });
  for (int s : servers) {
    for (int channel = 0; channel < channels_; ++channel) {
      const int stream = s * channels_ + channel;
      if (stream_chunks[stream].empty()) continue;
      {
        absl::MutexLock lock(&mu_);
        ++streams_in_flight_;
      }
      auto on_sent = [exchange] {
        absl::MutexLock lock(&exchange->mu);
        if (--exchange->streams_sending == 0) exchange->all_sent = MonotonicNow();
      };
      auto on_done = [this, exchange, s, carried = std::move(stream_chunks[stream])](
                         absl::Status status) {
        {
          absl::MutexLock lock(&exchange->mu);
          if (!status.ok()) {
            absl::Status named(status.code(),
                               absl::StrCat("parameter server ", s, ": ", status.message()));
            if (exchange->error.ok()) exchange->error = named;
            if (!options_.retry.Retryable(status) && exchange->permanent.ok()) {
              exchange->permanent = named;
            }
          }
          for (uint32_t c : carried) {
            if (--exchange->carriers[c] == 0 && !exchange->answered[c]) {
              exchange->orphaned.push_back(c);
            }
          }
        }
        // The last touch of the client: it may be destroyed once this is done.
        absl::MutexLock lock(&mu_);
        --streams_in_flight_;
      };
      transport_->StartExchange(s, channel, exchange->method, std::move(requests[stream]),
                                deadline, on_sent, on_reply, std::move(on_done));
    }
  }
}

bool ParameterClient::AwaitReply(absl::Span<const std::unique_ptr<Pending>> exchanges,
                                 size_t which, uint32_t chunk) {
  // How often the other exchanges are looked at while this one waits.
  constexpr absl::Duration kLookAtOthers = absl::Milliseconds(2);
  Exchange* exchange = exchanges[which]->exchange.get();
  if (exchange == nullptr) return false;
  struct Arg {
    Exchange* exchange;
    uint32_t chunk;
  } arg{exchange, chunk};
  const absl::Condition landed_or_orphaned(
      +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return a->exchange->landed[a->chunk] || !a->exchange->orphaned.empty();
      },
      &arg);
  while (true) {
    {
      absl::MutexLock lock(&exchange->mu);
      exchange->mu.AwaitWithTimeout(landed_or_orphaned, kLookAtOthers);
      if (exchange->landed[chunk]) return true;
      if (!exchange->orphaned.empty()) return false;
    }
    // A chunk of another exchange to send again: this reply may wait for
    // it, through a peer worker that waits for it before it sends again
    // what this server waits for (each waits on its exchanges in its own
    // order).
    for (const std::unique_ptr<Pending>& other : exchanges) {
      if (other->exchange == nullptr) return false;
      absl::MutexLock lock(&other->exchange->mu);
      if (!other->exchange->orphaned.empty()) return false;
    }
  }
}

absl::Status ParameterClient::Finish(std::unique_ptr<Pending> pending) {
  const std::shared_ptr<Exchange> exchange = std::move(pending->exchange);
  if (exchange == nullptr) return absl::CancelledError("parameter client cancelled");
  Backoff backoff(options_.retry);
  absl::Time give_up = MonotonicNow() + options_.retry.patience();
  absl::Time last_reply_seen = absl::InfinitePast();
  while (true) {
    std::vector<uint32_t> again;
    absl::Status error, permanent;
    bool progress;
    {
      absl::MutexLock lock(&exchange->mu);
      exchange->mu.Await(absl::Condition(
          +[](Exchange* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return e->unanswered == 0 || !e->orphaned.empty();
          },
          exchange.get()));
      if (exchange->unanswered == 0) {
        // Finished late (see AwaitReply), the exchange still ended when its
        // last reply landed.
        const absl::Time end = std::min(exchange->last_landed, MonotonicNow());
        const absl::Time sent = std::clamp(exchange->all_sent, exchange->start, end);
        const absl::Time first = std::clamp(exchange->first_reply, sent, end);
        absl::MutexLock stats_lock(&stats_mu_);
        stats_.bytes_pulled += exchange->bytes;
        if (exchange->method == ParameterMethod::kPushPull) {
          stats_.push_seconds += absl::ToDoubleSeconds(sent - exchange->start);
          stats_.wait_seconds += absl::ToDoubleSeconds(first - sent);
          stats_.pull_seconds += absl::ToDoubleSeconds(end - first);
        }
        return absl::OkStatus();
      }
      again.swap(exchange->orphaned);
      error = std::exchange(exchange->error, absl::OkStatus());
      permanent = exchange->permanent;
      progress = exchange->last_reply > last_reply_seen;
      last_reply_seen = exchange->last_reply;
    }
    if (cancelled()) return absl::CancelledError("parameter client cancelled");
    if (!permanent.ok()) return permanent;
    if (progress) {
      give_up = MonotonicNow() + options_.retry.patience();
      backoff.Reset();
    }
    if (MonotonicNow() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("no reply for ", again.size(), " chunks within ",
                       absl::FormatDuration(options_.retry.patience()), "; last error: ",
                       error.ok() ? "none (replies lost)" : error.ToString()));
    }
    {
      absl::MutexLock lock(&stats_mu_);
      ++stats_.retries;
    }
    VLOG(1) << "retrying " << again.size() << " chunks: " << error;
    // Replies lost on the way are asked for again at once; a failing or
    // silent server is given time.
    if (!progress || !error.ok()) {
      if (!SleepUnlessCancelled(backoff.Next())) {
        return absl::CancelledError("parameter client cancelled");
      }
    }
    Send(exchange, std::move(again));
  }
}

void StepExchanges::Add(std::unique_ptr<ParameterClient::Pending> exchange,
                        absl::Span<const uint32_t> chunks) {
  for (uint32_t c : chunks) exchange_of_chunk_[c] = pending_.size();
  pending_.push_back(std::move(exchange));
}

void StepExchanges::AddFirst(std::unique_ptr<ParameterClient::Pending> exchange) {
  pending_.insert(pending_.begin(), std::move(exchange));
  for (size_t& e : exchange_of_chunk_) ++e;
}

bool StepExchanges::Await(uint32_t chunk) {
  return pending_.empty() || client_->AwaitReply(pending_, exchange_of_chunk_[chunk], chunk);
}

bool StepExchanges::AwaitInOrder(uint32_t first, uint32_t last, int64_t end) {
  const v1::PartitionPlan& plan = client_->plan();
  next_awaited_ = std::max(next_awaited_, first);
  while (!pending_.empty() && next_awaited_ < last && plan.chunks(next_awaited_).offset() < end) {
    if (!client_->AwaitReply(pending_, exchange_of_chunk_[next_awaited_], next_awaited_)) {
      return false;
    }
    ++next_awaited_;
  }
  return true;
}

absl::Status StepExchanges::FinishAll() {
  for (auto& p : Take()) PSTRAIN_RETURN_IF_ERROR(client_->Finish(std::move(p)));
  return absl::OkStatus();
}

}  // namespace pstrain::worker
