// apply: the server's hot path — W workers' pushes of a large model summed
// and the optimizer's update applied, through the real shard store — against
// memcpy in the same run, bytes counted the same way on both sides.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/chunk_codec.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/shard_store.h"

namespace pstrain::bench {
namespace {

constexpr double kMiB = 1 << 20;
// gRPC hands a received message over in slices of one HTTP/2 DATA frame
// (16 KiB by default): the values of a payload split at odd bytes.
constexpr size_t kReceivedSliceBytes = 16384;

// A push frame cut the way a network read leaves it; the slices point into
// the gradient (no copy).
Frame ReceivedFrame(const v1::ChunkHeader& header, const std::shared_ptr<std::vector<float>>& grad,
                    int64_t offset) {
  const grpc::ByteBuffer encoded = EncodeFrameShared(header, grad->data() + offset, grad);
  std::vector<grpc::Slice> slices;
  CHECK(encoded.Dump(&slices).ok());
  std::vector<grpc::Slice> cut = {slices[0]};
  size_t message_bytes = slices[0].size();
  for (size_t i = 1; i < slices.size(); ++i) {
    for (size_t at = 0; at < slices[i].size();) {
      const size_t take = std::min(kReceivedSliceBytes - message_bytes % kReceivedSliceBytes,
                                   slices[i].size() - at);
      cut.push_back(slices[i].sub(at, at + take));
      at += take;
      message_bytes += take;
    }
  }
  absl::StatusOr<Frame> frame = Frame::Parse(grpc::ByteBuffer(cut.data(), cut.size()));
  CHECK(frame.ok()) << frame.status();
  return *std::move(frame);
}

struct OptimizerCase {
  const char* name;
  v1::OptimizerType type;
  float momentum;
  int state_arrays;  // optimizer state read and written per parameter
};

// Bytes per second of memcpy over `bytes`, counted as read + write.
double MemcpyRate(size_t bytes, int reps) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::memcpy(to.data(), from.data(), bytes);  // first touch
  const absl::Time start = absl::Now();
  for (int r = 0; r < reps; ++r) {
    from[r] = static_cast<char>(r);
    std::memcpy(to.data(), from.data(), bytes);
  }
  return 2.0 * bytes * reps / SecondsSince(start);
}

// Seconds per step of W workers' pushes of every chunk through the store,
// their step ends already in: the last push of each chunk sums the W
// gradients and applies the update.
absl::StatusOr<double> ApplySeconds(const v1::JobSpec& spec, const v1::PartitionPlan& plan,
                                    int steps) {
  server::ShardStore store({});
  v1::ServerAssignment a;
  a.set_job_id("bench");
  *a.mutable_spec() = spec;
  *a.mutable_plan() = plan;
  PSTRAIN_RETURN_IF_ERROR(store.AddJob(a));
  const int workers = spec.num_workers();
  std::vector<std::shared_ptr<std::vector<float>>> grads;
  for (int w = 0; w < workers; ++w) {
    grads.push_back(std::make_shared<std::vector<float>>(plan.total_floats(), 1e-3f * (w + 1)));
  }
  double seconds = 0;
  for (int step = 0; step <= steps; ++step) {
    std::vector<Frame> frames;
    for (int w = 0; w < workers; ++w) {
      for (const v1::ChunkInfo& c : plan.chunks()) {
        v1::ChunkHeader h;
        h.set_kind(v1::FRAME_KIND_PUSH);
        h.set_job_id("bench");
        h.set_worker(w);
        h.set_step(step);
        h.set_version(step);
        h.set_chunk(c.id());
        h.set_dtype(v1::DTYPE_FP32);
        h.set_num_elements(static_cast<uint32_t>(c.size()));
        frames.push_back(ReceivedFrame(h, grads[w], c.offset()));
      }
    }
    // The step ends first: the timed pushes apply the step themselves.
    for (int w = 0; w < workers; ++w) {
      v1::ChunkHeader h;
      h.set_kind(v1::FRAME_KIND_STEP_END);
      h.set_job_id("bench");
      h.set_worker(w);
      h.set_step(step);
      h.set_chunk(plan.chunks(0).id());
      h.set_gradient_max_abs(1e-3f * (w + 1));
      PSTRAIN_RETURN_IF_ERROR(store.EndStep(h));
    }
    const absl::Time start = absl::Now();
    for (Frame& f : frames) PSTRAIN_RETURN_IF_ERROR(store.Push(std::move(f), nullptr));
    if (step > 0) seconds += SecondsSince(start);  // step 0 touches the memory first
  }
  return seconds / steps;
}

}  // namespace

int RunApplyBench(const ApplyBenchOptions& options) {
  const int64_t floats = static_cast<int64_t>(options.mib * kMiB / 4);
  Table table("apply", {"optimizer", "workers", "MiB", "GiB/s", "memcpy_GiB/s", "ratio"});
  const OptimizerCase cases[] = {{"sgd", v1::OPTIMIZER_TYPE_SGD, 0, 0},
                                 {"momentum", v1::OPTIMIZER_TYPE_SGD, 0.9f, 1},
                                 {"adam", v1::OPTIMIZER_TYPE_ADAM, 0, 2}};
  for (const OptimizerCase& c : cases) {
    for (int workers : options.workers) {
      v1::JobSpec spec = JobOfSize(floats, 1, workers, options.chunk_bytes);
      spec.mutable_optimizer()->set_type(c.type);
      spec.mutable_optimizer()->set_momentum(c.momentum);
      const v1::PartitionPlan plan = PlanOf(spec);
      const double n_bytes = 4.0 * plan.total_floats();
      absl::StatusOr<double> seconds = ApplySeconds(spec, plan, options.steps);
      if (!seconds.ok()) {
        LOG(ERROR) << "apply " << c.name << ": " << seconds.status();
        return 1;
      }
      // Read every worker's gradient; read and write the parameters and
      // each state array.
      const double rate = (workers + 2 + 2 * c.state_arrays) * n_bytes / *seconds;
      // memcpy measured beside each row: the machine's bandwidth right now.
      const double memcpy_rate = MemcpyRate(static_cast<size_t>(n_bytes), options.steps);
      table.Add(Table::Row()
                    .Text(c.name)
                    .Int(workers)
                    .Number(n_bytes / kMiB, 1)
                    .Number(rate / (1 << 30), 2)
                    .Number(memcpy_rate / (1 << 30), 2)
                    .Number(rate / memcpy_rate, 3));
    }
  }
  return 0;
}

}  // namespace pstrain::bench
