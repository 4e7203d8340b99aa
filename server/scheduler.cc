#include "server/scheduler.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <numeric>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "server/shard_store.h"

namespace pstrain::server {

int64_t RoomOn(const v1::Node& node, const std::map<std::string, int64_t>& reserved) {
  if (node.max_memory_bytes() == 0) return std::numeric_limits<int64_t>::max();
  auto it = reserved.find(node.id());
  return node.max_memory_bytes() - (it == reserved.end() ? 0 : it->second);
}

absl::StatusOr<Placement> PlaceJob(const v1::JobSpec& spec, const std::vector<int64_t>& need,
                                   const ClusterState& cluster, int64_t worker_need) {
  if (static_cast<int>(cluster.free_workers.size()) < spec.num_workers()) {
    return absl::FailedPreconditionError(absl::StrCat("waiting for ", spec.num_workers(),
                                                      " free workers (",
                                                      cluster.free_workers.size(), " free)"));
  }
  std::vector<const v1::Node*> workers;
  for (const v1::Node* w : cluster.free_workers) {
    if (RoomOn(*w, {}) >= worker_need) workers.push_back(w);
  }
  if (static_cast<int>(workers.size()) < spec.num_workers()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "waiting for %d free workers with room for %.1f MB (%d free, %d with room)",
        spec.num_workers(), worker_need / 1e6, cluster.free_workers.size(), workers.size()));
  }
  if (spec.colocated_servers()) {
    Placement placement;
    for (const v1::Node* w : workers) {
      const int s = static_cast<int>(placement.workers.size());
      if (s == spec.num_workers()) break;
      auto it = cluster.colocated_servers.find(w->id());
      if (it == cluster.colocated_servers.end() || RoomOn(*it->second, cluster.reserved) < need[s]) {
        continue;
      }
      placement.workers.push_back(w);
      placement.servers.push_back(it->second);
    }
    if (static_cast<int>(placement.workers.size()) < spec.num_workers()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "waiting for ", spec.num_workers(),
          " free workers with a server of their own (--colocated_server) with room (",
          placement.workers.size(), " now)"));
    }
    return placement;
  }
  if (static_cast<int>(cluster.servers.size()) < spec.num_servers()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "waiting for ", spec.num_servers(), " servers (", cluster.servers.size(), " alive)"));
  }
  // The largest shard first, each on the server with the most room.
  std::vector<int> order(spec.num_servers());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return need[a] > need[b]; });
  Placement placement;
  placement.servers.assign(spec.num_servers(), nullptr);
  std::set<const v1::Node*> taken;
  for (int s : order) {
    const v1::Node* best = nullptr;
    for (const v1::Node* n : cluster.servers) {
      if (taken.contains(n) || RoomOn(*n, cluster.reserved) < need[s]) continue;
      if (best == nullptr || RoomOn(*n, cluster.reserved) > RoomOn(*best, cluster.reserved)) {
        best = n;
      }
    }
    if (best == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "waiting for room: a shard needs %.1f MB on a server", need[s] / 1e6));
    }
    placement.servers[s] = best;
    taken.insert(best);
  }
  placement.workers.assign(workers.begin(), workers.begin() + spec.num_workers());
  return placement;
}

bool WorksOn(const v1::Node& worker, const std::string& job_id, const v1::JobSpec& spec) {
  if (spec.model().type() == v1::MODEL_TYPE_EXTERNAL) return worker.join_job() == job_id;
  return worker.join_job().empty();
}

std::map<std::string, int64_t> ReservedBytes(const Txn& txn) {
  std::map<std::string, int64_t> reserved;
  for (const std::string& id : txn.Ids()) {
    const v1::Job& job = txn.Get(id);
    if (job.state() != v1::JOB_STATE_RUNNING) continue;
    for (int s = 0; s < job.server_nodes_size(); ++s) {
      reserved[job.server_nodes(s)] += ShardStore::BytesNeeded(job.spec(), txn.Plan(id), s);
    }
  }
  return reserved;
}

void ScheduleJobs(Txn& txn, const NodeRegistry& registry) {
  std::set<std::string> busy;
  std::vector<std::string> pending;
  for (const std::string& id : txn.Ids()) {
    const v1::Job& job = txn.Get(id);
    if (job.state() == v1::JOB_STATE_PENDING) pending.push_back(id);
    if (job.state() == v1::JOB_STATE_RUNNING) {
      busy.insert(job.worker_nodes().begin(), job.worker_nodes().end());
    }
  }
  std::map<std::string, int64_t> reserved = ReservedBytes(txn);
  for (const std::string& id : pending) {
    const v1::JobSpec& spec = txn.Get(id).spec();
    const v1::PartitionPlan& plan = txn.Plan(id);
    ClusterState cluster;
    cluster.reserved = reserved;
    for (const auto& [node_id, node] : registry.nodes()) {
      if (node.info.state() != v1::NODE_STATE_ALIVE) continue;
      if (node.info.role() == v1::NODE_ROLE_SERVER) {
        if (node.info.colocated_with().empty()) {
          cluster.servers.push_back(&node.info);
        } else {
          cluster.colocated_servers[node.info.colocated_with()] = &node.info;
        }
      }
      if (node.info.role() == v1::NODE_ROLE_WORKER && !busy.contains(node_id) &&
          WorksOn(node.info, id, spec)) {
        cluster.free_workers.push_back(&node.info);
      }
    }
    std::vector<int64_t> need(spec.num_servers());
    for (int s = 0; s < spec.num_servers(); ++s) need[s] = ShardStore::BytesNeeded(spec, plan, s);
    absl::StatusOr<Placement> placement = PlaceJob(spec, need, cluster, WorkerBytesNeeded(spec));
    if (!placement.ok()) {
      if (txn.Get(id).reason() != placement.status().message()) {
        txn.MutableVolatile(id)->set_reason(std::string(placement.status().message()));
      }
      continue;
    }
    v1::Job& job = *txn.Mutable(id);
    job.clear_server_nodes();
    job.clear_server_addresses();
    job.clear_server_incarnations();
    job.clear_worker_nodes();
    job.clear_worker_incarnations();
    job.clear_workers();
    for (int s = 0; s < spec.num_servers(); ++s) {
      const v1::Node& node = *placement->servers[s];
      job.add_server_nodes(node.id());
      job.add_server_addresses(node.address());
      job.add_server_incarnations(node.incarnation());
      reserved[node.id()] += need[s];
    }
    for (int w = 0; w < spec.num_workers(); ++w) {
      const v1::Node& node = *placement->workers[w];
      job.add_worker_nodes(node.id());
      job.add_worker_incarnations(node.incarnation());
      busy.insert(node.id());
      v1::WorkerStatus* status = job.add_workers();
      status->set_worker(w);
      status->set_node_id(node.id());
    }
    StartGeneration(&job, "placed", txn.now_ms());
    txn.SetState(id, v1::JOB_STATE_RUNNING, "");
  }
}

bool TakesCheckpointDir(const v1::Node& server, const std::string& dir) {
  if (server.checkpoint_root().empty()) return true;
  std::string root = std::filesystem::path(server.checkpoint_root()).lexically_normal().string();
  if (root.size() > 1 && root.back() == '/') root.pop_back();
  const std::string path = std::filesystem::path(dir).lexically_normal().string();
  return root == "/" || path == root || absl::StartsWith(path, root + "/");
}

absl::Status CheckCheckpointDirTaken(const v1::JobSpec& spec, const NodeRegistry& registry) {
  const std::string& dir = spec.checkpoint().dir();
  if (dir.empty()) return absl::OkStatus();
  std::vector<std::string> roots;
  for (const auto& [id, node] : registry.nodes()) {
    if (node.info.role() != v1::NODE_ROLE_SERVER || node.info.state() != v1::NODE_STATE_ALIVE) {
      continue;
    }
    if (TakesCheckpointDir(node.info, dir)) return absl::OkStatus();
    if (roots.size() < 4) roots.push_back(absl::StrCat(id, ": ", node.info.checkpoint_root()));
  }
  if (roots.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "checkpoint.dir: ", dir.substr(0, 200), " lies outside every server's --checkpoint_root (",
      absl::StrJoin(roots, ", "), roots.size() == 4 ? ", ..." : "",
      "): name a directory inside one, or start the servers with one that holds it"));
}

}  // namespace pstrain::server
