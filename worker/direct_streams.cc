#include "worker/direct_streams.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/chunk_codec.h"

namespace pstrain::worker {
namespace {

// Exchanges of at most this many request bytes are sent ahead.
constexpr size_t kShortExchangeBytes = 16 << 10;

// kDirectDone's body: [fixed32 LE code][message].
absl::Status DoneStatus(const grpc::Slice& body) {
  if (body.size() < 4) return absl::InternalError("a malformed end of stream from the server");
  uint32_t code = 0;
  for (int i = 0; i < 4; ++i) code |= static_cast<uint32_t>(body.begin()[i]) << (8 * i);
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
  }
  return absl::Status(
      static_cast<absl::StatusCode>(code),
      absl::string_view(reinterpret_cast<const char*>(body.begin()) + 4, body.size() - 4));
}

}  // namespace

DirectStreams::DirectStreams(std::unique_ptr<DirectConnection> connection)
    : connection_(std::move(connection)) {
  // Replies are read (into the parameters) and let go during on_reply:
  // through shared memory they are read where they lie in the pipe.
  connection_->Start([this](DirectMessage m) { OnMessage(std::move(m)); },
                     [this](const absl::Status& status) { OnClosed(status); },
                     [this] { EndExpired(); }, [](uint8_t type) { return type == kDirectReply; });
}

DirectStreams::~DirectStreams() { connection_->Close(); }

int DirectStreams::open_streams() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(streams_.size());
}

bool DirectStreams::StartExchange(ParameterMethod method,
                                  const std::vector<grpc::ByteBuffer>& requests,
                                  absl::Time deadline, ParameterTransport::SentFn& on_sent,
                                  ParameterTransport::ReplyFn& on_reply,
                                  ParameterTransport::DoneFn& on_done) {
  uint32_t id;
  {
    absl::MutexLock lock(&mu_);
    // Once ended, OnClosed has taken every stream: a new one would be lost.
    if (ended_) return false;
    id = next_id_++;
    streams_[id] =
        std::make_shared<Stream>(Stream{std::move(on_reply), std::move(on_done),
                                        requests.empty() ? absl::InfinitePast() : deadline});
    if (cancelled_ || requests.empty()) {
      // Ends on the connection's thread (an empty stream as "expired", but OK).
      if (requests.empty() && !cancelled_) {
        auto stream = streams_[id];
        streams_.erase(id);
        connection_->Post([stream, on_sent = std::move(on_sent)] {
          if (on_sent) on_sent();
          stream->on_done(absl::OkStatus());
        });
      } else {
        connection_->Post([this] { EndExpired(); });
      }
      return true;
    }
  }
  // The opening and every request, written together. A failed send means
  // the connection ended: OnClosed ends the stream. Through shared memory,
  // a short exchange (a step end, pulls) goes ahead of the long ones
  // queued: a server applies a sync step's chunks as their pushes arrive
  // only once it has the step end, and then its replies flow back while
  // the rest is pushed (64 MiB 1 x 1: 0.39-0.46x memcpy with the step end
  // behind the pushes, 0.55-0.58x ahead). Not over TCP: there the replies
  // overlapping the pushes were slower on 2 cores (0.67-0.72x the plain
  // sockets vs 0.72-0.85x), the server's connection thread sharing its
  // core with the worker's two.
  bool ahead = !connection_->over_tcp();
  size_t request_bytes = 0;
  for (size_t i = 0; ahead && i < requests.size(); ++i) {
    request_bytes += requests[i].Length();
    ahead = request_bytes <= kShortExchangeBytes;
  }
  std::vector<DirectConnection::Message> messages;
  messages.push_back({.type = kDirectOpen,
                      .flags = static_cast<uint8_t>(method),
                      .stream = id,
                      .body = nullptr,
                      .on_written = nullptr});
  for (size_t i = 0; i < requests.size(); ++i) {
    const bool last = i + 1 == requests.size();
    messages.push_back({.type = kDirectRequest,
                        .flags = last ? kDirectLast : uint8_t{0},
                        .stream = id,
                        .body = &requests[i],
                        .on_written = last ? std::move(on_sent) : nullptr});
  }
  connection_->SendAll(std::move(messages), ahead);
  return true;
}

void DirectStreams::CancelAll() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  connection_->Post([this] { EndExpired(); });
}

std::shared_ptr<DirectStreams::Stream> DirectStreams::Abandon(uint32_t id) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return nullptr;
  std::shared_ptr<Stream> stream = std::move(it->second);
  streams_.erase(it);
  connection_->Send(kDirectCancel, 0, id, nullptr);
  return stream;
}

void DirectStreams::EndExpired() {
  std::vector<std::pair<std::shared_ptr<Stream>, absl::Status>> ended;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    std::vector<uint32_t> ids;
    for (const auto& [id, stream] : streams_) {
      if (cancelled_ || now >= stream->deadline) ids.push_back(id);
    }
    for (uint32_t id : ids) {
      ended.emplace_back(
          Abandon(id), cancelled_ ? absl::CancelledError("stream cancelled")
                                  : absl::DeadlineExceededError("direct stream past its deadline"));
    }
  }
  for (auto& [stream, status] : ended) stream->on_done(status);
}

void DirectStreams::OnMessage(DirectMessage m) {
  std::shared_ptr<Stream> stream;
  {
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(m.stream);
    if (it == streams_.end()) return;  // abandoned: what is left of it goes nowhere
    stream = it->second;
    if (m.type == kDirectDone) streams_.erase(it);
  }
  if (m.type == kDirectReply) {
    stream->on_reply(m.Body());
  } else if (m.type == kDirectDone) {
    stream->on_done(DoneStatus(m.body));
  }
}

void DirectStreams::OnClosed(const absl::Status& status) {
  std::map<uint32_t, std::shared_ptr<Stream>> open;
  {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    open.swap(streams_);
  }
  // Retried by the client, over the server's sockets from now on.
  const absl::Status why =
      status.code() == absl::StatusCode::kCancelled
          ? status
          : absl::UnavailableError(absl::StrCat("the direct connection ended: ", status.message()));
  for (auto& [id, stream] : open) stream->on_done(why);
}

}  // namespace pstrain::worker
