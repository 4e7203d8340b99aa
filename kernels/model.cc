#include "kernels/model.h"

#include <algorithm>
#include <cmath>


namespace pstrain::kernels {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<TensorDesc> ModelTensors(const ModelShape& shape) {
  std::vector<int> widths;
  widths.push_back(shape.input_dim);
  widths.insert(widths.end(), shape.hidden.begin(), shape.hidden.end());
  widths.push_back(shape.num_classes);
  std::vector<TensorDesc> tensors;
  int64_t offset = 0;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    const int64_t in = widths[l], out = widths[l + 1];
    const std::string layer = "layer" + std::to_string(l);
    TensorDesc w{layer + ".weight", {in, out}, offset, in * out, in, false};
    offset += w.size;
    TensorDesc b{layer + ".bias", {out}, offset, out, in, true};
    offset += b.size;
    tensors.push_back(std::move(w));
    tensors.push_back(std::move(b));
  }
  return tensors;
}

int64_t NumParams(const ModelShape& shape) {
  int64_t n = 0;
  for (const TensorDesc& t : ModelTensors(shape)) n += t.size;
  return n;
}

void InitParams(const ModelShape& shape, uint64_t seed, int64_t begin, int64_t end,
                float* out) {
  const std::vector<TensorDesc> tensors = ModelTensors(shape);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorDesc& desc = tensors[t];
    const int64_t lo = std::max(begin, desc.offset);
    const int64_t hi = std::min(end, desc.offset + desc.size);
    if (lo >= hi) continue;
    if (desc.is_bias) {
      std::fill(out + (lo - begin), out + (hi - begin), 0.0f);
      continue;
    }
    const double limit = std::sqrt(6.0 / static_cast<double>(desc.fan_in));
    const uint64_t stream = SplitMix64(seed ^ SplitMix64(t + 1));
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t bits = SplitMix64(stream + static_cast<uint64_t>(i - desc.offset));
      const double unit = static_cast<double>(bits >> 11) * 0x1.0p-53;  // [0, 1)
      out[i - begin] = static_cast<float>((2.0 * unit - 1.0) * limit);
    }
  }
}

}  // namespace pstrain::kernels
