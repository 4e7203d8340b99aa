#include "worker/parameter_client.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/chunk_codec.h"
#include "kernels/cpu/cpu_kernels.h"
#include "glog/logging.h"

namespace pstrain::worker {
namespace {

bool Retryable(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kNotFound:  // the server has not loaded the job yet
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace

// One round of streams, shared with the transport's callbacks.
struct ParameterClient::Attempt {
  absl::Mutex mu;
  std::vector<bool> answered;
  int streams_open = 0;
  int streams_sending = 0;
  std::vector<absl::Status> status;
  int64_t bytes = 0;
  absl::Time start;
  absl::Time all_sent = absl::InfinitePast();
  absl::Time first_reply = absl::InfiniteFuture();
};

ParameterClient::ParameterClient(Options options, ParameterTransport* transport)
    : options_(std::move(options)),
      transport_(transport),
      channels_(std::max(1, transport_->channels_per_server())),
      chunk_versions_(options_.plan.chunks_size(), -1) {
  CHECK_EQ(static_cast<uint32_t>(transport_->num_servers()), options_.plan.num_servers())
      << "the transport does not reach the plan's servers";
  std::vector<int> next_channel(transport_->num_servers(), 0);
  for (const v1::ChunkInfo& info : options_.plan.chunks()) {
    int& next = next_channel[info.server()];
    channel_of_chunk_.push_back(next);
    next = (next + 1) % channels_;
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
  transport_->CancelAll();
}

bool ParameterClient::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool ParameterClient::SleepUnlessCancelled(absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  return !mu_.AwaitWithTimeout(absl::Condition(&cancelled_), duration);
}

v1::ChunkHeader ParameterClient::Header(v1::FrameKind kind, uint32_t chunk) const {
  v1::ChunkHeader h;
  h.set_kind(kind);
  h.set_job_id(options_.job_id);
  h.set_worker(options_.worker);
  h.set_chunk(chunk);
  h.set_dtype(kind == v1::FRAME_KIND_PUSH ? options_.wire_dtype : v1::DTYPE_FP32);
  return h;
}

std::vector<uint32_t> ParameterClient::AllChunks() const {
  std::vector<uint32_t> chunks(options_.plan.chunks_size());
  std::iota(chunks.begin(), chunks.end(), 0);
  return chunks;
}

absl::Status ParameterClient::PullAll(int64_t min_version, float* params) {
  auto make_request = [this, min_version](uint32_t c) {
    v1::ChunkHeader h = Header(v1::FRAME_KIND_PULL, c);
    h.set_version(min_version);
    return EncodeFrame(h, nullptr);
  };
  return Finish(Start(ParameterMethod::kPull, AllChunks(), make_request, min_version, params));
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::StartPushPull(
    int64_t step, const std::shared_ptr<std::vector<float>>& grad, float* params,
    std::vector<uint32_t> chunks) {
  if (chunks.empty()) chunks = AllChunks();
  const bool sync = options_.mode == v1::MODE_SYNC;
  // The payload: the gradient itself, or its cast for the wire.
  std::shared_ptr<const void> payload = grad;
  const char* base = reinterpret_cast<const char*>(grad->data());
  if (wire_grad_ != nullptr) {
    for (uint32_t c : chunks) {
      const v1::ChunkInfo& info = options_.plan.chunks(c);
      if (options_.wire_dtype == v1::DTYPE_BF16) {
        kernels::CastToBf16(grad->data() + info.offset(), wire_grad_->data() + info.offset(),
                            info.size());
      } else {
        kernels::CastToFp16(grad->data() + info.offset(), wire_grad_->data() + info.offset(),
                            info.size());
      }
    }
    payload = wire_grad_;
    base = reinterpret_cast<const char*>(wire_grad_->data());
  }
  const size_t value_bytes = DTypeBytes(options_.wire_dtype);
  auto make_request = [this, step, payload, base, value_bytes, sync](uint32_t c) {
    const v1::ChunkInfo& info = options_.plan.chunks(c);
    v1::ChunkHeader h = Header(v1::FRAME_KIND_PUSH, c);
    h.set_step(step);
    h.set_version(sync ? step : std::max<int64_t>(chunk_versions_[c], 0));
    h.set_num_elements(static_cast<uint32_t>(info.size()));
    return EncodeFrameShared(h, base + info.offset() * value_bytes, payload);
  };
  // Sync: exactly version step+1. Async: whatever the server has now.
  return Start(ParameterMethod::kPushPull, std::move(chunks), make_request, sync ? step + 1 : 0,
               params);
}

absl::Status ParameterClient::PushPull(int64_t step,
                                       const std::shared_ptr<std::vector<float>>& grad,
                                       float* params) {
  return Finish(StartPushPull(step, grad, params));
}

std::unique_ptr<ParameterClient::Pending> ParameterClient::Start(ParameterMethod method,
                                                                 std::vector<uint32_t> chunks,
                                                                 RequestFn make_request,
                                                                 int64_t min_version,
                                                                 float* params) {
  auto pending = std::make_unique<Pending>();
  pending->method = method;
  pending->chunks = std::move(chunks);
  pending->make_request = std::move(make_request);
  pending->min_version = min_version;
  pending->params = params;
  if (!cancelled()) Send(*pending);
  return pending;
}

void ParameterClient::Send(Pending& pending) {
  const v1::PartitionPlan& plan = options_.plan;
  const int num_servers = transport_->num_servers();
  std::sort(pending.chunks.begin(), pending.chunks.end());
  // requests[server * channels_ + channel]
  std::vector<std::vector<grpc::ByteBuffer>> requests(num_servers * channels_);
  int64_t bytes = 0;
  for (uint32_t c : pending.chunks) {
    requests[plan.chunks(c).server() * channels_ + channel_of_chunk_[c]].push_back(
        pending.make_request(c));
    if (pending.method == ParameterMethod::kPushPull) {
      bytes += plan.chunks(c).size() * static_cast<int64_t>(DTypeBytes(options_.wire_dtype));
    }
  }
  {
    absl::MutexLock lock(&stats_mu_);
    stats_.bytes_pushed += bytes;
  }
  auto attempt = std::make_shared<Attempt>();
  attempt->answered.assign(plan.chunks_size(), false);
  attempt->status.assign(num_servers, absl::OkStatus());
  for (const auto& stream : requests) attempt->streams_open += !stream.empty();
  attempt->streams_sending = attempt->streams_open;
  attempt->start = absl::Now();
  pending.attempt = attempt;

  const std::string& job_id = options_.job_id;
  const int64_t min_version = pending.min_version;
  float* params = pending.params;
  auto on_reply = [this, attempt, params, min_version, &plan, &job_id](
                      const grpc::ByteBuffer& buffer) {
    absl::StatusOr<Frame> frame = Frame::Parse(buffer);
    if (!frame.ok()) {
      LOG(WARNING) << "dropping a malformed reply: " << frame.status();
      return;
    }
    const v1::ChunkHeader& h = frame->header();
    if (h.kind() != v1::FRAME_KIND_VALUES || h.job_id() != job_id ||
        h.chunk() >= static_cast<uint32_t>(plan.chunks_size()) ||
        h.num_elements() != plan.chunks(h.chunk()).size() || h.version() < min_version) {
      LOG(WARNING) << "dropping an unexpected reply for chunk " << h.chunk();
      return;
    }
    {
      absl::MutexLock lock(&attempt->mu);
      attempt->first_reply = std::min(attempt->first_reply, absl::Now());
      if (attempt->answered[h.chunk()]) return;  // a duplicate
      attempt->answered[h.chunk()] = true;
      attempt->bytes += frame->payload_bytes();
    }
    // Each chunk is claimed once above, so copies never overlap.
    frame->ReadValues(0, h.num_elements(), params + plan.chunks(h.chunk()).offset());
    chunk_versions_[h.chunk()] = h.version();
  };
  const absl::Time deadline = absl::Now() + options_.exchange_timeout;
  for (int s = 0; s < num_servers; ++s) {
    for (int channel = 0; channel < channels_; ++channel) {
      std::vector<grpc::ByteBuffer>& stream = requests[s * channels_ + channel];
      if (stream.empty()) continue;
      {
        absl::MutexLock lock(&mu_);
        ++streams_in_flight_;
      }
      auto on_sent = [attempt] {
        absl::MutexLock lock(&attempt->mu);
        if (--attempt->streams_sending == 0) attempt->all_sent = absl::Now();
      };
      auto on_done = [this, attempt, s](absl::Status status) {
        {
          absl::MutexLock lock(&attempt->mu);
          if (attempt->status[s].ok()) attempt->status[s] = std::move(status);
          --attempt->streams_open;
        }
        // The last touch of the client: it may be destroyed once this is done.
        absl::MutexLock lock(&mu_);
        --streams_in_flight_;
      };
      transport_->StartExchange(s, channel, pending.method, std::move(stream), deadline,
                                on_sent, on_reply, on_done);
    }
  }
}

absl::Status ParameterClient::Finish(std::unique_ptr<Pending> pending) {
  const int num_servers = transport_->num_servers();
  absl::Duration backoff = options_.initial_backoff;
  absl::Time give_up = absl::Now() + options_.retry_window;
  while (true) {
    if (pending->attempt == nullptr) return absl::CancelledError("parameter client cancelled");
    std::shared_ptr<Attempt> attempt = pending->attempt;
    {
      absl::MutexLock lock(&attempt->mu);
      attempt->mu.Await(absl::Condition(
          +[](Attempt* a) { return a->streams_open == 0; }, attempt.get()));
    }
    std::vector<uint32_t> still;
    for (uint32_t c : pending->chunks) {
      if (!attempt->answered[c]) still.push_back(c);
    }
    {
      const absl::Time end = absl::Now();
      absl::MutexLock lock(&stats_mu_);
      stats_.bytes_pulled += attempt->bytes;
      if (pending->method == ParameterMethod::kPushPull) {
        const absl::Time sent = std::clamp(attempt->all_sent, attempt->start, end);
        const absl::Time first = std::clamp(attempt->first_reply, sent, end);
        stats_.push_seconds += absl::ToDoubleSeconds(sent - attempt->start);
        stats_.wait_seconds += absl::ToDoubleSeconds(first - sent);
        stats_.pull_seconds += absl::ToDoubleSeconds(end - first);
      }
    }
    if (still.empty()) return absl::OkStatus();
    if (cancelled()) return absl::CancelledError("parameter client cancelled");
    absl::Status first_error;
    for (int s = 0; s < num_servers; ++s) {
      const absl::Status& status = attempt->status[s];
      if (!Retryable(status)) {
        return absl::Status(status.code(),
                            absl::StrCat("parameter server ", s, ": ", status.message()));
      }
      if (!status.ok() && first_error.ok()) {
        first_error = absl::Status(status.code(),
                                   absl::StrCat("parameter server ", s, ": ", status.message()));
      }
    }
    const bool progress = still.size() < pending->chunks.size();
    if (progress) {
      give_up = absl::Now() + options_.retry_window;
      backoff = options_.initial_backoff;
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("no reply for ", still.size(), " chunks within ",
                       absl::FormatDuration(options_.retry_window), "; last error: ",
                       first_error.ok() ? "none (replies lost)" : first_error.ToString()));
    }
    {
      absl::MutexLock lock(&stats_mu_);
      ++stats_.retries;
    }
    VLOG(1) << "retrying " << still.size() << " chunks: " << first_error;
    // Replies lost on the way are asked for again at once; a failing or
    // silent server is given time.
    if (!progress || !first_error.ok()) {
      if (!SleepUnlessCancelled(backoff)) {
        return absl::CancelledError("parameter client cancelled");
      }
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
    pending->chunks = std::move(still);
    Send(*pending);
  }
}

}  // namespace pstrain::worker
