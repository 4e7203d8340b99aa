#include "worker/fault_injecting_transport.h"

#include <map>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"

namespace pstrain::worker {

absl::StatusOr<FaultInjection> ParseFaultInjection(absl::string_view spec) {
  FaultInjection f;
  std::map<std::string, double*> probabilities = {
      {"drop_request", &f.drop_request},   {"duplicate_request", &f.duplicate_request},
      {"drop_reply", &f.drop_reply},       {"duplicate_reply", &f.duplicate_reply},
      {"reorder_reply", &f.reorder_reply}, {"delay", &f.delay}};
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    const std::pair<std::string, std::string> kv =
        absl::StrSplit(absl::StripAsciiWhitespace(item), absl::MaxSplits('=', 1));
    const std::string& name = kv.first;
    const std::string& value = kv.second;
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("fault injection: ", name, ": ", what));
    };
    if (auto it = probabilities.find(name); it != probabilities.end()) {
      double p;
      if (!absl::SimpleAtod(value, &p) || !(p >= 0 && p <= 1)) return bad("not in [0, 1]");
      *it->second = p;
    } else if (name == "min_delay_ms" || name == "max_delay_ms") {
      int64_t ms;
      if (!absl::SimpleAtoi(value, &ms) || ms < 0 || ms > 600000) {
        return bad("not in [0, 600000] milliseconds");
      }
      (name == "min_delay_ms" ? f.min_delay : f.max_delay) = absl::Milliseconds(ms);
    } else if (name == "seed") {
      if (!absl::SimpleAtoi(value, &f.seed)) return bad("not a non-negative integer");
    } else {
      return bad("unknown fault (drop_request, duplicate_request, drop_reply, duplicate_reply, "
                 "reorder_reply, delay, min_delay_ms, max_delay_ms, seed)");
    }
  }
  if (f.min_delay > f.max_delay) {
    return absl::InvalidArgumentError("fault injection: min_delay_ms is above max_delay_ms");
  }
  return f;
}

// A reply with bytes of its own, to hand on after on_reply has returned
// (a reply's memory may be the transport's only until then).
grpc::ByteBuffer OwnCopy(const grpc::ByteBuffer& reply) {
  std::vector<grpc::Slice> slices;
  if (!reply.Dump(&slices).ok()) return grpc::ByteBuffer();
  for (grpc::Slice& slice : slices) slice = grpc::Slice(slice.begin(), slice.size());
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// What is still owed to one stream's callbacks: on_done waits until every
// reply that was held back or delayed has been delivered.
struct ExchangeState {
  absl::Mutex mu;
  ParameterTransport::ReplyFn on_reply;
  ParameterTransport::DoneFn on_done;
  int replies_in_flight ABSL_GUARDED_BY(mu) = 0;  // delayed, not yet delivered
  std::optional<grpc::ByteBuffer> held ABSL_GUARDED_BY(mu);  // reorder_reply
  std::optional<absl::Status> done ABSL_GUARDED_BY(mu);      // the stream ended
  bool broken = false;  // drop_request: the stream ends UNAVAILABLE
};

class FaultInjectingTransport::Impl {
 public:
  Impl(std::unique_ptr<ParameterTransport> inner, const FaultInjection& faults)
      : inner_(std::move(inner)), faults_(faults) {
    if (faults_.seed == 0) {
      std::random_device entropy;
      faults_.seed = (uint64_t{entropy()} << 32) | entropy();
    }
    rng_.seed(faults_.seed);
    LOG(WARNING) << "injecting transport faults (testing only), seed " << faults_.seed;
    timer_ = std::thread([this] { TimerLoop(); });
  }

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    timer_.join();  // runs whatever is still scheduled first
  }

  ParameterTransport& inner() { return *inner_; }
  uint64_t seed() const { return faults_.seed; }
  FaultCounts counts() const {
    absl::MutexLock lock(&mu_);
    return counts_;
  }

  void StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer> requests, absl::Time deadline, SentFn on_sent,
                     ReplyFn on_reply, DoneFn on_done) {
    std::vector<grpc::ByteBuffer> sent;
    bool broken = false;
    for (grpc::ByteBuffer& r : requests) {
      if (Happens(faults_.drop_request, &FaultCounts::requests_dropped)) {
        broken = true;
        break;
      }
      sent.push_back(r);
      if (method == ParameterMethod::kPushPull &&
          Happens(faults_.duplicate_request, &FaultCounts::requests_duplicated)) {
        sent.push_back(r);
      }
    }
    auto state = std::make_shared<ExchangeState>();
    state->on_reply = std::move(on_reply);
    state->on_done = std::move(on_done);
    state->broken = broken;
    auto start = [this, server, channel, method, sent = std::move(sent), deadline,
                  on_sent = std::move(on_sent), state]() mutable {
      inner_->StartExchange(
          server, channel, method, std::move(sent), deadline, std::move(on_sent),
          [this, state](const grpc::ByteBuffer& reply) { OnReply(state, reply); },
          [this, state](absl::Status status) { OnDone(state, std::move(status)); });
    };
    const std::optional<absl::Duration> delay = DrawDelay();
    if (delay.has_value()) {
      Schedule(*delay, std::move(start));
    } else {
      start();
    }
  }

  // Runs every scheduled task now.
  void Flush() {
    absl::MutexLock lock(&mu_);
    flush_ = true;
  }

 private:
  bool Happens(double p, int64_t FaultCounts::*counter) {
    if (p <= 0) return false;
    absl::MutexLock lock(&mu_);
    if (std::uniform_real_distribution<double>(0, 1)(rng_) >= p) return false;
    ++(counts_.*counter);
    return true;
  }

  std::optional<absl::Duration> DrawDelay() {
    if (!Happens(faults_.delay, &FaultCounts::delays)) return std::nullopt;
    absl::MutexLock lock(&mu_);
    const double lo = absl::ToDoubleSeconds(faults_.min_delay);
    const double hi = absl::ToDoubleSeconds(faults_.max_delay);
    return absl::Seconds(std::uniform_real_distribution<double>(lo, hi)(rng_));
  }

  void OnReply(const std::shared_ptr<ExchangeState>& state, const grpc::ByteBuffer& reply) {
    if (Happens(faults_.drop_reply, &FaultCounts::replies_dropped)) return;
    const int copies = Happens(faults_.duplicate_reply, &FaultCounts::replies_duplicated) ? 2 : 1;
    for (int i = 0; i < copies; ++i) {
      if (Happens(faults_.reorder_reply, &FaultCounts::replies_reordered)) {
        std::optional<grpc::ByteBuffer> previous;
        {
          absl::MutexLock lock(&state->mu);
          previous.swap(state->held);
          state->held = OwnCopy(reply);
        }
        if (previous.has_value()) Deliver(state, *previous);
        continue;
      }
      Deliver(state, reply);
      ReleaseHeld(state);  // the held one comes after this one
    }
  }

  void ReleaseHeld(const std::shared_ptr<ExchangeState>& state) {
    std::optional<grpc::ByteBuffer> held;
    {
      absl::MutexLock lock(&state->mu);
      held.swap(state->held);
    }
    if (held.has_value()) Deliver(state, *held);
  }

  void Deliver(const std::shared_ptr<ExchangeState>& state, const grpc::ByteBuffer& reply) {
    const std::optional<absl::Duration> delay = DrawDelay();
    if (!delay.has_value()) {
      state->on_reply(reply);
      return;
    }
    {
      absl::MutexLock lock(&state->mu);
      ++state->replies_in_flight;
    }
    Schedule(*delay, [this, state, reply = OwnCopy(reply)] {
      state->on_reply(reply);
      bool finish = false;
      {
        absl::MutexLock lock(&state->mu);
        finish = --state->replies_in_flight == 0 && state->done.has_value();
      }
      if (finish) Finish(state);
    });
  }

  void OnDone(const std::shared_ptr<ExchangeState>& state, absl::Status status) {
    ReleaseHeld(state);
    bool finish;
    if (state->broken && status.ok()) {
      status = absl::UnavailableError("injected fault: the stream broke before a request");
    }
    {
      absl::MutexLock lock(&state->mu);
      state->done = std::move(status);
      finish = state->replies_in_flight == 0;
    }
    if (finish) Finish(state);
  }

  void Finish(const std::shared_ptr<ExchangeState>& state) {
    absl::Status status;
    {
      absl::MutexLock lock(&state->mu);
      status = *state->done;
    }
    state->on_done(std::move(status));
  }

  void Schedule(absl::Duration delay, std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.emplace(absl::Now() + delay, std::move(task));
  }

  // Runs each task when it is due, or at once while flushing or stopping;
  // returns once stopping with nothing left.
  void TimerLoop() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        while (true) {
          if (tasks_.empty()) {
            flush_ = false;
            if (stopping_) return;
          } else if (flush_ || stopping_ || tasks_.begin()->first <= absl::Now()) {
            break;
          }
          wake_ = tasks_.empty() ? absl::InfiniteFuture() : tasks_.begin()->first;
          // Wakes early for a flush, a stop or a task due before wake_.
          mu_.AwaitWithDeadline(absl::Condition(
                                    +[](Impl* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                      return t->stopping_ || t->flush_ ||
                                             (!t->tasks_.empty() &&
                                              t->tasks_.begin()->first < t->wake_);
                                    },
                                    this),
                                wake_);
        }
        task = std::move(tasks_.begin()->second);
        tasks_.erase(tasks_.begin());
      }
      task();
    }
  }

  std::unique_ptr<ParameterTransport> inner_;
  FaultInjection faults_;
  mutable absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  FaultCounts counts_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool flush_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time wake_ ABSL_GUARDED_BY(mu_);  // when the timer thread wakes next
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread timer_;
};

absl::StatusOr<std::unique_ptr<FaultInjectingTransport>> FaultInjectingTransport::Create(
    std::unique_ptr<ParameterTransport> inner, const FaultInjection& faults) {
  for (double p : {faults.drop_request, faults.duplicate_request, faults.drop_reply,
                   faults.duplicate_reply, faults.reorder_reply, faults.delay}) {
    if (!(p >= 0 && p <= 1)) {
      return absl::InvalidArgumentError("fault injection: a probability is outside [0, 1]");
    }
  }
  if (faults.min_delay < absl::ZeroDuration() || faults.min_delay > faults.max_delay) {
    return absl::InvalidArgumentError("fault injection: delays must be 0 <= min <= max");
  }
  return std::unique_ptr<FaultInjectingTransport>(
      new FaultInjectingTransport(std::make_unique<Impl>(std::move(inner), faults)));
}

FaultInjectingTransport::FaultInjectingTransport(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

FaultInjectingTransport::~FaultInjectingTransport() {
  impl_->Flush();
  impl_.reset();
}

int FaultInjectingTransport::num_servers() const { return impl_->inner().num_servers(); }
bool FaultInjectingTransport::in_process(int server) const {
  return impl_->inner().in_process(server);
}
int FaultInjectingTransport::channels_per_server() const {
  return impl_->inner().channels_per_server();
}

void FaultInjectingTransport::StartExchange(int server, int channel, ParameterMethod method,
                                            std::vector<grpc::ByteBuffer> requests,
                                            absl::Time deadline, SentFn on_sent,
                                            ReplyFn on_reply, DoneFn on_done) {
  impl_->StartExchange(server, channel, method, std::move(requests), deadline,
                       std::move(on_sent), std::move(on_reply), std::move(on_done));
}

void FaultInjectingTransport::CancelAll() {
  impl_->inner().CancelAll();
  impl_->Flush();
}

FaultCounts FaultInjectingTransport::counts() const { return impl_->counts(); }
uint64_t FaultInjectingTransport::seed() const { return impl_->seed(); }

}  // namespace pstrain::worker
