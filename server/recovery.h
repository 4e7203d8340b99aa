// How a running job goes on after the loss of a node: generations, and the
// checkpoints they start from. Pure functions on the job's record, so that
// each rule is tested on its own; the coordinator decides when to call them
// (coordinator.cc, RecoverJobs).
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

#include "pstrain/v1/control.pb.h"

namespace pstrain::server {

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

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_RECOVERY_H_
