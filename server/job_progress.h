// How workers' reports become a job's progress and result. Pure functions
// on the job's record.
#ifndef PSTRAIN_SERVER_JOB_PROGRESS_H_
#define PSTRAIN_SERVER_JOB_PROGRESS_H_

#include <string>

#include "google/protobuf/map.h"
#include "pstrain/v1/control.pb.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::server {

// Applies worker r.worker()'s report to a running job: the worker's step
// (never backwards), loss, throughput, script metrics (the latest value of
// each name) and, once finished, its train time
// and step times; then the job's progress: the slowest worker's step, the
// mean of the workers' latest losses and their summed throughput, the mean
// script metrics; and, if
// the report evaluated the model, the job's test results. The caller has
// checked that the report comes from the job's worker.
void ApplyProgressReport(const v1::ReportProgressRequest& r, v1::Job* job);

// The job's script metrics: of each name, the mean over the workers that
// gave it of their latest values (in worker order: the same reports give
// the same bits).
google::protobuf::Map<std::string, double> MeanScriptMetrics(const v1::Job& job);

// Whether every worker of the job has finished.
bool AllWorkersFinished(const v1::Job& job);

// The result of a job whose workers have all finished: steps, the slowest
// worker's train time, samples per second over all workers, the mean final
// loss, the mean step times and script metrics; the test results already
// reported are kept.
v1::JobResult CompletedResult(const v1::Job& job);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_JOB_PROGRESS_H_
