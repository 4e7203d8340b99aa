#include "bench/grpc_echo.h"

#include <atomic>
#include <barrier>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace pstrain::bench {
namespace {

constexpr char kEchoMethod[] = "/bench.Echo/Echo";

// Writes back every message it reads, in order, while it goes on reading.
class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor() { StartRead(&in_); }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {
      reads_done_ = true;
      FinishIfDone();
      return;
    }
    queue_.push_back(in_);  // shares the slices
    in_.Clear();
    if (!writing_) {
      writing_ = true;
      StartWrite(&queue_.front());
    }
    StartRead(&in_);
  }
  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (ok && !queue_.empty()) {
      StartWrite(&queue_.front());
      return;
    }
    writing_ = false;
    if (!ok) reads_done_ = true;
    FinishIfDone();
  }
  void OnDone() override { delete this; }

 private:
  void FinishIfDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reads_done_ && !writing_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  absl::Mutex mu_;
  grpc::ByteBuffer in_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class EchoService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor();
  }
};

// One stream of one step: sends its messages one after the other while it
// reads their echoes; counts down `done` when the stream has ended.
class EchoCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  EchoCall(const std::vector<grpc::ByteBuffer>* messages, absl::BlockingCounter* done,
           std::atomic<bool>* failed)
      : messages_(messages), done_(done), failed_(failed) {}

  void Start(grpc::GenericStub* stub) {
    stub->PrepareBidiStreamingCall(&context_, kEchoMethod, grpc::StubOptions(), this);
    StartRead(&reply_);
    StartWrite(&(*messages_)[0]);
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return;
    if (++written_ < messages_->size()) {
      StartWrite(&(*messages_)[written_]);
    } else {
      StartWritesDone();
    }
  }
  void OnReadDone(bool ok) override {
    if (ok) StartRead(&reply_);
  }
  void OnDone(const grpc::Status& status) override {
    if (!status.ok()) *failed_ = true;
    absl::BlockingCounter* done = done_;
    delete this;
    done->DecrementCount();
  }

 private:
  const std::vector<grpc::ByteBuffer>* const messages_;
  absl::BlockingCounter* const done_;
  std::atomic<bool>* const failed_;
  grpc::ClientContext context_;
  grpc::ByteBuffer reply_;
  size_t written_ = 0;
};

}  // namespace

struct GrpcEchoServers::Impl {
  EchoService service;
  std::unique_ptr<grpc::Server> server;
};

absl::StatusOr<std::unique_ptr<GrpcEchoServers>> GrpcEchoServers::Start(int n) {
  auto out = std::unique_ptr<GrpcEchoServers>(new GrpcEchoServers);
  for (int i = 0; i < n; ++i) {
    auto impl = std::make_unique<Impl>();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterCallbackGenericService(&impl->service);
    impl->server = builder.BuildAndStart();
    if (impl->server == nullptr || port == 0) {
      return absl::UnavailableError("cannot start a gRPC echo server");
    }
    out->addresses_.push_back(absl::StrCat("127.0.0.1:", port));
    out->servers_.push_back(std::move(impl));
  }
  return out;
}

GrpcEchoServers::~GrpcEchoServers() {
  for (auto& s : servers_) s->server->Shutdown();
}

absl::StatusOr<double> GrpcEchoRate(const std::vector<std::string>& addresses,
                                    const std::vector<int64_t>& share_bytes, int workers,
                                    int64_t chunk_bytes, absl::Duration duration, int64_t* steps) {
  const int servers = static_cast<int>(addresses.size());
  int64_t largest = 0;
  for (int64_t b : share_bytes) largest = std::max(largest, b);
  // What the messages carry: one buffer, referenced by every message (the
  // slices point into it, as pstrain's point into the gradient).
  std::vector<char> payload(largest, 1);
  std::vector<std::vector<grpc::ByteBuffer>> messages(servers);
  for (int s = 0; s < servers; ++s) {
    for (int64_t at = 0; at < share_bytes[s]; at += chunk_bytes) {
      grpc::Slice slice(payload.data() + at, std::min(chunk_bytes, share_bytes[s] - at),
                        grpc::Slice::STATIC_SLICE);
      messages[s].emplace_back(&slice, 1);
    }
  }
  grpc::Slice small(payload.data(), 32, grpc::Slice::STATIC_SLICE);
  const std::vector<grpc::ByteBuffer> step_end = {grpc::ByteBuffer(&small, 1)};

  absl::Time start;  // when the last worker is warm: the timed part begins
  std::atomic<bool> failed{false};
  std::atomic<int64_t> moved{0};
  std::barrier warm(workers + 1, [&start]() noexcept { start = absl::Now(); });
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      // A connection per worker and server, as pstrain's transports have.
      std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
      for (const std::string& address : addresses) {
        grpc::ChannelArguments args;
        args.SetInt("bench.worker", w);
        stubs.push_back(std::make_unique<grpc::GenericStub>(
            grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
      }
      auto one_step = [&] {
        absl::BlockingCounter done(2 * servers);
        for (int s = 0; s < servers; ++s) {
          (new EchoCall(&messages[s], &done, &failed))->Start(stubs[s].get());
          (new EchoCall(&step_end, &done, &failed))->Start(stubs[s].get());
        }
        done.Wait();
      };
      one_step();  // connections, untimed
      warm.arrive_and_wait();
      int64_t done_steps = 0;
      while (!failed && absl::Now() - start < duration) {
        one_step();
        ++done_steps;
      }
      int64_t total = 0;
      for (int64_t b : share_bytes) total += b;
      moved += 2 * total * done_steps;
      if (w == 0) *steps = done_steps;
    });
  }
  warm.arrive_and_wait();
  for (std::thread& t : threads) t.join();
  if (failed) return absl::InternalError("a gRPC echo stream failed");
  return static_cast<double>(moved) / SecondsSince(start);
}

}  // namespace pstrain::bench
