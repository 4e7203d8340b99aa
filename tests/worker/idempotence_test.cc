// Retries are safe: with pushes duplicated and replies dropped on the way,
// the final parameters are bitwise those of a clean run.
#include <random>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"

namespace pstrain::testing {
namespace {

// Wraps a transport: sends some requests twice and loses some replies.
class FaultyTransport final : public worker::ParameterTransport {
 public:
  FaultyTransport(std::unique_ptr<worker::ParameterTransport> inner, double duplicate,
                  double drop, uint64_t seed)
      : inner_(std::move(inner)), duplicate_(duplicate), drop_(drop), rng_(seed) {}

  int num_servers() const override { return inner_->num_servers(); }
  int channels_per_server() const override { return inner_->channels_per_server(); }

  void StartExchange(int server, int channel, worker::ParameterMethod method,
                     std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                     SentFn on_sent, ReplyFn on_reply, DoneFn on_done) override {
    std::vector<grpc::ByteBuffer> sent;
    for (grpc::ByteBuffer& r : requests) {
      sent.push_back(r);
      if (method == worker::ParameterMethod::kPushPull && Chance(duplicate_)) {
        sent.push_back(r);
        ++duplicated_;
      }
    }
    inner_->StartExchange(server, channel, method, std::move(sent), deadline, std::move(on_sent),
                          [this, on_reply = std::move(on_reply)](const grpc::ByteBuffer& reply) {
                            if (Chance(drop_)) {
                              ++dropped_;
                              return;
                            }
                            on_reply(reply);
                          },
                          std::move(on_done));
  }

  void CancelAll() override { inner_->CancelAll(); }

  int duplicated() const { return duplicated_; }
  int dropped() const { return dropped_; }

 private:
  bool Chance(double p) {
    absl::MutexLock lock(&mu_);
    return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
  }

  std::unique_ptr<worker::ParameterTransport> inner_;
  const double duplicate_, drop_;
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> duplicated_{0}, dropped_{0};
};

TEST(IdempotenceTest, DuplicatedPushesAndLostRepliesChangeNothing) {
  DatasetCache data;
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 40);
  const v1::PartitionPlan plan = PlanFor(spec);

  InProcessServers clean_servers(2);
  ASSERT_TRUE(clean_servers.AddJob("job-clean", spec, plan).ok());
  WorkersResult clean = RunWorkers("job-clean", spec, plan, clean_servers.addresses(), &data);
  ASSERT_TRUE(clean.status.ok()) << clean.status;

  InProcessServers faulty_servers(2);
  ASSERT_TRUE(faulty_servers.AddJob("job-faulty", spec, plan).ok());
  std::vector<std::unique_ptr<FaultyTransport>> transports;
  for (int w = 0; w < 2; ++w) {
    transports.push_back(std::make_unique<FaultyTransport>(
        *worker::CreateGrpcTransport(faulty_servers.addresses()), 0.10, 0.05, 100 + w));
  }
  RunOptions run;
  run.make_transport = [&](int w) { return transports[w].get(); };
  WorkersResult faulty =
      RunWorkers("job-faulty", spec, plan, faulty_servers.addresses(), &data, run);
  ASSERT_TRUE(faulty.status.ok()) << faulty.status;

  int duplicated = 0, dropped = 0;
  int64_t retries = 0;
  for (int w = 0; w < 2; ++w) {
    duplicated += transports[w]->duplicated();
    dropped += transports[w]->dropped();
    retries += faulty.stats[w].retries;
  }
  // The faults really happened and the client really retried.
  EXPECT_GT(duplicated, 50);
  EXPECT_GT(dropped, 20);
  EXPECT_GT(retries, 0);

  ASSERT_EQ(faulty.params.size(), clean.params.size());
  EXPECT_EQ(0, std::memcmp(faulty.params.data(), clean.params.data(),
                           clean.params.size() * sizeof(float)))
      << "final parameters differ from the clean run";
  EXPECT_EQ(faulty_servers.Gather("job-faulty", plan), clean_servers.Gather("job-clean", plan));
}

}  // namespace
}  // namespace pstrain::testing
