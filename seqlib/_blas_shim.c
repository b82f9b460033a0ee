/*
 * A tiny shim that gives MLX's CPU backend an optimised BLAS on Linux.
 *
 * MLX's Linux wheel links netlib's reference BLAS, which runs a float32 GEMM
 * at a few GFLOP/s.  MLX calls only three BLAS routines by their plain CBLAS
 * names: cblas_sgemm, cblas_dgemm and cblas_cgemm.  This library defines just
 * those three names and forwards each call to the prefixed copies in
 * scipy-openblas32 (scipy_cblas_sgemm, ...), whose other symbols all carry the
 * `scipy_` prefix too.  seqlib loads it with RTLD_GLOBAL *before* importing
 * mlx.core, so the dynamic linker resolves MLX's references here first.
 *
 * We export nothing else on purpose: a library that also exported the Fortran
 * names (sgemm_, ...) would capture PyTorch's BLAS calls in the same process
 * and change its speed.
 */
#include <stdint.h>

/* CBLAS enums are passed as ints; the values are the same in every CBLAS. */
extern void scipy_cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                              float alpha, const float *a, int lda,
                              const float *b, int ldb, float beta, float *c, int ldc);
extern void scipy_cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                              double alpha, const double *a, int lda,
                              const double *b, int ldb, double beta, double *c, int ldc);
extern void scipy_cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                              const void *alpha, const void *a, int lda,
                              const void *b, int ldb, const void *beta, void *c, int ldc);

#define EXPORT __attribute__((visibility("default")))

/* Counts forwarded calls, so seqlib can check that MLX really calls us. */
static volatile int64_t forwarded_calls = 0;

EXPORT int64_t seqlib_blas_shim_calls(void) { return forwarded_calls; }

EXPORT void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        float alpha, const float *a, int lda,
                        const float *b, int ldb, float beta, float *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

EXPORT void cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        double alpha, const double *a, int lda,
                        const double *b, int ldb, double beta, double *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

EXPORT void cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        const void *alpha, const void *a, int lda,
                        const void *b, int ldb, const void *beta, void *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
