/*
 * A tiny shim that gives MLX's CPU backend an optimised BLAS on Linux.
 *
 * MLX's Linux wheel links netlib's reference BLAS, which runs a float32 GEMM
 * at a few GFLOP/s.  MLX calls only three BLAS routines by their plain CBLAS
 * names: cblas_sgemm, cblas_dgemm and cblas_cgemm.  This library defines just
 * those three names and forwards each call to the prefixed copies in
 * scipy-openblas32 (scipy_cblas_sgemm, ...), whose other symbols all carry the
 * `scipy_` prefix too.  seqlib loads it with RTLD_GLOBAL *before* importing
 * mlx.core or, since seqlib.route_mlx_blas, rebinds libmlx.so's three GOT slots to these
 * functions; seqlib.native's primitives, loaded after it, bind their cblas_sgemm here too.
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
 *
 * OpenBLAS's thread count is one setting for the whole process, and two threads call BLAS at
 * once here (MLX's CPU stream, and seqlib's streaming step on the caller's thread).  So every
 * forwarded call holds one lock: a small product lowers the count, runs and restores it before
 * any other product starts, and a large one never runs while the count is lowered.
 *
 * Matrix-vector products: OpenBLAS's GEMM packs the whole matrix operand on every call, so a
 * product with one row or one column (a recurrent step at batch 1: 1 x 4H x H) costs several
 * times its GEMV.  Row-major float32 and float64 products with m == 1 or n == 1 go to GEMV.
 */
#define _GNU_SOURCE /* sched_getcpu, cpu_set_t */
#include <pthread.h>
#include <sched.h>
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

extern void scipy_cblas_sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda,
                              const float *x, int incx, float beta, float *y, int incy);
extern void scipy_cblas_dgemv(int order, int trans, int m, int n, double alpha, const double *a, int lda,
                              const double *x, int incx, double beta, double *y, int incy);

extern void scipy_openblas_set_num_threads(int threads);
extern int scipy_openblas_get_num_threads(void);
/* Sets the CPUs OpenBLAS's worker thread_idx may run on (its last index, threads - 1, is the caller);
 * weak: an OpenBLAS without it leaves the workers where the kernel puts them. */
extern int openblas_setaffinity(int thread_idx, size_t cpusetsize, cpu_set_t *cpu_set) __attribute__((weak));

#define EXPORT __attribute__((visibility("default")))
#define SMALL_GEMM (1LL << 22) /* multiply-adds: about a millisecond's work on one core */

/* The number of threads the last forwarded call ran on, for the tests. */
static volatile int last_call_threads = 0;

EXPORT int seqlib_blas_shim_last_threads(void) { return last_call_threads; }

/* Forwarded calls that ran on more than one thread.  seqlib.native's idle workers watch it: a threaded
 * product needs every core, so they stop spinning and sleep when it changes (see Workers in
 * native/cpu_loop.h). */
static volatile int64_t threaded_calls = 0;

EXPORT int64_t seqlib_blas_shim_threaded_calls(void) { return __atomic_load_n(&threaded_calls, __ATOMIC_RELAXED); }

/* The caller's CPU the workers were last kept off, and how many workers that was (-1, 0: none yet). */
static int workers_off_cpu = -1, workers_kept_off = 0;

/* OpenBLAS's workers sleep between products (this build does not spin after one), so every threaded
 * product wakes them, and the kernel may place a woken worker on the CPU of the thread that woke it.
 * It did so after other threads had kept the other CPUs busy (torch's, between the benchmark harness's
 * calls): the worker then shared the caller's CPU for the whole product while another CPU idled.  So the
 * workers may run wherever the caller may, except on the caller's CPU.  Their masks change only when the
 * caller's CPU does; otherwise a product costs one sched_getcpu (a vDSO call).  seqlib.native's own
 * workers move off their caller's CPU likewise (Workers::leave_caller_cpu in native/cpu_loop.h).
 * Chapter 13's character model, H = 128, embedding and LSTM layers forward+backward, each call after
 * torch's step and an idle wait: 20.6 -> 15.6 ms; called alone 14.4 -> 13.2 (2-core Sapphire Rapids,
 * medians of 21). */
static void keep_workers_off_caller_cpu(int threads) {
  if (openblas_setaffinity == NULL) return;
  const int cpu = sched_getcpu();
  if (cpu < 0 || (cpu == workers_off_cpu && threads - 1 <= workers_kept_off)) return;
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  if (!CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return;
  CPU_CLR(cpu, &allowed);
  for (int worker = 0; worker < threads - 1; ++worker) openblas_setaffinity(worker, sizeof allowed, &allowed);
  workers_off_cpu = cpu, workers_kept_off = threads - 1;
}

/* Before a product: one thread if it is small.  Returns the thread count to restore after it (0:
 * none).  Larger products run on as many threads as OpenBLAS is set to use (OPENBLAS_NUM_THREADS,
 * threadpoolctl, the user): the shim lowers the count for a call, never raises it. */
static int threads_for(long long multiply_adds) {
  int threads = scipy_openblas_get_num_threads();
  if (multiply_adds >= SMALL_GEMM || threads <= 1) {
    last_call_threads = threads;
    if (threads > 1) {
      __atomic_add_fetch(&threaded_calls, 1, __ATOMIC_RELAXED);
      keep_workers_off_caller_cpu(threads);
    }
    return 0;
  }
  scipy_openblas_set_num_threads(1);
  last_call_threads = 1;
  return threads;
}

static void restore_threads(int threads) {
  if (threads > 0) scipy_openblas_set_num_threads(threads);
}

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* C (m x n) = alpha op(A) op(B) + beta C with m == 1 or n == 1, row-major, as one GEMV:
 * the vector is A's one row (m == 1) or B's one column (n == 1), read with its stride.  Where
 * beta is 0, C is zeroed first: GEMM never reads C then, and a fresh buffer may hold NaNs. */
#define GEMV_PRODUCT(gemv)                                                                               \
  if (beta == 0) {                                                                                       \
    for (int i = 0; i < (m == 1 ? n : m); ++i) c[(long long)i * (m == 1 ? 1 : ldc)] = 0;               \
  }                                                                                                      \
  if (m == 1) { /* c = op(B)^T a: B is k x n (NO_TRANS) or n x k (TRANS) */                              \
    gemv(ROW_MAJOR, trans_b == NO_TRANS ? TRANS : NO_TRANS, trans_b == NO_TRANS ? k : n,                \
         trans_b == NO_TRANS ? n : k, alpha, b, ldb, a, trans_a == NO_TRANS ? 1 : lda, beta, c, 1);     \
  } else { /* c = op(A) b: A is m x k (NO_TRANS) or k x m (TRANS) */                                     \
    gemv(ROW_MAJOR, trans_a, trans_a == NO_TRANS ? m : k, trans_a == NO_TRANS ? k : m, alpha, a, lda,   \
         b, trans_b == NO_TRANS ? ldb : 1, beta, c, ldc);                                                \
  }

static int is_gemv(int order, int m, int n, int k) {
  return order == ROW_MAJOR && (m == 1 || n == 1) && m > 0 && n > 0 && k > 0;
}

/* Held by every forwarded call: the thread count it sets is the process's (see above). */
static pthread_mutex_t thread_count_lock = PTHREAD_MUTEX_INITIALIZER;

/* Counts forwarded calls, so seqlib can check that MLX really calls us. */
static volatile int64_t forwarded_calls = 0;

EXPORT int64_t seqlib_blas_shim_calls(void) { return forwarded_calls; }

/* cblas_sgemm and cblas_dgemm: the same forwarding for float and double (GEMV for one row or column). */
#define REAL_GEMM(name, type, gemm, gemv)                                                               \
  EXPORT void name(int order, int trans_a, int trans_b, int m, int n, int k, type alpha, const type *a,  \
                   int lda, const type *b, int ldb, type beta, type *c, int ldc) {                       \
    __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);                                           \
    pthread_mutex_lock(&thread_count_lock);                                                              \
    int restore = threads_for((long long)m * n * k);                                                     \
    if (is_gemv(order, m, n, k)) {                                                                       \
      GEMV_PRODUCT(gemv)                                                                                 \
    } else {                                                                                             \
      gemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                       \
    }                                                                                                    \
    restore_threads(restore);                                                                            \
    pthread_mutex_unlock(&thread_count_lock);                                                            \
  }

REAL_GEMM(cblas_sgemm, float, scipy_cblas_sgemm, scipy_cblas_sgemv)
REAL_GEMM(cblas_dgemm, double, scipy_cblas_dgemm, scipy_cblas_dgemv)

EXPORT void cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                        const void *alpha, const void *a, int lda,
                        const void *b, int ldb, const void *beta, void *c, int ldc) {
  __atomic_add_fetch(&forwarded_calls, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&thread_count_lock);
  int restore = threads_for((long long)m * n * k);
  scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  restore_threads(restore);
  pthread_mutex_unlock(&thread_count_lock);
}
