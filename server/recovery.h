// How a running job goes on after the loss of a node: generations, and the
// checkpoints they start from. Functions of the job's record and the nodes'
// state, without gRPC or a clock, so that each rule is tested on its own:
// the rules first, then RecoverJobs, the decision the coordinator's control
// loop takes for every running job.
//
// A generation is a run of the job by one set of nodes from one step: every
// server starts from the same checkpoint (sync), every worker from the same
// step, and nothing of an older generation is summed into a newer one (the
// servers refuse its requests). In sync mode, with the sums in worker order
// and the data order a function of the step, a generation that starts from
// a checkpoint of step C computes exactly what the first computed after C:
// the job's result is bitwise that of a run without the fault.
#ifndef PSTRAIN_SERVER_RECOVERY_H_
#define PSTRAIN_SERVER_RECOVERY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pstrain/v1/control.pb.h"
#include "server/node_registry.h"

namespace pstrain::server {

class Txn;  // job_table.h

// The checkpoint a new generation of the job starts from: sync, the
// newest complete one; none (step 0, the initial values) without one, and
// in async mode (where every server goes on from its own).
std::optional<v1::CheckpointRecord> ResumeCheckpoint(const v1::Job& job);

// Starts the job's next generation with the nodes its record names now:
// generation + 1, the resume step (sync: the resume checkpoint's; async:
// each worker keeps its step), every worker's progress back to it and
// unfinished, and an entry in the job's history with `reason`. The first
// generation (1) is started the same way when the job is placed.
void StartGeneration(v1::Job* job, const std::string& reason, int64_t time_ms);

// Which servers of the current generation keep their values (async, a
// server whose process and the number of workers are the same as in the
// previous generation); every other server loads its checkpoint.
bool KeepsValues(const v1::Job& job, int server);

// A server could not load the checkpoint its generation starts from: the
// checkpoint is dropped from the job's record, so that the next generation
// starts from the one before it.
void DropCheckpoint(v1::Job* job, int64_t step, int64_t generation);

// What servers and workers have written of the job's checkpoints, as their
// reports said; kept by the coordinator in memory.
struct CheckpointReports {
  std::vector<std::vector<v1::CheckpointRecord>> by_server;  // by server index
  // By (step, generation): each worker's resume state, by worker index.
  std::map<std::pair<int64_t, int64_t>, std::map<uint32_t, v1::WorkerResumeState>> states;
};

// The newest checkpoint of the current generation, newer than the job's
// last, that every server has written and (sync) for which every worker of
// the generation gave its resume state; nullopt if there is none.
std::optional<v1::CheckpointRecord> NewlyComplete(const v1::Job& job,
                                                  const CheckpointReports& reports);

// Records a complete checkpoint in the job: kept with the workers' states,
// the oldest beyond the spec's `keep` dropped with theirs. (Both keep the
// job's last_checkpoint_step.)
void RecordCheckpoint(v1::Job* job, v1::CheckpointRecord record, const CheckpointReports& reports);

// Worker w's resume state at the step the current generation starts from;
// empty at step 0, and when the workers are not those of the generation
// that wrote the checkpoint (elastic: the batch was cut otherwise).
v1::WorkerResumeState ResumeStateOf(const v1::Job& job, int worker);

// The step of a checkpoint asked for now (psctl checkpoint): one that no
// chunk has reached when the nodes hear of it, the furthest worker's step
// plus what the job does in a few seconds. FAILED_PRECONDITION, naming the
// job, if it is not running, has no checkpoint.dir, is not sync (the others
// checkpoint every checkpoint.every_steps steps only) or ends before.
absl::StatusOr<int64_t> RequestedCheckpointStep(const v1::Job& job);

// The live server in worker `worker_id`'s process; null if none.
const NodeRegistry::Node* ColocatedServerOf(const NodeRegistry& registry,
                                            const std::string& worker_id);

// A live server of its own that holds no part of `job` and has `need`
// bytes of room, the one with the most; null if none, and for a colocated
// job (its servers are its workers').
const NodeRegistry::Node* SpareServer(const Txn& txn, const NodeRegistry& registry,
                                      const v1::Job& job, int64_t need);

// Looks at every running job's nodes, as `registry` knows them at `now` (by
// the registry's clock), and acts by the job's policy, in `txn`: a node
// whose id a new process took, or a lost node that is replaced (by a spare
// server, an idle worker), starts a new generation (from the latest
// complete checkpoint); a lost worker of an elastic job is left out of the
// next one, and an idle worker joins it; a server that could not load its
// checkpoint drops that checkpoint for an older one; a lost node that is
// not replaced in time, a lost worker under on_worker_loss: fail, or a
// server's error fails the job. Returns the jobs that start a new
// generation (the load failures reported of the old one are answered).
std::vector<std::string> RecoverJobs(Txn& txn, const NodeRegistry& registry, absl::Time now);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_RECOVERY_H_
