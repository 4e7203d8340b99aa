// What the data-plane benchmarks share (transport_bench.cc): the servers of
// a configuration in a process of their own, and the plain-socket baseline.
#ifndef PSTRAIN_BENCH_TRANSPORT_UTIL_H_
#define PSTRAIN_BENCH_TRANSPORT_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::bench {

// A configuration's servers, in a process of their own (transport_servers).
class ServerProcess {
 public:
  // pstrain's servers of the job, or (echo) as many plain gRPC echo servers;
  // with table_dim, of the sparse bench's job (SparseJobOf).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const v1::JobSpec& spec,
                                                              int64_t floats, int64_t chunk_bytes,
                                                              bool echo = false,
                                                              int table_dim = 0);
  ~ServerProcess();
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  explicit ServerProcess(std::string dir) : dir_(std::move(dir)) {}
  std::string address_file() const { return dir_ + "/addresses"; }

  const std::string dir_;
  pid_t pid_ = -1;
  std::vector<std::string> addresses_;
};

// One worker's step `step` of a benchmark (steps count from 0).
using BenchStep = std::function<absl::Status(int64_t step)>;

// Sync steps of `workers` threads, each running the step `make_step` gives
// it (which owns that worker's clients): `warm_steps` untimed ones, then
// steps for `duration` from the moment the last worker is warm. Worker 0
// watches the clock and names the last step; the others cannot be past it
// then (their step needs its push). Returns the timed part's seconds;
// *timed_steps: each worker's steps in it.
absl::StatusOr<double> RunTimedSteps(
    int workers, int warm_steps, absl::Duration duration,
    const std::function<absl::StatusOr<BenchStep>(int worker)>& make_step, int64_t* timed_steps);

// The same pattern over plain sockets of `family`: every worker connects to
// every server; per step each connection sends the server's share of the
// model while it reads as many bytes back, which the server echoes as they
// come; for `duration`. With `plain_server`, a plain parameter server
// instead: the server applies what it reads before it echoes it (Echo)
// and the worker scans its gradient's largest magnitude each step, as
// pstrain's sync step needs (the values arrive straight in its
// parameters). Returns bytes moved per second.
absl::StatusOr<double> RawSocketRate(int family, const std::vector<int64_t>& share_bytes,
                                     int workers, absl::Duration duration,
                                     bool plain_server = false);

}  // namespace pstrain::bench

#endif  // PSTRAIN_BENCH_TRANSPORT_UTIL_H_
