// What the fuzz targets share (fuzz_init.cc, linked into each, quiets the
// logs: errors logged for bad input would flood the run).
#ifndef PSTRAIN_TESTS_FUZZ_FUZZ_UTIL_H_
#define PSTRAIN_TESTS_FUZZ_FUZZ_UTIL_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/file_format.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "glog/logging.h"
#include "kernels/model.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::fuzz {


// `bytes` with its trailing CRC-32 (over everything before it) made right,
// so that mutations reach the parser behind the checksum.
inline std::string WithTrailingCrc(std::string bytes) {
  if (bytes.size() < 4) return bytes;
  bytes.resize(bytes.size() - 4);
  PutU32(bytes, Crc32(bytes.data(), bytes.size()));
  return bytes;
}

// Server 0's assignment of a small MLP job (2 servers, 2 workers named
// worker-0 and worker-1) in `mode`, with `extra` YAML appended to its spec.
inline v1::ServerAssignment SmallJobAssignment(const std::string& job_id, const char* mode,
                                               const std::string& extra = "") {
  absl::StatusOr<v1::JobSpec> spec =
      ParseJobSpecYaml(absl::StrCat("model: {type: mlp, hidden: [4]}\n"
                                    "optimizer: {type: adam, learning_rate: 0.01}\n"
                                    "mode: ",
                                    mode, "\n",
                                    "batch_size: 8\nsteps: 4\nnum_servers: 2\nnum_workers: "
                                    "2\nchunk_bytes: 4096\n",
                                    extra));
  CHECK(spec.ok()) << spec.status();
  absl::StatusOr<v1::PartitionPlan> plan = ComputePartitionPlan(
      kernels::ModelTensors(ModelShapeOf(*spec)), spec->chunk_bytes(), spec->num_servers());
  CHECK(plan.ok()) << plan.status();
  v1::ServerAssignment a;
  a.set_job_id(job_id);
  a.set_server_index(0);
  *a.mutable_spec() = *spec;
  *a.mutable_plan() = *plan;
  a.set_generation(1);
  a.set_num_workers(2);
  a.add_worker_nodes("worker-0");
  a.add_worker_nodes("worker-1");
  return a;
}

// An external model of 3 floats with two embedding tables (dims 2 and 3),
// one server and two workers (worker-0, worker-1), in `mode`: every key is
// this server's.
inline v1::ServerAssignment SparseJobAssignment(const std::string& job_id, const char* mode) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(absl::StrCat(
      "model: {type: external, tensors: [{name: w, shape: [3]}]}\n"
      "optimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\nsteps: 4\n"
      "num_servers: 1\nnum_workers: 2\nmode: ",
      mode,
      "\ntables:\n"
      "  - {name: a, dim: 2, admission: {min_count: 2, filter_counters: 16}}\n"
      "  - {name: b, dim: 3, optimizer: {type: adam}, eviction: {ttl_steps: 2}}\n"));
  CHECK(spec.ok()) << spec.status();
  spec = NormalizeJobSpec(*spec);
  CHECK(spec.ok()) << spec.status();
  absl::StatusOr<v1::PartitionPlan> plan =
      ComputePartitionPlan(JobTensors(*spec), spec->chunk_bytes(), spec->num_servers());
  CHECK(plan.ok()) << plan.status();
  v1::ServerAssignment a;
  a.set_job_id(job_id);
  *a.mutable_spec() = *spec;
  *a.mutable_plan() = *plan;
  a.set_generation(1);
  a.set_num_workers(2);
  a.add_worker_nodes("worker-0");
  a.add_worker_nodes("worker-1");
  return a;
}

}  // namespace pstrain::fuzz

#endif  // PSTRAIN_TESTS_FUZZ_FUZZ_UTIL_H_
