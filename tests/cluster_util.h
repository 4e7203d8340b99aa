// In-process clusters for tests: parameter servers serving real gRPC on
// 127.0.0.1 ports picked by the kernel, and workers as threads.
#ifndef PSTRAIN_TESTS_CLUSTER_UTIL_H_
#define PSTRAIN_TESTS_CLUSTER_UTIL_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/dataset.h"
#include "kernels/model.h"
#include "pstrain/v1/job.pb.h"
#include "server/parameter_server.h"
#include "tests/test_util.h"
#include "worker/parameter_client.h"
#include "worker/trainer.h"
#include "worker/transport.h"

namespace pstrain::testing {

// A normalized spec for the example MLP (784-256-128-10) with the given
// optimizer, sizes and steps.
v1::JobSpec MlpSpec(v1::OptimizerType optimizer, float learning_rate, int workers, int batch,
                    int servers, int64_t steps, int64_t chunk_bytes = 65536);

v1::PartitionPlan PlanFor(const v1::JobSpec& spec);

class InProcessServers {
 public:
  explicit InProcessServers(int n, server::ShardStore::Options store = {},
                            server::ClientLimits client_limits = {});
  ~InProcessServers();

  // Adds the job to every server (server i holds the chunks of index i),
  // at the generation and from the checkpoint that `start` names (its
  // generation, restore_step and restore_generation).
  absl::Status AddJob(const std::string& job_id, const v1::JobSpec& spec,
                      const v1::PartitionPlan& plan, const v1::ServerAssignment& start = {});
  std::vector<std::string> addresses() const;
  server::ParameterServer& server(int i) { return *servers_[i]; }
  // The whole flat parameter space as the servers hold it.
  std::vector<float> Gather(const std::string& job_id, const v1::PartitionPlan& plan);

 private:
  std::vector<std::unique_ptr<server::ParameterServer>> servers_;
};

struct WorkersResult {
  absl::Status status;                  // first failure, or OK
  std::vector<float> params;            // worker 0's final parameters
  std::vector<int64_t> steps_done;      // per worker
  std::vector<worker::ParameterClient::Stats> stats;
  std::vector<int64_t> device_samples;  // worker 0, per device
};

struct RunOptions {
  // Worker w uses make_transport(w) (owned by the caller) instead of gRPC.
  std::function<worker::ParameterTransport*(int)> make_transport;
  // The devices of every worker.
  worker::DeviceList devices;
  // Worker 0's step events.
  std::function<void(const worker::StepEvent&)> trace;
  // The workers' TrainerOptions::min_push_bytes.
  int64_t min_push_bytes = worker::TrainerOptions().min_push_bytes;
  // The gRPC transports' channels and window (without make_transport).
  worker::GrpcTransportOptions grpc;
  // The parameter clients' ParameterClient::Options::bytes_per_stream.
  int64_t bytes_per_stream = worker::ParameterClient::Options().bytes_per_stream;
  // The generation the workers run in, and its first step.
  int64_t generation = 0;
  int64_t resume_step = 0;
  // Where every worker counts (the workers' series add up), if set.
  worker::WorkerMetrics* metrics = nullptr;
};

// Runs spec.num_workers() trainers as threads until they finish.
WorkersResult RunWorkers(const std::string& job_id, const v1::JobSpec& spec,
                         const v1::PartitionPlan& plan, const std::vector<std::string>& addresses,
                         DatasetCache* data, const RunOptions& run = {});

// The shared-memory regions (common/direct_connection.h) mapped into process
// `pid` (0: this one) now: a connection maps its region once on each side.
int SharedMemoryMappings(int pid = 0);

// Established TCP connections of this process's sockets with `port` at
// either end: a connection between two sockets of the process counts
// twice.
int EstablishedTcpConnections(int port);

// Per tensor differences of `actual` against `expected`.
std::vector<TensorDiff> CompareTensors(const v1::PartitionPlan& plan,
                                       const std::vector<float>& actual,
                                       const std::vector<float>& expected);

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_CLUSTER_UTIL_H_
