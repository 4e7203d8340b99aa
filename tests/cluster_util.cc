#include "tests/cluster_util.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "worker/trainer.h"

namespace pstrain::testing {

v1::JobSpec MlpSpec(v1::OptimizerType optimizer, float learning_rate, int workers, int batch,
                    int servers, int64_t steps, int64_t chunk_bytes) {
  v1::JobSpec spec;
  spec.set_name("test");
  spec.mutable_model()->set_type(v1::MODEL_TYPE_MLP);
  spec.mutable_model()->add_hidden(256);
  spec.mutable_model()->add_hidden(128);
  spec.mutable_data()->set_dir(kFashionDir);
  spec.mutable_optimizer()->set_type(optimizer);
  spec.mutable_optimizer()->set_learning_rate(learning_rate);
  spec.set_mode(v1::MODE_SYNC);
  spec.set_batch_size(batch);
  spec.set_steps(steps);
  spec.set_num_servers(servers);
  spec.set_num_workers(workers);
  spec.set_chunk_bytes(chunk_bytes);
  spec.set_seed(11);
  absl::StatusOr<v1::JobSpec> normalized = NormalizeJobSpec(spec);
  PSTRAIN_EXPECT_OK(normalized);
  return *normalized;
}

v1::PartitionPlan PlanFor(const v1::JobSpec& spec) {
  absl::StatusOr<v1::PartitionPlan> plan = ComputePartitionPlan(
      JobTensors(spec), spec.chunk_bytes(), spec.num_servers());
  PSTRAIN_EXPECT_OK(plan);
  return *plan;
}

InProcessServers::InProcessServers(int n, server::ShardStore::Options store,
                                   server::ClientLimits client_limits) {
  for (int i = 0; i < n; ++i) {
    server::ParameterServer::Options options;
    options.store = store;
    options.client_limits = client_limits;
    absl::StatusOr<std::unique_ptr<server::ParameterServer>> s =
        server::ParameterServer::Create(options);
    PSTRAIN_EXPECT_OK(s);
    servers_.push_back(std::move(*s));
  }
}

InProcessServers::~InProcessServers() {
  for (auto& s : servers_) s->Shutdown(absl::Seconds(1));
}

absl::Status InProcessServers::AddJob(const std::string& job_id, const v1::JobSpec& spec,
                                      const v1::PartitionPlan& plan,
                                      const v1::ServerAssignment& start) {
  for (size_t i = 0; i < servers_.size(); ++i) {
    v1::ServerAssignment a = start;
    a.set_job_id(job_id);
    a.set_server_index(i);
    *a.mutable_spec() = spec;
    *a.mutable_plan() = plan;
    if (absl::Status s = servers_[i]->store().AddJob(a); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<std::string> InProcessServers::addresses() const {
  std::vector<std::string> out;
  for (const auto& s : servers_) out.push_back(s->address());
  return out;
}

std::vector<float> InProcessServers::Gather(const std::string& job_id,
                                            const v1::PartitionPlan& plan) {
  std::vector<float> params(plan.total_floats(), NAN);
  for (const v1::ChunkInfo& c : plan.chunks()) {
    absl::StatusOr<server::ShardStore::ChunkSnapshot> snap =
        servers_[c.server()]->store().ReadChunk(job_id, c.id());
    PSTRAIN_EXPECT_OK(snap);
    if (!snap.ok()) continue;
    std::copy(snap->values.begin(), snap->values.end(), params.begin() + c.offset());
  }
  return params;
}

WorkersResult RunWorkers(const std::string& job_id, const v1::JobSpec& spec,
                         const v1::PartitionPlan& plan, const std::vector<std::string>& addresses,
                         DatasetCache* data, const RunOptions& run) {
  const int workers = spec.num_workers();
  WorkersResult result;
  result.steps_done.resize(workers);
  result.stats.resize(workers);
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      worker::TrainerOptions options;
      options.assignment.set_job_id(job_id);
      options.assignment.set_worker_index(w);
      options.assignment.set_generation(run.generation);
      options.assignment.set_resume_step(run.resume_step);
      *options.assignment.mutable_spec() = spec;
      *options.assignment.mutable_plan() = plan;
      for (const std::string& a : addresses) options.assignment.add_server_addresses(a);
      options.data = data;
      if (run.make_transport) {
        worker::ParameterTransport* transport = run.make_transport(w);
        options.transport = [transport](int) { return transport; };
      }
      options.devices = run.devices;
      options.make_transport = worker::GrpcTransportFactory(run.grpc);
      if (w == 0) options.trace = run.trace;
      options.min_push_bytes = run.min_push_bytes;
      options.metrics = run.metrics;
      options.client.retry = options.client.retry.WithPatience(absl::Seconds(30));
      options.client.bytes_per_stream = run.bytes_per_stream;
      absl::StatusOr<std::unique_ptr<worker::Trainer>> trainer =
          worker::Trainer::Create(std::move(options));
      absl::Status status = trainer.ok() ? (*trainer)->Run() : trainer.status();
      absl::MutexLock lock(&mu);
      if (!status.ok() && result.status.ok()) result.status = status;
      if (trainer.ok()) {
        result.steps_done[w] = (*trainer)->steps_done();
        result.stats[w] = (*trainer)->client_stats();
        if (w == 0) {
          result.params = (*trainer)->params();
          for (size_t k = 0; k < std::max<size_t>(1, run.devices.indices.size()); ++k) {
            result.device_samples.push_back((*trainer)->samples_processed(static_cast<int>(k)));
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return result;
}

int SharedMemoryMappings(int pid) {
  std::ifstream maps(pid == 0 ? std::string("/proc/self/maps")
                              : absl::StrCat("/proc/", pid, "/maps"));
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    n += line.find("/memfd:pstrain-shm") != std::string::npos;
  }
  return n;
}

int EstablishedTcpConnections(int port) {
  // This process's sockets, by inode: another process's connection whose
  // ephemeral port happens to be `port` (ctest runs tests side by side) is
  // not counted.
  std::set<std::string> own_sockets;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(fd.path(), error).string();
    if (!error && absl::StartsWith(target, "socket:[") && absl::EndsWith(target, "]")) {
      own_sockets.insert(target.substr(8, target.size() - 9));
    }
  }
  int n = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream lines(table);
    std::string line;
    std::getline(lines, line);  // the heading
    while (std::getline(lines, line)) {
      // "  0: 0100007F:A1B2 0100007F:C3D4 01 ... INODE ...": local, remote,
      // state (01: ESTABLISHED), and the socket's inode tenth.
      std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.size() < 10 || fields[3] != "01" || !own_sockets.contains(fields[9])) continue;
      for (int f : {1, 2}) {
        const std::string& address = fields[f];
        int at = 0;
        if (const size_t colon = address.rfind(':'); colon != std::string::npos &&
            absl::SimpleHexAtoi(address.substr(colon + 1), &at) && at == port) {
          ++n;
        }
      }
    }
  }
  return n;
}

std::vector<TensorDiff> CompareTensors(const v1::PartitionPlan& plan,
                                       const std::vector<float>& actual,
                                       const std::vector<float>& expected) {
  std::vector<TensorDiff> diffs;
  for (const v1::TensorInfo& t : plan.tensors()) {
    TensorDiff d;
    d.name = t.name();
    double diff2 = 0, norm2 = 0;
    for (int64_t i = t.offset(); i < t.offset() + t.size(); ++i) {
      const double delta = static_cast<double>(actual[i]) - expected[i];
      diff2 += delta * delta;
      norm2 += static_cast<double>(expected[i]) * expected[i];
      d.max_abs = std::max(d.max_abs, std::abs(delta));
    }
    d.relative_l2 = std::sqrt(diff2) / std::max(std::sqrt(norm2), 1e-30);
    diffs.push_back(d);
  }
  return diffs;
}

}  // namespace pstrain::testing
