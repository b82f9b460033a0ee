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
 *
 * Threads: OpenBLAS splits any GEMM above a small size across all its threads.
 * For the small products of a recurrent step (batch 1: 1 x 4H x H) the
 * hand-off costs more than the arithmetic, and on a busy machine waiting for
 * a descheduled thread made such steps 10x slower.  Products below
 * SMALL_GEMM multiply-adds run on one thread; larger ones on as many as
 * OpenBLAS is set to use (OPENBLAS_NUM_THREADS, threadpoolctl, ...).  seqlib.native's primitives call
 * cblas_sgemm by its plain name and so come here too.
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

extern void scipy_openblas_set_num_threads(int threads);
extern int scipy_openblas_get_num_threads(void);

#define EXPORT __attribute__((visibility("default")))
#define SMALL_GEMM (1LL << 22) /* multiply-adds: about a millisecond's work on one core */

/* The number of threads the last forwarded call ran on, for the tests. */
static volatile int last_call_threads = 0;

EXPORT int seqlib_blas_shim_last_threads(void) { return last_call_threads; }

/* Before a product: one thread if it is small.  Returns the thread count to restore after it (0:
 * none).  Larger products run on as many threads as OpenBLAS is set to use (OPENBLAS_NUM_THREADS,
 * threadpoolctl, the user): the shim lowers the count for a call, never raises it. */
static int threads_for(long long multiply_adds) {
  int threads = scipy_openblas_get_num_threads();
  if (multiply_adds >= SMALL_GEMM || threads <= 1) {
    last_call_threads = threads;
    return 0;
  }
  scipy_openblas_set_num_threads(1);
  last_call_threads = 1;
  return threads;
}

static void restore_threads(int threads) {
  if (threads > 0) scipy_openblas_set_num_threads(threads);
}

/* Counts forwarded calls, so seqlib can check that MLX really calls us. */
static volatile int64_t forwarded_calls = 0;

EXPORT int64_t seqlib_blas_shim_calls(void) { return forwarded_calls; }

EXPORT void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        float alpha, const float *a, int lda,
                        const float *b, int ldb, float beta, float *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  int restore = threads_for((long long)m * n * k);
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  restore_threads(restore);
}

EXPORT void cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        double alpha, const double *a, int lda,
                        const double *b, int ldb, double beta, double *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  int restore = threads_for((long long)m * n * k);
  scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  restore_threads(restore);
}

EXPORT void cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        const void *alpha, const void *a, int lda,
                        const void *b, int ldb, const void *beta, void *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  int restore = threads_for((long long)m * n * k);
  scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  restore_threads(restore);
}
