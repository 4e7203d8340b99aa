#include "server/scheduler.h"

#include "absl/strings/match.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

v1::Node Node(const std::string& id, int64_t max_memory = 0) {
  v1::Node n;
  n.set_id(id);
  n.set_max_memory_bytes(max_memory);
  return n;
}

v1::JobSpec Spec(int servers, int workers) {
  v1::JobSpec spec;
  spec.set_num_servers(servers);
  spec.set_num_workers(workers);
  return spec;
}

TEST(SchedulerTest, WaitsForWorkersThenServersThenRoom) {
  const v1::Node w0 = Node("worker-0"), s0 = Node("server-0", 100), s1 = Node("server-1", 100);
  ClusterState cluster;
  absl::StatusOr<Placement> p = PlaceJob(Spec(2, 2), {10, 10}, cluster);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "waiting for 2 free workers (0 free)"));
  cluster.free_workers = {&w0, &w0};
  p = PlaceJob(Spec(2, 2), {10, 10}, cluster);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "waiting for 2 servers (0 alive)"));
  cluster.servers = {&s0, &s1};
  cluster.reserved = {{"server-0", 95}};
  p = PlaceJob(Spec(2, 2), {10, 10}, cluster);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "waiting for room")) << p.status();
  cluster.reserved.clear();
  PSTRAIN_EXPECT_OK(PlaceJob(Spec(2, 2), {10, 10}, cluster).status());
}

TEST(SchedulerTest, TheLargestShardGoesToTheServerWithTheMostRoom) {
  const v1::Node w0 = Node("worker-0"), w1 = Node("worker-1");
  const v1::Node small = Node("server-a", 100), big = Node("server-b", 1000),
                 unlimited = Node("server-c", 0);
  ClusterState cluster;
  cluster.free_workers = {&w0, &w1};
  cluster.servers = {&small, &big};
  absl::StatusOr<Placement> p = PlaceJob(Spec(2, 1), {50, 500}, cluster);
  PSTRAIN_ASSERT_OK(p.status());
  EXPECT_EQ(p->servers[1]->id(), "server-b");
  EXPECT_EQ(p->servers[0]->id(), "server-a");
  EXPECT_EQ(p->workers.size(), 1u);
  EXPECT_EQ(p->workers[0]->id(), "worker-0");
  cluster.servers = {&small, &big, &unlimited};
  p = PlaceJob(Spec(1, 1), {2000}, cluster);
  PSTRAIN_ASSERT_OK(p.status());
  EXPECT_EQ(p->servers[0]->id(), "server-c") << "no limit: the most room";
  EXPECT_EQ(RoomOn(big, {{"server-b", 300}}), 700);
}

// A colocated job takes workers whose own server has room for their
// shard, and those servers: server s is worker s's, and servers of their
// own are not used.
TEST(SchedulerTest, AColocatedJobTakesWorkersWithTheirOwnServers) {
  const v1::Node w0 = Node("worker-0"), w1 = Node("worker-1"), w2 = Node("worker-2");
  const v1::Node s0 = Node("worker-0-server", 100), s2 = Node("worker-2-server", 100),
                 full = Node("worker-1-server", 5), own = Node("server-0");
  v1::JobSpec spec = Spec(2, 2);
  spec.set_colocated_servers(true);
  ClusterState cluster;
  cluster.servers = {&own};
  cluster.free_workers = {&w0, &w1, &w2};
  cluster.colocated_servers = {{"worker-0", &s0}};
  absl::StatusOr<Placement> p = PlaceJob(spec, {10, 10}, cluster);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "with a server of their own")) << p.status();
  cluster.colocated_servers = {{"worker-0", &s0}, {"worker-1", &full}, {"worker-2", &s2}};
  p = PlaceJob(spec, {10, 10}, cluster);
  PSTRAIN_ASSERT_OK(p.status());
  ASSERT_EQ(p->workers.size(), 2u);
  EXPECT_EQ(p->workers[0]->id(), "worker-0");
  EXPECT_EQ(p->servers[0]->id(), "worker-0-server");
  EXPECT_EQ(p->workers[1]->id(), "worker-2") << "worker-1's server has no room";
  EXPECT_EQ(p->servers[1]->id(), "worker-2-server");
}

// Workers take a job only if it fits in their max_memory_bytes (0:
// unlimited): at and just past the limit.
TEST(SchedulerTest, WorkersTakeOnlyJobsThatFit) {
  const v1::Node small = Node("worker-0", 999), exact = Node("worker-1", 1000),
                 unlimited = Node("worker-2", 0), s0 = Node("server-0");
  ClusterState cluster;
  cluster.servers = {&s0};
  cluster.free_workers = {&small, &exact};
  absl::StatusOr<Placement> p = PlaceJob(Spec(1, 2), {10}, cluster, 1000);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "2 free workers with room for"))
      << p.status();
  EXPECT_TRUE(absl::StrContains(p.status().message(), "(2 free, 1 with room)")) << p.status();
  cluster.free_workers = {&small, &exact, &unlimited};
  p = PlaceJob(Spec(1, 2), {10}, cluster, 1000);
  PSTRAIN_ASSERT_OK(p.status());
  EXPECT_EQ(p->workers[0]->id(), "worker-1");
  EXPECT_EQ(p->workers[1]->id(), "worker-2");
}

// What a worker needs for the quick-start job: the data set dominates.
TEST(SchedulerTest, AWorkerNeedsItsModelActivationsAndData) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type(v1::MODEL_TYPE_MLP);
  spec.mutable_model()->add_hidden(256);
  spec.mutable_model()->add_hidden(128);
  spec.set_batch_size(64);
  const int64_t params = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10;
  EXPECT_EQ(WorkerBytesNeeded(spec),
            4 * (3 * params + 2 * 64 * (784 + 256 + 128 + 10)) + 70000 * (784 + 4));
}

TEST(SchedulerTest, ACheckpointDirectoryIsTakenInsideTheServersRoot) {
  v1::Node server = Node("server-0");
  EXPECT_TRUE(TakesCheckpointDir(server, "/anywhere")) << "no root: anywhere";
  server.set_checkpoint_root("/var/lib/pstrain/checkpoints/");
  EXPECT_TRUE(TakesCheckpointDir(server, "/var/lib/pstrain/checkpoints"));
  EXPECT_TRUE(TakesCheckpointDir(server, "/var/lib/pstrain/checkpoints/job/a"));
  EXPECT_TRUE(TakesCheckpointDir(server, "/var/lib/pstrain/x/../checkpoints/job"));
  EXPECT_FALSE(TakesCheckpointDir(server, "/var/lib/pstrain/checkpoints-2"));
  EXPECT_FALSE(TakesCheckpointDir(server, "/var/lib/pstrain/checkpoints/../elsewhere"));
  EXPECT_FALSE(TakesCheckpointDir(server, "/tmp/ckpt"));
  server.set_checkpoint_root("/");
  EXPECT_TRUE(TakesCheckpointDir(server, "/tmp/ckpt"));
}

TEST(SchedulerTest, ASubmitNamingADirectoryNoServerTakesIsRefused) {
  FakeClock clock;
  NodeRegistry registry({}, &clock, [] { return 1u; });
  v1::JobSpec spec = Spec(1, 1);
  spec.mutable_checkpoint()->set_dir("/tmp/ckpt");
  // No server yet: nothing to check against.
  PSTRAIN_EXPECT_OK(CheckCheckpointDirTaken(spec, registry));
  for (const auto& [id, root] : {std::pair{"server-0", "/srv/a"}, std::pair{"server-1", "/srv/b"}}) {
    v1::RegisterRequest r;
    r.set_role(v1::NODE_ROLE_SERVER);
    r.set_node_id(id);
    r.set_address("127.0.0.1:1");
    r.set_incarnation(7);
    r.set_checkpoint_root(root);
    PSTRAIN_ASSERT_OK(registry.Register(r).status());
  }
  const absl::Status refused = CheckCheckpointDirTaken(spec, registry);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "checkpoint.dir: /tmp/ckpt lies outside every "
                                                   "server's --checkpoint_root (server-0: /srv/a, "
                                                   "server-1: /srv/b)"))
      << refused;
  spec.mutable_checkpoint()->set_dir("/srv/b/job-1");
  PSTRAIN_EXPECT_OK(CheckCheckpointDirTaken(spec, registry));
  spec.mutable_checkpoint()->clear_dir();
  PSTRAIN_EXPECT_OK(CheckCheckpointDirTaken(spec, registry));
}

}  // namespace
}  // namespace pstrain::server
