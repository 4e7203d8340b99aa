#include "server/node_registry.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

class NodeRegistryTest : public ::testing::Test {
 protected:
  explicit NodeRegistryTest(NodeRegistry::Options options = {.lease = absl::Seconds(10)})
      : registry_(options, &clock_, [] { return 0xabcdu; }) {}

  absl::StatusOr<NodeRegistry::Registration> Register(const std::string& id,
                                                      uint64_t incarnation,
                                                      v1::NodeRole role = v1::NODE_ROLE_WORKER) {
    v1::RegisterRequest r;
    r.set_role(role);
    r.set_node_id(id);
    r.set_incarnation(incarnation);
    r.set_pid(static_cast<int>(incarnation));
    if (role == v1::NODE_ROLE_SERVER) r.set_address("127.0.0.1:1");
    return registry_.Register(r);
  }
  absl::Status Heartbeat(const std::string& id, uint64_t incarnation) {
    v1::HeartbeatRequest h;
    h.set_node_id(id);
    h.set_incarnation(incarnation);
    return registry_.Heartbeat(h);
  }

  FakeClock clock_;
  NodeRegistry registry_;
};

TEST_F(NodeRegistryTest, IdsAreGivenKeptOrRefused) {
  absl::StatusOr<NodeRegistry::Registration> r = Register("", 1);
  PSTRAIN_ASSERT_OK(r.status());
  EXPECT_EQ(r->node_id, "worker-0000abcd");
  r = Register("server-1", 2, v1::NODE_ROLE_SERVER);
  PSTRAIN_ASSERT_OK(r.status());
  EXPECT_EQ(r->node_id, "server-1");
  EXPECT_EQ(r->replaced_incarnation, 0u);
  for (const char* bad : {"Server-1", "-a", "a-", "a_b", "a b"}) {
    EXPECT_EQ(Register(bad, 3).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(Register(std::string(64, 'a'), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Register("w", 0).status().code(), absl::StatusCode::kInvalidArgument)
      << "an incarnation is required";
  EXPECT_EQ(Register("server-1", 4).status().code(), absl::StatusCode::kInvalidArgument)
      << "a server's id cannot become a worker's";
  v1::RegisterRequest long_host;
  long_host.set_role(v1::NODE_ROLE_WORKER);
  long_host.set_node_id("worker-long-host");
  long_host.set_incarnation(5);
  long_host.set_hostname(std::string(255, 'h'));
  PSTRAIN_EXPECT_OK(registry_.Register(long_host).status());
  long_host.set_hostname(std::string(256, 'h'));
  long_host.set_node_id("worker-longer-host");
  long_host.set_incarnation(6);
  const absl::Status too_long = registry_.Register(long_host).status();
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(too_long.message(), "hostname")) << too_long;
}

TEST_F(NodeRegistryTest, TwoLiveProcessesNeverHoldOneId) {
  PSTRAIN_ASSERT_OK(Register("worker-1", 1).status());
  PSTRAIN_ASSERT_OK(Register("worker-1", 1).status());  // a retried registration
  absl::StatusOr<NodeRegistry::Registration> other = Register("worker-1", 2);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "held by a live process"));
  clock_.Advance(absl::Seconds(9));
  PSTRAIN_ASSERT_OK(Heartbeat("worker-1", 1));
  clock_.Advance(absl::Seconds(9));
  EXPECT_TRUE(registry_.ExpireLeases().empty()) << "the heartbeat renewed the lease";
  EXPECT_EQ(Register("worker-1", 2).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(NodeRegistryTest, ANewProcessTakesALostIdAndTheOldOneIsFenced) {
  PSTRAIN_ASSERT_OK(Register("worker-1", 1).status());
  clock_.Advance(absl::Seconds(11));
  const auto lost = registry_.ExpireLeases();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].first, "worker-1");
  EXPECT_TRUE(absl::StrContains(lost[0].second, "no heartbeat")) << lost[0].second;
  absl::StatusOr<NodeRegistry::Registration> r = Register("worker-1", 2);
  PSTRAIN_ASSERT_OK(r.status());
  EXPECT_EQ(r->replaced_incarnation, 1u);
  EXPECT_TRUE(registry_.IsAlive("worker-1", 2));
  EXPECT_FALSE(registry_.IsAlive("worker-1", 1));
  EXPECT_EQ(Heartbeat("worker-1", 1).code(), absl::StatusCode::kFailedPrecondition);
  PSTRAIN_EXPECT_OK(Heartbeat("worker-1", 2));
}

TEST_F(NodeRegistryTest, AClosedSessionLetsANewProcessTakeTheIdAtOnce) {
  PSTRAIN_ASSERT_OK(Register("server-1", 1, v1::NODE_ROLE_SERVER).status());
  EXPECT_TRUE(registry_.SessionOpened("server-1", 1));
  EXPECT_FALSE(registry_.SessionOpened("server-1", 9)) << "not the holder";
  EXPECT_EQ(Register("server-1", 2, v1::NODE_ROLE_SERVER).status().code(),
            absl::StatusCode::kUnavailable);
  registry_.SessionClosed("server-1", 1);  // the process died: its connection closed
  absl::StatusOr<NodeRegistry::Registration> r = Register("server-1", 2, v1::NODE_ROLE_SERVER);
  PSTRAIN_ASSERT_OK(r.status());
  EXPECT_EQ(r->replaced_incarnation, 1u);
}

TEST_F(NodeRegistryTest, ALostProcessThatComesBackIsAliveAgain) {
  PSTRAIN_ASSERT_OK(Register("worker-1", 1).status());
  clock_.Advance(absl::Seconds(11));
  ASSERT_EQ(registry_.ExpireLeases().size(), 1u);
  EXPECT_FALSE(registry_.IsAlive("worker-1"));
  PSTRAIN_ASSERT_OK(Heartbeat("worker-1", 1));
  EXPECT_TRUE(registry_.IsAlive("worker-1", 1));
}

TEST_F(NodeRegistryTest, AwaitedNodesComeBackAsTheSameProcessOrAfterALease) {
  registry_.Await("worker-1", v1::NODE_ROLE_WORKER, "", 5);
  EXPECT_EQ(Heartbeat("worker-1", 5).code(), absl::StatusCode::kNotFound) << "register first";
  EXPECT_EQ(Register("worker-1", 6).status().code(), absl::StatusCode::kUnavailable)
      << "the awaited process may still come back";
  absl::StatusOr<NodeRegistry::Registration> r = Register("worker-1", 5);
  PSTRAIN_ASSERT_OK(r.status());
  EXPECT_EQ(r->replaced_incarnation, 0u) << "the same process";

  registry_.Await("worker-2", v1::NODE_ROLE_WORKER, "", 7);
  clock_.Advance(absl::Seconds(11));
  const auto lost = registry_.ExpireLeases();
  ASSERT_EQ(lost.size(), 2u);  // worker-1 stopped heartbeating too
  r = Register("worker-2", 8);
  PSTRAIN_ASSERT_OK(r.status());
  EXPECT_EQ(r->replaced_incarnation, 7u);
}

TEST_F(NodeRegistryTest, LongLostNodesAreForgotten) {
  PSTRAIN_ASSERT_OK(Register("worker-1", 1).status());
  clock_.Advance(absl::Seconds(11));
  registry_.ExpireLeases();
  clock_.Advance(absl::Minutes(9));
  registry_.ForgetLongLost();
  EXPECT_NE(registry_.Find("worker-1"), nullptr);
  clock_.Advance(absl::Minutes(2));
  registry_.ForgetLongLost();
  EXPECT_EQ(registry_.Find("worker-1"), nullptr);
}

// The limits, at and just past their values.
class NodeRegistryLimitsTest : public NodeRegistryTest {
 protected:
  NodeRegistryLimitsTest()
      : NodeRegistryTest(
            {.lease = absl::Seconds(10), .max_lost_nodes = 2, .max_registrations_per_minute = 3}) {}
};

TEST_F(NodeRegistryLimitsTest, RegistrationsPerMinuteAreLimited) {
  for (int i = 1; i <= 3; ++i) {
    PSTRAIN_ASSERT_OK(Register(absl::StrCat("worker-", i), i).status());
    clock_.Advance(absl::Seconds(10));
  }
  absl::StatusOr<NodeRegistry::Registration> refused = Register("worker-4", 4);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--max_registrations_per_minute"))
      << refused.status();
  EXPECT_EQ(registry_.Find("worker-4"), nullptr);  // nothing changed
  clock_.Advance(absl::Seconds(30));  // the first registration is a minute old
  PSTRAIN_EXPECT_OK(Register("worker-4", 4).status());
  EXPECT_EQ(Register("worker-5", 5).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(NodeRegistryLimitsTest, OnlyTheLatestLostNodesAreKept) {
  for (int i = 1; i <= 3; ++i) {
    PSTRAIN_ASSERT_OK(Register(absl::StrCat("worker-", i), i).status());
    clock_.Advance(absl::Seconds(30));  // worker-i is lost before the next registers
    registry_.ExpireLeases();
    registry_.ForgetLongLost();
  }
  EXPECT_EQ(registry_.Find("worker-1"), nullptr);  // the longest lost, past two
  EXPECT_NE(registry_.Find("worker-2"), nullptr);
  EXPECT_NE(registry_.Find("worker-3"), nullptr);
  EXPECT_EQ(registry_.nodes().size(), 2u);
}

}  // namespace
}  // namespace pstrain::server
