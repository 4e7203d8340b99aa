// A stand-in for the part of OpenBLAS's cblas.h that kernels/cpu uses; see
// kernels/standalone/README.md. Not used by normal builds.
#ifndef PSTRAIN_KERNELS_STANDALONE_CBLAS_H_
#define PSTRAIN_KERNELS_STANDALONE_CBLAS_H_

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };

// C = alpha op(A) op(B) + beta C, row-major only.
void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m,
                 int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc);
void openblas_set_num_threads(int threads);

#endif  // PSTRAIN_KERNELS_STANDALONE_CBLAS_H_
