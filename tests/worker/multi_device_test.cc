// A node of K devices computes the node's step exactly, splits the batch
// evenly, and pushes a layer while earlier layers are still computing.
#include <algorithm>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/reducer.h"
#include "worker/in_process.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"
#include "worker/slice_layout.h"

namespace pstrain::testing {
namespace {

worker::DeviceList Cpus(int n) {
  worker::DeviceList list;
  for (int i = 0; i < n; ++i) list.indices.push_back(i);
  return list;
}

class MultiDeviceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { data_ = new DatasetCache; }
  static void TearDownTestSuite() { delete data_; }

  WorkersResult Train(const v1::JobSpec& spec, const RunOptions& run) {
    const v1::PartitionPlan plan = PlanFor(spec);
    InProcessServers servers(spec.num_servers());
    PSTRAIN_EXPECT_OK(servers.AddJob("job-md", spec, plan));
    WorkersResult result = RunWorkers("job-md", spec, plan, servers.addresses(), data_, run);
    PSTRAIN_EXPECT_OK(result.status);
    return result;
  }

  // Training with `a` and with `b` ends with bitwise the same parameters.
  void ExpectTheSameParameters(const v1::JobSpec& spec, const RunOptions& a,
                               const RunOptions& b) {
    const WorkersResult with_a = Train(spec, a);
    const WorkersResult with_b = Train(spec, b);
    PSTRAIN_ASSERT_OK(with_a.status);
    PSTRAIN_ASSERT_OK(with_b.status);
    EXPECT_EQ(with_a.params, with_b.params);
  }

  static DatasetCache* data_;
};

DatasetCache* MultiDeviceTest::data_ = nullptr;

TEST_F(MultiDeviceTest, KDevicesGiveTheParametersOfOne) {
  constexpr int kSteps = 20;
  for (int batch : {64, 30}) {  // 30 does not divide by 4: shares 8, 8, 7, 7
    const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, batch, 2, kSteps);
    const v1::PartitionPlan plan = PlanFor(spec);
    RunOptions one;
    one.devices = Cpus(1);
    const WorkersResult reference = Train(spec, one);
    for (int k : {2, 4}) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch << ", " << k << " devices");
      RunOptions run;
      run.devices = Cpus(k);
      const WorkersResult result = Train(spec, run);
      for (const TensorDiff& d : CompareTensors(plan, result.params, reference.params)) {
        EXPECT_LE(d.relative_l2, 1e-5) << d.name;
      }
      ASSERT_EQ(result.device_samples.size(), static_cast<size_t>(k));
      int64_t total = 0;
      for (int d = 0; d < k; ++d) {
        const int share = batch / k + (d < batch % k ? 1 : 0);
        EXPECT_EQ(result.device_samples[d], int64_t{kSteps} * share) << "device " << d;
        total += result.device_samples[d];
      }
      EXPECT_EQ(total, int64_t{kSteps} * batch);
    }
  }
}

// 3 micro-batches of 10 per worker, on 4 devices (shares 8, 8, 7, 7, each
// in 3 pieces reduced across the devices piece by piece), train what one
// device does with a batch of 30.
TEST_F(MultiDeviceTest, AccumulatedMicroBatchesOnKDevicesGiveOneBatch) {
  constexpr int kSteps = 20;
  const v1::JobSpec whole = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 30, 2, kSteps);
  v1::JobSpec accumulated = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 10, 2, kSteps);
  accumulated.set_accumulate_steps(3);
  RunOptions one;
  one.devices = Cpus(1);
  const WorkersResult reference = Train(whole, one);
  RunOptions four;
  four.devices = Cpus(4);
  const WorkersResult result = Train(accumulated, four);
  for (const TensorDiff& d : CompareTensors(PlanFor(whole), result.params, reference.params)) {
    EXPECT_LE(d.relative_l2, 1e-5) << d.name;
  }
  ASSERT_EQ(result.device_samples.size(), 4u);
  EXPECT_EQ(result.device_samples[0], int64_t{kSteps} * 8);
  EXPECT_EQ(result.device_samples[3], int64_t{kSteps} * 7);
}

// Without coalescing, the last layer's push starts before the first
// layer's backward is done.
TEST_F(MultiDeviceTest, PushesOverlapTheBackwardPass) {
  for (int k : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << k << " devices");
    const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.01f, 1, 64, 2, 3);
    absl::Mutex mu;
    std::vector<worker::StepEvent> events;
    RunOptions run;
    run.devices = Cpus(k);
    run.min_push_bytes = 0;
    run.trace = [&](const worker::StepEvent& e) {
      absl::MutexLock lock(&mu);
      if (e.device == 0) events.push_back(e);
    };
    Train(spec, run);
    const int last_layer = 2;  // 784-256-128-10
    auto index = [&](worker::StepEvent::Kind kind, int layer) {
      for (size_t i = 0; i < events.size(); ++i) {
        if (events[i].kind == kind && events[i].layer == layer) return static_cast<int>(i);
      }
      return -1;
    };
    const int push_last = index(worker::StepEvent::Kind::kPushStarted, last_layer);
    const int first_done = index(worker::StepEvent::Kind::kBackwardDone, 0);
    ASSERT_GE(push_last, 0);
    ASSERT_GE(first_done, 0);
    EXPECT_LT(push_last, first_done);
  }
}

// The next step's values reach each device a layer at a time, as its
// forward pass asks for them: every layer is loaded after the pass asked
// for it and before it asks for the next, so the pass computes the first
// layers while the later ones are still on their way.
TEST_F(MultiDeviceTest, TheForwardPassAwaitsEachLayerAsItReachesIt) {
  constexpr int kSteps = 3;
  const int num_layers = 3;  // 784-256-128-10
  for (int k : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << k << " devices");
    const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.01f, 1, 64, 2, kSteps);
    absl::Mutex mu;
    std::vector<std::vector<worker::StepEvent>> events(k);
    RunOptions run;
    run.devices = Cpus(k);
    run.trace = [&](const worker::StepEvent& e) {
      absl::MutexLock lock(&mu);
      if (e.kind == worker::StepEvent::Kind::kValuesAsked ||
          e.kind == worker::StepEvent::Kind::kValuesLoaded) {
        events[e.device].push_back(e);
      }
    };
    Train(spec, run);
    for (int device = 0; device < k; ++device) {
      int asked = -1;  // the layer last asked for
      std::vector<int> loads(num_layers);
      for (const worker::StepEvent& e : events[device]) {
        if (e.kind == worker::StepEvent::Kind::kValuesAsked) {
          asked = e.layer;
        } else {
          EXPECT_EQ(e.layer, asked) << "device " << device << ": a layer loaded before it was asked for";
          ++loads[e.layer];
        }
      }
      // Every step's but the first (its values come with the job's start).
      for (int l = 0; l < num_layers; ++l) {
        EXPECT_EQ(loads[l], kSteps - 1) << "device " << device << ", layer " << l;
      }
    }
  }
}

// Coalescing small pushes into fewer exchanges changes no bit of the
// result, on one device and on several.
TEST_F(MultiDeviceTest, CoalescedPushesGiveTheSameParameters) {
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 0.001f, 2, 32, 2, 4);
  for (int k : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << k << " devices");
    RunOptions each_layer;
    each_layer.devices = Cpus(k);
    each_layer.min_push_bytes = 0;
    RunOptions coalesced = each_layer;
    coalesced.min_push_bytes = int64_t{1} << 30;  // one push per step
    ExpectTheSameParameters(spec, each_layer, coalesced);
  }
}

// Sync training gives bitwise the same parameters over the same-machine
// socket, through shared memory and over direct TCP connections as over
// gRPC's TCP.
TEST_F(MultiDeviceTest, EveryTransportGivesTheParametersOfTcp) {
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 0.001f, 2, 32, 2, 6);
  RunOptions tcp;
  tcp.devices = Cpus(1);
  tcp.grpc.same_machine_sockets = false;
  tcp.grpc.shared_memory = false;
  tcp.grpc.direct_tcp = false;
  RunOptions same_machine = tcp;
  same_machine.grpc.same_machine_sockets = true;
  ExpectTheSameParameters(spec, tcp, same_machine);
  RunOptions shared_memory = tcp;
  shared_memory.grpc.shared_memory = true;
  ExpectTheSameParameters(spec, tcp, shared_memory);
  RunOptions direct_tcp = tcp;
  direct_tcp.grpc.direct_tcp = true;
  ExpectTheSameParameters(spec, tcp, direct_tcp);
}

// Reduce-scatter and all-gather over padded, chunk-aligned slices of sizes
// that do not divide by K, against a plain sum.
TEST(SliceLayoutTest, ReduceScatterAndAllGatherMatchAPlainSum) {
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.01f, 1, 8, 3, 1, /*chunk_bytes=*/4004);
  const v1::PartitionPlan plan = PlanFor(spec);
  const int64_t n = plan.total_floats();
  auto device = kernels::CreateCpuDevice(0);
  for (int k_ranks : {1, 2, 3, 4}) {
    for (const auto& [first, last] :
         std::vector<std::pair<int, int>>{{0, plan.chunks_size()}, {0, 1}, {3, 9}}) {
      SCOPED_TRACE(::testing::Message() << k_ranks << " ranks, chunks " << first << ".." << last);
      const worker::SliceLayout layout = worker::SliceLayout::Create(plan, first, last, k_ranks);
      ASSERT_EQ(layout.slices.size(), static_cast<size_t>(k_ranks));
      // Slices tile the chunk range, whole chunks each.
      int next = first;
      for (const auto& s : layout.slices) {
        EXPECT_EQ(s.first_chunk, next);
        EXPECT_LE(s.floats, layout.slice_floats);
        next = s.last_chunk;
      }
      EXPECT_EQ(next, last);

      std::mt19937 rng(k_ranks * 100 + first);
      std::uniform_real_distribution<float> u(-1, 1);
      std::vector<std::vector<float>> grads(k_ranks, std::vector<float>(n));
      std::vector<float> sum(n, 0.0f);
      for (int r = 0; r < k_ranks; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          grads[r][i] = u(rng);
          sum[i] += grads[r][i];
        }
      }
      auto reducer = *kernels::CreateCpuReducer(k_ranks);
      std::vector<std::vector<float>> reduced(k_ranks, std::vector<float>(n, NAN));
      std::vector<std::vector<float>> gathered(k_ranks, std::vector<float>(n, NAN));
      std::vector<std::thread> threads;
      for (int r = 0; r < k_ranks; ++r) {
        threads.emplace_back([&, r] {
          std::vector<float> send(layout.padded_floats(), 0.0f), recv(layout.slice_floats);
          PSTRAIN_ASSERT_OK(layout.Pack(*device, grads[r].data(), send.data()));
          PSTRAIN_ASSERT_OK(
              reducer->ReduceScatter(r, send.data(), recv.data(), layout.slice_floats));
          PSTRAIN_ASSERT_OK(layout.UnpackSlice(*device, r, recv.data(), reduced[r].data()));
          // All-gather this rank's reduced slice back to everyone.
          std::vector<float> all(layout.padded_floats());
          PSTRAIN_ASSERT_OK(reducer->AllGather(r, recv.data(), all.data(), layout.slice_floats));
          for (int s = 0; s < k_ranks; ++s) {
            PSTRAIN_ASSERT_OK(layout.UnpackSlice(*device, s, all.data() + s * layout.slice_floats,
                                                 gathered[r].data()));
          }
        });
      }
      for (std::thread& t : threads) t.join();
      for (int r = 0; r < k_ranks; ++r) {
        const auto& s = layout.slices[r];
        for (int64_t i = s.flat_offset; i < s.flat_offset + s.floats; ++i) {
          ASSERT_NEAR(reduced[r][i], sum[i], 1e-5) << "rank " << r << " float " << i;
        }
        for (const auto& slice : layout.slices) {
          for (int64_t i = slice.flat_offset; i < slice.flat_offset + slice.floats; ++i) {
            ASSERT_NEAR(gathered[r][i], sum[i], 1e-5) << "rank " << r << " float " << i;
          }
        }
      }
    }
  }
}

TEST(CpuReducerTest, AnAbortReleasesRanksThatWait) {
  auto reducer = *kernels::CreateCpuReducer(2, std::chrono::seconds(60));
  std::vector<float> send(4, 1.0f), recv(2);
  absl::Status status;
  std::thread waiting([&] { status = reducer->ReduceScatter(0, send.data(), recv.data(), 2); });
  reducer->Abort();
  waiting.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
}

// Skipped without a GPU.
TEST_F(MultiDeviceTest, AnMlpTrainedOnAGpuReachesTheCpusAccuracy) {
  if (absl::StatusOr<int> gpus = kernels::CudaDeviceCount(); !gpus.ok()) {
    GTEST_SKIP() << "no GPU: " << gpus.status().message();
  }
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 1, 64, 1, 300);
  const std::shared_ptr<const Dataset> test = *data_->FashionMnist(kFashionDir, false);
  RunOptions cpu;
  cpu.devices = Cpus(1);
  RunOptions gpu;
  gpu.devices = *worker::ParseDevices("cuda:0");
  const double cpu_accuracy = worker::Evaluate(spec, Train(spec, cpu).params, *test)->accuracy;
  const double gpu_accuracy = worker::Evaluate(spec, Train(spec, gpu).params, *test)->accuracy;
  EXPECT_GT(cpu_accuracy, 0.75);
  EXPECT_NEAR(gpu_accuracy, cpu_accuracy, 0.01);
}

TEST(DevicesTest, ParsesAndRejects) {
  EXPECT_EQ(worker::ParseDevices("cpu:4")->indices.size(), 4u);
  EXPECT_EQ(worker::ParseDevices("cuda:0,cuda:1")->kind, worker::DeviceList::Kind::kCuda);
  for (const char* bad : {"", "gpu:0", "cpu:0", "cpu", "cpu:x", "cuda:0,cuda:0", "cpu:2,cuda:0",
                          "cuda:-1", "cpu:1,cpu:2"}) {
    EXPECT_FALSE(worker::ParseDevices(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace pstrain::testing
