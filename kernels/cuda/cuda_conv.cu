// The convolution's CUDA kernels: im2col and col2im, per-channel bias and
// sums, 2x2 max-pooling and its backward, and the [C][B] <-> [B][C]
// transposes. The same layouts and summation orders as kernels/cpu/cnn.cc.
#include <cstdint>

#include "kernels/cuda/cuda_internal.h"

namespace pstrain::kernels::cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20));
}

#define PSTRAIN_FOR_EACH(i, n) \
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

// col[(ci*3+ky)*3+kx][(s*h+y)*w+x] = in[ci][s][y+ky-1][x+kx-1], 0 outside.
__global__ void Im2ColKernel(ConvLayer c, const float* in, int batch, float* col) {
  const int64_t pixels = static_cast<int64_t>(batch) * c.height * c.width;
  PSTRAIN_FOR_EACH(i, pixels * c.in_channels * 9) {
    const int64_t row = i / pixels, p = i % pixels;
    const int ci = static_cast<int>(row / 9), ky = static_cast<int>(row / 3 % 3),
              kx = static_cast<int>(row % 3);
    const int x = static_cast<int>(p % c.width), y = static_cast<int>(p / c.width % c.height);
    const int64_t s = p / (static_cast<int64_t>(c.width) * c.height);
    const int yy = y + ky - 1, xx = x + kx - 1;
    col[i] = yy >= 0 && yy < c.height && xx >= 0 && xx < c.width
                 ? in[((ci * static_cast<int64_t>(batch) + s) * c.height + yy) * c.width + xx]
                 : 0.0f;
  }
}

// Each input pixel gathers its patch values in (ky, kx) order, the order
// in which the CPU's col2im adds them.
__global__ void Col2ImKernel(ConvLayer c, const float* col, int batch, float* d_in) {
  const int64_t pixels = static_cast<int64_t>(batch) * c.height * c.width;
  PSTRAIN_FOR_EACH(i, pixels * c.in_channels) {
    const int ci = static_cast<int>(i / pixels);
    const int64_t p = i % pixels;
    const int xx = static_cast<int>(p % c.width), yy = static_cast<int>(p / c.width % c.height);
    const int64_t image = p - (static_cast<int64_t>(yy) * c.width + xx);  // (s, 0, 0)
    float sum = 0.0f;
    for (int ky = 0; ky < 3; ++ky) {
      const int y = yy - ky + 1;
      if (y < 0 || y >= c.height) continue;
      for (int kx = 0; kx < 3; ++kx) {
        const int x = xx - kx + 1;
        if (x < 0 || x >= c.width) continue;
        sum += col[(ci * 9 + ky * 3 + kx) * pixels + image + static_cast<int64_t>(y) * c.width + x];
      }
    }
    d_in[i] = sum;
  }
}

__global__ void FillChannelsKernel(const float* bias, int channels, int64_t pixels, float* out) {
  PSTRAIN_FOR_EACH(i, channels * pixels) { out[i] = bias[i / pixels]; }
}

// One block per row: a tree sum of the row's values.
__global__ void RowSumsKernel(const float* m, int64_t cols, float* out) {
  __shared__ float partial[kThreads];
  const float* row = m + blockIdx.x * cols;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += row[j];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

// Over planes of h x w (channel, sample): each 2x2 window's maximum (the
// first of equal ones, in row order) and where it came from.
__global__ void MaxPoolKernel(ConvLayer c, int planes, const float* in, float* out,
                              int32_t* from) {
  const int ph = c.height / 2, pw = c.width / 2;  // (ConvLayer's methods are host code)
  PSTRAIN_FOR_EACH(o, static_cast<int64_t>(planes) * ph * pw) {
    const int x = static_cast<int>(o % pw), y = static_cast<int>(o / pw % ph);
    const int64_t plane = o / (static_cast<int64_t>(pw) * ph);
    const float* image = in + plane * c.height * c.width;
    int best = 2 * y * c.width + 2 * x;
    const int candidates[3] = {best + 1, best + c.width, best + c.width + 1};
    for (int k : candidates) {
      if (image[k] > image[best]) best = k;
    }
    out[o] = image[best];
    from[o] = static_cast<int32_t>(plane * c.height * c.width + best);
  }
}

__global__ void UnpoolKernel(const int32_t* from, const float* d_pooled, int64_t n, float* dz) {
  PSTRAIN_FOR_EACH(o, n) { dz[from[o]] = d_pooled[o]; }
}

// [C][B][area] <-> [B][C][area]; to_rows: from the first to the second.
__global__ void TransposeKernel(const float* in, int channels, int batch, int area, bool to_rows,
                                float* out) {
  PSTRAIN_FOR_EACH(i, static_cast<int64_t>(channels) * batch * area) {
    const int a = static_cast<int>(i % area);
    const int64_t cb = i / area;
    const int ch = static_cast<int>(cb / batch), s = static_cast<int>(cb % batch);
    const int64_t rows_index = (static_cast<int64_t>(s) * channels + ch) * area + a;
    if (to_rows) {
      out[rows_index] = in[i];
    } else {
      out[i] = in[rows_index];
    }
  }
}

}  // namespace

void LaunchIm2Col(cudaStream_t stream, const ConvLayer& c, const float* in, int batch,
                  float* col) {
  const int64_t n = static_cast<int64_t>(batch) * c.height * c.width * c.patch();
  Im2ColKernel<<<Blocks(n), kThreads, 0, stream>>>(c, in, batch, col);
}
void LaunchCol2Im(cudaStream_t stream, const ConvLayer& c, const float* col, int batch,
                  float* d_in) {
  const int64_t n = static_cast<int64_t>(batch) * c.height * c.width * c.in_channels;
  Col2ImKernel<<<Blocks(n), kThreads, 0, stream>>>(c, col, batch, d_in);
}
void LaunchFillChannels(cudaStream_t stream, const float* bias, int channels, int64_t pixels,
                        float* out) {
  FillChannelsKernel<<<Blocks(channels * pixels), kThreads, 0, stream>>>(bias, channels, pixels,
                                                                         out);
}
void LaunchRowSums(cudaStream_t stream, const float* m, int rows, int64_t cols, float* out) {
  RowSumsKernel<<<rows, kThreads, 0, stream>>>(m, cols, out);
}
void LaunchMaxPool(cudaStream_t stream, const ConvLayer& c, int batch, const float* in,
                   float* out, int32_t* from) {
  const int planes = c.out_channels * batch;
  MaxPoolKernel<<<Blocks(static_cast<int64_t>(planes) * c.pooled_height() * c.pooled_width()),
                  kThreads, 0, stream>>>(c, planes, in, out, from);
}
void LaunchUnpool(cudaStream_t stream, const int32_t* from, const float* d_pooled, int64_t n,
                  float* dz) {
  UnpoolKernel<<<Blocks(n), kThreads, 0, stream>>>(from, d_pooled, n, dz);
}
void LaunchTranspose(cudaStream_t stream, const float* in, int channels, int batch, int area,
                     bool to_rows, float* out) {
  TransposeKernel<<<Blocks(static_cast<int64_t>(channels) * batch * area), kThreads, 0, stream>>>(
      in, channels, batch, area, to_rows, out);
}

}  // namespace pstrain::kernels::cuda
