#include "server/in_process_sessions.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"

namespace pstrain::server {
namespace {

// A stream of this process's own worker (InProcessService): its requests
// are handled on the worker's thread, its replies handed over on the
// thread that has them.
class InProcessStream final : public ReplyingStream {
 public:
  InProcessStream(ClientLoad* load, std::string client, InProcessService::ReplyFn on_reply,
                  InProcessService::DoneFn on_done)
      : on_reply_(std::move(on_reply)), on_done_(std::move(on_done)), owed_(load, std::move(client)) {}

  absl::Status ExpectReply() override {
    absl::MutexLock lock(&mu_);
    return owed_.Owe();
  }
  // Under the stream's lock: a Cancel waits for a reply being handed over,
  // and nothing is handed over after it.
  void Reply(grpc::ByteBuffer frame) override {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    owed_.Pay();
    on_reply_(frame);
    EndIfDone();
  }
  void Fail(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    End(status);
  }
  bool Abandoned() const override {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  bool ended() const { return Abandoned(); }
  void LastRequest() {
    absl::MutexLock lock(&mu_);
    last_request_ = true;
    EndIfDone();
  }
  void Cancel() { Fail(absl::CancelledError("stream cancelled")); }

 private:
  void EndIfDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (last_request_ && owed_.count() == 0) End(absl::OkStatus());
  }
  void End(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    on_done_(status);
    // What the callbacks hold (the client's exchange) goes now.
    on_reply_ = nullptr;
    on_done_ = nullptr;
  }

  mutable absl::Mutex mu_;
  InProcessService::ReplyFn on_reply_ ABSL_GUARDED_BY(mu_);
  InProcessService::DoneFn on_done_ ABSL_GUARDED_BY(mu_);
  OwedReplies owed_ ABSL_GUARDED_BY(mu_);
  bool last_request_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

// One transport's streams to the server of its own process.
class InProcessSession final : public InProcessService::Session {
 public:
  explicit InProcessSession(const StreamContext& context) : context_(context) {}
  ~InProcessSession() override { CancelAll(); }

  void Exchange(ParameterMethod method, std::vector<grpc::ByteBuffer> requests,
                InProcessService::SentFn on_sent, InProcessService::ReplyFn on_reply,
                InProcessService::DoneFn on_done) override {
    CloseEnded();
    auto state = std::make_shared<InProcessStream>(context_.load, kClient, std::move(on_reply),
                                                   std::move(on_done));
    if (absl::Status s = context_.load->OpenStream(kClient); !s.ok()) {
      state->Fail(s);
      return;
    }
    auto stream = std::make_shared<Stream>(state, context_, method);
    {
      absl::MutexLock lock(&mu_);
      streams_.push_back(stream);
    }
    {
      absl::MutexLock lock(&stream->mu);
      for (const grpc::ByteBuffer& request : requests) {
        if (stream->closed || state->ended()) break;
        if (absl::Status s = stream->requests.Handle(request, state); !s.ok()) {
          state->Fail(s);
          break;
        }
      }
    }
    if (!state->ended() && on_sent) on_sent();
    state->LastRequest();
  }

  void CancelAll() override {
    std::vector<std::shared_ptr<Stream>> all;
    {
      absl::MutexLock lock(&mu_);
      all.swap(streams_);
    }
    for (const auto& stream : all) {
      stream->state->Cancel();
      Close(*stream);
    }
  }

 private:
  // The budget of this process's worker.
  static constexpr char kClient[] = "this process";

  struct Stream {
    Stream(std::shared_ptr<InProcessStream> s, const StreamContext& context, Method method)
        : state(std::move(s)), requests(context.store, method, context.roster, std::nullopt) {}
    const std::shared_ptr<InProcessStream> state;
    absl::Mutex mu;  // a stream's requests are handled, or closed, one at a time
    StreamRequests requests ABSL_GUARDED_BY(mu);
    bool closed ABSL_GUARDED_BY(mu) = false;
  };

  void Close(Stream& stream) {
    absl::MutexLock lock(&stream.mu);
    if (stream.closed) return;
    stream.closed = true;
    stream.requests.DropWaits();
    context_.load->CloseStream(kClient);
  }

  // Streams that ended are closed as new ones come.
  void CloseEnded() {
    std::vector<std::shared_ptr<Stream>> ended;
    {
      absl::MutexLock lock(&mu_);
      auto end = std::partition(streams_.begin(), streams_.end(),
                                [](const auto& s) { return !s->state->ended(); });
      ended.assign(end, streams_.end());
      streams_.erase(end, streams_.end());
    }
    for (const auto& stream : ended) Close(*stream);
  }

  const StreamContext context_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<InProcessService::Session> OpenInProcessSession(const StreamContext& context) {
  return std::make_unique<InProcessSession>(context);
}

}  // namespace pstrain::server
