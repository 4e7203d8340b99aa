// The reference GEMM of a kernels-only build: rows of C split over threads,
// each row accumulated in the i-k-j order that vectorises.
#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cblas.h"

namespace {
int g_threads = 0;  // 0: all the machine's
}

void openblas_set_num_threads(int threads) { g_threads = threads; }

void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m,
                 int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  if (order != CblasRowMajor) std::abort();
  auto at = [&](int i, int p) {
    return trans_a == CblasNoTrans ? a[static_cast<long>(i) * lda + p]
                                   : a[static_cast<long>(p) * lda + i];
  };
  // op(B) as a k x n row-major matrix: B itself, or its transpose copied.
  std::vector<float> transposed;
  if (trans_b != CblasNoTrans) {
    transposed.resize(static_cast<size_t>(k) * n);
    for (int j = 0; j < n; ++j) {
      for (int p = 0; p < k; ++p) transposed[static_cast<size_t>(p) * n + j] = b[static_cast<long>(j) * ldb + p];
    }
    b = transposed.data();
    ldb = n;
  }
  auto rows = [&](int first, int last) {
    std::vector<float> row(n);
    for (int i = first; i < last; ++i) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (int p = 0; p < k; ++p) {
        const float s = at(i, p);
        if (s == 0.0f) continue;
        const float* brow = b + static_cast<long>(p) * ldb;
        for (int j = 0; j < n; ++j) row[j] += s * brow[j];
      }
      float* crow = c + static_cast<long>(i) * ldc;
      for (int j = 0; j < n; ++j) crow[j] = alpha * row[j] + (beta == 0.0f ? 0.0f : beta * crow[j]);
    }
  };
  const int threads = std::max(1, std::min<int>(g_threads > 0 ? g_threads
                                                              : std::thread::hardware_concurrency(),
                                                m));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back(rows, m * t / threads, m * (t + 1) / threads);
  }
  for (std::thread& t : pool) t.join();
}
