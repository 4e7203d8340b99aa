#include "kernels/model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/random.h"

namespace pstrain::kernels {

std::vector<ConvLayer> ConvLayers(const ModelShape& shape) {
  std::vector<ConvLayer> layers;
  ConvLayer next{shape.image_channels, 0, shape.image_height, shape.image_width};
  for (int channels : shape.conv) {
    next.out_channels = channels;
    layers.push_back(next);
    next = {channels, 0, next.pooled_height(), next.pooled_width()};
  }
  return layers;
}

int64_t DenseInputDim(const ModelShape& shape) {
  if (shape.conv.empty()) return shape.input_dim;
  const ConvLayer last = ConvLayers(shape).back();
  return int64_t{last.out_channels} * last.pooled_height() * last.pooled_width();
}

absl::Status CheckModelShape(const ModelShape& shape) {
  if (shape.input_dim < 1 || shape.num_classes < 2) {
    return absl::InvalidArgumentError("model needs input_dim >= 1 and num_classes >= 2");
  }
  for (int width : shape.hidden) {
    if (width < 1) return absl::InvalidArgumentError("hidden widths must be >= 1");
  }
  if (shape.conv.empty()) return absl::OkStatus();
  if (shape.image_channels < 1 || shape.image_height < 1 || shape.image_width < 1 ||
      int64_t{shape.image_channels} * shape.image_height * shape.image_width !=
          shape.input_dim) {
    return absl::InvalidArgumentError("a CNN's image must be channels x height x width = " +
                                      std::to_string(shape.input_dim) + " values");
  }
  for (const ConvLayer& c : ConvLayers(shape)) {
    if (c.out_channels < 1) return absl::InvalidArgumentError("conv channels must be >= 1");
    if (c.pooled_height() < 1 || c.pooled_width() < 1) {
      return absl::InvalidArgumentError(
          "conv: " + std::to_string(shape.conv.size()) + " convolutions pool a " +
          std::to_string(shape.image_height) + "x" + std::to_string(shape.image_width) +
          " image below 1x1");
    }
  }
  return absl::OkStatus();
}

std::vector<TensorDesc> ModelTensors(const ModelShape& shape) {
  std::vector<TensorDesc> tensors;
  int64_t offset = 0;
  for (const ConvLayer& c : ConvLayers(shape)) {
    const std::string layer = "conv" + std::to_string(tensors.size() / 2);
    const int64_t fan_in = c.patch();
    TensorDesc w{layer + ".weight", {c.out_channels, c.in_channels, 3, 3}, offset,
                 c.out_channels * fan_in, fan_in, false};
    offset += w.size;
    TensorDesc b{layer + ".bias", {c.out_channels}, offset, c.out_channels, fan_in, true};
    offset += b.size;
    tensors.push_back(std::move(w));
    tensors.push_back(std::move(b));
  }
  std::vector<int64_t> widths;
  widths.push_back(DenseInputDim(shape));
  widths.insert(widths.end(), shape.hidden.begin(), shape.hidden.end());
  widths.push_back(shape.num_classes);
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
  InitTensors(ModelTensors(shape), seed, begin, end, out);
}

void InitTensors(const std::vector<TensorDesc>& tensors, uint64_t seed, int64_t begin,
                 int64_t end, float* out) {
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
    const uint64_t stream = Mix64(seed ^ Mix64(t + 1));
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t bits = Mix64(stream + static_cast<uint64_t>(i - desc.offset));
      const double unit = static_cast<double>(bits >> 11) * 0x1.0p-53;  // [0, 1)
      out[i - begin] = static_cast<float>((2.0 * unit - 1.0) * limit);
    }
  }
}

}  // namespace pstrain::kernels
