// Declarations shared by the kernels/cuda sources; includes CUDA headers.
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_INTERNAL_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_INTERNAL_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/device.h"
#include "kernels/model.h"

namespace pstrain::kernels::cuda {

// Element-wise kernels, launched on `stream` (asynchronous).
void LaunchFillRows(cudaStream_t stream, const float* row, int rows, int cols, float* out);
void LaunchRelu(cudaStream_t stream, float* z, int64_t n);
void LaunchReluMask(cudaStream_t stream, const float* activation, float* delta, int64_t n);
void LaunchColumnSums(cudaStream_t stream, const float* m, int rows, int cols, float* out);
// Per row: loss, whether the arg-max is the label, and (if dlogits) the
// scaled gradient; *bad_label is set if a label is out of range.
void LaunchSoftmaxCrossEntropy(cudaStream_t stream, const float* logits, const int32_t* labels,
                               int rows, int classes, float grad_scale, float* dlogits,
                               float* row_loss, int32_t* row_correct, int32_t* bad_label);
void LaunchToBf16(cudaStream_t stream, const float* in, uint16_t* out, int64_t n);
void LaunchFromBf16(cudaStream_t stream, const uint16_t* in, float* out, int64_t n);
void LaunchToFp16(cudaStream_t stream, const float* in, uint16_t* out, int64_t n);
void LaunchFromFp16(cudaStream_t stream, const uint16_t* in, float* out, int64_t n);

// A CNN's convolution kernels (cuda_conv.cu), layouts as in cpu/cnn.cc:
// activations [C][B][H][W], im2col [Cin*9][B*H*W].
void LaunchIm2Col(cudaStream_t stream, const ConvLayer& c, const float* in, int batch,
                  float* col);
void LaunchCol2Im(cudaStream_t stream, const ConvLayer& c, const float* col, int batch,
                  float* d_in);
// out[ch][i] = bias[ch] for i < pixels.
void LaunchFillChannels(cudaStream_t stream, const float* bias, int channels, int64_t pixels,
                        float* out);
void LaunchRowSums(cudaStream_t stream, const float* m, int rows, int64_t cols, float* out);
// 2x2 maxima of the ReLU output `in` and where each came from.
void LaunchMaxPool(cudaStream_t stream, const ConvLayer& c, int batch, const float* in,
                   float* out, int32_t* from);
// dz[from[o]] = d_pooled[o] for o < n (dz zeroed before).
void LaunchUnpool(cudaStream_t stream, const int32_t* from, const float* d_pooled, int64_t n,
                  float* dz);
// [C][B][area] -> [B][C][area] (to_rows), or back.
void LaunchTranspose(cudaStream_t stream, const float* in, int channels, int batch, int area,
                     bool to_rows, float* out);

// The model kernels on `device`'s GPU, using its stream and cuBLAS handle.
absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCudaMlp(Device* device, int ordinal,
                                                            cudaStream_t stream,
                                                            cublasHandle_t cublas,
                                                            const ModelShape& shape,
                                                            int max_batch, Precision precision);

}  // namespace pstrain::kernels::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_INTERNAL_H_
