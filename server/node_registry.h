// The coordinator's table of nodes: their ids, which process (incarnation)
// holds each id, and their leases.
//
// A node id names a role in the cluster ("server-1", a pod's name), not a
// process: a process that comes back under a lost node's id takes its
// place. Each process picks a random incarnation number at start and sends
// it with every call, so the coordinator tells a node's processes apart:
//   - Register with an id that no live process holds takes the id. "Live"
//     means the holder's session (a stream it keeps open) is open, or, with
//     no session, its lease has not lapsed. A new incarnation that takes an
//     id from a gone one is reported, so that the jobs it served recover.
//   - Register while a live process holds the id is UNAVAILABLE: the new
//     process retries until the old one is gone. Two live processes never
//     hold one id.
//   - A heartbeat from an incarnation that no longer holds its id is
//     FAILED_PRECONDITION: the process was fenced and must exit.
// After a coordinator restart the nodes of running jobs are AWAITED under
// the incarnations their jobs recorded: the same processes register again
// and are taken back as they were.
//
// Not thread-safe: the coordinator calls it under its lock. Time comes from
// the clock it is given.
#ifndef PSTRAIN_SERVER_NODE_REGISTRY_H_
#define PSTRAIN_SERVER_NODE_REGISTRY_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/node_id.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::server {

class NodeRegistry {
 public:
  struct Options {
    // A node not heard from for this long is lost.
    absl::Duration lease = absl::Seconds(10);
    // Lost nodes stay listed this long, then are forgotten.
    absl::Duration forget_after = absl::Minutes(10);
    // At most this many lost nodes are listed: beyond, the longest lost
    // are forgotten sooner.
    int max_lost_nodes = 1000;
    // Registrations taken in any minute (by the clock): one beyond is
    // RESOURCE_EXHAUSTED.
    int max_registrations_per_minute = 600;
  };

  struct Node {
    v1::Node info;            // as ListNodes shows it
    uint64_t incarnation = 0;  // the process holding the id
    absl::Time last_heard;     // by the clock
    absl::Time lost_at = absl::InfiniteFuture();
    std::string lost_reason;  // once lost: why
    bool session_open = false;
    bool session_seen = false;  // this incarnation has opened a session
  };

  struct Registration {
    std::string node_id;
    // Non-zero: this process took the id from that incarnation, which is
    // gone (its jobs must recover).
    uint64_t replaced_incarnation = 0;
  };

  // `random` draws the numbers of the ids the coordinator assigns.
  NodeRegistry(Options options, const Clock* clock, std::function<uint32_t()> random);

  // INVALID_ARGUMENT for a bad request (role, address, id, a zero
  // incarnation, an id of the other role); UNAVAILABLE while a live process
  // holds the id; RESOURCE_EXHAUSTED past max_registrations_per_minute. An
  // empty node_id gets a new id ("worker-3f9a2c1b").
  absl::StatusOr<Registration> Register(const v1::RegisterRequest& request);

  // NOT_FOUND for an unknown or awaited node (register again);
  // FAILED_PRECONDITION for an incarnation that no longer holds the id. A
  // lost node whose process comes back is alive again.
  absl::Status Heartbeat(const v1::HeartbeatRequest& request);

  // The node's session stream opened or closed. False if the incarnation
  // does not hold the id (the stream is refused).
  bool SessionOpened(const std::string& id, uint64_t incarnation);
  void SessionClosed(const std::string& id, uint64_t incarnation);

  // After a coordinator restart: a node that a running job recorded,
  // awaited for one lease.
  void Await(const std::string& id, v1::NodeRole role, const std::string& address,
             uint64_t incarnation);

  // Marks the nodes whose lease ran out as lost; returns them, each with a
  // line saying why.
  std::vector<std::pair<std::string, std::string>> ExpireLeases();
  // Forgets nodes lost more than forget_after ago, and the longest lost
  // beyond max_lost_nodes.
  void ForgetLongLost();

  // Null if unknown.
  const Node* Find(const std::string& id) const;
  // Registered, alive, and (if incarnation is not 0) held by that process.
  bool IsAlive(const std::string& id, uint64_t incarnation = 0) const;
  const std::map<std::string, Node>& nodes() const { return nodes_; }

 private:
  // The holder of the id is known to be gone: lost, or the session it had
  // opened is closed (a process that never opened one is gone when its
  // lease lapses).
  bool Gone(const Node& node) const;

  const Options options_;
  const Clock* const clock_;
  const std::function<uint32_t()> random_;
  std::map<std::string, Node> nodes_;
  std::deque<absl::Time> registered_at_;  // registrations of the last minute
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_NODE_REGISTRY_H_
