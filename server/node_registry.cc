#include "server/node_registry.h"

#include <limits.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/enum_names.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

int64_t WallMs() { return absl::ToUnixMillis(absl::Now()); }

// Empty, or host:port of letters, digits and . - _ [ ] : — what a scrape
// target may be (and safe to write into the targets file as it is).
// A host name (RFC 1035 limits one to 253 characters), with room.
constexpr size_t kMaxHostnameBytes = 255;

bool IsHostPort(const std::string& s) {
  if (s.empty()) return true;
  if (s.size() > 255 || s.rfind(':') == std::string::npos) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_' || c == '[' || c == ']' ||
           c == ':';
  });
}

}  // namespace

NodeRegistry::NodeRegistry(Options options, const Clock* clock,
                           std::function<uint32_t()> random)
    : options_(options), clock_(clock), random_(std::move(random)) {}

bool NodeRegistry::Gone(const Node& node) const {
  return node.info.state() == v1::NODE_STATE_LOST || (node.session_seen && !node.session_open);
}

absl::StatusOr<NodeRegistry::Registration> NodeRegistry::Register(
    const v1::RegisterRequest& request) {
  if (request.role() != v1::NODE_ROLE_SERVER && request.role() != v1::NODE_ROLE_WORKER) {
    return absl::InvalidArgumentError("role: must be server or worker");
  }
  if (request.role() == v1::NODE_ROLE_SERVER && request.address().empty()) {
    return absl::InvalidArgumentError("address: a server must give its address");
  }
  if (!IsHostPort(request.address()) || !IsHostPort(request.metrics_address())) {
    return absl::InvalidArgumentError(absl::StrCat(
        IsHostPort(request.address()) ? "metrics_address" : "address", ": not a host:port"));
  }
  if (request.max_memory_bytes() < 0) {
    return absl::InvalidArgumentError("max_memory_bytes: must be >= 0");
  }
  if (request.checkpoint_root().size() > PATH_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint_root: longer than ", PATH_MAX, " bytes"));
  }
  if (request.hostname().size() > kMaxHostnameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("hostname: longer than ", kMaxHostnameBytes, " bytes"));
  }
  if (request.incarnation() == 0) {
    return absl::InvalidArgumentError("incarnation: must be set (a random number per process)");
  }
  if (!request.node_id().empty() && !IsValidNodeId(request.node_id())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node_id: '", request.node_id().substr(0, 80),
        "' is not a node id (1-63 of a-z, 0-9, '-' and '.', starting and ending alphanumeric)"));
  }
  if (!request.join_job().empty() &&
      (request.role() != v1::NODE_ROLE_WORKER || request.join_job().size() > 128)) {
    return absl::InvalidArgumentError(request.role() != v1::NODE_ROLE_WORKER
                                          ? "join_job: only a worker joins a job"
                                          : "join_job: longer than 128 bytes");
  }
  if (!request.colocated_with().empty() &&
      (request.role() != v1::NODE_ROLE_SERVER || !IsValidNodeId(request.colocated_with()))) {
    return absl::InvalidArgumentError(
        request.role() != v1::NODE_ROLE_SERVER
            ? "colocated_with: only a server runs in a worker's process"
            : absl::StrCat("colocated_with: '", request.colocated_with().substr(0, 80),
                           "' is not a node id"));
  }
  const absl::Time now = clock_->Now();
  while (!registered_at_.empty() && now - registered_at_.front() >= absl::Minutes(1)) {
    registered_at_.pop_front();
  }
  if (static_cast<int>(registered_at_.size()) >= options_.max_registrations_per_minute) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "registrations: ", registered_at_.size(),
        " in the last minute, the most this coordinator takes (--max_registrations_per_minute); "
        "retry later"));
  }
  std::string id = request.node_id();
  while (id.empty() || (request.node_id().empty() && nodes_.contains(id))) {
    id = absl::StrFormat("%s-%08x", EnumName(request.role()), random_());
  }
  Registration result;
  result.node_id = id;
  auto it = nodes_.find(id);
  if (it != nodes_.end()) {
    Node& node = it->second;
    if (node.info.role() != request.role()) {
      return absl::InvalidArgumentError(
          absl::StrCat("node_id: ", id, " is a ", EnumName(node.info.role()), ", not a ",
                       EnumName(request.role())));
    }
    if (node.incarnation != request.incarnation()) {
      if (!Gone(node)) {
        return absl::UnavailableError(absl::StrFormat(
            "node id %s is held by a live process (pid %d on %s, incarnation %016x)%s; "
            "retry once it is gone",
            id, node.info.pid(), node.info.hostname(), node.incarnation,
            node.info.state() == v1::NODE_STATE_AWAITED ? ", awaited since a coordinator restart"
                                                         : ""));
      }
      result.replaced_incarnation = node.incarnation;
      LOG(INFO) << "node " << id << ": a new process (pid " << request.pid()
                << ") takes the place of the one that is gone";
    }
  }
  Node& node = nodes_[id];
  node.info.set_id(id);
  node.info.set_role(request.role());
  node.info.set_address(request.address());
  node.info.set_hostname(request.hostname());
  node.info.set_pid(request.pid());
  node.info.set_max_memory_bytes(request.max_memory_bytes());
  node.info.set_metrics_address(request.metrics_address());
  node.info.set_join_job(request.join_job());
  node.info.set_colocated_with(request.colocated_with());
  node.info.set_checkpoint_root(request.checkpoint_root());
  node.info.set_incarnation(request.incarnation());
  node.info.set_state(v1::NODE_STATE_ALIVE);
  node.info.set_last_heartbeat_ms(WallMs());
  if (node.incarnation != request.incarnation()) {
    node.session_open = false;
    node.session_seen = false;
    node.info.set_session_open(false);
  }
  node.incarnation = request.incarnation();
  node.last_heard = now;
  node.lost_at = absl::InfiniteFuture();
  registered_at_.push_back(now);
  LOG(INFO) << "node " << id << " registered (" << request.address() << ", pid "
            << request.pid() << ")";
  return result;
}

absl::Status NodeRegistry::Heartbeat(const v1::HeartbeatRequest& request) {
  auto it = nodes_.find(request.node_id());
  // An awaited node registers again, so that its details are known.
  if (it == nodes_.end() || it->second.info.state() == v1::NODE_STATE_AWAITED) {
    return absl::NotFoundError(absl::StrCat("unknown node '", request.node_id(), "'"));
  }
  Node& node = it->second;
  if (node.incarnation != request.incarnation()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "node %s is now held by another process (pid %d on %s): this one was fenced",
        node.info.id(), node.info.pid(), node.info.hostname()));
  }
  node.last_heard = clock_->Now();
  node.info.set_last_heartbeat_ms(WallMs());
  node.info.clear_jobs();
  for (const v1::HeldJob& held : request.held()) node.info.add_jobs(held.job_id());
  if (node.info.state() == v1::NODE_STATE_LOST) {
    LOG(INFO) << "node " << node.info.id() << " is back";
    node.info.set_state(v1::NODE_STATE_ALIVE);
    node.lost_at = absl::InfiniteFuture();
  }
  return absl::OkStatus();
}

bool NodeRegistry::SessionOpened(const std::string& id, uint64_t incarnation) {
  auto it = nodes_.find(id);
  if (it == nodes_.end() || it->second.incarnation != incarnation ||
      it->second.info.state() == v1::NODE_STATE_AWAITED) {
    return false;
  }
  it->second.session_open = true;
  it->second.session_seen = true;
  it->second.info.set_session_open(true);
  return true;
}

void NodeRegistry::SessionClosed(const std::string& id, uint64_t incarnation) {
  auto it = nodes_.find(id);
  if (it != nodes_.end() && it->second.incarnation == incarnation) {
    it->second.session_open = false;
    it->second.info.set_session_open(false);
  }
}

void NodeRegistry::Await(const std::string& id, v1::NodeRole role, const std::string& address,
                         uint64_t incarnation) {
  Node& node = nodes_[id];
  node.info.set_id(id);
  node.info.set_role(role);
  node.info.set_address(address);
  node.info.set_incarnation(incarnation);
  node.info.set_state(v1::NODE_STATE_AWAITED);
  node.incarnation = incarnation;
  node.last_heard = clock_->Now();
}

std::vector<std::pair<std::string, std::string>> NodeRegistry::ExpireLeases() {
  std::vector<std::pair<std::string, std::string>> lost;
  const absl::Time now = clock_->Now();
  for (auto& [id, node] : nodes_) {
    if (node.info.state() == v1::NODE_STATE_LOST || now - node.last_heard <= options_.lease) {
      continue;
    }
    std::string why =
        node.info.state() == v1::NODE_STATE_AWAITED
            ? absl::StrCat("node ", id, " did not come back within ",
                           absl::FormatDuration(options_.lease), " of a coordinator restart")
            : absl::StrCat("node ", id, " lost: no heartbeat for ",
                           absl::FormatDuration(now - node.last_heard));
    node.info.set_state(v1::NODE_STATE_LOST);
    node.info.clear_jobs();
    node.lost_at = now;
    node.lost_reason = why;
    LOG(WARNING) << why;
    lost.emplace_back(id, std::move(why));
  }
  return lost;
}

void NodeRegistry::ForgetLongLost() {
  const absl::Time now = clock_->Now();
  std::erase_if(nodes_, [&](const auto& entry) {
    const Node& node = entry.second;
    return node.info.state() == v1::NODE_STATE_LOST && now - node.lost_at > options_.forget_after;
  });
  std::vector<std::pair<absl::Time, std::string>> lost;
  for (const auto& [id, node] : nodes_) {
    if (node.info.state() == v1::NODE_STATE_LOST) lost.emplace_back(node.lost_at, id);
  }
  if (static_cast<int>(lost.size()) <= options_.max_lost_nodes) return;
  std::sort(lost.begin(), lost.end());
  for (size_t i = 0; i < lost.size() - options_.max_lost_nodes; ++i) nodes_.erase(lost[i].second);
}

const NodeRegistry::Node* NodeRegistry::Find(const std::string& id) const {
  auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : &it->second;
}

bool NodeRegistry::IsAlive(const std::string& id, uint64_t incarnation) const {
  const Node* node = Find(id);
  return node != nullptr && node->info.state() == v1::NODE_STATE_ALIVE &&
         (incarnation == 0 || node->incarnation == incarnation);
}

}  // namespace pstrain::server
