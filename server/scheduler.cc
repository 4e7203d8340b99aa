#include "server/scheduler.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

}  // namespace pstrain::server
