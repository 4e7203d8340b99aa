// The routing piece of a worker's transport: each exchange goes to the
// first carrier that takes it, and one that declines leaves it whole for
// the next.
#include "worker/routing_transport.h"

#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/direct_connection.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"
#include "worker/direct_carrier.h"

namespace pstrain::worker {
namespace {

// Takes the exchanges of the servers it reaches and keeps what it was
// given.
class RecordingCarrier final : public Carrier {
 public:
  explicit RecordingCarrier(std::vector<bool> reaches) : reaches_(std::move(reaches)) {}

  bool StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                     SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) override {
    if (!reaches_[server]) return false;
    servers.push_back(server);
    request_counts.push_back(requests.size());
    requests.clear();
    DoneFn done = std::move(on_done);
    done(absl::OkStatus());
    return true;
  }
  void CancelAll() override { ++cancelled; }

  std::vector<int> servers;
  std::vector<size_t> request_counts;
  int cancelled = 0;

 private:
  const std::vector<bool> reaches_;
};

std::vector<grpc::ByteBuffer> Requests(int n) {
  std::vector<grpc::ByteBuffer> requests;
  for (int i = 0; i < n; ++i) {
    grpc::Slice slice(std::string(16, static_cast<char>('a' + i)));
    requests.emplace_back(&slice, 1);
  }
  return requests;
}

TEST(RoutingTransportTest, AnExchangeGoesToTheFirstCarrierThatTakesItWhole) {
  auto first = std::make_unique<RecordingCarrier>(std::vector<bool>{true, false});
  auto last = std::make_unique<RecordingCarrier>(std::vector<bool>{true, true});
  RecordingCarrier* first_seen = first.get();
  RecordingCarrier* last_seen = last.get();
  std::vector<std::unique_ptr<Carrier>> carriers;
  carriers.push_back(std::move(first));
  carriers.push_back(std::move(last));
  RoutingTransport transport(std::move(carriers), {false, false}, /*channels_per_server=*/1);
  EXPECT_EQ(transport.num_servers(), 2);

  int done = 0;
  for (int server : {0, 1, 1}) {
    transport.StartExchange(server, 0, ParameterMethod::kPushPull, Requests(3),
                            absl::InfiniteFuture(), nullptr, nullptr,
                            [&done](absl::Status s) {
                              PSTRAIN_EXPECT_OK(s);
                              ++done;
                            });
  }
  EXPECT_EQ(done, 3);
  EXPECT_EQ(first_seen->servers, std::vector<int>{0});
  EXPECT_EQ(last_seen->servers, (std::vector<int>{1, 1}));
  EXPECT_EQ(last_seen->request_counts, (std::vector<size_t>{3, 3}))
      << "a carrier that declines leaves the requests to the next";

  transport.CancelAll();
  EXPECT_EQ(first_seen->cancelled, 1);
  EXPECT_EQ(last_seen->cancelled, 1);
}

TEST(RoutingTransportTest, AnExchangeNoCarrierTakesEndsUnavailable) {
  std::vector<std::unique_ptr<Carrier>> carriers;
  carriers.push_back(std::make_unique<RecordingCarrier>(std::vector<bool>{false}));
  RoutingTransport transport(std::move(carriers), {false}, 1);
  absl::Status status;
  transport.StartExchange(0, 0, ParameterMethod::kPull, Requests(1), absl::InfiniteFuture(),
                          nullptr, nullptr, [&status](absl::Status s) { status = s; });
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
}

TEST(RoutingTransportTest, ADirectConnectionThatEndedLeavesTheExchangeWholeToTheNext) {
  // A server that takes a direct TCP connection and drops it at once.
  constexpr uint64_t kInstance = 42;
  absl::StatusOr<std::unique_ptr<DirectListener>> listener = DirectListener::ListenTcp(
      "127.0.0.1", kInstance, {}, [](std::unique_ptr<DirectConnection>) {});
  PSTRAIN_ASSERT_OK(listener);
  absl::StatusOr<std::unique_ptr<DirectConnection>> connection = DirectConnection::ConnectTcp(
      "127.0.0.1", (*listener)->port(), kInstance, {}, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(connection);
  std::vector<std::vector<std::unique_ptr<DirectConnection>>> by_server(1);
  by_server[0].push_back(*std::move(connection));
  auto fallback = std::make_unique<RecordingCarrier>(std::vector<bool>{true});
  RecordingCarrier* fallback_seen = fallback.get();
  std::vector<std::unique_ptr<Carrier>> carriers;
  carriers.push_back(std::make_unique<DirectCarrier>(std::move(by_server)));
  carriers.push_back(std::move(fallback));

  std::atomic<int> started = 0;
  std::atomic<int> done = 0;
  {
    RoutingTransport transport(std::move(carriers), {false}, /*channels_per_server=*/1);
    // Until the worker's end has seen the connection end, an exchange may
    // still go to it (and end with an error).
    const absl::Time deadline = MonotonicNow() + absl::Seconds(30);
    while (fallback_seen->servers.empty() && MonotonicNow() < deadline) {
      ++started;
      transport.StartExchange(0, 0, ParameterMethod::kPushPull, Requests(3),
                              absl::InfiniteFuture(), nullptr, nullptr,
                              [&done](absl::Status) { ++done; });
      if (fallback_seen->servers.empty()) absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(fallback_seen->servers, std::vector<int>{0}) << "the direct carrier never declined";
    EXPECT_EQ(fallback_seen->request_counts, std::vector<size_t>{3})
        << "the direct carrier that declined kept none of the requests";
  }
  EXPECT_EQ(done, started) << "every exchange ended once, on either carrier";
}

}  // namespace
}  // namespace pstrain::worker
