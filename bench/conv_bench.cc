// conv: the CPU convolution as pstrain runs it (im2col + one sgemm over the
// batch; backward: two sgemms + col2im) against the same products as bare
// OpenBLAS sgemms on an im2col matrix made in advance, in one run, on one
// core; and the whole CNN's forward + backward in samples/s.
#include <cblas.h>

#include <algorithm>
#include <functional>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/job_spec.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_models.h"

namespace pstrain::bench {
namespace {

// Calls per second of fn, run for about `seconds`.
double Rate(const std::function<void()>& fn, double seconds) {
  fn();  // warm-up: first touch of the buffers
  int64_t calls = 0;
  const absl::Time start = absl::Now();
  while (SecondsSince(start) < seconds) {
    fn();
    ++calls;
  }
  return calls / SecondsSince(start);
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

}  // namespace

int RunConvBench(const ConvBenchOptions& o) {
  kernels::SetBlasThreads(1);
  kernels::ModelShape shape;
  shape.input_dim = kFashionInputDim;
  shape.num_classes = kFashionClasses;
  shape.conv = o.conv;
  shape.hidden = o.hidden;
  shape.image_height = shape.image_width = kFashionImageSide;
  if (absl::Status s = kernels::CheckModelShape(shape); !s.ok()) {
    std::cerr << "pstrain-bench conv: " << s << "\n";
    return 2;
  }
  const int b = o.batch;
  Table table("conv", {"layer", "pass", "pstrain_per_s", "sgemm_per_s", "ratio", "gflops"});
  int index = 0;
  for (const kernels::ConvLayer& c : kernels::ConvLayers(shape)) {
    const int pixels = b * c.height * c.width;
    const std::vector<float> in = Random(static_cast<size_t>(c.in_channels) * pixels, 1);
    const std::vector<float> weight = Random(static_cast<size_t>(c.out_channels) * c.patch(), 2);
    const std::vector<float> dz = Random(static_cast<size_t>(c.out_channels) * pixels, 3);
    std::vector<float> col(static_cast<size_t>(c.patch()) * pixels);
    std::vector<float> dcol(col.size()), out(dz.size()), dw(weight.size()), din(in.size());
    kernels::Im2Col(c, in.data(), b, col.data());
    auto product = [&] {  // out = W col
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, c.out_channels, pixels, c.patch(),
                  1.0f, weight.data(), c.patch(), col.data(), pixels, 0.0f, out.data(), pixels);
    };
    auto gradients = [&] {  // dW = dZ col^T, dcol = W^T dZ
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c.out_channels, c.patch(), pixels,
                  1.0f, dz.data(), pixels, col.data(), pixels, 0.0f, dw.data(), c.patch());
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, c.patch(), pixels, c.out_channels,
                  1.0f, weight.data(), c.patch(), dz.data(), pixels, 0.0f, dcol.data(), pixels);
    };
    const double flops = 2.0 * c.out_channels * c.patch() * pixels;
    const std::string name = absl::StrCat("conv", index++, " ", c.in_channels, "->",
                                          c.out_channels, " @", c.height, "x", c.width);
    // The bare products and pstrain's passes, alternated per round so that
    // a change of the machine's load falls on both.
    double ours_fwd = 0, bare_fwd = 0, ours_bwd = 0, bare_bwd = 0;
    const double slice = o.seconds / (4.0 * o.rounds);
    for (int r = 0; r < o.rounds; ++r) {
      bare_fwd += Rate(product, slice);
      ours_fwd += Rate(
          [&] {
            kernels::Im2Col(c, in.data(), b, col.data());
            product();
          },
          slice);
      bare_bwd += Rate(gradients, slice);
      ours_bwd += Rate(
          [&] {
            gradients();
            kernels::Col2Im(c, dcol.data(), b, din.data());
          },
          slice);
    }
    table.Add(Table::Row().Text(name).Text("forward").Number(ours_fwd / o.rounds, 1)
                  .Number(bare_fwd / o.rounds, 1).Number(ours_fwd / bare_fwd, 3)
                  .Number(flops * ours_fwd / o.rounds / 1e9, 2));
    table.Add(Table::Row().Text(name).Text("backward").Number(ours_bwd / o.rounds, 1)
                  .Number(bare_bwd / o.rounds, 1).Number(ours_bwd / bare_bwd, 3)
                  .Number(2 * flops * ours_bwd / o.rounds / 1e9, 2));
  }
  table.Finish();

  // The whole model, forward and backward, one core.
  auto kernels = kernels::CreateCpuModelKernels(shape, b);
  if (!kernels.ok()) {
    std::cerr << "pstrain-bench conv: " << kernels.status() << "\n";
    return 1;
  }
  const int64_t n = kernels::NumParams(shape);
  std::vector<float> params(n), grad(n);
  kernels::InitParams(shape, 1, 0, n, params.data());
  const std::vector<float> x = Random(static_cast<size_t>(b) * shape.input_dim, 4);
  std::vector<int32_t> labels(b);
  for (int i = 0; i < b; ++i) labels[i] = i % shape.num_classes;
  kernels::BatchStats stats;
  const double steps_per_s = Rate(
      [&] {
        (*kernels)->ForwardBackward(params.data(), x.data(), labels.data(), b, 1.0f, grad.data(),
                                    &stats)
            .IgnoreError();
      },
      o.seconds / 4);
  Table model("conv_model", {"model", "batch", "samples_per_s"});
  model.Add(Table::Row().Text(absl::StrCat("cnn conv ", o.conv.size(), " layers, ",
                                           n, " params")).Int(b).Number(steps_per_s * b, 0));
  model.Finish();
  return 0;
}

}  // namespace pstrain::bench
