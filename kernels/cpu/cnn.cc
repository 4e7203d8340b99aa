// A CNN on the CPU: each convolution as im2col + one cblas_sgemm over the
// whole batch, ReLU and 2x2 max-pooling, then the dense layers.
//
// Activations are kept channel-major over the batch, [C][B][H][W], so that
// a convolution's output is the product W[Cout][Cin*9] * col[Cin*9][B*H*W]
// as it stands, and its weight gradient dZ * col^T, both single sgemms.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_models.h"

namespace pstrain::kernels {
namespace {

// [C][B][area] -> [B][C][area] (to_rows: the dense layers' rows), or back.
void Transpose(const float* in, int channels, int batch, int area, bool to_rows, float* out) {
  for (int s = 0; s < batch; ++s) {
    for (int c = 0; c < channels; ++c) {
      const size_t by_channel = (static_cast<size_t>(c) * batch + s) * area;
      const size_t by_row = (static_cast<size_t>(s) * channels + c) * area;
      std::memcpy(out + (to_rows ? by_row : by_channel), in + (to_rows ? by_channel : by_row),
                  sizeof(float) * area);
    }
  }
}

class CpuCnn final : public ModelKernels {
 public:
  CpuCnn(const ModelShape& shape, int max_batch, Precision precision)
      : tensors_(ModelTensors(shape)),
        convs_(ConvLayers(shape)),
        dense_(shape, max_batch, precision),
        max_batch_(max_batch),
        gemm_(precision) {
    const size_t b = max_batch;
    size_t widest_col = 0, widest_out = 0;
    for (const ConvLayer& c : convs_) {
      const size_t pixels = b * c.height * c.width;
      const size_t pooled = b * c.out_channels * c.pooled_height() * c.pooled_width();
      col_.emplace_back(c.patch() * pixels);
      relu_.emplace_back(c.out_channels * pixels);
      pooled_.emplace_back(pooled);
      argmax_.emplace_back(pooled);
      widest_col = std::max(widest_col, col_.back().size());
      widest_out = std::max(widest_out, relu_.back().size());
    }
    const ConvLayer& first = convs_.front();
    if (first.in_channels > 1) input_.resize(b * first.in_channels * first.height * first.width);
    features_.resize(b * dense_.input_dim());
    d_features_.resize(features_.size());
    d_out_.resize(widest_out);
    // d(pooled) of the layer below: the size of the largest pooled output.
    for (const std::vector<float>& p : pooled_) d_in_.resize(std::max(d_in_.size(), p.size()));
  }

  absl::Status ForwardBackward(const float* params, const float* x, const int32_t* labels,
                               int batch, float grad_scale, float* grad, BatchStats* stats,
                               const GradientReadyFn& on_ready,
                               const ParamsNeededFn& params_needed) override {
    if (absl::Status s = dense_.CheckBatch(labels, batch); !s.ok()) return s;
    if (absl::Status s = Forward(params, x, batch, params_needed); !s.ok()) return s;
    dense_.Backward(params, features_.data(), labels, batch, grad_scale, grad, stats, on_ready,
                    d_features_.data());
    // d(last pooling) from the dense layers' d(input), [B][C*h*w] -> [C][B][h][w].
    const ConvLayer& last = convs_.back();
    Transpose(d_features_.data(), last.out_channels, batch,
              last.pooled_height() * last.pooled_width(), /*to_rows=*/false, d_in_.data());
    for (int l = static_cast<int>(convs_.size()) - 1; l >= 0; --l) {
      BackwardConv(l, params, batch, grad, on_ready);
    }
    return absl::OkStatus();
  }

  absl::Status Evaluate(const float* params, const float* x, const int32_t* labels,
                        int64_t batch, BatchStats* stats) override {
    for (int64_t start = 0; start < batch; start += max_batch_) {
      const int n = static_cast<int>(std::min<int64_t>(max_batch_, batch - start));
      if (absl::Status s = dense_.CheckBatch(labels + start, n); !s.ok()) return s;
      if (absl::Status s = Forward(params, x + start * InputFloats(), n); !s.ok()) return s;
      dense_.AddStats(labels + start, n, stats);
    }
    return absl::OkStatus();
  }

 private:
  int64_t InputFloats() const {
    const ConvLayer& c = convs_.front();
    return int64_t{c.in_channels} * c.height * c.width;
  }

  absl::Status Forward(const float* params, const float* x, int batch,
                       const ParamsNeededFn& params_needed = nullptr) {
    // The input, [B][C][H][W], as [C][B][H][W] (the same for one channel).
    const ConvLayer& first = convs_.front();
    const float* in = x;
    if (first.in_channels > 1) {
      Transpose(x, first.in_channels, batch, first.height * first.width, /*to_rows=*/false,
                input_.data());
      in = input_.data();
    }
    for (size_t l = 0; l < convs_.size(); ++l) {
      if (params_needed) {
        const int64_t floats = tensors_[2 * l].size + tensors_[2 * l + 1].size;
        if (absl::Status s = params_needed(static_cast<int>(l), floats); !s.ok()) return s;
      }
      ForwardConv(l, params, in, batch);
      in = pooled_[l].data();
    }
    // The last pooling, [C][B][h][w], as the dense layers' rows [B][C*h*w].
    const ConvLayer& last = convs_.back();
    Transpose(in, last.out_channels, batch, last.pooled_height() * last.pooled_width(),
              /*to_rows=*/true, features_.data());
    return dense_.Forward(params, features_.data(), batch, params_needed);
  }

  // col_[l] = im2col(in), relu_[l] = ReLU(W col + b), pooled_[l] = its
  // 2x2 maxima (argmax_[l]: where each came from).
  void ForwardConv(size_t l, const float* params, const float* in, int batch) {
    const ConvLayer& c = convs_[l];
    const int h = c.height, w = c.width;
    const int pixels = batch * h * w;
    float* col = col_[l].data();
    Im2Col(c, in, batch, col);
    const float* weight = params + tensors_[2 * l].offset;
    const float* bias = params + tensors_[2 * l + 1].offset;
    float* z = relu_[l].data();
    for (int co = 0; co < c.out_channels; ++co) {
      std::fill(z + static_cast<size_t>(co) * pixels, z + static_cast<size_t>(co + 1) * pixels,
                bias[co]);
    }
    gemm_(false, false, c.out_channels, pixels, c.patch(), weight, c.patch(), col, pixels, 1.0f,
          z, pixels);
    const size_t n = static_cast<size_t>(c.out_channels) * pixels;
    for (size_t i = 0; i < n; ++i) z[i] = std::max(z[i], 0.0f);

    const int ph = c.pooled_height(), pw = c.pooled_width();
    float* pooled = pooled_[l].data();
    int32_t* from = argmax_[l].data();
    for (int plane = 0; plane < c.out_channels * batch; ++plane) {
      const float* image = z + static_cast<size_t>(plane) * h * w;
      for (int y = 0; y < ph; ++y) {
        for (int x = 0; x < pw; ++x) {
          int best = (2 * y) * w + 2 * x;
          for (int i : {best + 1, best + w, best + w + 1}) {
            if (image[i] > image[best]) best = i;
          }
          const size_t o = (static_cast<size_t>(plane) * ph + y) * pw + x;
          pooled[o] = image[best];
          from[o] = plane * h * w + best;
        }
      }
    }
  }

  // From d(pooled_[l]) in d_in_: the layer's weight and bias gradients
  // and, below the first layer, d(pooled_[l-1]) back in d_in_.
  void BackwardConv(int l, const float* params, int batch, float* grad,
                    const GradientReadyFn& on_ready) {
    const ConvLayer& c = convs_[l];
    const int h = c.height, w = c.width;
    const int pixels = batch * h * w;
    const size_t outputs = static_cast<size_t>(c.out_channels) * pixels;
    // dZ: the pooled gradients back where their maxima were, where ReLU passed.
    float* dz = d_out_.data();
    std::fill(dz, dz + outputs, 0.0f);
    const size_t pooled = static_cast<size_t>(c.out_channels) * batch * c.pooled_height() *
                          c.pooled_width();
    const int32_t* from = argmax_[l].data();
    for (size_t o = 0; o < pooled; ++o) dz[from[o]] = d_in_[o];
    const float* z = relu_[l].data();
    for (size_t i = 0; i < outputs; ++i) {
      if (z[i] <= 0.0f) dz[i] = 0.0f;
    }
    float* dw = grad + tensors_[2 * l].offset;
    float* db = grad + tensors_[2 * l + 1].offset;
    float* col = col_[l].data();
    gemm_(false, true, c.out_channels, c.patch(), pixels, dz, pixels, col, pixels, 0.0f, dw,
          c.patch());
    for (int co = 0; co < c.out_channels; ++co) {
      const float* row = dz + static_cast<size_t>(co) * pixels;
      double sum = 0;
      for (int i = 0; i < pixels; ++i) sum += row[i];
      db[co] = static_cast<float>(sum);
    }
    const int64_t layer_floats = int64_t{c.out_channels} * c.patch() + c.out_channels;
    if (l == 0) {
      if (on_ready) on_ready(0, layer_floats);
      return;
    }
    // d(col) = W^T dZ, over col itself (used for the last time), then
    // col2im: each patch value back onto the input pixel it was.
    const float* weight = params + tensors_[2 * l].offset;
    gemm_(true, false, c.patch(), pixels, c.out_channels, weight, c.patch(), dz, pixels, 0.0f,
          col, pixels);
    if (on_ready) on_ready(l, layer_floats);
    Col2Im(c, col, batch, d_in_.data());
  }

  const std::vector<TensorDesc> tensors_;
  const std::vector<ConvLayer> convs_;
  DenseLayers dense_;
  const int max_batch_;
  std::vector<float> input_;  // a multi-channel input, [C][B][H][W]
  // Per convolution, [C][B][H][W] each: im2col, ReLU output, pooled output
  // and the ReLU output index each pooled value came from.
  std::vector<std::vector<float>> col_, relu_, pooled_;
  std::vector<std::vector<int32_t>> argmax_;
  std::vector<float> features_, d_features_;  // the dense input and its gradient
  std::vector<float> d_out_;                  // d(ReLU output) of one convolution
  std::vector<float> d_in_;                   // d(pooled) of the layer being done
  Gemm gemm_;                                 // the convolutions' products
};

}  // namespace

void Im2Col(const ConvLayer& c, const float* in, int batch, float* col) {
  const int h = c.height, w = c.width;
  const int pixels = batch * h * w;
  for (int ci = 0; ci < c.in_channels; ++ci) {
    for (int ky = 0; ky < 3; ++ky) {
      for (int kx = 0; kx < 3; ++kx) {
        float* row = col + static_cast<size_t>((ci * 3 + ky) * 3 + kx) * pixels;
        for (int s = 0; s < batch; ++s) {
          const float* image = in + (static_cast<size_t>(ci) * batch + s) * h * w;
          for (int y = 0; y < h; ++y) {
            float* out = row + (static_cast<size_t>(s) * h + y) * w;
            const int yy = y + ky - 1;
            if (yy < 0 || yy >= h) {
              std::fill(out, out + w, 0.0f);
              continue;
            }
            // out[x] = src[x + kx - 1] where that is inside the row.
            const float* src = image + static_cast<size_t>(yy) * w;
            const int x0 = kx == 0 ? 1 : 0, x1 = kx == 2 ? w - 1 : w;
            if (x0 > 0) out[0] = 0.0f;
            if (x1 > x0) std::copy(src + x0 + kx - 1, src + x1 + kx - 1, out + x0);
            if (x1 < w) out[w - 1] = 0.0f;
          }
        }
      }
    }
  }
}

void Col2Im(const ConvLayer& c, const float* col, int batch, float* d_in) {
  const int h = c.height, w = c.width;
  const int pixels = batch * h * w;
  std::fill(d_in, d_in + static_cast<size_t>(c.in_channels) * pixels, 0.0f);
  for (int ci = 0; ci < c.in_channels; ++ci) {
    for (int ky = 0; ky < 3; ++ky) {
      for (int kx = 0; kx < 3; ++kx) {
        const float* row = col + static_cast<size_t>((ci * 3 + ky) * 3 + kx) * pixels;
        for (int s = 0; s < batch; ++s) {
          float* image = d_in + (static_cast<size_t>(ci) * batch + s) * h * w;
          for (int y = 0; y < h; ++y) {
            const int yy = y + ky - 1;
            if (yy < 0 || yy >= h) continue;
            const float* src = row + (static_cast<size_t>(s) * h + y) * w;
            float* dst = image + static_cast<size_t>(yy) * w;
            const int x0 = kx == 0 ? 1 : 0, x1 = kx == 2 ? w - 1 : w;
            for (int x = x0; x < x1; ++x) dst[x + kx - 1] += src[x];
          }
        }
      }
    }
  }
}

std::unique_ptr<ModelKernels> NewCpuCnn(const ModelShape& shape, int max_batch,
                                        Precision precision) {
  return std::make_unique<CpuCnn>(shape, max_batch, precision);
}

}  // namespace pstrain::kernels
