// The CPU models' parts: the dense layers that every model ends in, and the
// two model kinds built on them (cpu_kernels.h's factory picks one).
#ifndef PSTRAIN_KERNELS_CPU_CPU_MODELS_H_
#define PSTRAIN_KERNELS_CPU_CPU_MODELS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/model.h"

namespace pstrain::kernels {

// Row-major C = op(A) op(B) + beta C (cblas_sgemm, alpha 1; lda, ldb, ldc
// the stored matrices' row strides) at a precision: for TF32, bf16 and fp16
// both inputs rounded to it first, into buffers of its own, as tensor cores
// read them; fp32 products and sums.
class Gemm {
 public:
  explicit Gemm(Precision precision) : precision_(precision) {}
  void operator()(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda,
                  const float* b, int ldb, float beta, float* c, int ldc);

 private:
  const float* Rounded(const float* matrix, int64_t floats, std::vector<float>* into) const;

  const Precision precision_;
  std::vector<float> rounded_a_, rounded_b_;
};

// The dense layers of a shape, DenseInputDim(shape) -> hidden -> classes, on
// batches of up to max_batch rows, with their activations.
class DenseLayers {
 public:
  DenseLayers(const ModelShape& shape, int max_batch, Precision precision);

  int64_t input_dim() const { return widths_[0]; }
  int max_batch() const { return max_batch_; }
  absl::Status CheckBatch(const int32_t* labels, int batch) const;

  // The logits of x (batch rows of input_dim floats), kept for Backward;
  // each layer's parameters asked for from params_needed (if set) first.
  absl::Status Forward(const float* params, const float* x, int batch,
                       const ParamsNeededFn& params_needed = nullptr);
  // Adds the loss and accuracy of the last Forward to *stats.
  void AddStats(const int32_t* labels, int batch, BatchStats* stats) const;
  // After Forward(x): the gradients of grad_scale * the batch's loss, layer
  // by layer from the last, each announced to on_ready (the model's first
  // layer, if it is dense, in row blocks). If d_input is set, it receives
  // the gradient with respect to x (batch rows of input_dim floats).
  void Backward(const float* params, const float* x, const int32_t* labels, int batch,
                float grad_scale, float* grad, BatchStats* stats,
                const GradientReadyFn& on_ready, float* d_input);

 private:
  int num_layers() const { return static_cast<int>(widths_.size()) - 1; }
  const TensorDesc& weight(int l) const { return tensors_[2 * (first_layer_ + l)]; }
  const TensorDesc& bias(int l) const { return tensors_[2 * (first_layer_ + l) + 1]; }

  const std::vector<TensorDesc> tensors_;
  const int first_layer_;  // the model's layer index of the first dense layer
  const int max_batch_;
  std::vector<int64_t> widths_;
  // activations_[0] is unused (the input is read in place).
  std::vector<std::vector<float>> activations_;
  std::vector<float> delta_;
  std::vector<float> delta_prev_;
  Gemm gemm_;
};

// A convolution's patches, [C][B][H][W] -> col[Cin*9][B*H*W] (row
// (channel, ky, kx), column (sample, y, x); zeros outside the image), and
// back: Col2Im overwrites d_in with the sum of each pixel's patch values.
void Im2Col(const ConvLayer& c, const float* in, int batch, float* col);
void Col2Im(const ConvLayer& c, const float* col, int batch, float* d_in);

std::unique_ptr<ModelKernels> NewCpuMlp(const ModelShape& shape, int max_batch,
                                        Precision precision);
std::unique_ptr<ModelKernels> NewCpuCnn(const ModelShape& shape, int max_batch,
                                        Precision precision);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CPU_CPU_MODELS_H_
