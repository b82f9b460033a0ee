// seqlib_math.h: helpers shared by seqlib's kernels.
//
// Not a kernel: seqlib passes this text as the `header=` of every
// mx.fast.metal_kernel it builds.  All gate math runs in float32, whatever
// the storage type T of the arrays (float, half or bfloat).

// 1 / (1 + e^-x).  For x below -88, e^-x is +inf and the result is exactly 0;
// no input makes it NaN except NaN.
inline float sigmoid_of(float x) {
  return 1.0f / (1.0f + metal::exp(-x));
}

// The precise tanh: the fast-math one loses accuracy near 0 and can
// overflow to NaN for large |x| on some GPUs.
inline float tanh_of(float x) {
  return metal::precise::tanh(x);
}

// The bag kernels' MODE template argument (seqlib.kernels.BagMode).
constant constexpr int MODE_SUM = 0;
constant constexpr int MODE_MEAN = 1;
constant constexpr int MODE_MAX = 2;

// embedding_renorm's NORM template argument (seqlib.kernels.NormKind): which p-norm.
constant constexpr int NORM_MAX = 0;  // p = inf
constant constexpr int NORM_L1 = 1;
constant constexpr int NORM_L2 = 2;
constant constexpr int NORM_P = 3;  // any other p, through pow
