// Where jobs run: choosing the nodes of a pending job. Functions of the
// cluster's state and the jobs, without gRPC or a clock, so that the policy
// is tested on its own.
//
// A worker runs one job at a time, if the job fits in its max_memory_bytes;
// a server holds several jobs as long as their state fits in its
// max_memory_bytes (0: unlimited). A job takes
// spec.num_workers free workers, in id order, and spec.num_servers distinct
// servers: the largest shard first, each on the server with the most room
// left. A job with colocated_servers takes the free workers whose own
// server (the one in their process) has room for their shard: server s is
// worker s's.
#ifndef PSTRAIN_SERVER_SCHEDULER_H_
#define PSTRAIN_SERVER_SCHEDULER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/membership.pb.h"
#include "server/job_table.h"
#include "server/node_registry.h"

namespace pstrain::server {

struct Placement {
  std::vector<const v1::Node*> servers;  // by server index
  std::vector<const v1::Node*> workers;  // by worker index
};

// The live nodes a job may be placed on, and what running jobs already use.
struct ClusterState {
  std::vector<const v1::Node*> free_workers;  // alive, running no job; by id
  std::vector<const v1::Node*> servers;       // alive, of their own; by id
  // Alive servers that run in a worker's process, by the worker's id.
  std::map<std::string, const v1::Node*> colocated_servers;
  std::map<std::string, int64_t> reserved;    // server id -> bytes running jobs need
};

// The bytes a server with `node`'s capacity has left.
int64_t RoomOn(const v1::Node& node, const std::map<std::string, int64_t>& reserved);

// Chooses the nodes for a job whose servers need need[s] bytes each and
// whose workers need worker_need bytes (a worker's max_memory_bytes, 0:
// unlimited). FAILED_PRECONDITION with the reason shown in the job
// ("waiting for 2 free workers (1 free)") when it cannot run yet.
absl::StatusOr<Placement> PlaceJob(const v1::JobSpec& spec, const std::vector<int64_t>& need,
                                   const ClusterState& cluster, int64_t worker_need = 0);

// Whether a worker may be given job `job_id`: a pool worker takes any job
// of a built-in model; a worker that joined a job (the client library) that
// job alone, whose model is external.
bool WorksOn(const v1::Node& worker, const std::string& job_id, const v1::JobSpec& spec);

// Whether `server` takes `dir` as a job's checkpoint.dir: its
// checkpoint_root is empty or holds dir. Compared as written, after "."
// and ".." are resolved: the server itself also resolves symbolic links.
bool TakesCheckpointDir(const v1::Node& server, const std::string& dir);

// At submit: INVALID_ARGUMENT naming checkpoint.dir when servers are
// registered and none takes the job's directory (it would fail once
// placed); OK without a directory, or before any server registered.
absl::Status CheckCheckpointDirTaken(const v1::JobSpec& spec, const NodeRegistry& registry);

// The bytes the running jobs, as `txn` sees them, need on each server node.
std::map<std::string, int64_t> ReservedBytes(const Txn& txn);

// Starts every pending job, oldest first, that the live nodes of `registry`
// can take: places it (PlaceJob) and starts its first generation. A job
// that cannot start yet keeps the reason in its record.
void ScheduleJobs(Txn& txn, const NodeRegistry& registry);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SCHEDULER_H_
