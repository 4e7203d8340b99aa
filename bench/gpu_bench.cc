// pstrain-gpu-bench: the figures of the GPU check (bench/gpu_check.sh).
// cuBLAS GEMM throughput; one training step of a wide MLP and of the
// example CNN on the GPU against the CPU twin (time and agreement); the click
// model's embedding bags against theirs; a few hundred training steps on
// synthetic data, showing the loss fall. A table, and one JSON line a row.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/click_model.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/device.h"
#include "kernels/model.h"

namespace pstrain::kernels {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

void Row(const std::string& name, const std::string& text, const std::string& json) {
  std::printf("%-28s %s\n", name.c_str(), text.c_str());
  std::printf("{\"bench\":\"gpu\",\"row\":\"%s\",%s}\n", name.c_str(), json.c_str());
  std::fflush(stdout);
}

#define CHECK_OK(expr)                                                              \
  do {                                                                              \
    const auto& s_ = (expr);                                                        \
    if (!s_.ok()) {                                                                 \
      std::fprintf(stderr, "%s: %s\n", #expr, s_.ToString().c_str());             \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

// One training step of `shape` at `batch` on the GPU against the CPU twin:
// time and agreement of the gradients.
int CompareStep(Device* gpu, const std::string& label, const ModelShape& shape, int batch) {
  const int64_t params_n = NumParams(shape);
  std::vector<float> params(params_n), x(static_cast<size_t>(batch) * shape.input_dim);
  std::vector<int32_t> y(batch);
  InitParams(shape, 1, 0, params_n, params.data());
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (float& v : x) v = unit(rng);
  for (int i = 0; i < batch; ++i) y[i] = i % 10;

  auto gpu_kernels = *gpu->CreateModelKernels(shape, batch, Precision::kFp32);
  auto p = *gpu->Allocate(params_n * 4);
  auto g = *gpu->Allocate(params_n * 4);
  auto state = *gpu->Allocate(params_n * 8);
  auto dx = *gpu->Allocate(x.size() * 4);
  auto dy = *gpu->Allocate(y.size() * 4);
  CHECK_OK(gpu->CopyToDevice(p.as<void>(), params.data(), params_n * 4));
  CHECK_OK(gpu->CopyToDevice(dx.as<void>(), x.data(), x.size() * 4));
  CHECK_OK(gpu->CopyToDevice(dy.as<void>(), y.data(), y.size() * 4));
  OptimizerConfig adam;
  adam.type = OptimizerConfig::Type::kAdam;
  adam.learning_rate = 1e-3f;
  auto gpu_adam = *CreateCudaOptimizer(adam, 0);
  BatchStats stats;
  CHECK_OK(gpu_kernels->ForwardBackward(p.as<float>(), dx.as<float>(), dy.as<int32_t>(), batch,
                                        1.0f / batch, g.as<float>(), &stats));
  std::vector<float> gpu_grad(params_n);
  CHECK_OK(gpu->CopyToHost(gpu_grad.data(), g.as<void>(), params_n * 4));
  const int steps = 20;
  auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= steps; ++i) {
    CHECK_OK(gpu_kernels->ForwardBackward(p.as<float>(), dx.as<float>(), dy.as<int32_t>(), batch,
                                          1.0f / batch, g.as<float>(), &stats));
    CHECK_OK(gpu_adam->ApplyInPlace(p.as<float>(), g.as<float>(), state.as<float>(), params_n, i));
  }
  CHECK_OK(gpu->Synchronize());
  const double gpu_step = Seconds(start) / steps;

  auto cpu_kernels = *CreateCpuModelKernels(shape, batch);
  std::vector<float> cpu_grad(params_n);
  BatchStats cpu_stats;
  start = std::chrono::steady_clock::now();
  CHECK_OK(cpu_kernels->ForwardBackward(params.data(), x.data(), y.data(), batch, 1.0f / batch,
                                        cpu_grad.data(), &cpu_stats));
  const double cpu_step = Seconds(start);
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < params_n; ++i) {
    diff += std::pow(static_cast<double>(gpu_grad[i]) - cpu_grad[i], 2);
    norm += std::pow(static_cast<double>(cpu_grad[i]), 2);
  }
  const double relative = std::sqrt(diff / norm);
  char text[160];
  std::snprintf(text, sizeof(text),
                "GPU %.2f ms/step (fwd+bwd+Adam), CPU %.0f ms (fwd+bwd): %.0fx; gradient "
                "rel. diff %.2e",
                gpu_step * 1e3, cpu_step * 1e3, cpu_step / gpu_step, relative);
  Row(label, text,
      "\"gpu_ms\":" + std::to_string(gpu_step * 1e3) + ",\"cpu_ms\":" +
          std::to_string(cpu_step * 1e3) + ",\"grad_rel_diff\":" + std::to_string(relative));

  return 0;
}

// The click model's embedding bags (a batch of 4096 samples, 26 fields of
// up to 3 tokens each, over 200,000 rows of 16 floats): forward and
// backward on the GPU against the CPU twins, time and bitwise agreement.
int CompareEmbeddingBags(Device* gpu) {
  std::mt19937 rng(7);
  BagIndex index;
  index.rows = 200000;
  index.bag_starts = {0};
  for (int b = 0; b < 4096 * 26; ++b) {
    const int entries = static_cast<int>(rng() % 4);
    for (int e = 0; e < entries; ++e) {
      index.entry_rows.push_back(static_cast<int32_t>(rng() % 200000));
    }
    index.bag_starts.push_back(static_cast<int64_t>(index.entry_rows.size()));
  }
  CHECK_OK(TransposeBags(index));
  const int dim = 16;
  const int64_t bags = static_cast<int64_t>(index.bag_starts.size()) - 1;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> rows(index.rows * dim), d_out(bags * dim);
  for (float& v : rows) v = unit(rng);
  for (float& v : d_out) v = unit(rng);
  auto upload = [&](const void* data, size_t bytes) {
    DeviceBuffer b = *gpu->Allocate(bytes);
    (void)gpu->CopyToDevice(b.as<void>(), data, bytes);
    return b;
  };
  DeviceBuffer starts = upload(index.bag_starts.data(), index.bag_starts.size() * 8);
  DeviceBuffer entries = upload(index.entry_rows.data(), index.entry_rows.size() * 4);
  DeviceBuffer row_starts = upload(index.row_starts.data(), index.row_starts.size() * 8);
  DeviceBuffer row_bags = upload(index.row_bags.data(), index.row_bags.size() * 8);
  DeviceBuffer g_rows = upload(rows.data(), rows.size() * 4);
  DeviceBuffer g_d_out = upload(d_out.data(), d_out.size() * 4);
  DeviceBuffer g_out = *gpu->Allocate(d_out.size() * 4);
  DeviceBuffer g_grad = *gpu->Allocate(rows.size() * 4);
  BagIndexView on_gpu = index.view();
  on_gpu.bag_starts = starts.as<int64_t>();
  on_gpu.entry_rows = entries.as<int32_t>();
  on_gpu.row_starts = row_starts.as<int64_t>();
  on_gpu.row_bags = row_bags.as<int64_t>();

  std::vector<float> out(d_out.size()), grad(rows.size());
  constexpr int kIterations = 20;
  auto cpu_start = std::chrono::steady_clock::now();
  for (int i = 0; i < kIterations; ++i) {
    EmbeddingBagForward(index.view(), dim, Pooling::kSum, rows.data(), out.data());
    EmbeddingBagBackward(index.view(), dim, Pooling::kSum, d_out.data(), grad.data());
  }
  const double cpu = Seconds(cpu_start) / kIterations;
  CHECK_OK(CudaEmbeddingBagForward(0, on_gpu, dim, Pooling::kSum, g_rows.as<float>(),
                                   g_out.as<float>()));  // warm-up
  CHECK_OK(gpu->Synchronize());
  auto gpu_start = std::chrono::steady_clock::now();
  for (int i = 0; i < kIterations; ++i) {
    CHECK_OK(CudaEmbeddingBagForward(0, on_gpu, dim, Pooling::kSum, g_rows.as<float>(),
                                     g_out.as<float>()));
    CHECK_OK(CudaEmbeddingBagBackward(0, on_gpu, dim, Pooling::kSum, g_d_out.as<float>(),
                                      g_grad.as<float>()));
  }
  CHECK_OK(gpu->Synchronize());
  const double on_device = Seconds(gpu_start) / kIterations;
  std::vector<float> got_out(out.size()), got_grad(grad.size());
  CHECK_OK(gpu->CopyToHost(got_out.data(), g_out.as<void>(), got_out.size() * 4));
  CHECK_OK(gpu->CopyToHost(got_grad.data(), g_grad.as<void>(), got_grad.size() * 4));
  const bool bitwise = got_out == out && got_grad == grad;
  char text[256];
  std::snprintf(text, sizeof(text),
                "forward+backward %.3f ms on the GPU, %.3f ms on the CPU (%.1fx); %s", on_device * 1e3,
                cpu * 1e3, cpu / on_device, bitwise ? "bitwise equal" : "DIFFERENT");
  Row("embedding_bags_b4096_f26_d16", text,
      "\"gpu_ms\":" + std::to_string(on_device * 1e3) + ",\"cpu_ms\":" +
          std::to_string(cpu * 1e3) + ",\"bitwise\":" + (bitwise ? "true" : "false"));
  return bitwise ? 0 : 1;
}

int Run() {
  absl::StatusOr<int> gpus = CudaDeviceCount();
  if (!gpus.ok()) {
    std::fprintf(stderr, "no GPU: %s\n", gpus.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::string> name = CudaDeviceName(0);
  Row("device", name.ok() ? *name : "?", "\"gpus\":" + std::to_string(*gpus));

  // GEMM throughput at 4096^3.
  const int n = 4096;
  for (auto [precision, label] : {std::pair{Precision::kFp32, "fp32"},
                                  std::pair{Precision::kTf32, "tf32"},
                                  std::pair{Precision::kBf16, "bf16"},
                                  std::pair{Precision::kFp16, "fp16"}}) {
    absl::StatusOr<double> seconds = CudaGemmSeconds(0, n, n, n, precision, 20);
    CHECK_OK(seconds.status());
    const double tflops = 2.0 * n * n * n / *seconds / 1e12;
    char text[128];
    std::snprintf(text, sizeof(text), "%.1f TFLOP/s (%.3f ms)", tflops, *seconds * 1e3);
    Row(std::string("gemm_4096_") + label, text,
        "\"tflops\":" + std::to_string(tflops) + ",\"ms\":" + std::to_string(*seconds * 1e3));
  }

  std::unique_ptr<Device> gpu = *CreateCudaDevice(0);
  if (int failed = CompareStep(gpu.get(), "mlp_784_4096_4096_b1024", {784, {4096, 4096}, 10},
                               1024)) {
    return failed;
  }
  // The CNN of examples/fashion_cnn.yaml.
  if (int failed = CompareStep(gpu.get(), "cnn_32_64_128_b256",
                               {784, {128}, 10, {32, 64}, 1, 28, 28}, 256)) {
    return failed;
  }

  if (int failed = CompareEmbeddingBags(gpu.get())) return failed;

  // Training on synthetic data: a fixed random linear teacher labels
  // uniform inputs; a 784-256-128-10 MLP learns it on the GPU.
  const ModelShape small{784, {256, 128}, 10};
  const int64_t small_n = NumParams(small);
  const int tb = 256;
  std::vector<float> teacher(784 * 10);
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& w : teacher) w = normal(rng);
  auto sk = *gpu->CreateModelKernels(small, tb, Precision::kFp32);
  auto sp = *gpu->Allocate(small_n * 4);
  auto sg = *gpu->Allocate(small_n * 4);
  auto ss = *gpu->Allocate(small_n * 8);
  auto sx = *gpu->Allocate(static_cast<size_t>(tb) * 784 * 4);
  auto sy = *gpu->Allocate(tb * 4);
  std::vector<float> sparams(small_n), bx(static_cast<size_t>(tb) * 784);
  std::vector<int32_t> by(tb);
  InitParams(small, 3, 0, small_n, sparams.data());
  CHECK_OK(gpu->CopyToDevice(sp.as<void>(), sparams.data(), small_n * 4));
  OptimizerConfig adam;
  adam.type = OptimizerConfig::Type::kAdam;
  adam.learning_rate = 1e-3f;
  auto sadam = *CreateCudaOptimizer(adam, 0);
  double first_loss = 0, last_loss = 0;
  std::string curve;
  for (int step = 1; step <= 400; ++step) {
    for (int i = 0; i < tb; ++i) {
      float best = -1e30f;
      for (int j = 0; j < 784; ++j) bx[i * 784 + j] = unit(rng);
      for (int c = 0; c < 10; ++c) {
        float s = 0;
        for (int j = 0; j < 784; ++j) s += teacher[j * 10 + c] * (bx[i * 784 + j] - 0.5f);
        if (s > best) {
          best = s;
          by[i] = c;
        }
      }
    }
    CHECK_OK(gpu->CopyToDevice(sx.as<void>(), bx.data(), bx.size() * 4));
    CHECK_OK(gpu->CopyToDevice(sy.as<void>(), by.data(), by.size() * 4));
    BatchStats s;
    CHECK_OK(sk->ForwardBackward(sp.as<float>(), sx.as<float>(), sy.as<int32_t>(), tb, 1.0f / tb,
                                 sg.as<float>(), &s));
    CHECK_OK(sadam->ApplyInPlace(sp.as<float>(), sg.as<float>(), ss.as<float>(), small_n, step));
    const double loss = s.loss_sum / tb;
    if (step == 1) first_loss = loss;
    last_loss = loss;
    if (step % 50 == 0 || step == 1) curve += std::to_string(step) + ":" + std::to_string(loss) + " ";
  }
  char text[512];
  std::snprintf(text, sizeof(text), "loss %.3f -> %.3f over 400 steps (%s)", first_loss, last_loss,
                curve.c_str());
  Row("train_synthetic_400", text,
      "\"first_loss\":" + std::to_string(first_loss) + ",\"last_loss\":" +
          std::to_string(last_loss));
  return last_loss < first_loss ? 0 : 1;
}

}  // namespace
}  // namespace pstrain::kernels

int main() { return pstrain::kernels::Run(); }
