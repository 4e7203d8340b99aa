// Every CUDA kernel against its CPU twin. Skipped where there is no GPU;
// the test that needs none checks that the lack of one is reported clearly.
#include <cmath>
#include <random>

#include <string>
#include "gtest/gtest.h"
#include "kernels/click_model.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/device.h"
#include "kernels/reducer.h"

namespace pstrain::kernels {
namespace {

#define SKIP_WITHOUT_GPU()                                                      \
  do {                                                                          \
    absl::StatusOr<int> gpus = CudaDeviceCount();                               \
    if (!gpus.ok()) GTEST_SKIP() << "no GPU: " << gpus.status().message();      \
  } while (0)

TEST(CudaTest, NoGpuIsSaidClearlyAndCpuDevicesStillWork) {
  absl::StatusOr<int> gpus = CudaDeviceCount();
  if (gpus.ok()) GTEST_SKIP() << "this machine has " << *gpus << " GPU(s)";
  EXPECT_EQ(gpus.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(gpus.status().message()).find("CUDA"), std::string::npos)
      << gpus.status();
  absl::StatusOr<std::unique_ptr<Device>> gpu = CreateCudaDevice(0);
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(CreateNcclReducer({0}).ok());
  std::unique_ptr<Device> cpu = CreateCpuDevice(0);
  EXPECT_TRUE(cpu->CreateModelKernels({4, {3}, 2}, 2, Precision::kFp32).ok());
}

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double RelativeL2(const float* a, const float* b, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// A buffer on the GPU filled from the host.
template <typename T>
DeviceBuffer Upload(Device& gpu, const std::vector<T>& host) {
  DeviceBuffer b = *gpu.Allocate(host.size() * sizeof(T));
  EXPECT_TRUE(gpu.CopyToDevice(b.as<void>(), host.data(), host.size() * sizeof(T)).ok());
  return b;
}

template <typename T>
std::vector<T> Download(Device& gpu, const DeviceBuffer& b, size_t n) {
  std::vector<T> host(n);
  EXPECT_TRUE(gpu.CopyToHost(host.data(), b.as<void>(), n * sizeof(T)).ok());
  return host;
}

struct PrecisionCase {
  Precision precision;
  double gradient_tolerance;  // per-tensor relative L2 against the CPU twin
};

// The GPU's gradients, loss and evaluation against the CPU twin's (at the
// same precision: the same roundings of the products' inputs) for a shape,
// every tensor within `tolerance` (relative L2), every layer announced
// once, the last first.
void ExpectGpuMatchesCpu(const ModelShape& shape, int batch, Precision precision,
                         double tolerance) {
  const int64_t n = NumParams(shape);
  std::vector<float> params(n);
  InitParams(shape, 7, 0, n, params.data());
  const std::vector<float> x = Random(static_cast<size_t>(batch) * shape.input_dim, 3, 0.5f);
  std::vector<int32_t> y(batch);
  for (int i = 0; i < batch; ++i) y[i] = i % shape.num_classes;

  auto cpu = *CreateCpuModelKernels(shape, batch, precision);
  std::vector<float> cpu_grad(n);
  BatchStats cpu_stats;
  ASSERT_TRUE(cpu->ForwardBackward(params.data(), x.data(), y.data(), batch, 1.0f / batch,
                                   cpu_grad.data(), &cpu_stats)
                  .ok());

  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  absl::StatusOr<std::unique_ptr<ModelKernels>> created =
      gpu->CreateModelKernels(shape, batch, precision);
  ASSERT_TRUE(created.ok()) << created.status();
  ModelKernels& kernels = **created;
  DeviceBuffer p = Upload(*gpu, params), dx = Upload(*gpu, x), dy = Upload(*gpu, y);
  DeviceBuffer g = *gpu->Allocate(n * sizeof(float));
  BatchStats gpu_stats;
  std::vector<int> ready;
  ASSERT_TRUE(kernels.ForwardBackward(p.as<float>(), dx.as<float>(), dy.as<int32_t>(), batch,
                                      1.0f / batch, g.as<float>(), &gpu_stats,
                                      [&](int layer, int64_t) { ready.push_back(layer); })
                  .ok());
  std::vector<int> expected;
  for (int l = static_cast<int>(ModelTensors(shape).size() / 2) - 1; l >= 0; --l) {
    expected.push_back(l);
  }
  EXPECT_EQ(ready, expected);
  const std::vector<float> gpu_grad = Download<float>(*gpu, g, n);
  for (const TensorDesc& t : ModelTensors(shape)) {
    EXPECT_LE(RelativeL2(gpu_grad.data() + t.offset, cpu_grad.data() + t.offset, t.size),
              tolerance)
        << t.name;
  }
  EXPECT_NEAR(gpu_stats.loss_sum, cpu_stats.loss_sum, tolerance * 10 * cpu_stats.loss_sum);
  EXPECT_NEAR(gpu_stats.correct, cpu_stats.correct, batch / 20);

  BatchStats eval_cpu, eval_gpu;
  ASSERT_TRUE(cpu->Evaluate(params.data(), x.data(), y.data(), batch, &eval_cpu).ok());
  ASSERT_TRUE(
      kernels.Evaluate(p.as<float>(), dx.as<float>(), dy.as<int32_t>(), batch, &eval_gpu).ok());
  EXPECT_NEAR(eval_gpu.loss_sum, eval_cpu.loss_sum, tolerance * 10 * eval_cpu.loss_sum);
}

class CudaMlpTest : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(CudaMlpTest, ForwardBackwardMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  ExpectGpuMatchesCpu({784, {512, 256}, 10}, 128, GetParam().precision,
                      GetParam().gradient_tolerance);
}

// The CNN of examples/fashion_cnn.yaml, and one on a 3-channel image with an
// odd side (the transposes of the input and a pooling that drops a column).
// A bias gradient sums a whole batch of pixels: fp32 gets 10x the MLP's bound
// for the GPU's tree sum against the CPU's sum in order.
TEST_P(CudaMlpTest, CnnForwardBackwardMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  const double tolerance = GetParam().gradient_tolerance * 10;
  ExpectGpuMatchesCpu({784, {128}, 10, {32, 64}, 1, 28, 28}, 64, GetParam().precision,
                      tolerance);
  ExpectGpuMatchesCpu({3 * 8 * 7, {16}, 10, {8, 8}, 3, 8, 7}, 16, GetParam().precision,
                      tolerance);
}

// fp32 within 1e-5 relative; TF32 and fp16 keep 10 mantissa bits in the
// products, bf16 7: their gradients are within 1e-2 and 3e-2 (the bounds
// hold against fp32 too; the twin's roundings are the GPU's, but an input
// computed in another order can round the other way).
INSTANTIATE_TEST_SUITE_P(Precisions, CudaMlpTest,
                         ::testing::Values(PrecisionCase{Precision::kFp32, 1e-5},
                                           PrecisionCase{Precision::kTf32, 1e-2},
                                           PrecisionCase{Precision::kBf16, 3e-2},
                                           PrecisionCase{Precision::kFp16, 1e-2}),
                         [](const ::testing::TestParamInfo<PrecisionCase>& info) {
                           switch (info.param.precision) {
                             case Precision::kFp32:
                               return "Fp32";
                             case Precision::kTf32:
                               return "Tf32";
                             case Precision::kBf16:
                               return "Bf16";
                             case Precision::kFp16:
                               return "Fp16";
                           }
                           return "Unknown";
                         });

// The click model's embedding bags: a batch of 512 samples x 26 fields
// over 5,000 rows (bags of 0 to 6 entries, Zipf-like hot rows), both
// poolings, bitwise the CPU twins' (the same order of sums, no fused
// multiply-add).
TEST(CudaTest, EmbeddingBagsMatchTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(4);
  BagIndex index;
  index.rows = 5000;
  index.bag_starts = {0};
  for (int b = 0; b < 512 * 26; ++b) {
    const int entries = static_cast<int>(rng() % 7);
    for (int e = 0; e < entries; ++e) {
      const uint32_t r = rng() % 5000;
      index.entry_rows.push_back(static_cast<int32_t>(r % (1 + rng() % 5000)));
    }
    index.bag_starts.push_back(static_cast<int64_t>(index.entry_rows.size()));
  }
  ASSERT_TRUE(TransposeBags(index).ok());
  const int dim = 16;
  const std::vector<float> rows = Random(index.rows * dim, 5);
  const std::vector<float> d_out = Random((index.bag_starts.size() - 1) * dim, 6);
  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  DeviceBuffer starts = Upload(*gpu, index.bag_starts), entries = Upload(*gpu, index.entry_rows),
               row_starts = Upload(*gpu, index.row_starts), row_bags = Upload(*gpu, index.row_bags),
               g_rows = Upload(*gpu, rows), g_d_out = Upload(*gpu, d_out);
  BagIndexView on_gpu = index.view();
  on_gpu.bag_starts = starts.as<int64_t>();
  on_gpu.entry_rows = entries.as<int32_t>();
  on_gpu.row_starts = row_starts.as<int64_t>();
  on_gpu.row_bags = row_bags.as<int64_t>();
  DeviceBuffer g_out = *gpu->Allocate(d_out.size() * sizeof(float));
  DeviceBuffer g_grad = *gpu->Allocate(rows.size() * sizeof(float));
  for (Pooling pooling : {Pooling::kSum, Pooling::kMean}) {
    std::vector<float> out(d_out.size()), grad(rows.size());
    EmbeddingBagForward(index.view(), dim, pooling, rows.data(), out.data());
    EmbeddingBagBackward(index.view(), dim, pooling, d_out.data(), grad.data());
    ASSERT_TRUE(CudaEmbeddingBagForward(0, on_gpu, dim, pooling, g_rows.as<float>(),
                                        g_out.as<float>())
                    .ok());
    ASSERT_TRUE(CudaEmbeddingBagBackward(0, on_gpu, dim, pooling, g_d_out.as<float>(),
                                         g_grad.as<float>())
                    .ok());
    EXPECT_EQ(Download<float>(*gpu, g_out, out.size()), out);
    EXPECT_EQ(Download<float>(*gpu, g_grad, grad.size()), grad);
  }
}

TEST(CudaTest, BadLabelsAreAnErrorOnTheGpuToo) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  const ModelShape shape{4, {3}, 2};
  auto kernels = *gpu->CreateModelKernels(shape, 2, Precision::kFp32);
  DeviceBuffer p = *gpu->Allocate(NumParams(shape) * sizeof(float));
  DeviceBuffer x = Upload(*gpu, std::vector<float>(8, 0.5f));
  DeviceBuffer y = Upload(*gpu, std::vector<int32_t>{0, 5});
  DeviceBuffer g = *gpu->Allocate(NumParams(shape) * sizeof(float));
  BatchStats stats;
  EXPECT_EQ(kernels->ForwardBackward(p.as<float>(), x.as<float>(), y.as<int32_t>(), 2, 1.0f,
                                     g.as<float>(), &stats)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// At the config's learning rate and at a schedule's (the span's).
TEST(CudaTest, OptimizersMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  const int64_t n = 100003;
  for (auto type : {OptimizerConfig::Type::kSgd, OptimizerConfig::Type::kAdam,
                    OptimizerConfig::Type::kAdagrad}) {
    OptimizerConfig c;
    c.type = type;
    c.learning_rate = 0.01f;
    c.momentum = type == OptimizerConfig::Type::kSgd ? 0.9f : 0.0f;
    c.weight_decay = 1e-4f;
    auto cpu = *CreateCpuOptimizer(c);
    auto cuda = *CreateCudaOptimizer(c, 0);
    ASSERT_EQ(cuda->StateFloatsPerParam(), cpu->StateFloatsPerParam());
    std::vector<float> p = Random(n, 1), state(cpu->StateFloatsPerParam() * n, 0.0f);
    DeviceBuffer dp = Upload(*gpu, p);
    DeviceBuffer ds = *gpu->Allocate(std::max<size_t>(1, state.size()) * sizeof(float));
    for (int t = 1; t <= 5; ++t) {
      const std::vector<float> g = Random(n, 10 + t);
      DeviceBuffer dg = Upload(*gpu, g);
      // Odd updates at the config's rate, even ones at a schedule's.
      const float rate = t % 2 == 1 ? 0.0f : 0.002f * t;
      OptimizerSpan on_cpu{p.data(), p.data(), g.data(), state.data(), n, n, rate};
      OptimizerSpan on_gpu{dp.as<float>(), dp.as<float>(), dg.as<float>(), ds.as<float>(),
                           n, n, rate};
      ASSERT_TRUE(cpu->Apply(on_cpu, t).ok());
      ASSERT_TRUE(cuda->Apply(on_gpu, t).ok());
    }
    const std::vector<float> gp = Download<float>(*gpu, dp, n);
    EXPECT_LE(RelativeL2(gp.data(), p.data(), n), 1e-6) << static_cast<int>(type);
  }
}

TEST(CudaTest, CastsMatchTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  std::vector<float> values = Random(4096, 5, 100.0f);
  for (float special : {0.0f, -0.0f, 1e-40f, -1e-45f, 65504.0f, 65520.0f, 1e30f, -1e30f,
                        std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(), std::ldexp(1.0f, -25),
                        std::ldexp(3.0f, -25), 1.0f + std::ldexp(1.0f, -11)}) {
    values.push_back(special);
  }
  const int64_t n = static_cast<int64_t>(values.size());
  DeviceBuffer in = Upload(*gpu, values);
  DeviceBuffer half = *gpu->Allocate(n * sizeof(uint16_t));
  DeviceBuffer back = *gpu->Allocate(n * sizeof(float));
  std::vector<uint16_t> cpu_half(n);
  std::vector<float> cpu_back(n);
  struct Pair {
    decltype(&CudaCastToBf16) to_gpu;
    decltype(&CudaCastFromBf16) from_gpu;
    decltype(&CastToBf16) to_cpu;
    decltype(&CastFromBf16) from_cpu;
  };
  for (const Pair& pair : {Pair{CudaCastToBf16, CudaCastFromBf16, CastToBf16, CastFromBf16},
                           Pair{CudaCastToFp16, CudaCastFromFp16, CastToFp16, CastFromFp16}}) {
    ASSERT_TRUE(pair.to_gpu(0, in.as<float>(), half.as<uint16_t>(), n).ok());
    ASSERT_TRUE(pair.from_gpu(0, half.as<uint16_t>(), back.as<float>(), n).ok());
    pair.to_cpu(values.data(), cpu_half.data(), n);
    pair.from_cpu(cpu_half.data(), cpu_back.data(), n);
    EXPECT_EQ(Download<uint16_t>(*gpu, half, n), cpu_half);
    const std::vector<float> gpu_back = Download<float>(*gpu, back, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(gpu_back[i] == cpu_back[i] || (std::isnan(gpu_back[i]) && std::isnan(cpu_back[i])))
          << values[i];
    }
  }
}

TEST(CudaTest, NcclReducerMatchesTheCpuReducerOnOneGpu) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  auto nccl = *CreateNcclReducer({0});
  auto cpu = *CreateCpuReducer(1);
  const int64_t count = 1000;
  const std::vector<float> send = Random(count, 9);
  std::vector<float> cpu_recv(count), cpu_all(count);
  ASSERT_TRUE(cpu->ReduceScatter(0, send.data(), cpu_recv.data(), count).ok());
  ASSERT_TRUE(cpu->AllGather(0, cpu_recv.data(), cpu_all.data(), count).ok());
  DeviceBuffer dsend = Upload(*gpu, send);
  DeviceBuffer drecv = *gpu->Allocate(count * sizeof(float));
  DeviceBuffer dall = *gpu->Allocate(count * sizeof(float));
  ASSERT_TRUE(nccl->ReduceScatter(0, dsend.as<float>(), drecv.as<float>(), count).ok());
  ASSERT_TRUE(nccl->AllGather(0, drecv.as<float>(), dall.as<float>(), count).ok());
  EXPECT_EQ(Download<float>(*gpu, drecv, count), cpu_recv);
  EXPECT_EQ(Download<float>(*gpu, dall, count), cpu_all);
}

}  // namespace
}  // namespace pstrain::kernels
