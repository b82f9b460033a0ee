// recurrent_cpu.cpp: a recurrent layer-direction (LSTM, GRU, Elman RNN) over packed rows as MLX
// primitives on the CPU.
//
// The CPU counterpart of metal_kernels/lstm_sequence.metal and gru_sequence.metal.  MLX's own ops run a step as a
// matmul plus about ten elementwise kernels, each one pass over memory with scalar code
// on x86; here the whole time loop runs inside one primitive.  Two forms of it:
//   packed (x86 with AVX2 and FMA, sequences of 4 or more steps): w_hh packed once per call into the
//     layout of a register-tiled product, each step's product and gate math fused, the units shared
//     among a team of threads that meet once per step (see "packed" below);
//   OpenBLAS: per step one BLAS call (OpenBLAS through seqlib's BLAS shim, the recurrent matmul) and
//     one loop of gate math that the compiler vectorises for the host's vector units (-march=native):
//     short sequences, the Elman RNN, other CPUs.
// seqlib.native builds this file against the installed MLX on first use (module.cpp binds it);
// seqlib.scan calls it, and wires the backward into autodiff.
//
//   LSTMSequence, GRUSequence, RNNSequence   forward: output, final state(s), and (save) what
//                                            the backward needs; the LSTM's and the GRU's from x_gates, or
//                                            from their input x and w_ih (lstm_input_sequence,
//                                            gru_input_sequence: see computes_input_side)
//   ...SequenceBackward                      backward through the steps in reverse: the gradients
//                                            of x_gates, of the initial state(s), and for the GRU
//                                            of its hidden side (for db_hh, and dW_hh with the states
//                                            each step started from: previous_states_product); after an
//                                            input-side forward, where they are small, also d_x and the
//                                            weights' and biases' gradients (InputGradients), or where only
//                                            the input side's are, those (gradients_in_loop)
//   SwapLeadingAxes                          a batch-first input copied time-major, on several threads
//
// All are cpu_loop.h's one primitive class, CpuLoop, running one of the loops below.
//
// Shapes (float32, row-major): N packed rows, B sequences, H units; x_gates (N, 4H) is
// x W_ih^T + b_ih + b_hh in gate order i, f, g, o; w_hh (4H, H); h0, c0 (B, H).  At step t
// the first batch_sizes[t] rows of the state advance, the others keep their value, as in
// seqlib.scan.  The gate math is seqlib.pointwise's, with seqlib.activations.fast_tanh's
// rational tanh and sigmoid(x) = tanh(x / 2) / 2 + 1 / 2; built without FMA contraction,
// so AVX2 and AVX-512 machines round alike.
//
// Napkin math per step: 2 B 4H H FLOPs in the matmul, about 40 B H in the gate math; bytes:
// w_hh (16 H^2) read once per step, the gates (16 B H) written and read once.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cpu_loop.h"
#include "mlx/backend/common/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using seqlib_cpu::row_of;

// By its plain CBLAS name: seqlib's BLAS shim (seqlib/_blas_shim.c, loaded globally before this
// library) serves it with OpenBLAS, single-threaded for the small products of a step.
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// seqlib.activations.fast_tanh: x P(x^2) / Q(x^2), exactly +-1 beyond kTanhClip, NaN stays NaN.  The ratio on
// floats or on vectors of them (GCC's vector operators): the same operations in the same order, no FMA, so
// the scalar and vector loops round alike.
constexpr float kTanhClip = 7.90531110763549805f;
template <class V>
inline V tanh_ratio(V x) {
  const V s = x * x, s2 = s * s, s4 = s2 * s2;
  const V p = (0.99999999846087562f + 0.13127960818606593f * s) +
              s2 * (0.0031534538885072843f + 1.1687376471272515e-05f * s) +
              s4 * ((-2.2515741118421894e-08f + 6.4773125632460462e-11f * s) + s2 * -1.1907169347536057e-13f);
  const V q = (1.0f + 0.46461292548968347f * s) + s2 * (0.024691123530499584f + 0.00026190431069089969f * s);
  return x * p / q;
}

inline float fast_tanh(float x) { return x > kTanhClip ? 1.0f : (x < -kTanhClip ? -1.0f : tanh_ratio(x)); }

inline float fast_sigmoid(float x) { return 0.5f * fast_tanh(0.5f * x) + 0.5f; }

// x[k] plus bias[k], or x[k] where there is no bias (nullptr).  The layers pass the input product x W_ih^T
// and its bias (b_ih + b_hh, or b_ih) apart, and the loops add them as they read each row: the same bits
// as MLX's addmm, which adds the bias to each finished dot product, without addmm's pass over (N, G H)
// that broadcasts the bias into the output first (7 ms of 20 at N = 12,800, G H = 512).
inline float biased(const float* x, const float* bias, int k) { return bias != nullptr ? x[k] + bias[k] : x[k]; }

// Rows of x_gates plus the bias (where there is one) into pre (rows, width).
inline void biased_rows(float* pre, const float* x, const float* bias, int rows, int width) {
  for (int r = 0; r < rows; ++r) {
    const size_t row = static_cast<size_t>(r) * width;
    for (int k = 0; k < width; ++k) pre[row + k] = biased(x + row, bias, k);
  }
}

// count pre-activations of the Elman RNN to h and out: tanh, or relu (which keeps NaN, as torch's).
inline void rnn_rows(size_t count, bool relu, const float* pre, float* h, float* out) {
  for (size_t k = 0; k < count; ++k) {
    const float x = pre[k];
    h[k] = out[k] = relu ? (x < 0 ? 0.0f : x) : fast_tanh(x);
  }
}

struct Step {
  int first;  // first packed row of the step
  int rows;   // sequences still running at the step
  bool operator==(const Step&) const = default;
};

// The steps in the order they are computed (reversed for the reverse direction).
std::vector<Step> steps_of(const std::vector<int>& batch_sizes, bool reverse) {
  std::vector<Step> steps;
  int first = 0;
  for (int rows : batch_sizes) {
    steps.push_back({first, rows});
    first += rows;
  }
  if (reverse) std::reverse(steps.begin(), steps.end());
  return steps;
}

// Bits of a loop's option.  kInputSide: an LSTM's or a GRU's forward has its input x (N, D) as ins[0] and w_ih
// (G H, D) as ins[4], not x_gates: the loop computes each step's input side itself (see computes_input_side);
// its backward takes x and w_ih after its usual ins and gives the input side's gradients after its usual outs
// (InputGradients, input_gradients).  kSumBias: an LSTM's or a GRU's backward without kInputSide also sums its
// gates' gradients over every row, the bias gradients, in its loop (RowSums), after its usual outs.
constexpr int kSave = 1, kRelu = 2, kInputSide = 4, kSumBias = 8;

// What a primitive's loop needs besides its arrays: the steps in computing order, its option bits.
struct Loop {
  std::vector<Step> steps;
  int option;
  bool operator==(const Loop&) const = default;
};

// rows x width floats from src to dst
inline void copy_rows(float* dst, const float* src, int rows, int width) {
  std::memcpy(dst, src, sizeof(float) * rows * width);
}

// A forward's optional last input, ins[at]: the bias (G H,) added to every row of x_gates; nullptr without one.
inline const float* bias_input(const std::vector<mx::array>& ins, size_t at) {
  return ins.size() > at ? ins[at].data<float>() : nullptr;
}

// Where an LSTM's or a GRU's optional bias sits among its forward's ins (its vjp's primals): after w_ih where the
// loop computes its input side (kInputSide), else after the states.
inline size_t gate_bias_at(const Loop& loop) { return loop.option & kInputSide ? 5 : 4; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The vector of floats of the loops' gate math (forward and backward), for the widest vectors the build has
// (-march=native); arithmetic is GCC's vector operators, and here are the operations those lack.  With
// `lanes` below kLanes (the last units of a row) load and store touch only the first lanes floats (masked:
// the others read as zero, are never written, and fault on no page).
namespace simd {
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline __mmask16 first(int lanes) { return static_cast<__mmask16>((1u << lanes) - 1); }
inline Vec load(const float* p, int lanes = kLanes) {
  return lanes == kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first(lanes), p);
}
inline void store(float* p, Vec v, int lanes = kLanes) {
  if (lanes == kLanes) return _mm512_storeu_ps(p, v);
  _mm512_mask_storeu_ps(p, first(lanes), v);
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, rounded once
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
// 1 where x > clip, -1 where x < -clip, else value (NaN: neither)
inline Vec clipped(Vec x, Vec value, float clip) {
  const __mmask16 high = _mm512_cmp_ps_mask(x, _mm512_set1_ps(clip), _CMP_GT_OQ);
  const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-clip), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(high, _mm512_mask_blend_ps(low, value, _mm512_set1_ps(-1.0f)), _mm512_set1_ps(1.0f));
}
// r[0..16) as the rows of a 16 x 16 tile, replaced by its columns: r[j][i] = r[i][j] before.  Lanes swap in
// pairs, then in pairs of pairs within each 128-bit quarter, then the quarters among groups of four registers.
inline void transpose(Vec r[kLanes]) {
  Vec t[kLanes];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 8; ++i) {
    const int a = i / 4 * 8 + i % 4;
    t[a] = _mm512_shuffle_f32x4(r[a], r[a + 4], 0x88), t[a + 4] = _mm512_shuffle_f32x4(r[a], r[a + 4], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline __m256i first(int lanes) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load(const float* p, int lanes = kLanes) {
  return lanes == kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(lanes));
}
inline void store(float* p, Vec v, int lanes = kLanes) {
  if (lanes == kLanes) return _mm256_storeu_ps(p, v);
  _mm256_maskstore_ps(p, first(lanes), v);
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec clipped(Vec x, Vec value, float clip) {
  const Vec high = _mm256_cmp_ps(x, _mm256_set1_ps(clip), _CMP_GT_OQ);
  const Vec low = _mm256_cmp_ps(x, _mm256_set1_ps(-clip), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_blendv_ps(value, _mm256_set1_ps(-1.0f), low), _mm256_set1_ps(1.0f), high);
}
// r[0..8) as the rows of an 8 x 8 tile, replaced by its columns: r[j][i] = r[i][j] before.
inline void transpose(Vec r[kLanes]) {
  Vec t[kLanes], q[kLanes];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    q[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), q[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    q[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), q[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(q[i], q[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(q[i], q[i + 4], 0x31);
  }
}
#endif
}  // namespace simd
using simd::Vec;

// fast_tanh and fast_sigmoid on a vector: the scalar versions' operations on every lane.
inline Vec fast_tanh(Vec x) { return simd::clipped(x, tanh_ratio(x), kTanhClip); }
inline Vec fast_sigmoid(Vec x) { return 0.5f * fast_tanh(0.5f * x) + 0.5f; }
#endif

// bias[first, end) += the sum of d's count rows (stride ldd) there, row by row: each column adds its rows in
// order, on vectors where the build has them, one float at a time where not (the same bits either way).
inline void accumulate_sums(int first, int end, int count, const float* d, size_t ldd, float* bias) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int g = first; g < end; g += simd::kLanes) {
    const int lanes = std::min(simd::kLanes, end - g);
    Vec sum = simd::load(bias + g, lanes);
    for (int k = 0; k < count; ++k) sum = sum + simd::load(d + k * ldd + g, lanes);
    simd::store(bias + g, sum, lanes);
  }
#else
  for (int k = 0; k < count; ++k) {
    for (int g = first; g < end; ++g) bias[g] += d[k * ldd + g];
  }
#endif
}

// The bias gradients that a backward without kInputSide takes in its loop (kSumBias): sum (width,) += every
// step's rows of `rows` (N, width), a step at a time in the loop's order, each step's rows in order, whichever
// thread takes which columns: the same bits for every team.  Taken after each step's meeting, while its rows
// are in cache (a team that never meets takes them after the loop, in the same order), where MLX's sum over the
// rows read them all back from memory on one thread afterwards: 1.9 ms of an LSTM's 100 ms forward+backward at
// (T, B, D, H) = (100, 32, 256, 512) (2-core AVX-512 Xeon).
struct RowSums {
  const mx::array* rows;
  float* sum;
};

// The columns [first, end) of each of sums, with the rows of step.
inline void add_row_sums(const std::vector<RowSums>& sums, const Step& step, int first, int end) {
  for (const RowSums& s : sums) {
    accumulate_sums(first, end, step.rows, row_of(*s.rows, step.first), s.rows->shape(1), s.sum);
  }
}

// A backward's RowSums where its loop has kSumBias (else none), zeroed: the sums of `rows` in outs[first_sum], ...,
// as many of them as there are (the GRU's b_ih's only where its forward had a bias).
std::vector<RowSums> bias_sums(const Loop& loop, std::vector<mx::array>& outs,
                               const std::vector<const mx::array*>& rows, size_t first_sum) {
  std::vector<RowSums> sums;
  if (!(loop.option & kSumBias)) return sums;
  for (size_t k = 0; k < rows.size() && first_sum + k < outs.size(); ++k) {
    float* sum = outs[first_sum + k].data<float>();
    std::fill_n(sum, outs[first_sum + k].size(), 0.0f);
    sums.push_back({rows[k], sum});
  }
  return sums;
}

// The sums over a whole loop, on one thread (a loop that is not packed; every sum G H wide).
void sum_rows(const Loop& loop, const std::vector<RowSums>& sums) {
  if (sums.empty()) return;
  for (auto step = loop.steps.rbegin(); step != loop.steps.rend(); ++step) {
    add_row_sums(sums, *step, 0, sums[0].rows->shape(1));
  }
}

// The LSTM's gate math for one unit (seqlib.pointwise's), on floats or on vectors of them (the same
// operations in the same order: both round alike): the pre-activations i, f, g, o become activations, c
// advances; returns tanh of the new c (h is o times it).
template <class V>
inline V lstm_unit(V& i, V& f, V& g, V& o, V& c) {
  i = fast_sigmoid(i), f = fast_sigmoid(f), g = fast_tanh(g), o = fast_sigmoid(o);
  c = f * c + i * g;
  return fast_tanh(c);
}

// The GRU's (torch's), likewise: from the input sides x_r, x_z, x_n and the hidden sides (with b_hh) hs_r,
// hs_z, hs_n, the activations r, z, n; returns the new h.
template <class V>
inline V gru_unit(V x_r, V x_z, V x_n, V hs_r, V hs_z, V hs_n, V h_prev, V& reset, V& update, V& n) {
  reset = fast_sigmoid(x_r + hs_r);
  update = fast_sigmoid(x_z + hs_z);
  n = fast_tanh(x_n + reset * hs_n);
  return n + update * (h_prev - n);
}

// The LSTM's backward through one unit's gate math (seqlib.pointwise's), on floats or on vectors of them
// (the same operations in the same order: both round alike): from its activations, tanh of its cell, its
// previous cell and the gradient reaching its output, the gradients of its four pre-activations; d_c moves
// back a step.
template <class V>
inline void lstm_unit_backward(V i, V f, V g, V o, V tanh_c, V c_prev, V d_out, V& d_c, V& d_i, V& d_f, V& d_g,
                               V& d_o) {
  const V dc = d_c + d_out * o * (1.0f - tanh_c * tanh_c);
  d_i = dc * g * i * (1.0f - i);
  d_f = dc * c_prev * f * (1.0f - f);
  d_g = dc * i * (1.0f - g * g);
  d_o = d_out * tanh_c * o * (1.0f - o);
  d_c = dc * f;
}

// The GRU's, likewise: from its activations r, z, n, its hidden side's n part, its previous state and the
// gradient reaching its output, the gradients of r, z, n (the hidden side's n is d_n r) and of the direct path.
template <class V>
inline void gru_unit_backward(V reset, V update, V n, V hs_n, V h_prev, V d_out, V& d_r, V& d_z, V& d_n, V& d_h) {
  d_n = d_out * (1.0f - update) * (1.0f - n * n);
  d_z = d_out * (h_prev - n) * update * (1.0f - update);
  d_r = d_n * hs_n * reset * (1.0f - reset);
  d_h = d_out * update;
}

// How for_units' body reads and writes the units it is given: a vector's first `lanes` floats (masked), or
// one float where the build has no AVX2.
#if defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  int lanes;
  Vec operator()(const float* p) const { return simd::load(p, lanes); }
  void put(float* p, Vec v) const { simd::store(p, v, lanes); }
};
#else
struct Lanes {
  float operator()(const float* p) const { return *p; }
  void put(float* p, float v) const { *p = v; }
};
#endif

// biased() through a Lanes reader: x[k..] (+ bias[bias_k..] where there is a bias).
template <class At>
inline auto biased_at(At at, const float* x, int k, const float* bias, int bias_k) {
  const auto value = at(x + k);
  return bias != nullptr ? value + at(bias + bias_k) : value;
}
template <class At>
inline auto biased_at(At at, const float* x, const float* bias, int k) {
  return biased_at(at, x, k, bias, k);
}

// Units [first, end) of a row: body(j, at) for each vector of them (the last one partial), or for each unit
// where the build has no AVX2; at(p) reads the units at p, at.put(p, v) writes them.
template <class Body>
inline void for_units(int first, int end, Body body) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int j = first; j < end; j += simd::kLanes) body(j, Lanes{std::min(simd::kLanes, end - j)});
#else
  for (int j = first; j < end; ++j) body(j, Lanes{});
#endif
}

// Where a forward saves what its backward reads (save), per row and unit `slots` floats: the LSTM's activations
// i, f, g, o and its new c (5), the GRU's activations r, z, n and its hidden side's n part (4); each in a slot
// of `units` floats for each block of units of the row.  A step's rows take consecutive rows of the array,
// laid out block by block: block 0 of every row of the step in turn, then block 1, and so on.  The packed
// loop's gate math runs a block at a time over the step's rows, so it writes one sequential stream (a row's
// slots of a block are adjacent, the next row's follow); with the slots in rows of the usual layout each block
// of an LSTM wrote five lines 2 KB apart per row (H = 128), and the saving forward took 1.7 ms more than the
// inference one instead of 0.3-0.7 (2-core Sapphire Rapids, (T, B, H) = (32, 64, 128), D = 32 / 128: 2.79 /
// 3.54 ms -> 2.16-2.25 / 2.77-2.95; inference 1.78-1.94 / 2.39-2.57).  One layer's forward+backward, three
// alternated processes, medians of 15: (T, B, D, H) = (32, 64, 32, 128) 8.2-8.8 -> 7.4-7.7 ms, (200, 64, 128,
// 128) 72-73 -> 64-66, (100, 32, 256, 512) 146-148 -> 140-142.  units: the build's vector (kLanes
// floats) where it has AVX2, else the whole row (one block: the usual row layout); rows are padded to whole
// blocks, the padding never written nor read.
constexpr int kLstmSlots = 5, kGruSlots = 4;
struct SavedBlocks {
  int slots, units, blocks;
  SavedBlocks(int hidden, int slot_count)
      : slots(slot_count), units(block_units(hidden)), blocks((hidden + units - 1) / units) {}
  int row_floats() const { return slots * blocks * units; }  // the array's width
  // The offset of slot `slot` of unit j of the step's row r: j the first unit of a vector with AVX2 (a vector
  // never crosses a block), any unit without (one block).
  size_t at(const Step& step, int r, int slot, int j) const {
    const size_t block_row = static_cast<size_t>(j / units) * step.rows + r;
    return static_cast<size_t>(step.first) * row_floats() + (block_row * slots + slot) * units + j % units;
  }

 private:
  static int block_units(int hidden) {
#if defined(__AVX2__) && defined(__FMA__)
    (void)hidden;
    return simd::kLanes;
#else
    return std::max(hidden, 1);
#endif
  }
};

// One row's LSTM gate math: a (4H) holds the row's pre-activations i, f, g, o and becomes their
// activations; c_row advances in place; h_row and out_row get the new h; where saved is not nullptr, the
// activations and the new c go to its slots for row r of the step (SavedBlocks, kLstmSlots).
inline void lstm_row(int hidden, float* a, float* c_row, float* h_row, float* out_row, float* saved = nullptr,
                     const Step* step = nullptr, int r = 0) {
  const SavedBlocks layout(hidden, kLstmSlots);
  for_units(0, hidden, [&](int j, Lanes at) {
    auto i = at(a + j), f = at(a + hidden + j), g = at(a + 2 * hidden + j), o = at(a + 3 * hidden + j);
    auto c = at(c_row + j);
    const auto tanh_c = lstm_unit(i, f, g, o, c), h = o * tanh_c;
    at.put(a + j, i), at.put(a + hidden + j, f), at.put(a + 2 * hidden + j, g), at.put(a + 3 * hidden + j, o);
    at.put(c_row + j, c), at.put(h_row + j, h), at.put(out_row + j, h);
    if (saved != nullptr) {
      float* slots = saved + layout.at(*step, r, 0, j);
      at.put(slots, i), at.put(slots + layout.units, f), at.put(slots + 2 * layout.units, g);
      at.put(slots + 3 * layout.units, o), at.put(slots + 4 * layout.units, c);
    }
  });
}

// One row's GRU gate math: x (3H) the input side r, z, n (plus bias, where not nullptr), hs (3H) the
// hidden side with b_hh; h_row advances in place, out_row gets the new h; where saved is not nullptr, the
// activations r, z, n and hs's n part go to its slots for row r of the step (SavedBlocks, kGruSlots).
inline void gru_row(int hidden, const float* x, const float* bias, const float* hs, float* h_row, float* out_row,
                    float* saved = nullptr, const Step* step = nullptr, int r = 0) {
  const SavedBlocks layout(hidden, kGruSlots);
  for_units(0, hidden, [&](int j, Lanes at) {
    decltype(at(x)) reset, update, n;
    const auto h = gru_unit(biased_at(at, x, bias, j), biased_at(at, x, bias, hidden + j),
                            biased_at(at, x, bias, 2 * hidden + j), at(hs + j), at(hs + hidden + j),
                            at(hs + 2 * hidden + j), at(h_row + j), reset, update, n);
    at.put(h_row + j, h), at.put(out_row + j, h);
    if (saved != nullptr) {
      float* slots = saved + layout.at(*step, r, 0, j);
      at.put(slots, reset), at.put(slots + layout.units, update), at.put(slots + 2 * layout.units, n);
      at.put(slots + 3 * layout.units, at(hs + 2 * hidden + j));
    }
  });
}

// The step computed before `step` in loop (nullptr for the first): where a row's state came from.
inline const Step* earlier_step(const Loop& loop, const Step& step) {
  return &step == loop.steps.data() ? nullptr : &step - 1;
}

// Whether row r of a step took its state from the earlier step (earlier_step) rather than from the initial state
// (the first step; in the reverse direction, a sequence that joins at this step).
inline bool continues(const Step* earlier, int r) { return earlier != nullptr && r < earlier->rows; }

// How many of a step's first `rows` rows continue (continues): rows [0, n) do, rows [n, rows) start from the initial
// state (a step's rows are its sequences in order, the longest first, so those that continue come first).
inline int continuing_rows(const Step* earlier, int rows) {
  return earlier != nullptr ? std::min(earlier->rows, rows) : 0;
}

// The LSTM's backward through one step's gate math, for units [first, end) of rows [first_row, end_row) (those
// of the step's rows that fall there): d_gates (the step's rows, from its first: rows of outs[0] or a
// GateRows buffer) from d_h (the gradient reaching h, rows of d_h0's buffer) and d_c, which moves back a step
// in place.  tanh of the step's c is computed again (the forward's function on the same floats:
// the same bits); the c before the step is the earlier step's saved c, or c0's row where the row was not in
// that step (the first step; a sequence that joins later in the reverse direction).  ins and outs as
// lstm_backward's; earlier: earlier_step(loop, step); first a multiple of the saved blocks' units.
void lstm_gate_backward(const std::vector<mx::array>& ins, float* d_gates, const Step& step, const Step* earlier,
                        const float* d_h, float* d_c, int first, int end, int first_row, int end_row) {
  const int hidden = ins[4].shape(1);
  const SavedBlocks layout(hidden, kLstmSlots);
  const float* saved = ins[1].data<float>();
  for (int r = first_row; r < std::min(end_row, step.rows); ++r) {
    const int row = step.first + r;
    const float* c0_row = row_of(ins[2], r);
    const float* d_output = row_of(ins[3], row);
    float* d_a = d_gates + static_cast<size_t>(r) * 4 * hidden;
    const float* d_h_row = d_h + static_cast<size_t>(r) * hidden;
    float* d_c_row = d_c + static_cast<size_t>(r) * hidden;
    for_units(first, end, [&](int j, Lanes at) {
      const float* slots = saved + layout.at(step, r, 0, j);
      const float* c_prev = continues(earlier, r) ? saved + layout.at(*earlier, r, 4, j) : c0_row + j;
      const int units = layout.units;
      auto d_c_j = at(d_c_row + j);
      decltype(d_c_j) d_i, d_f, d_g, d_o;
      lstm_unit_backward(at(slots), at(slots + units), at(slots + 2 * units), at(slots + 3 * units),
                         fast_tanh(at(slots + 4 * units)), at(c_prev), at(d_output + j) + at(d_h_row + j), d_c_j, d_i,
                         d_f, d_g, d_o);
      at.put(d_a + j, d_i), at.put(d_a + hidden + j, d_f), at.put(d_a + 2 * hidden + j, d_g);
      at.put(d_a + 3 * hidden + j, d_o), at.put(d_c_row + j, d_c_j);
    });
  }
}

// The GRU's backward through one step's gate math, for units [first, end) of rows [first_row, end_row) (those
// of the step's rows that fall there): the gradients of
// its input and hidden sides (the step's rows, from its first: rows of outs[0] and outs[1] or GateRows buffers)
// from d_h, which takes the direct path's part (the
// recurrent product's is added after).  The state before the step is the earlier step's output row, or h0's
// where the row was not in it (as the LSTM's c: lstm_gate_backward).  ins and outs as gru_backward's; earlier:
// earlier_step(loop, step); first a multiple of the saved blocks' units.
void gru_gate_backward(const std::vector<mx::array>& ins, float* d_input_side, float* d_hidden_side,
                       const Step& step, const Step* earlier, float* d_h, int first, int end, int first_row,
                       int end_row) {
  const int hidden = ins[5].shape(1);
  const SavedBlocks layout(hidden, kGruSlots);
  const float* saved = ins[1].data<float>();
  for (int r = first_row; r < std::min(end_row, step.rows); ++r) {
    const int row = step.first + r;
    const float* h_prev = continues(earlier, r) ? row_of(ins[2], earlier->first + r) : row_of(ins[3], r);
    const float* d_output = row_of(ins[4], row);
    float* d_input = d_input_side + static_cast<size_t>(r) * 3 * hidden;
    float* d_hidden = d_hidden_side + static_cast<size_t>(r) * 3 * hidden;
    float* d_h_row = d_h + static_cast<size_t>(r) * hidden;
    for_units(first, end, [&](int j, Lanes at) {
      const float* slots = saved + layout.at(step, r, 0, j);
      const int units = layout.units;
      const auto reset = at(slots);
      std::remove_const_t<decltype(reset)> d_r, d_z, d_n, d_direct;
      gru_unit_backward(reset, at(slots + units), at(slots + 2 * units), at(slots + 3 * units), at(h_prev + j),
                        at(d_output + j) + at(d_h_row + j), d_r, d_z, d_n, d_direct);
      at.put(d_input + j, d_r), at.put(d_hidden + j, d_r);
      at.put(d_input + hidden + j, d_z), at.put(d_hidden + hidden + j, d_z);
      at.put(d_input + 2 * hidden + j, d_n), at.put(d_hidden + 2 * hidden + j, d_n * reset);
      at.put(d_h_row + j, d_direct);  // the direct path
    });
  }
}

// A barrier for a team of threads that meet once per time step: the last to arrive opens the next
// generation; the others spin while the partners they wait for make progress, and sleep on the generation (a
// futex, woken by the last to arrive) once they do not.  A waiting thread watches one partner that has not
// arrived: it spins on while that partner counts beats (progress(), called by the loops between tiles), is
// being woken from such a sleep, or has not met once yet (it may be starting: a worker woken from its
// semaphore, packing its blocks); it sleeps after kStallTime without a sign of one of these (the partner is
// queued behind another thread: spinning would keep a core from it), and after kSpinTime in any case.  It
// also yields its CPU where another thread of the team last met on that CPU.
//
// Both halves were measured.  Sleeping: on a 2-core virtual machine, a team of two woken after the process
// was idle (as the benchmark harness times each call) often ran on one core, a step's partners taking turns,
// and the LSTM at (T, B, D, H) = (50, 1, 64, 256) took 10-12 ms where it takes 1.2 while its threads spun
// without a bound; and with a 500 us spin that did not watch its partners, a fresh clone's unit tests (torch's
// threads spinning between the oracle's calls) took 14.7 minutes instead of 3.4 (though a later fresh clone
// without that spin once took 14.3, and 4.2 when rerun: that figure may be partly the machine's).
// Spinning: on a 16-core Sapphire Rapids virtual machine a thread woken from the futex arrives late at the next meeting
// by its wake-up (a halted virtual CPU is woken by the host), so that with a 45 us spin its partners slept again at the
// next step, and at the next: one LSTM layer's forward at (35, 20, 650, 650) took 23 ms, its loop 7.1, with 359 of the
// loop's 525 waits asleep; spinning about 0.7 ms, 6.0 ms, the loop 3.2, none asleep (torch: 6.4).
class StepBarrier {
 public:
  explicit StepBarrier(int count) : count_(count), members_(std::make_unique<Member[]>(count)) {}

  // A sign of progress from thread `thread` (cheap: one store to its own cache line).
  void progress(int thread) {
    Member& me = members_[thread];
    me.beats.store(me.beats.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }

  // Called by each thread of the team, thread = 0 .. count - 1, once per meeting.
  void wait(int thread) {
    if (count_ == 1) return;
    Member& me = members_[thread];
    me.cpu.store(sched_getcpu(), std::memory_order_relaxed);
    progress(thread);
    const int generation = generation_.load(std::memory_order_acquire);
    me.arrived.store(generation, std::memory_order_relaxed);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      generation_.notify_all();  // a system call only where a thread sleeps on it
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    auto last_sign = start;  // when the watched partner last showed progress
    int watched = -1;
    unsigned beats = 0;
    for (int spins = 1; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      seqlib_cpu::spin_pause();
      if (spins % kCheckEvery != 0) continue;
      const auto now = std::chrono::steady_clock::now();
      const int late = late_partner(generation);
      if (late >= 0) {
        const Member& partner = members_[late];
        const unsigned seen = partner.beats.load(std::memory_order_relaxed);
        if (late != watched || seen != beats || seen == 0 || partner.waking.load(std::memory_order_relaxed)) {
          last_sign = now;
        }
        watched = late, beats = seen;
      }
      if (now - last_sign > kStallTime || now - start > kSpinTime) {
        me.waking.store(true, std::memory_order_relaxed);  // until it runs again, partners know it is waking
        while (generation_.load(std::memory_order_acquire) == generation) {
          generation_.wait(generation, std::memory_order_acquire);
        }
        me.waking.store(false, std::memory_order_relaxed);
        return;
      }
      if (shares_cpu(thread)) sched_yield();  // a partner may be waiting for this CPU: let it run
    }
  }

 private:
  static constexpr int kCheckEvery = 128;  // pauses between looks at the clock and the partners (~1.5 us)
  static constexpr std::chrono::microseconds kStallTime{100}, kSpinTime{500};
  struct alignas(64) Member {  // what a thread shows its partners, on a cache line of its own
    std::atomic<unsigned> beats{0};  // progress() calls and meetings
    std::atomic<int> arrived{-1};    // the last generation it met at
    std::atomic<int> cpu{-1};        // the CPU it last met on
    std::atomic<bool> waking{false};  // asleep at a meeting, or woken and not yet running
  };

  // A thread that has not arrived at this generation's meeting, or -1.
  int late_partner(int generation) const {
    for (int other = 0; other < count_; ++other) {
      if (members_[other].arrived.load(std::memory_order_relaxed) != generation) return other;
    }
    return -1;
  }

  // Whether another thread of the team last met on the CPU this one runs on (a stale answer costs a yield).
  bool shares_cpu(int thread) const {
    const int cpu = sched_getcpu();
    for (int other = 0; other < count_; ++other) {
      if (other != thread && members_[other].cpu.load(std::memory_order_relaxed) == cpu) return true;
    }
    return false;
  }

  const int count_;
  std::unique_ptr<Member[]> members_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

// body(thread, threads, barrier) on `threads` threads at once (this one and threads - 1 of run_parallel's), all
// sharing one barrier.
template <class Body>
void run_team(int threads, Body body) {
  StepBarrier barrier(threads);
  seqlib_cpu::run_parallel(threads, [&](int thread) { body(thread, threads, barrier); });
}

// ----------------------------------------------------------------- LSTM and GRU, packed (AVX2 and AVX-512)
//
// For a sequence of many steps the recurrent product of each step, h (rows, H) @ w_hh^T (H, G H), is
// small: OpenBLAS repacks all of w_hh on every call and, for a product this size, spends more time
// around it than in it.  Here w_hh is packed once per sequence into blocks of kUnits hidden units (one
// vector: 16 with AVX-512, 8 with AVX2): block b holds, for every k, the weights of units
// kUnits b .. kUnits (b + 1) - 1 of every gate, one slot of kUnits columns each (LSTM: i, f, g, o, kTile =
// 4 kUnits columns; GRU: r, z, n, 3 kUnits), so one register tile of (up to rows_per_tile_of(3 or 4) rows) x
// the block's columns accumulates all gates of a block's units, and the gate math runs on
// the tile (the "epilogue"), one vector per gate and row: the gates' products never go through memory.
// Per k and row the tile broadcasts one h and multiplies it into the block's columns (tile_product).
// Used where the build has AVX2 and FMA and runs_packed says so; otherwise the OpenBLAS loops below
// run.  Same math, other summation order: the results agree with the OpenBLAS loops to float32
// rounding.  AVX2 and AVX-512 builds give the same bits: each output adds its products in the order
// of k with one FMA each, and the gate math does the same operations on every lane.
//
// The backward's product, d_gates (rows, G H) @ w_hh (G H, H), runs on the same tiles: w_hh packed
// once per backward into blocks of kTile columns of H (pack_column_blocks), K = G H.
#if defined(__AVX2__) && defined(__FMA__)
constexpr int kUnits = simd::kLanes, kTile = 4 * kUnits;  // one block: kUnits units x 4 gates
constexpr int kRowsPerTile = 6;
// The rows of a tile of `slots` vectors: 8 for the GRU's three (the loop alone, 2-core Sapphire Rapids, three
// alternated processes, ms: (T, B, H) = (100, 32, 512) 20.3-21.9 -> 19.2-19.7, (35, 20, 650) 7.9-8.6 ->
// 7.4-7.9, (200, 64, 128) 6.9-7.1 -> 6.5-7.2).
#if defined(__AVX512F__)
constexpr int rows_per_tile_of(int slots) { return slots == 3 ? 8 : kRowsPerTile; }
#else
constexpr int rows_per_tile_of(int slots) { return slots == 3 ? 4 : kRowsPerTile; }  // 12 accumulators of 16
#endif
constexpr int kPackedMinSteps = 4;

// count floats on a 64-byte boundary (the packed weights, the tiles' products): a tile's vector loads then
// never straddle two cache lines.  Not initialised: each user writes what it reads.
class AlignedFloats {
 public:
  explicit AlignedFloats(size_t count) : storage_(new float[count + 16]) {
    const auto address = reinterpret_cast<uintptr_t>(storage_.get());
    data_ = storage_.get() + ((64 - address % 64) % 64) / sizeof(float);
  }
  float* data() { return data_; }
  const float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> storage_;
  float* data_;
};

// Blocks [first, end) of w (G H, K), G = gates: 4 (LSTM) or 3 (GRU), packed into (blocks, K, G kUnits):
// packed[b][k][g kUnits + u] = w[g H + kUnits b + u][k]; zero past H.  A gate's kUnits rows of a block are one
// run of w: read kUnits floats of each at a time, transposed in registers, written as kUnits rows of its slot.
// (One float at a time, k by k across the rows, waited on memory: 0.55 ms against 0.27 for w_hh at H = 650 on
// one Zen 5 core, from L3; 1.49 against 0.67 from DRAM.)
// w is w_hh (K = H) or, where an LSTM's or a GRU's loop computes its input side, w_ih (K = D).
// Each thread of a packed loop packs the blocks it multiplies by (they then sit in its own caches).
void pack_gate_blocks(const float* w, int hidden, int depth, int gates, int first, int end, float* packed) {
  const int width = gates * kUnits;
  for (int b = first; b < end; ++b) {
    const int units = std::min(kUnits, hidden - b * kUnits);
    float* block = packed + static_cast<size_t>(b) * depth * width;
    for (int g = 0; g < gates; ++g) {
      const float* rows = w + (static_cast<size_t>(g) * hidden + static_cast<size_t>(b) * kUnits) * depth;
      for (int k = 0; k < depth; k += kUnits) {
        const int count = std::min(kUnits, depth - k);
        Vec tile[kUnits];  // rows u of w, floats k .. k + count, then columns k .. k + count of them
        for (int u = 0; u < kUnits; ++u) {
          tile[u] = u < units ? simd::load(rows + static_cast<size_t>(u) * depth + k, count) : simd::broadcast(0.0f);
        }
        simd::transpose(tile);
        for (int j = 0; j < count; ++j) simd::store(block + static_cast<size_t>(k + j) * width + g * kUnits, tile[j]);
      }
    }
  }
}

// Blocks [first, end) of w (K, N) row-major packed into (blocks, K, kTile): packed[b][k][j] = w[k][kTile b + j],
// zero past N.  The backward's right-hand side: d_h = d_gates @ w_hh with K = G H, N = H.
void pack_column_blocks(const float* w, int depth, int width, int first, int end, float* packed) {
  for (int b = first; b < end; ++b) {
    const int columns = std::min(kTile, width - b * kTile);
    for (int k = 0; k < depth; ++k) {
      float* row = packed + (static_cast<size_t>(b) * depth + k) * kTile;
      std::memcpy(row, w + static_cast<size_t>(k) * width + b * kTile, sizeof(float) * columns);
      std::fill(row + columns, row + kTile, 0.0f);
    }
  }
}

using seqlib_cpu::l2_bytes;

// Lines of data that a tile asks L2 for while it multiplies, one per k (its first `lines` k): the next chunk's
// weights, which the next tiles will read (rows_product).
struct Ahead {
  const char* from = nullptr;
  int lines = 0;
};

// Lines of memory that a packed backward asks for a few at a time between its tiles, so that their latency hides
// behind the tiles' FMAs (see "Asked for a step ahead" at packed_backward_steps): runs of `count` segments of
// `bytes` bytes each, `stride` bytes apart, asked into L2.
class LineRequests {
 public:
  void clear() { runs_.clear(), run_ = 0, segment_ = 0, line_ = 0, lines_ = 0; }
  void add(const void* from, size_t bytes, int count = 1, size_t stride = 0) {
    if (bytes == 0 || count <= 0) return;
    runs_.push_back({static_cast<const char*>(from), bytes, stride, count});
    lines_ += static_cast<size_t>(count) * (bytes / 64 + 2);  // at most: a segment may straddle a line more
  }
  size_t lines() const { return lines_; }  // an upper bound on the lines added since clear()
  // Ask for the next `lines` lines (fewer once every line has been asked for).
  void issue(size_t lines) {
    while (lines > 0 && run_ < runs_.size()) {
      const Run& run = runs_[run_];
      const auto start = reinterpret_cast<uintptr_t>(run.from + segment_ * run.stride);
      const uintptr_t last = (start + run.bytes - 1) & ~uintptr_t{63};
      if (line_ == 0) line_ = start & ~uintptr_t{63};
      for (; line_ <= last && lines > 0; line_ += 64, --lines) {
        _mm_prefetch(reinterpret_cast<const char*>(line_), _MM_HINT_T1);
      }
      if (line_ <= last) return;
      line_ = 0;
      if (++segment_ == static_cast<size_t>(run.count)) segment_ = 0, ++run_;
    }
  }

 private:
  struct Run {
    const char* from;
    size_t bytes, stride;
    int count;
  };
  std::vector<Run> runs_;
  size_t run_ = 0, segment_ = 0, lines_ = 0;
  uintptr_t line_ = 0;  // the next line of the current segment; 0 before its first
};

// tile (ROWS, SLOTS kUnits) = a[ROWS rows of stride lda, depth columns] @ block (depth, SLOTS kUnits), or with resume
// tile += that product: the accumulators start from the tile, so a product taken in chunks of depth adds
// its products in the same order, and rounds the same, as one taken whole.
#if defined(__AVX512F__)
// AVX-512 (32 registers): per k the block's SLOTS vectors of 16 columns (4 for the LSTM, 3 for the GRU),
// loaded once, and ROWS broadcasts (up to rows_per_tile_of(SLOTS): 6 or 8) into SLOTS ROWS accumulators: the
// LSTM's 24 FMAs per 10 loads, the GRU's 24 per 11.
// (Blocks of 8 units, 32 columns in 2 vectors x 8 rows, took 10 loads per 16 FMAs: their product ran
// 7-11% slower alone, on a 2-core Sapphire Rapids.)  The GRU's three slots instead of four with a zero one
// (the loop alone, three alternated processes, 2-core Sapphire Rapids, ms): (T, B, H) = (100, 32, 512)
// 27.1-27.9 -> 20.6-22.2, (35, 20, 650) 10.4-10.9 -> 8.0-8.1, (200, 64, 128) 8.5-8.6 -> 7.3-8.5, (50, 1,
// 256) 0.36-0.37 -> 0.31-0.33; the LSTM's loop unchanged by the template (27.6-28.3 / 27.3-27.8 ms at (100, 32,
// 512)).
template <int ROWS, int SLOTS>
inline void tile_product(const float* a, int lda, int depth, const float* block, float* tile, bool resume,
                         Ahead ahead = {}) {
  constexpr int width = SLOTS * kUnits;
  __m512 acc[ROWS][SLOTS];
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < SLOTS; ++v) {
      acc[r][v] = resume ? _mm512_loadu_ps(tile + r * width + 16 * v) : _mm512_setzero_ps();
    }
  }
  for (int k = 0; k < depth; ++k) {
    const float* w = block + static_cast<size_t>(k) * width;
    if (k < ahead.lines) _mm_prefetch(ahead.from + 64 * k, _MM_HINT_T1);
    __m512 weights[SLOTS];
    for (int v = 0; v < SLOTS; ++v) weights[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 x = _mm512_set1_ps(a[static_cast<size_t>(r) * lda + k]);
      for (int v = 0; v < SLOTS; ++v) acc[r][v] = _mm512_fmadd_ps(x, weights[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < SLOTS; ++v) _mm512_storeu_ps(tile + r * width + 16 * v, acc[r][v]);
  }
}
#else
// AVX2 (16 registers): the LSTM's tile as two halves of 16 columns, each 2 vectors of weights loaded once per k
// and ROWS <= 6 broadcasts into 12 accumulators: 12 FMAs per 8 loads (all 32 columns at once, 3 rows, took 15
// loads per 12 FMAs and ran at half the rate).  One row has too few accumulators in a half for the FMAs'
// latency: it takes all 32 columns at once, 4 accumulators.  The GRU's 24 columns go at once: 3 vectors and
// ROWS <= 4 broadcasts into 12 accumulators, 12 FMAs per 7 loads.
template <int ROWS, int SLOTS>
inline void tile_product(const float* a, int lda, int depth, const float* block, float* tile, bool resume,
                         Ahead ahead = {}) {
  static_assert(SLOTS == 3 || SLOTS == 4, "a block has the GRU's 3 or the LSTM's 4 slots");
  constexpr int width = SLOTS * kUnits, vectors = SLOTS == 3 ? 3 : 2, parts = SLOTS == 3 ? 1 : 2;
  for (int part = 0; part < parts; ++part) {  // the GRU's one pass, the LSTM's two halves
    __m256 acc[ROWS][vectors];
    for (int r = 0; r < ROWS; ++r) {
      for (int v = 0; v < vectors; ++v) {
        acc[r][v] = resume ? _mm256_loadu_ps(tile + r * width + 16 * part + 8 * v) : _mm256_setzero_ps();
      }
    }
    const float* w = block + 16 * part;
    for (int k = 0; k < depth; ++k, w += width) {
      if (part == 0 && k < ahead.lines) _mm_prefetch(ahead.from + 64 * k, _MM_HINT_T1);
      __m256 weights[vectors];
      for (int v = 0; v < vectors; ++v) weights[v] = _mm256_loadu_ps(w + 8 * v);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + static_cast<size_t>(r) * lda + k);
        for (int v = 0; v < vectors; ++v) acc[r][v] = _mm256_fmadd_ps(x, weights[v], acc[r][v]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      for (int v = 0; v < vectors; ++v) _mm256_storeu_ps(tile + r * width + 16 * part + 8 * v, acc[r][v]);
    }
  }
}

template <>
inline void tile_product<1, 4>(const float* a, int, int depth, const float* block, float* tile, bool resume,
                               Ahead ahead) {
  __m256 acc[4];
  for (int v = 0; v < 4; ++v) acc[v] = resume ? _mm256_loadu_ps(tile + 8 * v) : _mm256_setzero_ps();
  for (int k = 0; k < depth; ++k) {
    if (k < ahead.lines) _mm_prefetch(ahead.from + 64 * k, _MM_HINT_T1);
    const float* w = block + static_cast<size_t>(k) * kTile;
    const __m256 x = _mm256_broadcast_ss(a + k);
    for (int v = 0; v < 4; ++v) acc[v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(w + 8 * v), acc[v]);
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(tile + 8 * v, acc[v]);
}
#endif

// tile_product for rows (1 .. ROWS) rows: ROWS starts at the most a tile of SLOTS vectors takes.
template <int SLOTS, int ROWS = rows_per_tile_of(SLOTS)>
inline void tile_product_of_rows(int rows, const float* a, int lda, int depth, const float* block, float* tile,
                                 bool resume, Ahead ahead = {}) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return tile_product_of_rows<SLOTS, ROWS - 1>(rows, a, lda, depth, block, tile, resume, ahead);
  }
  tile_product<ROWS, SLOTS>(a, lda, depth, block, tile, resume, ahead);
}

// The rows (rows, SLOTS kUnits: kTile for the LSTM and the backward) = a[rows of stride lda, depth columns] @
// block (depth, SLOTS kUnits), in tiles of up to rows_per_tile_of(SLOTS) rows (spread evenly: no thin last
// tile), taken in chunks of kDepthChunk: a chunk of the block
// (16 KB with AVX2, 32 KB with AVX-512) stays in L1 while every tile reads it, where a whole block (AVX2, depth
// 512: 64 KB; the backward's depth 2,048: 256 KB) would stream from L2 once per tile.  The chunks resume the
// tiles' accumulators: the same bits as one pass.  One thread at (T, B, H) = (100, 32, 512), interleaved runs:
// 145 -> 118 ms (2-core Zen 3, AVX2).  With AVX-512's 64 columns, chunks of 128 beat 64 by 5-7% (the product
// alone, 2-core Sapphire Rapids, 48 KB of L1).
// With ask_ahead (where a thread's blocks outgrow half its L2, so that each step reads them from L3 again), the
// tiles of a chunk ask L2 for the next chunk while they multiply, one line per k, the chunk's lines shared among
// its tiles: after the block's last chunk, the first kDepthChunk rows of `then` (then_floats floats), the block
// the thread takes next.  Without it the first tile of every chunk waited on L3 (the hottest instruction of the
// forward at (T, B, D, H) = (100, 32, 256, 512) was a weight load).  Interleaved builds, 2-core AVX-512 Xeon
// (2 MB of L2), medians, ms: LSTM forward (100, 32, 256, 512) 40.4, 40.3, 39.1 -> 36.6, 35.3, 35.4; (35, 20,
// 650, 650) 19.8, 19.6 -> 18.3, 18.7; GRU (100, 32, 256, 512) 28.5, 28.8 -> 27.5, 26.9; LSTM (50, 1, 64, 512)
// 2.95, 2.72 -> 2.51, 2.41; in the backward's product too, LSTM forward+backward (100, 32, 256, 512) 120, 125 ->
// 113, 108 (the GRU's even).  Where the weights fit, asking for lines already in L2 bought nothing: (200, 64, 128,
// 128) lost 1-3%, hence the condition.  No output changes: the same products in the same order.
constexpr int kDepthChunk = 128;
// Each tile's rows are finished by its last chunk: epilogue(first row, rows) then runs on them, while they are in
// L1, and its work (gate math: divides and dependent chains) overlaps the next tile's FMAs in the core.
template <int SLOTS = 4, class Epilogue>
inline void rows_product(int rows, const float* a, int lda, int depth, const float* block, float* out,
                         Epilogue epilogue, bool ask_ahead = false, const float* then = nullptr, int then_floats = 0) {
  constexpr int width = SLOTS * kUnits;
  constexpr int rows_per_tile = rows_per_tile_of(SLOTS);
  const int tiles = (rows + rows_per_tile - 1) / rows_per_tile;
  for (int k = 0; k < depth; k += kDepthChunk) {
    const int chunk = std::min(kDepthChunk, depth - k);
    const bool last = k + chunk == depth;
    // what the tiles ask for while they take this chunk: the next chunk, or after the last one, `then`
    const char* next = !ask_ahead ? nullptr
                       : reinterpret_cast<const char*>(last ? then : block + static_cast<size_t>(k + chunk) * width);
    const int next_lines = (last ? then_floats : std::min(kDepthChunk, depth - k - chunk) * width) / 16;
    for (int t = 0; t < tiles; ++t) {
      const int r0 = rows * t / tiles, count = rows * (t + 1) / tiles - r0;
      const int from_line = next_lines * t / tiles, lines = next_lines * (t + 1) / tiles - from_line;
      const Ahead ahead = next != nullptr ? Ahead{next + 64 * from_line, std::min(lines, chunk)} : Ahead{};
      tile_product_of_rows<SLOTS>(count, a + static_cast<size_t>(r0) * lda + k, lda, chunk,
                                  block + static_cast<size_t>(k) * width, out + static_cast<size_t>(r0) * width, k > 0,
                                  ahead);
      if (last) epilogue(r0, count);
    }
  }
}

// The LSTM's gate math for `units` (<= kUnits) units of one row: acc holds their four gates' products
// (i, f, g, o: kUnits each), x their input sides (i at x[0], f at x[x_stride], ...: a row of x_gates, stride
// H, or of a tile's input products, stride kUnits) and bias (i at bias[0], f at bias[H], ...; or nullptr)
// what is added to them; c advances in place, h and out get the new h, and where saved is not nullptr, the
// activations and the new c go to its five slots (SavedBlocks: kUnits floats apart).
inline void lstm_gate_math(int units, int hidden, const float* x, int x_stride, const float* bias, const float* acc,
                           float* c, float* h, float* out, float* saved) {
  using simd::store;
  const Lanes lanes{units};
  const auto at = [&](int gate) {
    return biased_at(lanes, x, gate * x_stride, bias, gate * hidden) + simd::load(acc + gate * kUnits);
  };
  Vec i = at(0), f = at(1), g = at(2), o = at(3), c_new = simd::load(c, units);
  const Vec tanh_c = lstm_unit(i, f, g, o, c_new), h_new = o * tanh_c;
  store(c, c_new, units);
  store(h, h_new, units);
  store(out, h_new, units);
  if (saved != nullptr) {
    store(saved, i, units), store(saved + kUnits, f, units), store(saved + 2 * kUnits, g, units);
    store(saved + 3 * kUnits, o, units), store(saved + 4 * kUnits, c_new, units);
  }
}

// How many threads a packed loop shares its blocks among: one where a step is too small to repay a meeting
// per step (microseconds, more when a neighbour holds a core), else as many as the process may use and
// there are blocks.  A step is large enough when its product has 4M multiply-adds, or when w_hh (of four
// gates) has 256 KB or more: at small batches a step is bound by reading w_hh, which a team reads in
// parts, each from its own core's cache (each part at least half that, so that reading it outlasts a
// meeting).  The layer on a 2-core Sapphire Rapids, against a team of one, forward / forward+backward:
// LSTM (T, B, H) = (50, 1, 256) 0.66 / 0.75, (50, 1, 512) 0.42 / 0.46, (100, 16, 128) 0.79 / 0.90;
// GRU (50, 1, 512) 0.63 / 0.49; but (100, 2, 64), w_hh 64 KB, 1.02 / 1.04.
// (Before threads were kept between calls, (16, 128) ran twice as slow on two threads of a 2-core Zen 3.)
constexpr int64_t kTeamMinMultiplyAdds = 1 << 22;
constexpr int64_t kTeamMinWeightBytes = 256 << 10;

using seqlib_cpu::share_of;

int team_size(int batch, int hidden, int blocks) {
  int64_t most = std::min(seqlib_cpu::thread_budget(), blocks / 2);
  if (int64_t{batch} * 4 * hidden * hidden < kTeamMinMultiplyAdds) {  // a team only to read w_hh in parts
    const int64_t w_hh_bytes = int64_t{4 * sizeof(float)} * hidden * hidden;
    if (w_hh_bytes < kTeamMinWeightBytes) return 1;
    most = std::min(most, w_hh_bytes / (kTeamMinWeightBytes / 2));
  }
  return static_cast<int>(std::max<int64_t>(1, most));
}

// How many parts a packed loop's team splits the rows into: where team_size leaves threads idle (fewer
// blocks than twice the threads: small H on many cores), each block group's rows are shared among
// threads too, at least 2 kRowsPerTile rows each.  16-core Sapphire Rapids, (T, B, H) = (200, 64, 128): the
// loop alone took 22.2 ms on one thread, 11.5 on two, 9.2 on four and no less on more, its 8 blocks
// shared by at most 4 threads.
constexpr int kMinRowsPerPart = 2 * kRowsPerTile;
int row_parts(int batch, int hidden, int block_groups) {
  if (int64_t{batch} * 4 * hidden * hidden < kTeamMinMultiplyAdds) return 1;
  return std::max(1, std::min(seqlib_cpu::thread_budget() / block_groups, batch / kMinRowsPerPart));
}

// How a packed loop's team shares each step: `groups` groups of threads each take a share of the blocks of units
// (of columns, in the backward), and the `parts` threads of a group each a share of the rows.
struct Team {
  int groups, parts;
  int threads() const { return groups * parts; }
};

// The team of a packed loop whose units make unit_blocks blocks of kUnits, at most most_groups groups, all its
// packed weights weight_bytes.  Where those weights fit in half a core's L2 and the rows make two parts or more, the
// team splits the rows only: each thread takes all units of the same sequences at every step, whose states depend
// on nothing the other threads compute, so that the threads never meet inside the loop (a forward's; a backward's
// d_h; an input-side backward still meets once a step for its weight gradients, which add up every row).  Split by
// blocks, every thread reads the whole state each step and the team meets once a step.  Each output adds the same
// products in the same order either way.  One layer, 2-core AVX-512 Xeon (2 MB of L2), (T, B, D, H) = (200, 64,
// 128, 128), interleaved builds, blocks -> rows, ms: forward GRU 11.2, 10.9 -> 9.3, 8.5, LSTM 14.5, 13.1 -> 12.4,
// 11.7; forward+backward GRU 40.0, 38.5 -> 35.5, 31.2, LSTM 50.5, 45.2 -> 42.5, 43.1.
//
// A short loop (under kWakeMinMultiplyAdds on its weights, which fit in L2) runs on its own thread where the workers
// sleep (Workers::ready): on a 2-core virtual machine, after the process was idle (as the benchmark harness times each
// call), a worker's CPU took 0.5-1.5 ms to run it, longer than such a loop.  LSTM (T, B, D, H) = (50, 1, 64, 256)
// forward, 15 calls each after the harness's settle, ms: a team of two 1.4-4.7 (in most processes 2-4: the team's
// threads shared one CPU, or the other CPU barely ran), one thread 0.9-1.3; called back to back, 0.64-0.72 and
// 0.95-0.97, which the team keeps (its workers watch).
constexpr int64_t kWakeMinMultiplyAdds = int64_t{1} << 25;

Team team_of(int batch, int hidden, int unit_blocks, int most_groups, int64_t weight_bytes, int64_t multiply_adds) {
  const int groups = std::min(team_size(batch, hidden, unit_blocks), most_groups);
  Team team{groups, row_parts(batch, hidden, groups)};
  if (groups > 1 && 2 * weight_bytes <= l2_bytes() && batch >= 2 * kMinRowsPerPart) {
    team = {1, std::min(seqlib_cpu::thread_budget(), batch / kMinRowsPerPart)};
  }
  if (team.threads() > 1 && multiply_adds < kWakeMinMultiplyAdds && weight_bytes <= l2_bytes() &&
      !seqlib_cpu::Workers::get().ready(team.threads() - 1)) {
    return {1, 1};
  }
  return team;
}

// The rows of all steps of a loop.
int64_t loop_rows(const Loop& loop) {
  int64_t rows = 0;
  for (const Step& step : loop.steps) rows += step.rows;
  return rows;
}

// h_n (B, H): each sequence's output row at its last step (sequences stop at different steps).
void final_states(const Loop& loop, const mx::array& output, float* h_n) {
  int batch = 0;  // the first step's rows, the last's in the reverse direction
  for (const Step& step : loop.steps) batch = std::max(batch, step.rows);
  std::vector<int> last_row(batch);
  for (const Step& step : loop.steps) {
    for (int r = 0; r < step.rows; ++r) last_row[r] = step.first + r;
  }
  const int hidden = output.shape(1);
  for (size_t r = 0; r < last_row.size(); ++r) copy_rows(h_n + r * hidden, row_of(output, last_row[r]), 1, hidden);
}

// The time loop on packed weights, its blocks of kUnits units shared among groups of threads (team_size),
// and each step's rows among the threads of a group (row_parts): at each step, for each of its blocks and
// every tile of up to rows_per_tile_of(G) of its rows, each thread computes the tile's product h[rows] @ block and
// gate_math(step, row, unit, units, tile row, input row, h, h_next) on it, which
// writes the row's new h for those units into h_next; then the team meets, and h and h_next swap.  Where
// the loop computes the input side (input.x: see computes_input_side), the tiles first take
// x[rows] @ the block's w_ih (packed as w_hh is) into input_products, whose row is gate_math's input row
// (nullptr otherwise: gate_math reads x_gates): two products apart, added as x_gates and h's product are,
// so that both forms round alike where the matmul sums x @ w_ih^T in the order of k, as the tiles do
// (OpenBLAS within its block of K).
// Every tile reads all of h's units, so the new h goes to the other buffer and one meeting per step
// suffices.  Rows past a step's rows are not carried over: final_states gathers h_n from the output.
// Each output adds the same products in the same order whichever thread computes it: the same bits for
// every team.
//
// A thread takes its blocks in turn forward and backward (b0 .. bn at even steps, bn .. b0 at odd ones), so
// that a step starts on the blocks that the step before finished on, still in L2: where a thread's blocks
// do not all fit (H = 512, B = 32: 2 MB of w_hh each on two threads, 2 MB of L2 a core) the rest streams
// from L3 as before, the first part no longer.  The loop alone, interleaved with the one-way order (2-core
// Sapphire Rapids, AVX-512): LSTM (T, B, H) = (100, 32, 512) 0.976, (35, 20, 650) 0.941; (200, 64, 128),
// whose blocks fit, 1.01 (noise).  The order of blocks changes no output's arithmetic.
//
// x_gates (N, G H), which gate_math reads, streams from memory (N G H floats, read once): a step
// ahead, each block asks for the next step's input sides of its units (prefetch_row), so that gate_math
// finds them in cache.  Without it, at (B, H) = (32, 128) on one thread, gate_math's first read of
// x_gates held 40% of its time; with it the loop (T = 200) took 17 ms instead of 26 (Zen 3).  The requests
// go out one row at a time between the rows' gate math: all of a block's at once (B G lines) filled the
// core's few line-fill buffers and stalled it on the prefetches (a fifth of the gate math's samples at
// (B, H) = (64, 128), Sapphire Rapids).

// The n-th block that a thread of a packed loop takes at its step_index-th step, from its blocks [first, end):
// forward at even steps, backward at odd ones (see "A thread takes its blocks in turn" above).
inline int block_in_turn(int first, int end, int n, size_t step_index) {
  return step_index % 2 == 0 ? first + n : end - 1 - n;
}

// The input sides of units [unit, unit + kUnits) of one row of x_gates, for its G gates, asked for: each
// line once (a segment that starts past the first kUnits floats of its line lies in a line that the next
// block asks for).
inline void prefetch_row(const float* x, int hidden, int gates) {
  for (int g = 0; g < gates; ++g) {
    const auto* segment = reinterpret_cast<const char*>(x + static_cast<size_t>(g) * hidden);
    if (reinterpret_cast<uintptr_t>(segment) % 64 < kUnits * sizeof(float)) _mm_prefetch(segment, _MM_HINT_T0);
  }
}

// Where an LSTM's or a GRU's loop computes its input side itself (kInputSide): its input x (N, depth) and w_ih
// (G H, depth).
struct InputSide {
  const float* x = nullptr;  // nullptr: the loop reads x_gates
  const float* w_ih = nullptr;
  int depth = 0;
};

template <int GATES, class GateMath>
void packed_steps(const Loop& loop, int batch, int hidden, const float* w_hh, const mx::array& x_gates, float* h,
                  float* h_next, GateMath gate_math, InputSide input = {}) {
  constexpr int width = GATES * kUnits;  // a block's columns: kUnits for each gate
  const int blocks = (hidden + kUnits - 1) / kUnits, depth = input.depth;
  const int64_t weight_floats = int64_t{hidden + depth} * GATES * hidden;
  const Team team = team_of(batch, hidden, blocks, blocks, 4 * weight_floats, weight_floats * loop_rows(loop));
  const int groups = team.groups, parts = team.parts;
  AlignedFloats packed(static_cast<size_t>(blocks) * hidden * width);
  AlignedFloats packed_ih(input.x != nullptr ? static_cast<size_t>(blocks) * depth * width : 0);
  run_team(team.threads(), [&](int thread, int, StepBarrier& barrier) {
    const int part = thread % parts;
    const auto [first_block, end_block] = share_of(0, blocks, thread / parts, groups);
    // this thread's rows of a step: a share of them where the team meets every step; where it never does (one group),
    // the same sequences at every step (its share of the batch, those of them running), whose states it alone keeps
    const auto [first_sequence, end_sequence] = share_of(0, batch, part, parts);
    const auto rows_of = [&](const Step& step) {
      return groups > 1 ? share_of(0, step.rows, part, parts)
                        : std::pair{std::min(first_sequence, step.rows), std::min(end_sequence, step.rows)};
    };
    const auto [pack_from, pack_end] = share_of(first_block, end_block, part, parts);  // the group packs its blocks
    pack_gate_blocks(w_hh, hidden, hidden, GATES, pack_from, pack_end, packed.data());
    if (input.x != nullptr) {
      pack_gate_blocks(input.w_ih, hidden, depth, GATES, pack_from, pack_end, packed_ih.data());
    }
    if (parts > 1) barrier.wait(thread);  // each thread reads blocks that others of its group packed
    const int64_t weight_bytes = int64_t{4} * (end_block - first_block) * (hidden + depth) * width;
    const bool ask_ahead = 2 * weight_bytes > l2_bytes();  // its blocks' weights outgrow L2: see rows_product
    AlignedFloats products(static_cast<size_t>(batch) * width);  // a block's products for every row of a step
    AlignedFloats input_products(input.x != nullptr ? static_cast<size_t>(batch) * width : 0);  // and x's
    float *current = h, *next = h_next;
    for (size_t s = 0; s < loop.steps.size(); ++s) {
      const Step& step = loop.steps[s];
      const Step* coming = s + 1 < loop.steps.size() ? &loop.steps[s + 1] : nullptr;
      const std::pair<int, int> rows = rows_of(step);  // not a structured binding: the epilogue captures them
      const int first_row = rows.first, end_row = rows.second;
      // the next step's rows of this thread (more, reversed), whose input sides are asked for a step ahead
      const auto ahead = coming != nullptr && input.x == nullptr ? rows_of(*coming) : std::pair{0, 0};
      const int ahead_first = ahead.first, ahead_end = ahead.second;
      for (int n = 0; n < end_block - first_block; ++n) {
        const int b = block_in_turn(first_block, end_block, n, s);
        const float* block = packed.data() + static_cast<size_t>(b) * hidden * width;
        const int unit = b * kUnits, units = std::min(kUnits, hidden - unit);
        const auto ask = [&](int r) { prefetch_row(row_of(x_gates, coming->first + r) + unit, hidden, GATES); };
        // what the thread reads after this block: the next block's w_ih (or w_hh); none after the step's last
        const int then_block = n + 1 < end_block - first_block ? block_in_turn(first_block, end_block, n + 1, s) : -1;
        const float* then = then_block < 0 ? nullptr
                            : input.x != nullptr ? packed_ih.data() + static_cast<size_t>(then_block) * depth * width
                                                 : packed.data() + static_cast<size_t>(then_block) * hidden * width;
        const int then_floats = std::min(kDepthChunk, input.x != nullptr ? depth : hidden) * width;
        if (input.x != nullptr) {  // the input side: x[rows] @ the block's w_ih, for gate_math beside h's product
          rows_product<GATES>(end_row - first_row, input.x + (static_cast<size_t>(step.first) + first_row) * depth,
                              depth, depth, packed_ih.data() + static_cast<size_t>(b) * depth * width,
                              input_products.data(), [&](int, int) { barrier.progress(thread); }, ask_ahead,
                              block, std::min(kDepthChunk, hidden) * width);
        }
        rows_product<GATES>(end_row - first_row, current + static_cast<size_t>(first_row) * hidden, hidden, hidden,
                            block, products.data(), [&](int first, int count) {
                       barrier.progress(thread);
                       for (int i = first; i < first + count; ++i) {
                         const size_t at = static_cast<size_t>(i) * width;
                         gate_math(step, first_row + i, unit, units, products.data() + at,
                                   input.x != nullptr ? input_products.data() + at : nullptr, current, next);
                         if (ahead_first + i < ahead_end) ask(ahead_first + i);
                       }
                     }, ask_ahead, then, then_floats);
        for (int r = ahead_first + end_row - first_row; r < ahead_end; ++r) ask(r);
      }
      if (groups > 1) barrier.wait(thread);  // every thread reads all of h: its rows, its group's rows
      std::swap(current, next);
    }
  });
}

// lstm_forward's loop on packed weights (same ins, outs and saved arrays; with kInputSide, x and w_ih).
void lstm_forward_packed(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
  const bool save = loop.option & kSave, input_side = loop.option & kInputSide;
  const int batch = ins[2].shape(0), hidden = ins[2].shape(1);
  const float* bias = bias_input(ins, gate_bias_at(loop));
  const InputSide input = input_side ? InputSide{ins[0].data<float>(), ins[4].data<float>(), ins[0].shape(1)}
                                     : InputSide{};
  // Both buffers start as h0: in the reverse direction a sequence joins at a later step, reading h0 from either.
  std::vector<float> h(ins[2].data<float>(), ins[2].data<float>() + static_cast<size_t>(batch) * hidden), h_next(h);
  float* c = outs[2].data<float>();  // c advances in place in c_n: at each step each (row, unit) by one thread
  // (which may change between steps: the step's meeting orders its write before the next step's read)
  copy_rows(c, ins[3].data<float>(), batch, hidden);
  const SavedBlocks layout(hidden, kLstmSlots);
  float* saved = save ? outs[3].data<float>() : nullptr;
  auto gate_math = [&](const Step& step, int r, int unit, int units, const float* acc, const float* input_acc,
                       const float*, float* next) {
    // the input sides: the tile's (kInputSide; i at 0, f at kUnits, ...), or x_gates' (i at 0, f at H, ...)
    const float* x = input_acc != nullptr ? input_acc : row_of(ins[0], step.first + r) + unit;
    lstm_gate_math(units, hidden, x, input_acc != nullptr ? kUnits : hidden, bias != nullptr ? bias + unit : nullptr,
                   acc, c + static_cast<size_t>(r) * hidden + unit, next + static_cast<size_t>(r) * hidden + unit,
                   row_of(outs[0], step.first + r) + unit, save ? saved + layout.at(step, r, 0, unit) : nullptr);
  };
  packed_steps<4>(loop, batch, hidden, ins[1].data<float>(), ins[0], h.data(), h_next.data(), gate_math, input);
  final_states(loop, outs[0], outs[1].data<float>());
}

// The GRU's gate math for `units` (<= kUnits) units of one row: acc holds their products with w_hh (r, z,
// n: kUnits each), b_hh (r at 0, z at H, n at 2H) their hidden biases, x their input sides (r at x[0], z at
// x[x_stride], n at x[2 x_stride]: a row of x_gates, stride H, or of a tile's input products, stride kUnits)
// and bias (r at bias[0], z at bias[H], ...; or nullptr) what is added to those; h_prev is the state before
// the step.  h and out get the new h; where saved is not nullptr, the activations r, z, n and the hidden
// side's n part (W_hn h + b_hn, which the backward reads) go to its four slots (SavedBlocks: kUnits floats
// apart).
inline void gru_gate_math(int units, int hidden, const float* x, int x_stride, const float* bias, const float* b_hh,
                          const float* acc, const float* h_prev, float* h, float* out, float* saved) {
  using simd::store;
  const auto side = [&](int gate) { return simd::load(acc + gate * kUnits) + simd::load(b_hh + gate * hidden, units); };
  const Vec hs_r = side(0), hs_z = side(1), hs_n = side(2);
  Vec reset, update, n;
  const Lanes lanes{units};
  const auto at = [&](int gate) { return biased_at(lanes, x, gate * x_stride, bias, gate * hidden); };
  const Vec h_new = gru_unit(at(0), at(1), at(2), hs_r, hs_z, hs_n, lanes(h_prev), reset, update, n);
  store(h, h_new, units);
  store(out, h_new, units);
  if (saved != nullptr) {
    store(saved, reset, units), store(saved + kUnits, update, units), store(saved + 2 * kUnits, n, units);
    store(saved + 3 * kUnits, hs_n, units);
  }
}

// gru_forward's loop on packed weights (same ins, outs and saved arrays; with kInputSide, x and w_ih).
void gru_forward_packed(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
  const bool save = loop.option & kSave, input_side = loop.option & kInputSide;
  const int batch = ins[3].shape(0), hidden = ins[3].shape(1);
  const float *b_hh = ins[2].data<float>(), *bias = bias_input(ins, gate_bias_at(loop));
  const InputSide input = input_side ? InputSide{ins[0].data<float>(), ins[4].data<float>(), ins[0].shape(1)}
                                     : InputSide{};
  std::vector<float> h(ins[3].data<float>(), ins[3].data<float>() + static_cast<size_t>(batch) * hidden), h_next(h);
  const SavedBlocks layout(hidden, kGruSlots);
  float* saved = save ? outs[2].data<float>() : nullptr;
  auto gate_math = [&](const Step& step, int r, int unit, int units, const float* acc, const float* input_acc,
                       const float* current, float* next) {
    const size_t row = static_cast<size_t>(step.first) + r, at = static_cast<size_t>(r) * hidden + unit;
    // the input sides: the tile's (kInputSide; r at 0, z at kUnits, n at 2 kUnits), or x_gates' (stride H)
    const float* x = input_acc != nullptr ? input_acc : row_of(ins[0], row) + unit;
    gru_gate_math(units, hidden, x, input_acc != nullptr ? kUnits : hidden, bias != nullptr ? bias + unit : nullptr,
                  b_hh + unit, acc, current + at, next + at, row_of(outs[0], row) + unit,
                  save ? saved + layout.at(step, r, 0, unit) : nullptr);
  };
  packed_steps<3>(loop, batch, hidden, ins[1].data<float>(), ins[0], h.data(), h_next.data(), gate_math, input);
  final_states(loop, outs[0], outs[1].data<float>());
}

// ----------------------------------------------------------------- the backward's gradients of the gates

// Where a packed backward's gate math writes a step's gradients of the gates (d_x_gates; the GRU's input and
// hidden sides), and its loop reads them back: the step's rows of the (N, width) output; or, where that has no
// rows (the fused input-side backward: nothing reads them after the loop), one of two buffers of a step's rows,
// which the steps take in turn.  A buffer is read by the team until it meets after the next step's gate math,
// which writes the other one: the rows then stay in cache instead of going to memory, N G H floats written and
// never read again.  Before, the stores of the GRU's gate math to its two (N, 3H) outputs held most of its time.
class GateRows {
 public:
  GateRows(mx::array& out, int batch)
      : width_(out.shape(1)),
        out_(out.shape(0) > 0 ? out.data<float>() : nullptr),
        buffers_(out_ == nullptr ? 2 * static_cast<size_t>(batch) * width_ : 0),
        batch_(batch) {}
  int width() const { return width_; }
  // The first of the rows of step, the index-th step that the backward computes.
  float* rows(const Step& step, size_t index) const {
    if (out_ != nullptr) return out_ + static_cast<size_t>(step.first) * width_;
    return buffers_.data() + (index % 2) * static_cast<size_t>(batch_) * width_;
  }

 private:
  int width_;
  float* out_;
  mutable AlignedFloats buffers_;
  int batch_;
};

// ----------------------------------------------------------------- the input side's gradients inside the backward
//
// Where a forward computed its input side in the loop (kInputSide), its backward takes in its loop what the vjp
// would otherwise compute after it with four MLX operations over all N rows of d_gates (N, G H): d_x = d_gates
// w_ih (N, D), d_w_ih = d_gates^T x (G H, D), d_w_hh = d_gates^T h_prev (G H, H) (h_prev: the state each row's
// step started from, as previous_states_product gathers it) and the bias gradients, sums of d_gates' rows.
// Each step, once the team has met (every row of the step's d_gates written), the threads take
// - d_x's rows of the step: d_gates @ w_ih on the tiles of d_h's product, w_ih packed in blocks of kTile
//   columns of D as w_hh is (pack_column_blocks, K = G H), each thread a share of the step's rows (d_x feeds
//   nothing in the loop: no thread waits for another's rows; with D = 32 the blocks alone were too few);
// - the weight gradients: rows [g0, g1) of d_w_ih and d_w_hh (each thread its share of the G H rows, in blocks of
//   vectors) add the step's outer products, d_gates[r, g] x[r] and d_gates[r, g] h_prev[r] for every row r
//   in order, on register tiles of up to kOuterAccumulators vectors loaded from and stored back to the thread's
//   own copy of those rows, transposed (Transposed, accumulate_rows), which goes to the gradient after the loop;
//   the bias gradients add the step's d_gates rows on the same rows g.
// The step's d_gates rows are then still in cache, where the four operations read all of d_gates back from
// memory, at OpenBLAS's rate for these shapes (265-290 GFLOP/s at N = 12,800, G H = 512, D = H = 128, on
// 2-core AVX-512 Xeons that ran a 2048^3 product at 343-400).  Every gradient element adds its products
// in the same order (the steps in the loop's order, each step's rows in order), whichever thread takes it:
// the same bits for every team.  The GRU's w_hh and b_hh take its hidden side's gradients, w_ih and the bias
// its input side's.
// Only where the gradients are small (fuses_input_gradients): they are read and written back at every step.  Where
// only the input side's are (fuses_input_side_gradients), the loop takes d_x, d_w_ih and the biases' and leaves
// d_w_hh to one product after it (InputGradients::d_w_hh nullptr; d_gates then keeps all N rows for it).
// The loop alone, interleaved builds, weights' gradients (2-core AVX-512 Xeon, (T, B, D, H) = (200, 64, 128, 128)):
// the transposed copies (aligned d_gates rows as the tiles' vector loads) against the gradient's own rows (the
// sources' rows as the loads, straddling cache lines), layer forward+backward: GRU 36.4-37.4 -> 35.5-36.6 ms, LSTM
// 42.5-43.7 -> 40.4-41.6.
// The tile alone (accumulate_tile<6, 4>, its data in cache, AVX-512) runs at the FMA peak: 2.3 vector FMAs per TSC
// cycle on a 2.6 GHz TSC; 200 steps of one matrix's gradient at (B, D, G H) = (64, 128, 384) took 8.4 M cycles,
// 9.8 M with each step's rows fresh from memory.  In the GRU's loop at that shape both take 26-29 M per thread:
// the rest is the loop's memory traffic (the other thread's rows of d_gates, the L2 shared with the packed
// weights and the activations streaming through).  Asking L1 for the next tile's sums, and copying each step's
// sources to rows of 144 floats (against cache-set conflicts of 512-byte rows), changed nothing measurable.
// Not kept: each thread adding the outer products of its own rows of the step, for every gate row, into its own copy
// of the gradients (summed after the loop), the team then never meeting in the loop.  Layer forward+backward at
// that shape, interleaved builds, that loop against this one: GRU 0.92-0.94, LSTM 1.00 (its copies, 512 KB a
// thread, crowd L2).  But its sums depend on how the team splits the rows, where every team now gives the bits of
// one thread (test_native: packed loops shared among threads).  With the split fixed at two halves of the rows,
// each summed apart, the gain went wherever a thread held both halves, as one thread would: GRU 0.99, LSTM 1.07.
// Even or slower as well (GRU, LSTM): each thread demoting to L3 (cldemote), after its gate math, the lines of its
// rows that the other thread's gradients read, 1.02, 1.02; blocks of 2 vectors of gate columns, 1.03, 1.02, or 6
// (tiles of 4 source columns), 0.98, 1.19.

#if defined(__AVX512F__)
constexpr int kOuterAccumulators = 24, kOuterVectors = 4;  // of 32 registers: 4 loads, 6 broadcasts, 24 FMAs
#else
constexpr int kOuterAccumulators = 12, kOuterVectors = 2;  // of 16: 12 + 2 loads + 1 broadcast
#endif
constexpr int kOuterRows = kOuterAccumulators / kOuterVectors;  // a wide tile's
constexpr int kOuterColumns = kOuterVectors * simd::kLanes;

// Where a packed backward takes its input side's gradients (kInputSide): the bias gradients are zeroed before the
// loop and add to themselves; the weight gradients are written after it (Transposed::write).
struct InputGradients {
  const float* x;          // (N, D)
  const float* w_ih;       // (G H, D)
  int depth;               // D
  const mx::array* h0;     // (B, H) and output (N, H): the states the steps started from
  const mx::array* output;
  const GateRows* d_input_side;   // (N, G H): d_x, d_w_ih and the bias's gradient from it
  const GateRows* d_hidden_side;  // (N, G H): d_w_hh (and the GRU's b_hh) from it; the LSTM's is d_input_side
  float* d_x;                      // (N, D); nullptr where x's gradient is not asked for
  float* d_w_ih;                   // (G H, D)
  float* d_w_hh;                   // (G H, H); nullptr: one product after the loop (fuses_input_side_gradients)
  float* d_bias;                   // (G H,): the input side's bias (b_ih, or the LSTM's folded bias)
  float* d_b_hh;                   // (G H,): the GRU's b_hh; nullptr for the LSTM
};

// The weight gradients' rows [g0, g1) that a thread takes, accumulated transposed in its own buffer (Transposed),
// 64-byte aligned, columns g - g0 padded to whole vectors: at[c][g - g0] for source column c.  The step's rows of
// d_gates (GateRows' buffers, 64-byte aligned) are then the vector loads, the sources (rows of x and of the states,
// MLX's arrays, whose rows start anywhere) only broadcast: vector loads that straddled two cache lines ran the
// tile 15% slower (alone, L1-resident, 2-core AVX-512 Xeon).  After the loop it goes to the gradient, transposed back.
struct Transposed {
  int first, end, stride;  // the gate rows [first, end), a source column's floats (end - first, padded)
  AlignedFloats at;
  Transposed(int first_gate, int end_gate, int width)
      : first(first_gate),
        end(end_gate),
        stride((end_gate - first_gate + simd::kLanes - 1) / simd::kLanes * simd::kLanes),
        at(static_cast<size_t>(width) * stride) {
    std::fill_n(at.data(), static_cast<size_t>(width) * stride, 0.0f);
  }
  // w (G H, width) rows [first, end) = the sums
  void write(int width, float* w) const {
    for (int g = first; g < end; ++g) {
      for (int c = 0; c < width; ++c) {
        w[static_cast<size_t>(g) * width + c] = at.data()[static_cast<size_t>(c) * stride + g - first];
      }
    }
  }
};

// at[ROWS rows (source columns) of stride ld, VECTORS kLanes gate columns, `gates` of them valid] += the sum over
// k < count of sources(k)[column + i] times d[k][the gate columns] (d's rows of stride ldd): each element adds
// its products in the order of k, one FMA each (d[k][g] source(k)[c], the product the gradient takes).  FULL: all
// VECTORS kLanes gate columns (no masks).
template <int ROWS, int VECTORS, bool FULL>
inline void accumulate_tile(int count, const float* d, int ldd, int gates, const float* const* sources, int column,
                            float* at, int ld) {
  int lanes[VECTORS];
  for (int v = 0; v < VECTORS; ++v) {
    lanes[v] = FULL ? simd::kLanes : std::clamp(gates - v * simd::kLanes, 0, simd::kLanes);
  }
  Vec acc[ROWS][VECTORS];
  for (int i = 0; i < ROWS; ++i) {
    for (int v = 0; v < VECTORS; ++v) acc[i][v] = simd::load(at + i * ld + v * simd::kLanes, lanes[v]);
  }
  for (int k = 0; k < count; ++k) {
    const float* d_row = d + static_cast<size_t>(k) * ldd;
    Vec values[VECTORS];
    for (int v = 0; v < VECTORS; ++v) values[v] = simd::load(d_row + v * simd::kLanes, lanes[v]);
    const float* source = sources[k] + column;
    for (int i = 0; i < ROWS; ++i) {
      const Vec scale = simd::broadcast(source[i]);
      for (int v = 0; v < VECTORS; ++v) acc[i][v] = simd::fma(values[v], scale, acc[i][v]);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    for (int v = 0; v < VECTORS; ++v) simd::store(at + i * ld + v * simd::kLanes, acc[i][v], lanes[v]);
  }
}

// accumulate_tile for rows (1 .. ROWS) source columns.
template <int VECTORS, int ROWS = kOuterAccumulators / VECTORS>
inline void accumulate_tile_of_rows(int rows, int count, const float* d, int ldd, int gates,
                                    const float* const* sources, int column, float* at, int ld) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      return accumulate_tile_of_rows<VECTORS, ROWS - 1>(rows, count, d, ldd, gates, sources, column, at, ld);
    }
  }
  if (gates == VECTORS * simd::kLanes) {
    return accumulate_tile<ROWS, VECTORS, true>(count, d, ldd, gates, sources, column, at, ld);
  }
  accumulate_tile<ROWS, VECTORS, false>(count, d, ldd, gates, sources, column, at, ld);
}

// sums += d^T[sums' gate rows] @ the sources, transposed: d the step's gradient of the gates (count rows of stride
// ldd), sources[k] the row (width floats) that d's row k multiplied.  Blocks of kOuterColumns gate columns
// outermost, so that the block's rows of d stay in L1 while every tile of source columns reads them.  tick() after
// each tile.
template <class Tick>
inline void accumulate_rows(Transposed& sums, int count, const float* d, int ldd, const float* const* sources,
                            int width, Tick tick) {
  for (int g = sums.first; g < sums.end; g += kOuterColumns) {
    const int gates = std::min(kOuterColumns, sums.end - g);
    float* at = sums.at.data() + (g - sums.first);
    const bool narrow = gates <= kOuterColumns / 2;  // a block of half the vectors: tiles of twice the columns
    const int rows = narrow ? 2 * kOuterRows : kOuterRows;
    for (int c = 0; c < width; c += rows) {
      const int tile_rows = std::min(rows, width - c);
      float* tile = at + static_cast<size_t>(c) * sums.stride;
      if (narrow) {
        accumulate_tile_of_rows<kOuterVectors / 2>(tile_rows, count, d + g, ldd, gates, sources, c, tile, sums.stride);
      } else {
        accumulate_tile_of_rows<kOuterVectors>(tile_rows, count, d + g, ldd, gates, sources, c, tile, sums.stride);
      }
      tick();
    }
  }
}

// One step's weight and bias gradients for the gate rows of d_w_ih and d_w_hh (the same rows, see above; d_w_hh
// nullptr where one product takes it after the loop), the index-th step computed: the step's rows of x and of the
// states they started from as the sources; tick() after each tile.
template <class Tick>
void accumulate_step_gradients(const Loop& loop, const Step& step, size_t index, const InputGradients& in,
                               Transposed& d_w_ih, Transposed* d_w_hh, std::vector<const float*>& sources, Tick tick) {
  const int first = d_w_ih.first, end = d_w_ih.end;
  if (first >= end) return;
  const int hidden = in.h0->shape(1), gates = in.d_input_side->width();
  const float* d_input = in.d_input_side->rows(step, index);
  const float* d_hidden = in.d_hidden_side->rows(step, index);
  for (int r = 0; r < step.rows; ++r) sources[r] = in.x + (static_cast<size_t>(step.first) + r) * in.depth;
  accumulate_rows(d_w_ih, step.rows, d_input, gates, sources.data(), in.depth, tick);
  if (d_w_hh != nullptr) {
    const Step* earlier = earlier_step(loop, step);
    for (int r = 0; r < step.rows; ++r) {
      sources[r] = continues(earlier, r) ? row_of(*in.output, earlier->first + r) : row_of(*in.h0, r);
    }
    accumulate_rows(*d_w_hh, step.rows, d_hidden, gates, sources.data(), hidden, tick);
  }
  accumulate_sums(first, end, step.rows, d_input, gates, in.d_bias);
  if (in.d_b_hh != nullptr) accumulate_sums(first, end, step.rows, d_hidden, gates, in.d_b_hh);
}

// What accumulate_step_gradients reads for gate rows [first_gate, end_gate) of a step, the index-th computed, that a
// thread of a packed backward may not have in its cache, asked for (LineRequests): the rows of x and of the states
// they started from, and the gradients of the gates that the other threads of its team wrote (rows outside
// [first_row, end_row)).
void ask_gradient_sources(LineRequests& lines, const Loop& loop, const Step& step, size_t index,
                          const InputGradients& in, int first_gate, int end_gate, int first_row, int end_row) {
  const int hidden = in.h0->shape(1), width = in.d_input_side->width();
  lines.add(in.x + static_cast<size_t>(step.first) * in.depth, sizeof(float) * step.rows * in.depth);
  const Step* earlier = earlier_step(loop, step);
  const int continuing = in.d_w_hh != nullptr ? continuing_rows(earlier, step.rows) : 0;  // the states: d_w_hh's
  if (continuing > 0) lines.add(row_of(*in.output, earlier->first), sizeof(float) * continuing * hidden);
  if (in.d_w_hh != nullptr && continuing < step.rows) {
    lines.add(row_of(*in.h0, continuing), sizeof(float) * (step.rows - continuing) * hidden);
  }
  const auto others = [&](const GateRows& gates, int r0, int r1) {
    if (r0 < r1) {
      lines.add(gates.rows(step, index) + static_cast<size_t>(r0) * width + first_gate,
                sizeof(float) * (end_gate - first_gate), r1 - r0, sizeof(float) * width);
    }
  };
  for (const GateRows* gates : {in.d_input_side, in.d_hidden_side}) {
    others(*gates, 0, std::min(first_row, step.rows));
    others(*gates, std::min(end_row, step.rows), step.rows);
    if (in.d_hidden_side == in.d_input_side) break;  // the LSTM's: one
  }
}

// The backward's time loop on packed weights: per step (in reverse) each thread of the team runs
// gate_backward(step, index, first, end, first row, end row) for its units and rows (index: the step's place in
// the loop's order, for GateRows), which writes the step's rows of d_gates (rows, K) for them; the team meets;
// then each thread computes its blocks of kTile columns of d_gates @ w_hh (K, H) for its rows, from all of
// d_gates' columns, and writes (or, with accumulate, adds) them into d_h's rows.  The next step's gate_backward
// reads the same thread's columns and rows of d_h (a thread keeps the same rows, the same sequences, at every
// step), and writes other rows of d_gates than the product still reads: one meeting per step.  As in the
// forward, the team may split rows (team_of); where it splits rows only, each thread's product reads only the rows
// of d_gates that it wrote, and without input its threads never meet.  With input (an input-side forward's
// backward), each thread then takes its share of the step's d_x rows (of its own rows, where the team splits rows
// only) and of the weight and bias gradients' rows, which read every row of d_gates: the team meets once a step.
// The GRU's backward loop at (T, B, D, H) = (200, 64, 128, 128) on 2 AVX-512 cores, cycles per thread, blocks ->
// rows: 62 M -> 52-54 M (gate math 13.5 -> 5.5-6.8, the product 13.3 -> 9-10, the weight gradients 23 -> 26-29:
// half their rows of d_gates now come from the other core).
//
// Asked for a step ahead (with input: see fuses_input_gradients and fuses_input_side_gradients): after the
// meeting a thread lists what this step's weight gradients read that its caches may lack (ask_gradient_sources)
// and what the next step's gate math reads from memory (gate_inputs: the saved activations, the states, the gradient
// reaching the output), and each tile of the step asks L2 for a share of those lines (tick).  The gate math then
// finds them in cache: in the loop above, per thread, gate math 5.5-6.8 -> 2.1-2.6 M cycles, the loop 51.5-54.5 ->
// 49.7-50.8 M.  Not asked for: the rows of d_gates that the next step's gate math writes, which sit in L2.  Asked
// into L1 with intent to write, they took the gate math from 4.8-4.9 to 2.4-2.5 M cycles but the weight gradients,
// whose tiles they evicted from L1, from 27.0 to 30.3: the GRU's backward loop per thread, medians of 15 calls in
// alternated processes, 53.2 M without against 54.7 M, its layer's forward+backward 34.3 against 35.2 ms; the LSTM's
// loop 69.8 against 70.8 M.  Without input (the larger layers, whose steps took few tiles for many lines) the
// requests came in bursts and bought nothing: none are made there.  With the input side's gradients alone (larger
// layers too, the states no longer asked for), leaving them out measured even: layer forward+backward at (32, 64,
// 32, 512), (100, 32, 64, 512) and (200, 64, 32, 256), LSTM and GRU, 1.000-1.006 of this.  Asking for all of them
// before the weight gradients (during the product's and d_x's tiles only) was slower: GRU and LSTM layer
// forward+backward at (200, 64, 128, 128) 1.04-1.06 and 1.02 of this order; asking for the other threads' rows of
// d_gates first, even.
//
// Not kept either: the gate math of the step before in the product's epilogue, on each finished tile of d_h (as
// the forward does).  It cost as much there as in its own pass (GRU at (200, 64, 128, 128), per thread: gate math
// 4.8-5.9 M cycles and product + d_x 22-23 M before, product with the gate math 15.9-17.7 M and d_x 10.8-11.3 M
// after): its work (multiplies on the FMA ports, loads of the saved activations) seems not to hide behind the
// tiles' FMAs.  Layer forward+backward, interleaved builds, this loop against it: GRU (200, 64, 128, 128)
// 0.977, (100, 32, 256, 512) 0.995; LSTM 1.003 and 0.995.
constexpr size_t kFirstStepTicks = 64;  // the tiles a thread is taken to take per step, before it has counted them
template <class GateBackward, class GateInputs>
void packed_backward_steps(const Loop& loop, int batch, int hidden, const float* w_hh, const GateRows& d_gates,
                           float* d_h, bool accumulate, GateBackward gate_backward, GateInputs gate_inputs,
                           const InputGradients* input = nullptr, const std::vector<RowSums>& row_sums = {}) {
  const int depth = d_gates.width(), blocks = (hidden + kTile - 1) / kTile;
  const int input_width = input != nullptr ? input->depth : 0;
  const int x_width = input != nullptr && input->d_x != nullptr ? input_width : 0;  // d_x's: 0 where not asked for
  const int x_blocks = (x_width + kTile - 1) / kTile;  // of w_ih's columns, packed for d_x
  const int64_t weight_floats = int64_t{depth} * (hidden + x_width);
  const Team team = team_of(batch, hidden, (hidden + kUnits - 1) / kUnits, blocks, 4 * weight_floats,
                            (input != nullptr ? 2 : 1) * weight_floats * loop_rows(loop));  // with d_w: twice
  const int groups = team.groups, parts = team.parts, threads = team.threads();
  // where the threads meet after each step's gate math: each reads columns of d_gates that others wrote (the
  // product, split by blocks), or rows (the weight gradients)
  const bool meets = groups > 1 || input != nullptr;
  AlignedFloats packed(static_cast<size_t>(blocks) * depth * kTile);
  AlignedFloats packed_ih(static_cast<size_t>(x_blocks) * depth * kTile);  // w_ih (G H, D) for d_x
  const int gate_vectors = (depth + simd::kLanes - 1) / simd::kLanes;  // of the weight gradients' rows
  run_team(threads, [&](int thread, int, StepBarrier& barrier) {
    const int part = thread % parts, group = thread / parts;
    const auto [first_block, end_block] = share_of(0, blocks, group, groups);
    const auto [first_row, end_row] = share_of(0, batch, part, parts);
    const int first = first_block * kTile, end = std::min(hidden, end_block * kTile);
    const auto [pack_from, pack_end] = share_of(first_block, end_block, part, parts);
    pack_column_blocks(w_hh, depth, hidden, pack_from, pack_end, packed.data());
    if (x_blocks > 0) {  // d_x's blocks, each thread a share; every thread multiplies by all of them
      const auto [from, to] = share_of(0, x_blocks, thread, threads);
      pack_column_blocks(input->w_ih, depth, x_width, from, to, packed_ih.data());
    }
    const auto [first_vector, end_vector] = share_of(0, gate_vectors, thread, threads);
    const int first_gate = first_vector * simd::kLanes, end_gate = std::min(depth, end_vector * simd::kLanes);
    std::optional<Transposed> d_w_ih, d_w_hh;  // this thread's rows of the weight gradients
    if (input != nullptr) {
      d_w_ih.emplace(first_gate, end_gate, input_width);
      if (input->d_w_hh != nullptr) d_w_hh.emplace(first_gate, end_gate, hidden);
    }
    std::vector<const float*> sources(input != nullptr ? batch : 0);  // rows of x or of the states, for a step
    if (parts > 1) barrier.wait(thread);  // each thread reads blocks that others of its group packed
    const int64_t weight_bytes = int64_t{4} * (end_block - first_block) * depth * kTile;
    const bool ask_ahead = 2 * weight_bytes > l2_bytes();  // its blocks outgrow L2: see rows_product
    AlignedFloats products(static_cast<size_t>(batch) * kTile);  // a block's products for every row of a step
    LineRequests coming;  // the next step's inputs of this thread's gate math
    size_t ticks = 0, step_ticks = kFirstStepTicks;  // tiles taken so far, and in the step before
    for (auto step = loop.steps.rbegin(); step != loop.steps.rend(); ++step) {
      const size_t index = step - loop.steps.rbegin();
      gate_backward(*step, index, first, end, first_row, end_row);
      if (meets) barrier.wait(thread);
      coming.clear();
      if (input != nullptr) {  // see "asked for a step ahead" above
        ask_gradient_sources(coming, loop, *step, index, *input, first_gate, end_gate, first_row, end_row);
        if (std::next(step) != loop.steps.rend()) {
          gate_inputs(*std::next(step), first, end, first_row, end_row, coming);
        }
      }
      const size_t per_tick = coming.lines() / std::max<size_t>(step_ticks, 1) + 1;
      const auto tick = [&] { barrier.progress(thread), coming.issue(per_tick), ++ticks; };
      const int row = std::min(first_row, step->rows), rows = std::min(end_row, step->rows) - row;
      const float* step_d_gates = d_gates.rows(*step, index);
      for (int i = 0; i < end_block - first_block; ++i) {
        const int b = block_in_turn(first_block, end_block, i, index);
        const float* block = packed.data() + static_cast<size_t>(b) * depth * kTile;
        const int column = b * kTile, columns = std::min(kTile, hidden - column);
        const int then_block = i + 1 < end_block - first_block ? block_in_turn(first_block, end_block, i + 1, index)
                                                                : -1;  // the block this thread takes next
        const float* then = then_block < 0 ? nullptr : packed.data() + static_cast<size_t>(then_block) * depth * kTile;
        rows_product(rows, step_d_gates + static_cast<size_t>(row) * depth, depth, depth, block, products.data(),
                     [&](int first, int count) {
                       tick();
                       for (int i = first; i < first + count; ++i) {
                         float* target = d_h + static_cast<size_t>(row + i) * hidden + column;
                         const float* result = products.data() + static_cast<size_t>(i) * kTile;
                         for (int j = 0; j < columns; ++j) target[j] = accumulate ? target[j] + result[j] : result[j];
                       }
                     }, ask_ahead, then, std::min(kDepthChunk, depth) * kTile);
      }
      if (input == nullptr) {
        if (meets) add_row_sums(row_sums, *step, first_gate, end_gate);  // after the meeting: every row written
        step_ticks = std::exchange(ticks, 0);
        continue;
      }
      // d_x's rows of the step, d_input_side @ w_ih: each thread of a group a share of its part's rows
      const int part_row = std::min(first_row, step->rows), part_rows = std::min(end_row, step->rows) - part_row;
      const std::pair<int, int> x_rows = share_of(0, part_rows, group, groups);  // not a structured binding:
      const int first_x_row = part_row + x_rows.first, end_x_row = part_row + x_rows.second;  // the epilogue takes them
      for (int b = 0; b < x_blocks; ++b) {
        const float* block = packed_ih.data() + static_cast<size_t>(b) * depth * kTile;
        const int column = b * kTile, columns = std::min(kTile, x_width - column);
        rows_product(end_x_row - first_x_row,
                     input->d_input_side->rows(*step, index) + static_cast<size_t>(first_x_row) * depth, depth, depth,
                     block, products.data(), [&](int first, int count) {
                       tick();
                       for (int i = first; i < first + count; ++i) {
                         copy_rows(input->d_x + (static_cast<size_t>(step->first) + first_x_row + i) * x_width +
                                   column, products.data() + static_cast<size_t>(i) * kTile, 1, columns);
                       }
                     });
      }
      accumulate_step_gradients(loop, *step, index, *input, *d_w_ih, d_w_hh ? &*d_w_hh : nullptr, sources, tick);
      step_ticks = std::exchange(ticks, 0);
    }
    if (input != nullptr) d_w_ih->write(input_width, input->d_w_ih);
    if (d_w_hh) d_w_hh->write(hidden, input->d_w_hh);
    if (!meets && !row_sums.empty()) {  // the threads never met: every row is written only now
      barrier.wait(thread);
      for (auto step = loop.steps.rbegin(); step != loop.steps.rend(); ++step) {
        add_row_sums(row_sums, *step, first_gate, end_gate);
      }
    }
  });
}

// A backward's InputGradients (kInputSide): x and w_ih at ins[at], ins[at + 1]; the outputs from outs[3] on (d_x,
// empty where not asked for; d_w_ih, d_w_hh, empty where taken after the loop; d_bias, then the GRU's d_b_hh), the
// accumulated ones (the biases') zeroed.
InputGradients input_gradients(const std::vector<mx::array>& ins, std::vector<mx::array>& outs, size_t at,
                               const mx::array& h0, const mx::array& output, const GateRows& d_input_side,
                               const GateRows& d_hidden_side) {
  for (size_t k = 6; k < outs.size(); ++k) std::fill_n(outs[k].data<float>(), outs[k].size(), 0.0f);
  return InputGradients{ins[at].data<float>(), ins[at + 1].data<float>(), static_cast<int>(ins[at].shape(1)), &h0,
                        &output, &d_input_side, &d_hidden_side,
                        outs[3].size() > 0 ? outs[3].data<float>() : nullptr, outs[4].data<float>(),
                        outs[5].size() > 0 ? outs[5].data<float>() : nullptr, outs[6].data<float>(),
                        outs.size() > 7 ? outs[7].data<float>() : nullptr};
}

// Rows [r0, r1) of an (N, width) array from packed row `first_row`, its columns [first, end), asked for.
void ask_rows(LineRequests& lines, const mx::array& a, int first_row, int r0, int r1, int first, int end) {
  if (r0 < r1) lines.add(row_of(a, first_row + r0) + first, sizeof(float) * (end - first), r1 - r0, 4 * a.shape(1));
}

// Slot `slot` (or all slots: -1) of units [first, end) of rows [r0, r1) of a step in saved (SavedBlocks), asked for.
void ask_saved(LineRequests& lines, const float* saved, const SavedBlocks& layout, const Step& step, int slot,
               int first, int end, int r0, int r1) {
  if (r0 >= r1) return;
  const size_t row_bytes = sizeof(float) * layout.slots * layout.units;  // a row's slots of one block
  for (int j = first; j < end; j += layout.units) {
    if (slot < 0) {
      lines.add(saved + layout.at(step, r0, 0, j), row_bytes * (r1 - r0));
    } else {
      lines.add(saved + layout.at(step, r0, slot, j), sizeof(float) * layout.units, r1 - r0, row_bytes);
    }
  }
}

// What lstm_gate_backward reads from memory for units [first, end) of rows [first_row, end_row) of a step (its
// arguments as that function's), asked for: the step's saved slots, the c each row started from, the gradient
// reaching the output.
void lstm_gate_inputs(const std::vector<mx::array>& ins, const Step& step, const Step* earlier, int first, int end,
                      int first_row, int end_row, LineRequests& lines) {
  const int hidden = ins[4].shape(1), r0 = first_row, r1 = std::min(end_row, step.rows);
  const int continuing = std::max(r0, continuing_rows(earlier, r1));  // rows [r0, continuing) continue
  const SavedBlocks layout(hidden, kLstmSlots);
  ask_saved(lines, ins[1].data<float>(), layout, step, -1, first, end, r0, r1);
  if (earlier != nullptr) ask_saved(lines, ins[1].data<float>(), layout, *earlier, 4, first, end, r0, continuing);
  ask_rows(lines, ins[2], 0, continuing, r1, first, end);  // c0's rows, where a row was not in the earlier step
  ask_rows(lines, ins[3], step.first, r0, r1, first, end);
}

// The same for gru_gate_backward: the step's saved slots, the states the rows started from, the gradient reaching
// the output.
void gru_gate_inputs(const std::vector<mx::array>& ins, const Step& step, const Step* earlier, int first, int end,
                     int first_row, int end_row, LineRequests& lines) {
  const int hidden = ins[5].shape(1), r0 = first_row, r1 = std::min(end_row, step.rows);
  const int continuing = std::max(r0, continuing_rows(earlier, r1));  // rows [r0, continuing) continue
  ask_saved(lines, ins[1].data<float>(), SavedBlocks(hidden, kGruSlots), step, -1, first, end, r0, r1);
  if (earlier != nullptr) ask_rows(lines, ins[2], earlier->first, r0, continuing, first, end);
  ask_rows(lines, ins[3], 0, continuing, r1, first, end);
  ask_rows(lines, ins[4], step.first, r0, r1, first, end);
}

void lstm_backward_packed(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
  const int batch = ins[4].shape(0), hidden = ins[4].shape(1);
  float* d_h = outs[1].data<float>();  // the gradients flow back in place in d_h0 and d_c0
  float* d_c = outs[2].data<float>();
  copy_rows(d_h, ins[4].data<float>(), batch, hidden);
  copy_rows(d_c, ins[5].data<float>(), batch, hidden);
  const GateRows d_gates(outs[0], batch);
  std::optional<InputGradients> input;
  if (loop.option & kInputSide) input = input_gradients(ins, outs, 6, ins[9], ins[8], d_gates, d_gates);
  const std::vector<RowSums> row_sums = bias_sums(loop, outs, {&outs[0]}, 3);
  packed_backward_steps(loop, batch, hidden, ins[0].data<float>(), d_gates, d_h, false,
                        [&](const Step& step, size_t index, int first, int end, int first_row, int end_row) {
                          lstm_gate_backward(ins, d_gates.rows(step, index), step, earlier_step(loop, step), d_h, d_c,
                                             first, end, first_row, end_row);
                        },
                        [&](const Step& step, int first, int end, int first_row, int end_row, LineRequests& lines) {
                          lstm_gate_inputs(ins, step, earlier_step(loop, step), first, end, first_row, end_row, lines);
                        }, input ? &*input : nullptr, row_sums);
}

void gru_backward_packed(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
  const int batch = ins[5].shape(0), hidden = ins[5].shape(1);
  float* d_h = outs[2].data<float>();
  copy_rows(d_h, ins[5].data<float>(), batch, hidden);
  const GateRows d_input_side(outs[0], batch), d_hidden_side(outs[1], batch);
  std::optional<InputGradients> input;
  if (loop.option & kInputSide) input = input_gradients(ins, outs, 6, ins[3], ins[2], d_input_side, d_hidden_side);
  const std::vector<RowSums> row_sums = bias_sums(loop, outs, {&outs[1], &outs[0]}, 3);  // b_hh's, b_ih's
  packed_backward_steps(loop, batch, hidden, ins[0].data<float>(), d_hidden_side, d_h, true,
                        [&](const Step& step, size_t index, int first, int end, int first_row, int end_row) {
                          gru_gate_backward(ins, d_input_side.rows(step, index), d_hidden_side.rows(step, index), step,
                                            earlier_step(loop, step), d_h, first, end, first_row, end_row);
                        },
                        [&](const Step& step, int first, int end, int first_row, int end_row, LineRequests& lines) {
                          gru_gate_inputs(ins, step, earlier_step(loop, step), first, end, first_row, end_row, lines);
                        }, input ? &*input : nullptr, row_sums);
}

// Whether a loop, forward or backward, runs on packed weights: enough steps to repay the packing.  The
// backward's loop alone, on a 2-core Zen 3 (AVX2): LSTM (T, B, H) = (200, 64, 128) 33 -> 20 ms, (35, 20, 650)
// 32 -> 26, (100, 32, 512) 57 -> 57; GRU (100, 32, 512) 47 -> 36.  The forward, in a layer on the same
// machine, OpenBLAS's workers then spinning for 2^20 cycles: the LSTM packed ahead at every size, from
// (B, H) = (1, 256) to (20, 650).  The GRU's tile then had a fourth, zero slot (a quarter of its FMAs
// wasted), and ran packed only with a team of threads; with three slots its packed loop is ahead on one thread
// too (the loop alone, 2-core Sapphire Rapids, alternated processes, us, OpenBLAS loop -> packed: AVX-512
// (T, B, H) = (100, 2, 64) 205-213 -> 146-149, (100, 8, 64) 714-764 -> 303-315, (100, 16, 96) 1,991-2,068 ->
// 966-1,004, (50, 1, 64) 139-147 -> 105-114, (100, 32, 64) 1,597-1,631 -> 1,003-1,012; an AVX2 build on
// the same machine 226-232 -> 201-208, 788-796 -> 457-471, 2,207-2,256 -> 1,529-1,535, 150-155 -> 148-152,
// 1,868-1,974 -> 1,682-1,699).
bool runs_packed(const Loop& loop) { return static_cast<int>(loop.steps.size()) >= kPackedMinSteps; }
#endif

// Whether an LSTM's or a GRU's packed loop computes each step's input side x_t W_ih^T itself (kInputSide),
// w_ih packed beside w_hh and its product taken on the same tiles before h's, instead of reading x_gates, which
// one matmul (OpenBLAS) computed for all steps before the loop.  That saves the matmul's own passes (x_gates,
// N G H floats, written to memory and read back a step at a time) and OpenBLAS's lower rate at these shapes
// (about 180 GFLOP/s at N = 12,800, D = 128, 4H = 512 on two Sapphire Rapids cores); it costs reading w_ih
// at every step.  That pays where the input is narrow against the batch (B, the first step's rows): D <= 8 B
// with AVX-512, D <= 4 B with AVX2.
// The LSTM's loop alone against the matmul + loop, interleaved (2-core Sapphire Rapids, AVX-512), (T, B, D, H) =
// (200, 64, 128, 128) 0.70, (100, 128, 256, 256) 0.74, (100, 16, 128, 512) 0.86, (100, 64, 512, 512) 0.87,
// (100, 32, 256, 512) 0.87-0.89.  Past D = 8 B a first version gained less or lost: (100, 16, 256, 512) 0.90,
// (35, 20, 256, 650) 0.95, (35, 40, 650, 650) 1.00, (35, 20, 512, 650) 1.02, (35, 20, 650, 650) 1.06,
// (100, 8, 512, 512) 1.15.
// The GRU's layer (scan.gru_input_sequence against scan.gru_sequence of the matmul, interleaved, two runs, forward
// / forward+backward; a 2-core AVX-512 Xeon): (200, 64, 128, 128) 0.77-0.78 / 0.90-0.92, (100, 32, 256, 512)
// 0.89-0.91 / 0.96-0.99, (32, 64, 64, 128) 0.74-0.75 / 0.92-0.93, (100, 16, 128, 512) 0.90-0.91 / 0.97-0.99,
// (100, 128, 256, 256) 0.80-0.82 / 0.93-0.96, (35, 20, 160, 650) 0.94-0.95 / 0.98-1.05; past D = 8 B as the
// LSTM's: (100, 16, 256, 512) 0.96 / 0.99, (35, 20, 650, 650) 1.08 / 1.04, (100, 8, 512, 512) 1.17 / 1.12.
// An AVX2 build (-march=haswell, on the same machine; forward, LSTM / GRU) gains less: D = 8 B lost at (100, 32,
// 256, 512) 1.05 / 1.05-1.06, and was even at (100, 16, 128, 512) 0.98 / 0.99-1.01 and (35, 20, 160, 650) 1.03 /
// 0.98-0.99; D = 4 B gained at (100, 32, 128, 512) 0.96 / 0.95, (100, 16, 64, 512) 0.93 / 0.94, (35, 20, 80, 650)
// 0.95 / 0.95, but not at H = 256, (100, 64, 256, 256) 1.04 / 1.05; D <= 2 B (200, 64, 128, 128) 0.97 / 0.96,
// (32, 64, 64, 128) 0.88 / 0.85-0.89, (100, 128, 256, 256) 1.00 / 1.01.
#if defined(__AVX512F__)
constexpr int kInputDepthPerRow = 8;
#else
constexpr int kInputDepthPerRow = 4;
#endif
bool computes_input_side(const Loop& loop, int batch, int depth) {
#if defined(__AVX2__) && defined(__FMA__)
  return runs_packed(loop) && depth >= 1 && depth <= kInputDepthPerRow * batch;
#else
  return false;
#endif
}

// Whether an input-side forward's backward takes its input side's gradients in its loop (InputGradients): where
// its weight gradients, G H (D + H) floats, which every step reads and writes back, take at most 512 KB.  One
// layer's forward+backward (all gradients, x's too), against the vjp's four MLX operations after the loop,
// interleaved in one process, two runs (2-core AVX-512 Xeon; gradient bytes in brackets): LSTM (T, B, D, H) =
// (200, 64, 128, 128) [512 KB] 0.95, 0.95, (32, 64, 128, 128) [512 KB] 1.04, 0.94, (32, 64, 32, 128) [320 KB]
// 0.96; GRU (200, 64, 128, 128) [384 KB] 0.95, 0.94, (32, 64, 128, 128) 0.98, 0.94, (32, 64, 32, 128) 0.91.
// A first version that shared d_x's blocks (not its rows) among the threads lost at D = 32 (1.12 / 1.09: one
// block of 64 columns, one thread took all of d_x while the other waited at the next meeting).  Past 512 KB the
// gradients and the packed weights outgrow a core's L2 (2 MB here) and the gain goes: GRU (100, 64, 64, 256)
// [983 KB] 0.93, (32, 64, 32, 256) [884 KB] 0.99; LSTM (100, 64, 64, 256) [1.3 MB] 1.00, (32, 64, 32, 256)
// [1.2 MB] 1.05, (100, 128, 256, 256) [2 MB] 1.01-1.02.  The in-loop products run at about 170 GFLOP/s a core
// where the operations reach 135 (265-290 GFLOP/s on two cores): the ceiling of this gain.
constexpr int64_t kFusedGradientBytes = 512 << 10;
bool fuses_input_gradients(int gates, int hidden, int depth) {
  return int64_t{4} * gates * hidden * (int64_t{hidden} + depth) <= kFusedGradientBytes;
}
// Where they are not, the loop may still take the input side's alone: d_x and d_w_ih (G H D floats), w_hh's gradient
// then one product after it (previous_states_product), as without the input side.  That spares the two products
// after the loop with a narrow side (N or D columns), which OpenBLAS runs at about 185 GFLOP/s on two Zen 5 cores
// against 470 for square ones (D = 32: d_x 1.4-1.7 ms, d_w_ih 1.5-1.7, each 268 MFLOP at N = 2,048, G H = 2,048); a
// first kernel of ours for them, without OpenBLAS's packing, ran at 160 and 90 (rows 8 KB apart share L1's and L2's
// sets).  Layer forward+backward (all gradients, x's too), this against the four operations after the loop,
// interleaved in one process, 2-core Zen 5 (tools/ab_native.py's compare; LSTM / GRU): (T, B, D, H) = (32, 64, 32,
// 512) 0.98-0.99 / 0.98-0.99, (100, 32, 64, 512) 0.97-0.99 / 0.96-0.97, (200, 64, 32, 256) 0.95-0.96 / 0.96-0.97,
// (100, 32, 16, 1024) 0.99 / 0.99; an AVX2 build (-march=x86-64-v3) 0.99 / 0.97, 1.00 / 0.98, 0.98 / 0.95.  The
// benchmark's training step of chapter 13's model at H = 512 (its first layer is (32, 64, 32, 512)): 0.997-1.008,
// within its noise.  At a few rows a step the loop's tiles are short and it lost: (50, 16, 32, 384) 1.02 / 1.01,
// (50, 8, 64, 512) 1.03 / 1.02; so it needs 32 rows and D <= 2 B.
bool fuses_input_side_gradients(int gates, int hidden, int depth, int batch) {
  return batch >= 32 && depth <= 2 * batch && int64_t{4} * gates * hidden * depth <= kFusedGradientBytes;
}

// ----------------------------------------------------------------- LSTM

// ins: x_gates (N, 4H), w_hh (4H, H), h0, c0 (B, H) [, bias (4H,) added to every row of x_gates]
//   or with kInputSide: x (N, D), w_hh, h0, c0, w_ih (4H, D) [, bias]
// outs: output (N, H), h_n, c_n (B, H) [, saved (N, SavedBlocks(H, kLstmSlots).row_floats()): each step's
//   activations and new c, what the backward reads]
void lstm_forward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
#if defined(__AVX2__) && defined(__FMA__)
  if ((loop.option & kInputSide) || runs_packed(loop)) {
    return lstm_forward_packed(ins, outs, loop);  // kInputSide: only where computes_input_side said so
  }
#endif
  const auto& steps = loop.steps;
  const int option = loop.option;
  const bool save = option & kSave;
  const int batch = ins[2].shape(0), hidden = ins[2].shape(1), gates = 4 * hidden;
  const float* bias = bias_input(ins, 4);
  float* h = outs[1].data<float>();  // the state advances in place in h_n and c_n
  float* c = outs[2].data<float>();
  copy_rows(h, ins[2].data<float>(), batch, hidden);
  copy_rows(c, ins[3].data<float>(), batch, hidden);
  std::vector<float> pre(static_cast<size_t>(batch) * gates);
  for (const Step& step : steps) {
    biased_rows(pre.data(), row_of(ins[0], step.first), bias, step.rows, gates);
    // pre (rows, 4H) = x_gates[rows of the step] (+ bias) + h[:rows] @ w_hh^T
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, step.rows, gates, hidden, 1.0f, h, hidden,
                      ins[1].data<float>(), hidden, 1.0f, pre.data(), gates);
    for (int r = 0; r < step.rows; ++r) {
      float* a = pre.data() + static_cast<size_t>(r) * gates;  // becomes the activations
      lstm_row(hidden, a, c + static_cast<size_t>(r) * hidden, h + static_cast<size_t>(r) * hidden,
               row_of(outs[0], step.first + r), save ? outs[3].data<float>() : nullptr, &step, r);
    }
  }
}

// ins: w_hh (4H, H), saved (N, SavedBlocks(H, kLstmSlots).row_floats()), c0 (B, H), d_output (N, H),
//   d_h_n, d_c_n (B, H)
// outs: d_x_gates (N, 4H), d_h0, d_c0 (B, H) [, with kSumBias d_bias (4H,): d_x_gates' rows summed]
//   with kInputSide also ins x (N, D), w_ih (4H, D), output (N, H), h0 (B, H) and outs d_x (N, D, or 0 rows),
//   d_w_ih (4H, D), d_w_hh (4H, H), d_bias (4H,); d_x_gates then has 0 rows (the loop keeps a step's: GateRows),
//   or where d_w_hh has 0 rows (taken after the loop from d_x_gates: fuses_input_side_gradients), all N
void lstm_backward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
#if defined(__AVX2__) && defined(__FMA__)
  if ((loop.option & kInputSide) || runs_packed(loop)) return lstm_backward_packed(ins, outs, loop);
#endif
  const int batch = ins[4].shape(0), hidden = ins[4].shape(1), gates = 4 * hidden;
  float* d_h = outs[1].data<float>();  // the gradients flow back in place in d_h0 and d_c0
  float* d_c = outs[2].data<float>();
  copy_rows(d_h, ins[4].data<float>(), batch, hidden);
  copy_rows(d_c, ins[5].data<float>(), batch, hidden);
  for (auto step = loop.steps.rbegin(); step != loop.steps.rend(); ++step) {
    lstm_gate_backward(ins, row_of(outs[0], step->first), *step, earlier_step(loop, *step), d_h, d_c, 0, hidden, 0,
                       step->rows);
    // d_h[:rows] = d_gates (rows, 4H) @ w_hh (4H, H)
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, step->rows, hidden, gates, 1.0f, row_of(outs[0], step->first),
                gates, ins[0].data<float>(), hidden, 0.0f, d_h, hidden);
  }
  sum_rows(loop, bias_sums(loop, outs, {&outs[0]}, 3));
}

// ----------------------------------------------------------------- GRU (torch's: n = tanh(x_n + r (W_hn h + b_hn)))

// ins: x_gates (N, 3H) = x W_ih^T (+ b_ih), w_hh (3H, H), b_hh (3H,), h0 (B, H) [, bias (3H,): b_ih]
//   or with kInputSide: x (N, D), w_hh, b_hh, h0, w_ih (3H, D) [, bias]
// outs: output (N, H), h_n (B, H) [, saved (N, SavedBlocks(H, kGruSlots).row_floats()): the activations r, z, n
//   and the hidden side's n part, W_hn h + b_hn; the backward reads the state before each step from the output]
void gru_forward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
#if defined(__AVX2__) && defined(__FMA__)
  if ((loop.option & kInputSide) || runs_packed(loop)) {
    return gru_forward_packed(ins, outs, loop);  // kInputSide: only where computes_input_side said so
  }
#endif
  const auto& steps = loop.steps;
  const int option = loop.option;
  const bool save = option & kSave;
  const int batch = ins[3].shape(0), hidden = ins[3].shape(1), gates = 3 * hidden;
  const float *b_hh = ins[2].data<float>(), *bias = bias_input(ins, 4);
  float* h = outs[1].data<float>();
  copy_rows(h, ins[3].data<float>(), batch, hidden);
  std::vector<float> hidden_side(static_cast<size_t>(batch) * gates);
  for (const Step& step : steps) {
    for (int r = 0; r < step.rows; ++r) copy_rows(hidden_side.data() + static_cast<size_t>(r) * gates, b_hh, 1, gates);
    // hidden_side (rows, 3H) = b_hh + h[:rows] @ w_hh^T
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, step.rows, gates, hidden, 1.0f, h, hidden,
                      ins[1].data<float>(), hidden, 1.0f, hidden_side.data(), gates);
    for (int r = 0; r < step.rows; ++r) {
      const float* hs = hidden_side.data() + static_cast<size_t>(r) * gates;
      gru_row(hidden, row_of(ins[0], step.first + r), bias, hs, h + static_cast<size_t>(r) * hidden,
              row_of(outs[0], step.first + r), save ? outs[2].data<float>() : nullptr, &step, r);
    }
  }
}

// ins: w_hh (3H, H), saved (N, SavedBlocks(H, kGruSlots).row_floats()), output (N, H), h0 (B, H),
//   d_output (N, H), d_h_n (B, H)
// outs: d_input_side (N, 3H) (= d_x_gates), d_hidden_side (N, 3H), d_h0 (B, H) [, with kSumBias d_b_hh (3H,):
//   d_hidden_side's rows summed, and where given a fifth, d_bias (3H,): d_input_side's]
//   with kInputSide also ins x (N, D), w_ih (3H, D) and outs d_x (N, D, or 0 rows), d_w_ih (3H, D), d_w_hh (3H, H),
//   d_bias (3H,), d_b_hh (3H,); d_input_side and d_hidden_side then have 0 rows (the loop keeps a step's: GateRows),
//   d_hidden_side all N where d_w_hh has 0 rows (taken after the loop from it: fuses_input_side_gradients)
void gru_backward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
#if defined(__AVX2__) && defined(__FMA__)
  if ((loop.option & kInputSide) || runs_packed(loop)) return gru_backward_packed(ins, outs, loop);
#endif
  const int batch = ins[5].shape(0), hidden = ins[5].shape(1), gates = 3 * hidden;
  float* d_h = outs[2].data<float>();
  copy_rows(d_h, ins[5].data<float>(), batch, hidden);
  for (auto step = loop.steps.rbegin(); step != loop.steps.rend(); ++step) {
    gru_gate_backward(ins, row_of(outs[0], step->first), row_of(outs[1], step->first), *step,
                      earlier_step(loop, *step), d_h, 0, hidden, 0, step->rows);
    // d_h[:rows] += d_hidden_side (rows, 3H) @ w_hh (3H, H)
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, step->rows, hidden, gates, 1.0f, row_of(outs[1], step->first),
                gates, ins[0].data<float>(), hidden, 1.0f, d_h, hidden);
  }
  sum_rows(loop, bias_sums(loop, outs, {&outs[1], &outs[0]}, 3));  // b_hh's, b_ih's
}

// ----------------------------------------------------------------- Elman RNN

// ins: x_gates (N, H) = x W_ih^T (+ b_ih + b_hh), w_hh (H, H), h0 (B, H) [, bias (H,) added to every row]
// outs: output (N, H), h_n (B, H)
void rnn_forward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
  const auto& steps = loop.steps;
  const bool relu = loop.option & kRelu;
  const int batch = ins[2].shape(0), hidden = ins[2].shape(1);
  const float* bias = bias_input(ins, 3);
  float* h = outs[1].data<float>();
  copy_rows(h, ins[2].data<float>(), batch, hidden);
  std::vector<float> pre(static_cast<size_t>(batch) * hidden);
  for (const Step& step : steps) {
    biased_rows(pre.data(), row_of(ins[0], step.first), bias, step.rows, hidden);
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, step.rows, hidden, hidden, 1.0f, h, hidden,
                      ins[1].data<float>(), hidden, 1.0f, pre.data(), hidden);
    rnn_rows(static_cast<size_t>(step.rows) * hidden, relu, pre.data(), h, row_of(outs[0], step.first));
  }
}

// ins: w_hh (H, H), output (N, H), d_output (N, H), d_h_n (B, H); outs: d_pre (N, H) (= d_x_gates), d_h0 (B, H)
void rnn_backward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Loop& loop) {
  const auto& steps = loop.steps;
  const int option = loop.option;
  const bool relu = option & kRelu;
  const int batch = ins[3].shape(0), hidden = ins[3].shape(1);
  float* d_h = outs[1].data<float>();
  copy_rows(d_h, ins[3].data<float>(), batch, hidden);
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    const float* h = row_of(ins[1], step->first);
    const float* d_output = row_of(ins[2], step->first);
    float* d_pre = row_of(outs[0], step->first);
    const size_t count = static_cast<size_t>(step->rows) * hidden;
    for (size_t k = 0; k < count; ++k) {
      const float d_out = d_output[k] + d_h[k];
      d_pre[k] = relu ? (h[k] <= 0 ? 0.0f : d_out) : d_out * (1 - h[k] * h[k]);  // torch's threshold_backward
    }
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, step->rows, hidden, hidden, 1.0f, d_pre, hidden,
                      ins[0].data<float>(), hidden, 0.0f, d_h, hidden);
  }
}

// ----------------------------------------------------------------- the operations Python calls

// ----------------------------------------------------------------- argument checks of the bindings
//
// Every binding checks its arrays and batch_sizes before a primitive is made: the loops index
// memory by them, so a wrong shape or a batch_sizes that adds up past the rows would read and
// write out of bounds.  A ValueError in Python names the operation, the argument and both shapes.

std::string shape_text(const mx::Shape& shape) {
  std::string text = "(";
  for (size_t k = 0; k < shape.size(); ++k) text += (k ? ", " : "") + std::to_string(shape[k]);
  return text + (shape.size() == 1 ? ",)" : ")");
}

void check_array(const char* op, const char* name, const mx::array& array, const mx::Shape& shape) {
  if (array.dtype() != mx::float32 || array.shape() != shape) {
    throw std::invalid_argument(std::string(op) + ": expected " + name + " float32 of shape " + shape_text(shape) +
                                ", got " + shape_text(array.shape()) +
                                (array.dtype() == mx::float32 ? "" : " not float32"));
  }
}

// (B, H) of a state: 2-D float32 with B, H >= 1.
std::pair<int, int> state_shape(const char* op, const char* name, const mx::array& state) {
  if (state.ndim() != 2 || state.shape(0) < 1 || state.shape(1) < 1) {
    throw std::invalid_argument(std::string(op) + ": expected " + name + " of shape (B, H) with B, H >= 1, got " +
                                shape_text(state.shape()));
  }
  check_array(op, name, state, state.shape());
  return {state.shape(0), state.shape(1)};
}

// batch_sizes: non-empty, non-increasing, each at least 1, starting at B, adding up to the rows.
void check_steps(const char* op, const std::vector<int>& batch_sizes, int batch, int64_t rows) {
  int64_t total = 0;
  bool ok = !batch_sizes.empty() && batch_sizes[0] == batch;
  for (size_t t = 0; ok && t < batch_sizes.size(); ++t) {
    ok = batch_sizes[t] >= 1 && (t == 0 || batch_sizes[t] <= batch_sizes[t - 1]);
    total += batch_sizes[t];
  }
  if (!ok || total != rows) {
    throw std::invalid_argument(std::string(op) + ": expected batch_sizes non-increasing from the batch size " +
                                std::to_string(batch) + ", each at least 1, adding up to the " +
                                std::to_string(rows) + " rows; got " + std::to_string(batch_sizes.size()) +
                                " sizes adding up to " + std::to_string(total));
  }
}

// The outputs of a recurrent loop: float32 arrays of the given shapes.
std::vector<mx::array> run_loop(const char* name, seqlib_cpu::CpuLoop<Loop>::Runner runner,
                                std::vector<mx::Shape> shapes, std::vector<const mx::array*> inputs, Loop loop,
                                seqlib_cpu::CpuLoop<Loop>::Vjp vjp = nullptr) {
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return seqlib_cpu::make_loop(name, runner, std::move(shapes), std::move(dtypes), inputs, std::move(loop), vjp);
}

std::vector<mx::array> sequence(const char* name, seqlib_cpu::CpuLoop<Loop>::Runner runner,
                                std::vector<mx::Shape> shapes, std::vector<const mx::array*> inputs,
                                const std::vector<int>& batch_sizes, bool reverse, int option,
                                seqlib_cpu::CpuLoop<Loop>::Vjp vjp = nullptr) {
  return run_loop(name, runner, std::move(shapes), std::move(inputs), Loop{steps_of(batch_sizes, reverse), option},
                  vjp);
}

// ----------------------------------------------------------------- the forwards' vector-Jacobian products
//
// Each forward that saved its activations (save) differentiates itself: the backward loop over the
// same steps (which also sums the LSTM's and the GRU's bias gradients: kSumBias), then every step's weight
// gradient in one product with the states the steps started from (previous_states_product), as MLX operations;
// after an input-side forward whose gradients are small (fuses_input_gradients), the backward loop takes them
// itself, and where only its input side's are (fuses_input_side_gradients), those.  Taking x's gradient in the loop
// where its w_ih is wide (d_input_side @ w_ih on packed w_ih, after each step's meeting) measured even with the
// matmul after it: LSTM (100, 32, 256, 512) per thread, the product 29-31 M cycles in the loop (w_ih streamed from
// L3 at every step) against 11.4 ms (30 M) for OpenBLAS's, and d_h's product slowed from 50 to 54 M; split by
// blocks of w_ih, 25-26.5 M but the gate math 13 -> 16 M.
// The cotangents of the saved arrays are ignored (they are seqlib's own, never read downstream).

void require_saved(const Loop& loop, const char* op) {
  if (!(loop.option & kSave)) {
    throw std::invalid_argument(std::string(op) + ": this call saved nothing for a backward (save=False); "
                                "call it with save=True to differentiate it");
  }
}

// The gradient of each primal that argnums asks for, from a table of them in input order.
std::vector<mx::array> pick(const std::vector<int>& argnums, const std::vector<mx::array>& by_input) {
  std::vector<mx::array> grads;
  for (int argnum : argnums) grads.push_back(by_input.at(argnum));
  return grads;
}

// The gradient of a forward's bias input where it has one (primals[at]): every row's d_x_gates summed.
void add_bias_gradient(std::vector<mx::array>& by_input, const mx::array& d_x_gates,
                       const std::vector<mx::array>& primals, size_t at) {
  if (primals.size() > at) by_input.push_back(mx::sum(d_x_gates, 0, false, seqlib_cpu::cpu_stream()));
}

// d_gates^T (G H, N) @ the state each row's step started from (N, H): the gradient of w_hh, whose product
// each step took with that state.  A row's state is the output row of the same sequence at the step computed
// before (earlier_step), or h0's row where the sequence was not in it; output (N, H), h0 (B, H).  Where every
// step has all B rows, those are output's rows shifted by a step: two products on slices, nothing copied;
// else the states are gathered first.
mx::array previous_states_product(const Loop& loop, const mx::array& d_gates, const mx::array& output,
                                  const mx::array& h0) {
  const auto s = seqlib_cpu::cpu_stream();
  const int n = output.shape(0), batch = h0.shape(0);
  if (n == 0) return mx::zeros({d_gates.shape(1), h0.shape(1)}, mx::float32, s);
  const auto rows = [&](const mx::array& a, int first, int end) {
    return mx::slice(a, {first, 0}, {end, a.shape(1)}, s);
  };
  const bool uniform = std::all_of(loop.steps.begin(), loop.steps.end(), [&](const Step& step) {
    return step.rows == batch;
  });
  if (uniform) {  // the first step computed is the first in time, or the last (reverse): its rows start at h0
    const bool reverse = loop.steps.size() > 1 && loop.steps[0].first > loop.steps[1].first;
    const int start = reverse ? n - batch : 0;  // the first step's rows
    const mx::array from_h0 = mx::matmul(mx::transpose(rows(d_gates, start, start + batch), s), h0, s);
    if (n == batch) return from_h0;
    const int later = reverse ? 0 : batch, earlier = reverse ? batch : 0;  // the other rows, and their states
    return mx::addmm(from_h0, mx::transpose(rows(d_gates, later, later + n - batch), s),
                     rows(output, earlier, earlier + n - batch), 1.0f, 1.0f, s);
  }
  std::vector<int32_t> source(n);  // each row's state: a row of [h0; output]
  for (const Step& step : loop.steps) {
    const Step* earlier = earlier_step(loop, step);
    for (int r = 0; r < step.rows; ++r) {
      source[step.first + r] = continues(earlier, r) ? batch + earlier->first + r : r;
    }
  }
  const mx::array states = mx::take(mx::concatenate({h0, output}, 0, s),
                                    mx::array(source.data(), {n}, mx::int32), 0, s);
  return mx::matmul(mx::transpose(d_gates, s), states, s);
}

// d_x_gates (N, G H) through x_gates = x w_ih^T, in a vjp's table of gradients by input: d_x = d_x_gates w_ih
// replaces the first, and d_w_ih = d_x_gates^T x is appended (an input-side forward's primals: x first, w_ih
// fifth).
void through_input_side(std::vector<mx::array>& by_input, const mx::array& d_x_gates,
                        const std::vector<mx::array>& primals) {
  const auto s = seqlib_cpu::cpu_stream();
  by_input[0] = mx::matmul(d_x_gates, primals[4], s);
  by_input.push_back(mx::matmul(mx::transpose(d_x_gates, s), primals[0], s));
}

// Which gradients an input-side forward's backward (kInputSide) takes in its loop, where the vjp asks for a weight's
// (w_hh's or w_ih's: argnums 1, 4; frozen weights keep the operations, which MLX skips unasked): all of them
// (fuses_input_gradients), the input side's alone (fuses_input_side_gradients), or none (MLX operations after the
// loop).  batch: B, the first step's rows.  And the rows of d_x the loop computes: all N where x's gradient is asked
// for (argnum 0), none where not (x is data).
enum class InLoop { kNone, kInputSide, kAll };
InLoop gradients_in_loop(const Loop& loop, const std::vector<int>& argnums, int gates, int hidden, int depth,
                         int batch) {
  const bool weights = std::any_of(argnums.begin(), argnums.end(), [](int k) { return k == 1 || k == 4; });
  if (!(loop.option & kInputSide) || !weights) return InLoop::kNone;
  if (fuses_input_gradients(gates, hidden, depth)) return InLoop::kAll;
  return fuses_input_side_gradients(gates, hidden, depth, batch) ? InLoop::kInputSide : InLoop::kNone;
}
int x_rows(const std::vector<int>& argnums, int n) {
  return std::find(argnums.begin(), argnums.end(), 0) != argnums.end() ? n : 0;
}

// primals: x_gates, w_hh, h0, c0 [, bias], or with kInputSide x, w_hh, h0, c0, w_ih [, bias];
// outputs: output, h_n, c_n, saved
std::vector<mx::array> lstm_vjp(const Loop& loop, const std::vector<mx::array>& primals,
                                const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                const std::vector<mx::array>& outputs) {
  const bool input_side = loop.option & kInputSide;
  require_saved(loop, input_side ? "lstm_input_sequence" : "lstm_sequence");
  const int n = primals[0].shape(0), b = primals[2].shape(0), h = primals[2].shape(1);
  const int depth = primals[0].shape(1);  // D, with kInputSide
  const InLoop in_loop = gradients_in_loop(loop, argnums, 4, h, depth, b);
  if (in_loop != InLoop::kNone) {
    const bool all = in_loop == InLoop::kAll;  // else d_w_hh after the loop, from every row of d_x_gates
    auto d = run_loop("LSTMSequenceBackward", lstm_backward,
                      {{all ? 0 : n, 4 * h}, {b, h}, {b, h}, {x_rows(argnums, n), depth}, {4 * h, depth},
                       {all ? 4 * h : 0, h}, {4 * h}},
                      {&primals[1], &outputs[3], &primals[3], &cotangents[0], &cotangents[1], &cotangents[2],
                       &primals[0], &primals[4], &outputs[0], &primals[2]},
                      Loop{loop.steps, kInputSide});
    const mx::array d_w_hh = all ? d[5] : previous_states_product(loop, d[0], outputs[0], primals[2]);
    std::vector<mx::array> by_input = {d[3], d_w_hh, d[1], d[2], d[4]};  // x, w_hh, h0, c0, w_ih
    if (primals.size() > gate_bias_at(loop)) by_input.push_back(d[6]);
    return pick(argnums, by_input);
  }
  const bool has_bias = primals.size() > gate_bias_at(loop);
  std::vector<mx::Shape> shapes = {{n, 4 * h}, {b, h}, {b, h}};
  if (has_bias) shapes.push_back({4 * h});  // the bias's gradient, summed in the loop (kSumBias)
  auto d = run_loop("LSTMSequenceBackward", lstm_backward, shapes,
                    {&primals[1], &outputs[3], &primals[3], &cotangents[0], &cotangents[1], &cotangents[2]},
                    Loop{loop.steps, has_bias ? kSumBias : 0});
  const mx::array& d_x_gates = d[0];
  std::vector<mx::array> by_input = {d_x_gates, previous_states_product(loop, d_x_gates, outputs[0], primals[2]),
                                     d[1], d[2]};
  if (input_side) through_input_side(by_input, d_x_gates, primals);
  if (has_bias) by_input.push_back(d[3]);
  return pick(argnums, by_input);
}

// primals: x_gates, w_hh, b_hh, h0 [, bias], or with kInputSide x, w_hh, b_hh, h0, w_ih [, bias];
// outputs: output, h_n, saved
std::vector<mx::array> gru_vjp(const Loop& loop, const std::vector<mx::array>& primals,
                               const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                               const std::vector<mx::array>& outputs) {
  const bool input_side = loop.option & kInputSide;
  require_saved(loop, input_side ? "gru_input_sequence" : "gru_sequence");
  const int n = primals[0].shape(0), b = primals[3].shape(0), h = primals[3].shape(1);
  const int depth = primals[0].shape(1);  // D, with kInputSide
  const InLoop in_loop = gradients_in_loop(loop, argnums, 3, h, depth, b);
  if (in_loop != InLoop::kNone) {
    const bool all = in_loop == InLoop::kAll;  // else d_w_hh after the loop, from every row of the hidden side's
    auto d = run_loop("GRUSequenceBackward", gru_backward,
                      {{0, 3 * h}, {all ? 0 : n, 3 * h}, {b, h}, {x_rows(argnums, n), depth}, {3 * h, depth},
                       {all ? 3 * h : 0, h}, {3 * h}, {3 * h}},
                      {&primals[1], &outputs[2], &outputs[0], &primals[3], &cotangents[0], &cotangents[1],
                       &primals[0], &primals[4]},
                      Loop{loop.steps, kInputSide});
    const mx::array d_w_hh = all ? d[5] : previous_states_product(loop, d[1], outputs[0], primals[3]);
    std::vector<mx::array> by_input = {d[3], d_w_hh, d[7], d[2], d[4]};  // x, w_hh, b_hh, h0, w_ih
    if (primals.size() > gate_bias_at(loop)) by_input.push_back(d[6]);
    return pick(argnums, by_input);
  }
  const bool has_bias = primals.size() > gate_bias_at(loop);
  std::vector<mx::Shape> shapes = {{n, 3 * h}, {n, 3 * h}, {b, h}, {3 * h}};  // b_hh's gradient summed in the loop
  if (has_bias) shapes.push_back({3 * h});                                     // and the bias's (kSumBias)
  auto d = run_loop("GRUSequenceBackward", gru_backward, shapes,
                    {&primals[1], &outputs[2], &outputs[0], &primals[3], &cotangents[0], &cotangents[1]},
                    Loop{loop.steps, kSumBias});
  std::vector<mx::array> by_input = {d[0], previous_states_product(loop, d[1], outputs[0], primals[3]), d[3],
                                     d[2]};
  if (input_side) through_input_side(by_input, d[0], primals);
  if (has_bias) by_input.push_back(d[4]);
  return pick(argnums, by_input);
}

// primals: x_gates, w_hh, h0 [, bias]; outputs: output, h_n
std::vector<mx::array> rnn_vjp(const Loop& loop, const std::vector<mx::array>& primals,
                               const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                               const std::vector<mx::array>& outputs) {
  require_saved(loop, "rnn_sequence");
  const int n = primals[0].shape(0), b = primals[2].shape(0), h = primals[2].shape(1);
  auto d = run_loop("RNNSequenceBackward", rnn_backward, {{n, h}, {b, h}},
                    {&primals[1], &outputs[0], &cotangents[0], &cotangents[1]}, Loop{loop.steps, loop.option & kRelu});
  std::vector<mx::array> by_input = {d[0], previous_states_product(loop, d[0], outputs[0], primals[2]), d[1]};
  add_bias_gradient(by_input, d[0], primals, 3);
  return pick(argnums, by_input);
}

// The inputs of a forward: its arrays, and the bias where given (checked: float32 (width,)).
std::vector<const mx::array*> with_bias(const char* op, std::vector<const mx::array*> inputs,
                                        const std::optional<mx::array>& bias, int width) {
  if (bias) {
    check_array(op, "bias", *bias, {width});
    inputs.push_back(&*bias);
  }
  return inputs;
}

// An LSTM forward's state and recurrent weights checked against each other: c0 (B, H), h0 (B, H), w_hh (4H, H).
// Returns (B, H).
std::pair<int, int> lstm_state_shape(const char* op, const mx::array& w_hh, const mx::array& h0, const mx::array& c0) {
  const auto [b, h] = state_shape(op, "c0", c0);
  check_array(op, "h0", h0, {b, h});
  check_array(op, "w_hh", w_hh, {4 * h, h});
  return {b, h};
}

// The shapes of an LSTM forward's outputs: output (N, H), h_n, c_n (B, H) [, saved (N, SavedBlocks(H,
// kLstmSlots).row_floats()): what its backward reads, where saved].  It saves 5H floats a row (to whole blocks): the
// activations and each step's c, whose tanh the backward computes again; not tanh(c) and the c before the step (the
// backward reads the earlier step's c), nor the h before each step (the weight gradient reads the output rows of the
// earlier step: previous_states_product).  Forward+backward of one layer on 2 cores (Sapphire Rapids, three alternated
// processes, medians of 15 back to back / of 7 after idle), 7H floats a row (tanh(c), the c and the h before the step)
// -> 6H (c) -> 5H: (T, B, D, H) = (32, 64, 32, 128) 9.9-10.3 / 11.1-11.5 -> 9.4-10.0 / 11.0-11.3 -> 8.8-9.1 / 10.5-10.6
// ms; (200, 64, 128, 128) 81-83 / 82-83 -> 78-81 / 79-81 -> 76-78 / 76-79; (100, 32, 256, 512) 162-165 / 163-169 ->
// 156-162 / 159-165 -> 155-160 / 156-162.
std::vector<mx::Shape> lstm_output_shapes(int n, int b, int h, bool save) {
  std::vector<mx::Shape> shapes = {{n, h}, {b, h}, {b, h}};
  if (save) shapes.push_back({n, SavedBlocks(h, kLstmSlots).row_floats()});
  return shapes;
}

std::vector<mx::array> lstm_sequence(const mx::array& x_gates, const mx::array& w_hh, const mx::array& h0,
                                     const mx::array& c0, std::vector<int> batch_sizes, bool reverse, bool save,
                                     const std::optional<mx::array>& bias) {
  const char* op = "lstm_sequence";
  const auto [b, h] = lstm_state_shape(op, w_hh, h0, c0);
  check_array(op, "x_gates", x_gates, {x_gates.ndim() == 2 ? x_gates.shape(0) : 0, 4 * h});
  check_steps(op, batch_sizes, b, x_gates.shape(0));
  return sequence("LSTMSequence", lstm_forward, lstm_output_shapes(x_gates.shape(0), b, h, save),
                  with_bias(op, {&x_gates, &w_hh, &h0, &c0}, bias, 4 * h), batch_sizes, reverse, save ? kSave : 0,
                  lstm_vjp);
}

// An input-side forward's x and w_ih checked against each other and the gates' width G H: x (N, D), w_ih (G H, D).
// Returns (N, D).
std::pair<int, int> input_side_shape(const char* op, const mx::array& x, const mx::array& w_ih, int gates) {
  if (x.ndim() != 2) {
    throw std::invalid_argument(std::string(op) + ": expected x of shape (N, D), got " + shape_text(x.shape()));
  }
  check_array(op, "x", x, {x.shape(0), x.shape(1)});
  check_array(op, "w_ih", w_ih, {gates, x.shape(1)});
  return {x.shape(0), x.shape(1)};
}

// lstm_sequence of x_gates = x w_ih^T, from the input x (N, D) and w_ih (4H, D): the loop computes each step's
// input side itself where computes_input_side says so, else x_gates is one matmul before it.
std::vector<mx::array> lstm_input_sequence(const mx::array& x, const mx::array& w_ih, const mx::array& w_hh,
                                           const mx::array& h0, const mx::array& c0, std::vector<int> batch_sizes,
                                           bool reverse, bool save, const std::optional<mx::array>& bias) {
  const char* op = "lstm_input_sequence";
  const auto [b_, h_] = lstm_state_shape(op, w_hh, h0, c0);
  const auto [n_, d_] = input_side_shape(op, x, w_ih, 4 * h_);
  check_steps(op, batch_sizes, b_, n_);
  auto inputs = with_bias(op, {&x, &w_hh, &h0, &c0, &w_ih}, bias, 4 * h_);  // checks bias under this op's name
  Loop loop{steps_of(batch_sizes, reverse), (save ? kSave : 0) | kInputSide};
  if (!computes_input_side(loop, b_, d_)) {
    const auto s = seqlib_cpu::cpu_stream();
    return lstm_sequence(mx::matmul(x, mx::transpose(w_ih, s), s), w_hh, h0, c0, batch_sizes, reverse, save, bias);
  }
  return run_loop("LSTMSequence", lstm_forward, lstm_output_shapes(n_, b_, h_, save), std::move(inputs),
                  std::move(loop), lstm_vjp);
}

// The backward of lstm_sequence from its saved array (its fourth output where save is true) and c0.
std::vector<mx::array> lstm_sequence_backward(const mx::array& w_hh, const mx::array& saved, const mx::array& c0,
                                              const mx::array& d_output, const mx::array& d_h_n,
                                              const mx::array& d_c_n, std::vector<int> batch_sizes, bool reverse) {
  const char* op = "lstm_sequence_backward";
  const auto [b_, h_] = state_shape(op, "d_c_n", d_c_n);
  const int n_ = saved.ndim() == 2 ? saved.shape(0) : 0;
  check_array(op, "d_h_n", d_h_n, {b_, h_});
  check_array(op, "c0", c0, {b_, h_});
  check_array(op, "w_hh", w_hh, {4 * h_, h_});
  check_array(op, "saved", saved, {n_, SavedBlocks(h_, kLstmSlots).row_floats()});
  check_array(op, "d_output", d_output, {n_, h_});
  check_steps(op, batch_sizes, b_, n_);
  const int n = saved.shape(0), b = d_h_n.shape(0), h = d_h_n.shape(1);
  return sequence("LSTMSequenceBackward", lstm_backward, {{n, 4 * h}, {b, h}, {b, h}},
                  {&w_hh, &saved, &c0, &d_output, &d_h_n, &d_c_n}, batch_sizes, reverse, 0);
}

// The shapes of a GRU forward's outputs: output (N, H), h_n (B, H) [, saved (N, SavedBlocks(H,
// kGruSlots).row_floats()): what its backward reads, where saved].  saved holds the activations and the hidden
// side's n part, 4H floats a row (to whole blocks), where the activations, the whole hidden side and the h
// before each step made 7H.  One layer's forward+backward on 2 cores (Sapphire Rapids, three alternated
// processes, medians of 15 back to back), 7H -> 4H in rows -> 4H in blocks: (T, B, D, H) = (32, 64, 32, 128)
// 10.4-10.6 -> 9.0-9.5 ms, then 8.8-9.3 -> 7.6-7.9 (a quieter hour); (200, 64, 128, 128) 76-78 -> 70-72, then
// 67.5-69 -> 62.7-63.6; (100, 32, 256, 512) 138-144 -> 132-136, then 126-127 -> 120; (35, 20, 650, 650) alike,
// then 59 -> 57-58.
std::vector<mx::Shape> gru_output_shapes(int n, int b, int h, bool save) {
  std::vector<mx::Shape> shapes = {{n, h}, {b, h}};
  if (save) shapes.push_back({n, SavedBlocks(h, kGruSlots).row_floats()});
  return shapes;
}

// A GRU forward's state and hidden-side weights checked against each other: h0 (B, H), w_hh (3H, H), b_hh (3H,).
// Returns (B, H).
std::pair<int, int> gru_state_shape(const char* op, const mx::array& w_hh, const mx::array& b_hh, const mx::array& h0) {
  const auto [b, h] = state_shape(op, "h0", h0);
  check_array(op, "w_hh", w_hh, {3 * h, h});
  check_array(op, "b_hh", b_hh, {3 * h});
  return {b, h};
}

std::vector<mx::array> gru_sequence(const mx::array& x_gates, const mx::array& w_hh, const mx::array& b_hh,
                                    const mx::array& h0, std::vector<int> batch_sizes, bool reverse, bool save,
                                    const std::optional<mx::array>& bias) {
  const char* op = "gru_sequence";
  const auto [b_, h_] = gru_state_shape(op, w_hh, b_hh, h0);
  check_array(op, "x_gates", x_gates, {x_gates.ndim() == 2 ? x_gates.shape(0) : 0, 3 * h_});
  check_steps(op, batch_sizes, b_, x_gates.shape(0));
  return sequence("GRUSequence", gru_forward, gru_output_shapes(x_gates.shape(0), b_, h_, save),
                  with_bias(op, {&x_gates, &w_hh, &b_hh, &h0}, bias, 3 * h_), batch_sizes, reverse,
                  save ? kSave : 0, gru_vjp);
}

// gru_sequence of x_gates = x w_ih^T, from the input x (N, D) and w_ih (3H, D): as lstm_input_sequence, the loop
// computes each step's input side itself where computes_input_side says so, else x_gates is one matmul before it.
std::vector<mx::array> gru_input_sequence(const mx::array& x, const mx::array& w_ih, const mx::array& w_hh,
                                          const mx::array& b_hh, const mx::array& h0, std::vector<int> batch_sizes,
                                          bool reverse, bool save, const std::optional<mx::array>& bias) {
  const char* op = "gru_input_sequence";
  const auto [b_, h_] = gru_state_shape(op, w_hh, b_hh, h0);
  const auto [n_, d_] = input_side_shape(op, x, w_ih, 3 * h_);
  check_steps(op, batch_sizes, b_, n_);
  auto inputs = with_bias(op, {&x, &w_hh, &b_hh, &h0, &w_ih}, bias, 3 * h_);  // checks bias under this op's name
  Loop loop{steps_of(batch_sizes, reverse), (save ? kSave : 0) | kInputSide};
  if (!computes_input_side(loop, b_, d_)) {
    const auto s = seqlib_cpu::cpu_stream();
    return gru_sequence(mx::matmul(x, mx::transpose(w_ih, s), s), w_hh, b_hh, h0, batch_sizes, reverse, save, bias);
  }
  return run_loop("GRUSequence", gru_forward, gru_output_shapes(n_, b_, h_, save), std::move(inputs),
                  std::move(loop), gru_vjp);
}

// The backward of gru_sequence from its saved array (its third output where save is true), output and h0.
std::vector<mx::array> gru_sequence_backward(const mx::array& w_hh, const mx::array& saved, const mx::array& output,
                                             const mx::array& h0, const mx::array& d_output, const mx::array& d_h_n,
                                             std::vector<int> batch_sizes, bool reverse) {
  const char* op = "gru_sequence_backward";
  const auto [b_, h_] = state_shape(op, "d_h_n", d_h_n);
  const int n_ = saved.ndim() == 2 ? saved.shape(0) : 0;
  check_array(op, "w_hh", w_hh, {3 * h_, h_});
  check_array(op, "saved", saved, {n_, SavedBlocks(h_, kGruSlots).row_floats()});
  check_array(op, "h0", h0, {b_, h_});
  for (const auto* array : {&output, &d_output}) check_array(op, "output and d_output", *array, {n_, h_});
  check_steps(op, batch_sizes, b_, n_);
  const int n = saved.shape(0), b = d_h_n.shape(0), h = d_h_n.shape(1);
  return sequence("GRUSequenceBackward", gru_backward, {{n, 3 * h}, {n, 3 * h}, {b, h}},
                  {&w_hh, &saved, &output, &h0, &d_output, &d_h_n}, batch_sizes, reverse, 0);
}

std::vector<mx::array> rnn_sequence(const mx::array& x_gates, const mx::array& w_hh, const mx::array& h0,
                                    std::vector<int> batch_sizes, bool reverse, bool relu, bool save,
                                    const std::optional<mx::array>& bias) {
  const char* op = "rnn_sequence";
  const auto [b_, h_] = state_shape(op, "h0", h0);
  check_array(op, "w_hh", w_hh, {h_, h_});
  check_array(op, "x_gates", x_gates, {x_gates.ndim() == 2 ? x_gates.shape(0) : 0, h_});
  check_steps(op, batch_sizes, b_, x_gates.shape(0));
  const int n = x_gates.shape(0), b = h0.shape(0), h = h0.shape(1);
  // the backward reads the output alone: saving changes no output (but allows the vjp)
  const std::vector<mx::Shape> shapes = {{n, h}, {b, h}};
  return sequence("RNNSequence", rnn_forward, shapes, with_bias(op, {&x_gates, &w_hh, &h0}, bias, h), batch_sizes,
                  reverse, (save ? kSave : 0) | (relu ? kRelu : 0), rnn_vjp);
}

std::vector<mx::array> rnn_sequence_backward(const mx::array& w_hh, const mx::array& output, const mx::array& d_output,
                                             const mx::array& d_h_n, std::vector<int> batch_sizes, bool reverse,
                                             bool relu) {
  const char* op = "rnn_sequence_backward";
  const auto [b_, h_] = state_shape(op, "d_h_n", d_h_n);
  const int n_ = output.ndim() == 2 ? output.shape(0) : 0;
  check_array(op, "w_hh", w_hh, {h_, h_});
  check_array(op, "output", output, {n_, h_});
  check_array(op, "d_output", d_output, {n_, h_});
  check_steps(op, batch_sizes, b_, n_);
  const int n = output.shape(0), b = d_h_n.shape(0), h = d_h_n.shape(1);
  return sequence("RNNSequenceBackward", rnn_backward, {{n, h}, {b, h}}, {&w_hh, &output, &d_output, &d_h_n},
                  batch_sizes, reverse, relu ? kRelu : 0);
}

// ----------------------------------------------------------------- one step now, for streaming
//
// lstm_step, gru_step and rnn_step run one time step of a cell or of a stack of unidirectional
// layers at once, outside MLX's graph: they evaluate their arguments, compute, and return
// evaluated arrays.  A stream of single steps at batch 1 is otherwise dominated by building and
// scheduling an MLX graph per step.  Two forms, by the batch:
//   a batch of 2 or more: the graph path's arithmetic: the input side is the bias (b_ih + b_hh where
//     the layer folds them) copied into the output, then one sgemm adding x W_ih^T to it, where the
//     graph path's loop adds the bias to the finished product (the same bits wherever OpenBLAS takes
//     the depth in one block), then the same loop as a one-step sequence;
//   batch 1: the products are matrix-vector products, bound by reading the weights, and run on a team
//     of threads that share the weights' rows (add_vector_products below); the bias, then x W_ih^T, then
//     h W_hh^T are added into one pre-activation per gate, then the gate math: the sums of a GEMV in
//     another order (within float32 rounding of the graph path's).

using OptionalArray = std::optional<mx::array>;

// An argument's values, evaluated and row-contiguous.
mx::array evaluated(const mx::array& argument) {
  mx::array array = argument;
  array.eval();
  if (!array.flags().row_contiguous) {
    array = mx::contiguous(array, false, seqlib_cpu::cpu_stream());
    array.eval();
  }
  return array;
}

mx::array fresh(int rows, int width) {
  return mx::array(mx::allocator::malloc(sizeof(float) * rows * width), {rows, width}, mx::float32);
}

// x_gates (B, G) = b_ih (+ b_hh) + x W_ih^T, or x W_ih^T without a bias.
mx::array input_side(const mx::array& x, const mx::array& w_ih, const OptionalArray& b_ih, const OptionalArray& b_hh) {
  const int batch = x.shape(0), width = w_ih.shape(0), features = w_ih.shape(1);
  mx::array x_gates = fresh(batch, width);
  float* out = x_gates.data<float>();
  if (b_ih) {
    const mx::array bias_ih = evaluated(*b_ih);
    std::vector<float> bias(bias_ih.data<float>(), bias_ih.data<float>() + width);
    if (b_hh) {
      const mx::array bias_hh = evaluated(*b_hh);
      for (int j = 0; j < width; ++j) bias[j] += bias_hh.data<float>()[j];
    }
    for (int r = 0; r < batch; ++r) copy_rows(out + static_cast<size_t>(r) * width, bias.data(), 1, width);
  }
  const mx::array rows = evaluated(x), weight = evaluated(w_ih);
  cblas_sgemm(kRowMajor, kNoTrans, kTrans, batch, width, features, 1.0f, rows.data<float>(), features,
              weight.data<float>(), features, b_ih ? 1.0f : 0.0f, out, width);
  return x_gates;
}

// Run a forward loop for one step of all B rows on evaluated arrays; returns output, h_n (, c_n).
std::vector<mx::array> step_now(seqlib_cpu::CpuLoop<Loop>::Runner runner, std::vector<mx::array> ins, int states,
                                int option) {
  const int batch = ins.back().shape(0), hidden = ins.back().shape(1);
  std::vector<mx::array> outs;
  for (int k = 0; k <= states; ++k) outs.push_back(fresh(batch, hidden));
  runner(ins, outs, Loop{{Step{0, batch}}, option});
  return outs;
}

// ----------------------------------------------------------------- a step's products, each weight read once
//
// At batch 1 a step's products x W_ih^T and h W_hh^T are matrix-vector products, bound by reading the
// weights (G H (D + H) floats: 8 MB for an LSTMCell at D = H = 512), which one core reads from L3 at about
// 20-25 GB/s.  The rows of W (the G H pre-activations) are shared among a team of threads, one per
// kStepBytesPerThread of the products' weights, each reading its rows through its own core (and keeping
// them in its own L2 where they fit).  Each output entry is summed by one thread in one order: any team
// gives the same bits.  An LSTMCell step (lstm_step) on a 2-core Sapphire Rapids, median of 9 x 200 calls:
// H = 512, 427 us on one thread, 267 on two (OpenBLAS's GEMV, which the step called before, 466-514 on one);
// H = 256, 107 and 54.
constexpr size_t kStepBytesPerThread = size_t{1} << 19;

// On a 2-core Zen 5 virtual machine one core streams an LSTMCell's 8 MB at H = 512 from L3 at about 80 GB/s, and one
// thread is as fast as the team or faster: 50 streamed steps, each after the benchmark harness's settle, alternated
// processes, us a step, one thread / this team (workers yielding in their watch, Workers): LSTMCell 118-128 /
// 140-143, its 8-bit form 100-105 / 113-115, GRUCell 90-99 / 108-113 (the team's fastest streams 70-85).  Measured
// and not kept: choosing by timing both (each size of step's first 16 calls alternately on one thread and on the
// team, the one with less time in all, tried again every 1,024 calls) gave 130-154 / 111-118 / 108-131: the team's
// fast and slow phases each last whole streams, so a trial can catch either.  A Sapphire Rapids core reads L3 at
// a quarter of that rate, and there the team paid (above).
// body(first, end) on each thread of a team for its share of `width` rows (in fours, the rows that
// quantized_rows and dot_rows take at once; the last thread takes the rest): a thread per
// kStepBytesPerThread of `bytes` (the weights the products read), at most one per 64 rows.
template <class Body>
void share_step_rows(size_t bytes, int width, Body body) {
  const int wanted = static_cast<int>(std::min<size_t>(bytes / kStepBytesPerThread, width / 64));
  run_team(std::clamp(wanted, 1, seqlib_cpu::thread_budget()), [&](int thread, int team, StepBarrier&) {
    const int quads = width / 4;
    const int first = 4 * (quads * thread / team), end = thread + 1 == team ? width : 4 * (quads * (thread + 1) / team);
    body(first, end);
  });
}

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_sum(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1)));
#endif
}

// out[r] += w[r] . x for ROWS rows of w (stride depth), each x vector loaded once for the rows.  Two chains
// per row (even and odd vectors) keep 2 ROWS FMAs in flight; the last vector (partial: masked) joins the even.
template <int ROWS>
inline void dot_rows(const float* x, const float* w, int depth, float* out) {
  constexpr int kLanes = simd::kLanes;
  Vec even[ROWS], odd[ROWS];
  for (int r = 0; r < ROWS; ++r) even[r] = odd[r] = Vec{};
  int k = 0;
  for (; k + 2 * kLanes <= depth; k += 2 * kLanes) {
    const Vec x_even = simd::load(x + k), x_odd = simd::load(x + k + kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const float* row = w + static_cast<size_t>(r) * depth;
      even[r] = simd::fma(simd::load(row + k), x_even, even[r]);
      odd[r] = simd::fma(simd::load(row + k + kLanes), x_odd, odd[r]);
    }
  }
  for (; k < depth; k += kLanes) {
    const int lanes = std::min(kLanes, depth - k);
    const Vec x_part = simd::load(x + k, lanes);
    for (int r = 0; r < ROWS; ++r) {
      even[r] = simd::fma(simd::load(w + static_cast<size_t>(r) * depth + k, lanes), x_part, even[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] += horizontal_sum(even[r] + odd[r]);
}
#endif

// out[j] += w[j] . x for rows [first, end) of w (N, depth): four rows at a time, then one (one float at a time
// where the build has no AVX2).
void dot_row_range(const float* x, const float* w, int depth, int first, int end, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  int j = first;
  for (; j + 4 <= end; j += 4) dot_rows<4>(x, w + static_cast<size_t>(j) * depth, depth, out + j);
  for (; j < end; ++j) dot_rows<1>(x, w + static_cast<size_t>(j) * depth, depth, out + j);
#else
  for (int j = first; j < end; ++j) {
    float total = 0.0f;
    for (int k = 0; k < depth; ++k) total += w[static_cast<size_t>(j) * depth + k] * x[k];
    out[j] += total;
  }
#endif
}

// One product of a step at batch 1: out (N) += w (N, K) @ x (K).
struct VectorProduct {
  const float* x;
  const mx::array& w;
  float* out;
};
// The products in the order given (every w has N rows; two may share an out), their rows shared by a team.
void add_vector_products(const std::vector<VectorProduct>& products) {
  size_t bytes = 0;
  for (const auto& product : products) bytes += product.w.nbytes();
  share_step_rows(bytes, products.front().w.shape(0), [&](int first, int end) {
    for (const auto& [x, w, out] : products) dot_row_range(x, w.data<float>(), w.shape(1), first, end, out);
  });
}

// What a step computes: its gate blocks G and gate math.
enum class StepKind { kLstm, kGru, kRnnTanh, kRnnRelu };
int gate_blocks_of(StepKind kind) { return kind == StepKind::kLstm ? 4 : kind == StepKind::kGru ? 3 : 1; }

// One layer's step from its products, for `batch` rows: the input side (B, G H) starts as b_ih (+ b_hh, but
// not the GRU's, which stays inside r * (W_hn h + b_hn)) and the GRU's hidden side as b_hh (nullptr: no bias);
// add_products(input side, recurrent side) adds x W_ih^T to the input side and h W_hh^T to the recurrent side
// (the input side itself, the GRU's hidden side apart); then the gate math.  h (B, H) holds the previous h and
// gets the new one, c (the LSTM's, (B, H)) advances in place, out gets the new h.
template <class AddProducts>
void step_layer(StepKind kind, int batch, int hidden, const float* b_ih, const float* b_hh, float* h, float* c,
                float* out, AddProducts add_products) {
  const bool gru = kind == StepKind::kGru;
  const int gates = gate_blocks_of(kind) * hidden;
  std::vector<float> input(static_cast<size_t>(batch) * gates, 0.0f), hidden_side(gru ? input.size() : 0, 0.0f);
  for (size_t r = 0; r < static_cast<size_t>(batch); ++r) {
    for (int j = 0; j < gates; ++j) {
      input[r * gates + j] = (b_ih ? b_ih[j] : 0.0f) + (b_hh && !gru ? b_hh[j] : 0.0f);
      if (b_hh && gru) hidden_side[r * gates + j] = b_hh[j];
    }
  }
  add_products(input.data(), gru ? hidden_side.data() : input.data());
  for (int r = 0; r < batch; ++r) {
    const size_t row = static_cast<size_t>(r) * hidden, pre = static_cast<size_t>(r) * gates;
    if (kind == StepKind::kLstm) {
      lstm_row(hidden, input.data() + pre, c + row, h + row, out + row, nullptr);
    } else if (gru) {
      gru_row(hidden, input.data() + pre, nullptr, hidden_side.data() + pre, h + row, out + row, nullptr);
    }
  }
  if (kind == StepKind::kRnnTanh || kind == StepKind::kRnnRelu) {
    rnn_rows(static_cast<size_t>(batch) * hidden, kind == StepKind::kRnnRelu, input.data(), h, out);
  }
}

// One layer's step at a batch of 2 or more, the graph path's arithmetic: (rows (B, D), its states (B, H) each,
// w_ih, w_hh, b_ih, b_hh) -> output, new h (, new c).
std::vector<mx::array> matrix_layer_step(StepKind kind, const mx::array& rows, const std::vector<mx::array>& states,
                                         const OptionalArray* w) {
  if (kind == StepKind::kLstm) {
    return step_now(lstm_forward, {input_side(rows, *w[0], w[2], w[3]), evaluated(*w[1]), states[0], states[1]}, 2, 0);
  }
  if (kind == StepKind::kGru) {
    mx::array b_hh = w[3] ? evaluated(*w[3]) : mx::zeros({w[1]->shape(0)}, mx::float32);
    b_hh.eval();  // b_hh stays inside r * (W_hn h + b_hn): only b_ih joins the input side
    return step_now(gru_forward, {input_side(rows, *w[0], w[2], std::nullopt), evaluated(*w[1]), b_hh, states[0]}, 1,
                    0);
  }
  return step_now(rnn_forward, {input_side(rows, *w[0], w[2], w[3]), evaluated(*w[1]), states[0]}, 1,
                  kind == StepKind::kRnnRelu ? kRelu : 0);
}

// One layer's step at batch 1, its products shared by a team (add_vector_products): the same arguments and
// results; the states are the caller's own copies, which the step advances in place.
std::vector<mx::array> vector_layer_step(StepKind kind, const mx::array& rows, const std::vector<mx::array>& states,
                                         const OptionalArray* w) {
  const int hidden = states[0].shape(1);
  const mx::array w_ih = evaluated(*w[0]), w_hh = evaluated(*w[1]);
  const OptionalArray b_ih = w[2] ? OptionalArray(evaluated(*w[2])) : std::nullopt;
  const OptionalArray b_hh = w[3] ? OptionalArray(evaluated(*w[3])) : std::nullopt;
  std::vector<mx::array> outs{fresh(1, hidden)};
  outs.insert(outs.end(), states.begin(), states.end());  // h (, c): advanced in place
  float* h = outs[1].data<float>();
  step_layer(kind, 1, hidden, b_ih ? b_ih->data<float>() : nullptr, b_hh ? b_hh->data<float>() : nullptr, h,
             kind == StepKind::kLstm ? outs[2].data<float>() : nullptr, outs[0].data<float>(),
             [&](float* input, float* recurrent) {
               add_vector_products({{rows.data<float>(), w_ih, input}, {h, w_hh, recurrent}});
             });
  return outs;
}

// A ValueError in Python unless x (B, D), the states ((B, H) or (L, B, H)) and each layer's w_ih
// (G H, D_in), w_hh (G H, H), b_ih and b_hh (G H,) or None are float32 and fit together (G gate
// blocks; D_in is D for the first layer and H after it).  The layers pass them so.
void check_step_arrays(const mx::array& x, const std::vector<mx::array>& states,
                       const std::vector<OptionalArray>& weights, int gate_blocks) {
  const auto fail = [](const std::string& what) { throw std::invalid_argument("step: " + what); };
  const mx::array& h = states[0];
  if (x.dtype() != mx::float32 || x.ndim() != 2) fail("expected x (B, D) float32");
  if (h.ndim() != 2 && h.ndim() != 3) fail("expected states (B, H) or (L, B, H)");
  const int layers = h.ndim() == 3 ? h.shape(0) : 1, batch = h.shape(-2), hidden = h.shape(-1);
  for (const auto& state : states) {
    if (state.dtype() != mx::float32 || state.shape() != h.shape()) fail("expected float32 states of one shape");
  }
  if (x.shape(0) != batch) fail("x and the states differ in batch size");
  if (weights.size() != 4 * static_cast<size_t>(layers)) fail("expected w_ih, w_hh, b_ih, b_hh for each layer");
  const int gates = gate_blocks * hidden;
  for (int layer = 0; layer < layers; ++layer) {
    const OptionalArray* w = &weights[4 * layer];
    const int input_size = layer == 0 ? x.shape(1) : hidden;
    if (!w[0] || !w[1]) fail("w_ih and w_hh are required");
    const auto check = [&](const OptionalArray& weight, mx::Shape shape, const char* name) {
      if (weight && (weight->dtype() != mx::float32 || weight->shape() != shape)) {
        fail(std::string(name) + ": wrong shape or dtype");
      }
    };
    check(w[0], {gates, input_size}, "w_ih");
    check(w[1], {gates, hidden}, "w_hh");
    check(w[2], {gates}, "b_ih");
    check(w[3], {gates}, "b_hh");
  }
}

// One step of a stack of layers: states are (B, H), or (L, B, H) for L layers; weights hold
// w_ih, w_hh, b_ih, b_hh (biases None) for each layer in turn.  Returns the last layer's output
// (B, H) and the new states, in the states' shapes.
std::vector<mx::array> layers_step(StepKind kind, const mx::array& x, const std::vector<mx::array>& states,
                                   const std::vector<OptionalArray>& weights) {
  check_step_arrays(x, states, weights, gate_blocks_of(kind));
  // This runs on the caller's thread while MLX's CPU stream may run other work (mx.async_eval).
  // Both may call BLAS: the shim holds one lock per product, so the thread count it lowers for a
  // small product is never seen by another.  (Synchronising the stream first cost about 150 us a
  // step, 4x the step.)
  const bool stacked = states[0].ndim() == 3;
  const int layers = stacked ? states[0].shape(0) : 1;
  std::vector<mx::array> given, finals;
  for (const auto& state : states) {
    given.push_back(evaluated(state));
    finals.push_back(mx::array(mx::allocator::malloc(sizeof(float) * state.size()), state.shape(), mx::float32));
  }
  const int batch = given[0].shape(stacked ? 1 : 0), hidden = given[0].shape(stacked ? 2 : 1);
  const size_t layer_floats = static_cast<size_t>(batch) * hidden;
  mx::array rows = evaluated(x);
  for (int layer = 0; layer < layers; ++layer) {
    std::vector<mx::array> layer_states;
    for (const auto& state : given) {
      layer_states.push_back(fresh(batch, hidden));
      copy_rows(layer_states.back().data<float>(), state.data<float>() + layer * layer_floats, batch, hidden);
    }
    const OptionalArray* layer_weights = &weights[4 * layer];
    std::vector<mx::array> outs = batch == 1 ? vector_layer_step(kind, rows, layer_states, layer_weights)
                                             : matrix_layer_step(kind, rows, layer_states, layer_weights);
    for (size_t k = 0; k < finals.size(); ++k) {
      copy_rows(finals[k].data<float>() + layer * layer_floats, outs[k + 1].data<float>(), batch, hidden);
    }
    rows = outs[0];
  }
  finals.insert(finals.begin(), rows);
  return finals;
}

std::vector<mx::array> lstm_step(const mx::array& x, const mx::array& h0, const mx::array& c0,
                                 const std::vector<OptionalArray>& weights) {
  return layers_step(StepKind::kLstm, x, {h0, c0}, weights);
}

std::vector<mx::array> gru_step(const mx::array& x, const mx::array& h0, const std::vector<OptionalArray>& weights) {
  return layers_step(StepKind::kGru, x, {h0}, weights);
}

std::vector<mx::array> rnn_step(const mx::array& x, const mx::array& h0, const std::vector<OptionalArray>& weights,
                                bool relu) {
  return layers_step(relu ? StepKind::kRnnRelu : StepKind::kRnnTanh, x, {h0}, weights);
}

// ----------------------------------------------------------------- one step on quantized weights
//
// quantized_step runs one step of a cell or a stack of layers whose weight matrices are stored as
// mx.quantize stores them in "affine" mode with 4 or 8 bits (seqlib.nn.QuantizedRecurrent): each
// product reads the packed integers and never forms the float matrix.  A step at batch 1 is bound by
// reading its weights, so it reads a quarter (8 bits) or an eighth (4 bits) of the float step's bytes.
// The arithmetic: for row j of W and group g of its columns, W[j, k] = scales[j, g] q[j, k] +
// biases[j, g], so x W^T [j] = sum_g scales[j, g] (sum_{k in g} x[k] q[j, k]) + biases[j, g] (sum_{k
// in g} x[k]): the integers times x exactly as floats, summed in a vector per group, scaled, and the
// groups' sums of x times the biases added.  It rounds otherwise than the dequantized float product
// (within float32 rounding of the same sum); the gate math is the float step's.  The integers are
// converted a vector at a time, the build's widest (16 with AVX-512, 8 with AVX2): the two builds sum in
// different orders, and one build gives the same bits on any number of threads.  Converting is the
// cost (about 1 ns per 16 values on one Sapphire Rapids core: widening, conversion and FMA, 3 vector
// operations per 16 weights), so a product over 1 MB of weights shares its rows among a team.

// A (N, K) matrix as mx.quantize stores it: packed (N, K bits / 32) uint32, value k of a row in bits
// [bits (k mod 32 / bits), +bits) of word k / (32 / bits); scales and biases (N, K / group_size) float32.
struct QuantizedMatrix {
  mx::array packed, scales, biases;
  int group_size, bits;
};

#if defined(__AVX2__) && defined(__FMA__)
// One vector (simd::kLanes) of a row's BITS-bit integers, from value k (a multiple of the width) on, as floats.
// 4 bits: byte b holds value 2b in its low nibble and 2b + 1 in its high one.
template <int BITS>
inline Vec quantized_values(const uint8_t* row, int k) {
#if defined(__AVX512F__)
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))));
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m512i pairs = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  // b0 b0 b1 b1 ...
    const __m512i shifted = _mm512_srlv_epi32(pairs, _mm512_set4_epi32(4, 0, 4, 0));
    return _mm512_cvtepi32_ps(_mm512_and_si512(shifted, _mm512_set1_epi32(15)));
  }
#else
  if constexpr (BITS == 8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
  } else {
    uint32_t four;
    std::memcpy(&four, row + k / 2, sizeof(four));
    const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(four));
    const __m256i pairs = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  // b0 b0 b1 b1 ...
    const __m256i shifted = _mm256_srlv_epi32(pairs, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(15)));
  }
#endif
}

// Rows taken at once, and chains of FMAs per row: with AVX-512, 8 rows of one chain (8 FMAs in flight, 8
// accumulators and 8 scaled sums of its 32 registers); with AVX2, 4 rows of two chains (the even and odd vectors
// of a group; a group of an odd number of vectors ends on the even).  Each x vector then feeds 8 FMAs.  Rows
// left over go 4, then 1 at a time with the same chains: every row sums in one order whatever rows it is taken
// with, so a build gives the same bits on any number of threads.  LSTMCell H = 512 at 8 bits (2 MB a step) on one
// Zen 5 core: 4 rows of two chains, the group's length a loop bound, 77 us a step; 8 rows 59; unrolled for
// mx.quantize's group sizes and with the biases' term in vectors 49.
constexpr int kQuantizedRows = simd::kLanes == 16 ? 8 : 4, kQuantizedChains = simd::kLanes == 16 ? 1 : 2;

// Rows [j, j + ROWS) of x_row (K) @ W^T + the biases' term, W quantized, added to out[0, ROWS): each x vector
// loaded once for the rows; x_sums (groups): x_row summed over each group.  Each group's sum is scaled into
// `scaled`, then the biases' term added there, a vector of groups at a time, before the one horizontal sum.
// GROUP: the group size, known when compiled (or 0: runtime_group).
template <int BITS, int ROWS, int GROUP>
inline void quantized_rows(const float* x_row, const float* x_sums, const uint8_t* rows, int row_bytes,
                           const float* scales, const float* biases, int groups, int runtime_group, float* out) {
  constexpr int kLanes = simd::kLanes, kChains = kQuantizedChains;
  const int group_size = GROUP > 0 ? GROUP : runtime_group;
  const auto values = [&](int r, int k) {
    return quantized_values<BITS>(rows + static_cast<size_t>(r) * row_bytes, k);
  };
  Vec scaled[ROWS];
  for (int r = 0; r < ROWS; ++r) scaled[r] = Vec{};
  for (int g = 0; g < groups; ++g) {
    Vec chains[kChains][ROWS];
    for (int c = 0; c < kChains; ++c) {
      for (int r = 0; r < ROWS; ++r) chains[c][r] = Vec{};
    }
    const int end = (g + 1) * group_size;
    int k = g * group_size;
    for (; k + kChains * kLanes <= end; k += kChains * kLanes) {
      for (int c = 0; c < kChains; ++c) {
        const Vec x = simd::load(x_row + k + c * kLanes);
        for (int r = 0; r < ROWS; ++r) chains[c][r] = simd::fma(x, values(r, k + c * kLanes), chains[c][r]);
      }
    }
    if (k < end) {  // two chains and an odd number of vectors: the last one
      const Vec x = simd::load(x_row + k);
      for (int r = 0; r < ROWS; ++r) chains[0][r] = simd::fma(x, values(r, k), chains[0][r]);
    }
    for (int r = 0; r < ROWS; ++r) {
      Vec sum = chains[0][r];
      for (int c = 1; c < kChains; ++c) sum = sum + chains[c][r];
      scaled[r] = simd::fma(simd::broadcast(scales[static_cast<size_t>(r) * groups + g]), sum, scaled[r]);
    }
  }
  for (int g = 0; g < groups; g += kLanes) {
    const int lanes = std::min(kLanes, groups - g);
    const Vec sums = simd::load(x_sums + g, lanes);
    for (int r = 0; r < ROWS; ++r) {
      scaled[r] = simd::fma(simd::load(biases + static_cast<size_t>(r) * groups + g, lanes), sums, scaled[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] += horizontal_sum(scaled[r]);
}

// Entries [first, end) of out_row += x_row @ W^T: kQuantizedRows rows at a time, then 4, then 1.
template <int BITS, int GROUP>
inline void quantized_row_range(const float* x_row, const float* x_sums, const uint8_t* packed, int row_bytes,
                                const float* scales, const float* biases, int groups, int group_size, int first,
                                int end, float* out_row) {
  const auto rows_at = [&]<int ROWS>(int j) {
    const size_t at = static_cast<size_t>(j) * groups;
    quantized_rows<BITS, ROWS, GROUP>(x_row, x_sums, packed + static_cast<size_t>(j) * row_bytes, row_bytes,
                                      scales + at, biases + at, groups, group_size, out_row + j);
  };
  int j = first;
  for (; j + kQuantizedRows <= end; j += kQuantizedRows) rows_at.template operator()<kQuantizedRows>(j);
  for (; j + 4 <= end; j += 4) rows_at.template operator()<4>(j);
  for (; j < end; ++j) rows_at.template operator()<1>(j);
}
#endif

// Entries [first, end) of out_row (N) += x_row (K) @ W^T, W quantized; x_sums: x_row's sum over each group.
void add_quantized_rows(const float* x_row, const float* x_sums, const QuantizedMatrix& w, int first, int end,
                        float* out_row) {
  const int depth = w.packed.shape(1) * 32 / w.bits, groups = depth / w.group_size;
  const int row_bytes = depth * w.bits / 8;
  const auto* packed = reinterpret_cast<const uint8_t*>(w.packed.data<uint32_t>());
  const float *scales = w.scales.data<float>(), *biases = w.biases.data<float>();
#if defined(__AVX2__) && defined(__FMA__)
  const auto row_range = [&]<int BITS, int GROUP>() {
    quantized_row_range<BITS, GROUP>(x_row, x_sums, packed, row_bytes, scales, biases, groups, w.group_size, first,
                                     end, out_row);
  };
  const auto with_bits = [&]<int GROUP>() {
    w.bits == 8 ? row_range.template operator()<8, GROUP>() : row_range.template operator()<4, GROUP>();
  };
  switch (w.group_size) {  // mx.quantize's group sizes unrolled; any other multiple of 16 looped
    case 32: with_bits.template operator()<32>(); break;
    case 64: with_bits.template operator()<64>(); break;
    case 128: with_bits.template operator()<128>(); break;
    default: with_bits.template operator()<0>();
  }
#else
  const int per_word = 32 / w.bits;
  for (int j = first; j < end; ++j) {
    const auto* words = reinterpret_cast<const uint32_t*>(packed + static_cast<size_t>(j) * row_bytes);
    float total = 0.0f;
    for (int g = 0; g < groups; ++g) {
      float dot = 0.0f;
      for (int k = g * w.group_size; k < (g + 1) * w.group_size; ++k) {
        dot += x_row[k] * static_cast<float>((words[k / per_word] >> (w.bits * (k % per_word))) & ((1u << w.bits) - 1));
      }
      total += scales[static_cast<size_t>(j) * groups + g] * dot;
    }
    const float* bias = biases + static_cast<size_t>(j) * groups;
    for (int g = 0; g < groups; ++g) total += bias[g] * x_sums[g];
    out_row[j] += total;
  }
#endif
}

// Products on quantized weights, each out (B, N) += x (B, K) @ W^T in the order given (every W has N rows;
// two products may share an out), their rows shared by a team as the float step's (share_step_rows).  LSTMCell
// H = 512 at 8 bits (2.3 MB a step) on a 2-core Sapphire Rapids: the step alone 170-250 -> 130-160 us.  The
// team is sized by the float matrices' bytes, as the float step's, not the packed bytes: converting the
// integers costs about what reading floats does, so counting packed bytes gave the 8-bit step a quarter of the
// float step's team.  On a 16-core Emerald Rapids virtual machine that made the 8-bit LSTMCell step at H = 512
// slower than the float one (151 against 81 us, 4 threads against 16; its float weights fit in the 16 cores'
// L2).  On 2 cores, alternated processes, us per step at H = 256 (1 thread -> 2): 82, 79, 75 -> 76, 75, 75.
struct QuantizedProduct {
  mx::array x;
  const QuantizedMatrix* w;
  float* out;
};
void add_quantized_products(const std::vector<QuantizedProduct>& products) {
  size_t work = 0;  // the float matrices' bytes: converting the integers, not reading them, is the cost
  std::vector<std::vector<float>> x_sums;  // per product, (B, groups): each row of x summed over each group
  for (const auto& [x, w, out] : products) {
    work += sizeof(float) * w->packed.shape(0) * x.shape(1);
    const int batch = x.shape(0), depth = x.shape(1), groups = depth / w->group_size;
    std::vector<float>& sums = x_sums.emplace_back(static_cast<size_t>(batch) * groups, 0.0f);
    const float* xs = x.data<float>();
    for (size_t b = 0; b < static_cast<size_t>(batch); ++b) {
      for (int g = 0; g < groups; ++g) {
        const float* group = xs + b * depth + static_cast<size_t>(g) * w->group_size;
        for (int k = 0; k < w->group_size; ++k) sums[b * groups + g] += group[k];
      }
    }
  }
  const int width = products.front().w->packed.shape(0);
  share_step_rows(work, width, [&](int first, int end) {
    for (size_t p = 0; p < products.size(); ++p) {
      const auto& [x, w, out] = products[p];
      const size_t depth = x.shape(1), groups = depth / w->group_size;
      for (size_t b = 0; b < static_cast<size_t>(x.shape(0)); ++b) {
        add_quantized_rows(x.data<float>() + b * depth, x_sums[p].data() + b * groups, *w, first, end, out + b * width);
      }
    }
  });
}

// The quantized matrix at weights[at..at+3) (packed, scales, biases), checked against (rows, columns).
QuantizedMatrix quantized_matrix(const std::vector<OptionalArray>& weights, size_t at, int rows, int columns,
                                 int group_size, int bits, const char* name) {
  const auto fail = [&](const std::string& what) {
    throw std::invalid_argument(std::string("quantized_step: ") + name + ": " + what);
  };
  if (!weights[at] || !weights[at + 1] || !weights[at + 2]) fail("expected its packed values, scales and biases");
  const mx::array &packed = *weights[at], &scales = *weights[at + 1], &biases = *weights[at + 2];
  if (packed.dtype() != mx::uint32 || packed.shape() != mx::Shape{rows, columns * bits / 32}) {
    fail("expected packed values uint32 of shape " + shape_text({rows, columns * bits / 32}) + ", got " +
         shape_text(packed.shape()));
  }
  const mx::Shape group_shape{rows, columns / group_size};
  for (const mx::array* array : {&scales, &biases}) {
    if (array->dtype() != mx::float32 || array->shape() != group_shape) {
      fail("expected float32 scales and biases of shape " + shape_text(group_shape) + ", got " +
           shape_text(array->shape()));
    }
  }
  return {evaluated(packed), evaluated(scales), evaluated(biases), group_size, bits};
}

// A bias (G H,) where given, else none.
std::optional<mx::array> bias_of(const OptionalArray& bias, int gates, const char* name) {
  if (!bias) return std::nullopt;
  if (bias->dtype() != mx::float32 || bias->shape() != mx::Shape{gates}) {
    throw std::invalid_argument(std::string("quantized_step: ") + name + ": expected float32 of shape (" +
                                std::to_string(gates) + ",), got " + shape_text(bias->shape()));
  }
  return evaluated(*bias);
}

// One step of `kind` ("lstm", "gru", "rnn_tanh", "rnn_relu") for a cell or a stack of L layers: x (B, D);
// states as lstm_step's ((B, H) or (L, B, H)); weights, 8 per layer: w_ih's packed values, scales and
// biases, w_hh's, then b_ih and b_hh (or None).  Returns the last layer's output (B, H) and the new states.
std::vector<mx::array> quantized_step(const std::string& kind, const mx::array& x, const std::vector<mx::array>& states,
                                      const std::vector<OptionalArray>& weights, int group_size, int bits) {
  const auto fail = [](const std::string& what) { throw std::invalid_argument("quantized_step: " + what); };
  const std::vector<std::pair<std::string, StepKind>> kinds{{"lstm", StepKind::kLstm}, {"gru", StepKind::kGru},
                                                           {"rnn_tanh", StepKind::kRnnTanh},
                                                           {"rnn_relu", StepKind::kRnnRelu}};
  const auto named = std::find_if(kinds.begin(), kinds.end(), [&](const auto& entry) { return entry.first == kind; });
  if (named == kinds.end()) fail("kind: expected 'lstm', 'gru', 'rnn_tanh' or 'rnn_relu', got '" + kind + "'");
  const StepKind step_kind = named->second;
  const int gate_blocks = gate_blocks_of(step_kind);
  if (bits != 4 && bits != 8) fail("bits: expected 4 or 8, got " + std::to_string(bits));
  if (group_size < 16 || group_size % 16 != 0) {
    fail("group_size: expected a multiple of 16, got " + std::to_string(group_size));
  }
  const bool lstm = step_kind == StepKind::kLstm;
  if (states.size() != (lstm ? 2u : 1u)) fail(std::string("expected ") + (lstm ? "2 states" : "1 state"));
  const mx::array& h = states[0];
  if (x.dtype() != mx::float32 || x.ndim() != 2) fail("expected x (B, D) float32");
  if (h.ndim() != 2 && h.ndim() != 3) fail("expected states (B, H) or (L, B, H)");
  for (const auto& state : states) {
    if (state.dtype() != mx::float32 || state.shape() != h.shape()) fail("expected float32 states of one shape");
  }
  const bool stacked = h.ndim() == 3;
  const int layers = stacked ? h.shape(0) : 1, batch = h.shape(-2), hidden = h.shape(-1), gates = gate_blocks * hidden;
  if (x.shape(0) != batch) fail("x and the states differ in batch size");
  if (weights.size() != 8 * static_cast<size_t>(layers)) fail("expected 8 weights for each layer");
  std::vector<mx::array> given, finals;
  for (const auto& state : states) {
    given.push_back(evaluated(state));
    finals.push_back(mx::array(mx::allocator::malloc(sizeof(float) * state.size()), state.shape(), mx::float32));
  }
  const size_t layer_floats = static_cast<size_t>(batch) * hidden;
  mx::array rows = evaluated(x);
  for (int layer = 0; layer < layers; ++layer) {
    const size_t at = 8 * static_cast<size_t>(layer);
    const int input_size = rows.shape(1);
    if (input_size % group_size != 0 || hidden % group_size != 0) {
      fail("the matrices' columns (" + std::to_string(input_size) + ", " + std::to_string(hidden) +
           ") must be multiples of group_size " + std::to_string(group_size));
    }
    const QuantizedMatrix w_ih = quantized_matrix(weights, at, gates, input_size, group_size, bits, "w_ih");
    const QuantizedMatrix w_hh = quantized_matrix(weights, at + 3, gates, hidden, group_size, bits, "w_hh");
    const auto b_ih = bias_of(weights[at + 6], gates, "b_ih"), b_hh = bias_of(weights[at + 7], gates, "b_hh");
    mx::array h_prev = fresh(batch, hidden), output = fresh(batch, hidden);
    copy_rows(h_prev.data<float>(), given[0].data<float>() + layer * layer_floats, batch, hidden);
    float* c = lstm ? finals[1].data<float>() + layer * layer_floats : nullptr;
    if (c != nullptr) copy_rows(c, given[1].data<float>() + layer * layer_floats, batch, hidden);
    float* out = output.data<float>();
    step_layer(step_kind, batch, hidden, b_ih ? b_ih->data<float>() : nullptr, b_hh ? b_hh->data<float>() : nullptr,
               h_prev.data<float>(), c, out, [&](float* input, float* recurrent) {
                 add_quantized_products({{rows, &w_ih, input}, {h_prev, &w_hh, recurrent}});
               });
    copy_rows(finals[0].data<float>() + layer * layer_floats, out, batch, hidden);
    rows = output;
  }
  finals.insert(finals.begin(), rows);
  return finals;
}

// ----------------------------------------------------------------- a batch-first input, time-major
//
// The layers run on time-major rows (T B, D); a batch_first input (B, T, D) is copied into them.  MLX's
// copy of a swapaxes view runs on one thread (about 10 GB/s: 0.65 ms for (32, 100, 256) on a 16-core
// Sapphire Rapids, 5% of the LSTM's forward), so the layers use this threaded copy where the
// primitives serve.  A permutation: each value, and its bits, moves unchanged.

struct Swap {
  bool operator==(const Swap&) const = default;
};

// (A, B, *) -> (B, A, *) for any number of trailing axes (mx.compile(shapeless=True)).
std::vector<mx::Shape> swapped_shape(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>& = {}) {
  mx::Shape shape = inputs[0].shape();
  std::swap(shape[0], shape[1]);
  return {shape};
}

// ins: x (A, B, *); outs: (B, A, *), out[b, a] = x[a, b]
void swap_leading(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Swap&) {
  const mx::array& x = ins[0];
  const int64_t first_axis = x.shape(0), second_axis = x.shape(1);
  int64_t width = 1;  // floats in x[a, b]
  for (size_t axis = 2; axis < x.ndim(); ++axis) width *= x.shape(axis);
  const float* from = x.data<float>();
  float* to = outs[0].data<float>();
  seqlib_cpu::parallel_for(second_axis, static_cast<int64_t>(x.size()), [&](int64_t first, int64_t end) {
    for (int64_t b = first; b < end; ++b) {
      for (int64_t a = 0; a < first_axis; ++a) {
        std::memcpy(to + (b * first_axis + a) * width, from + (a * second_axis + b) * width, sizeof(float) * width);
      }
    }
  });
}

// The gradient: the cotangent (B, A, *) seen as (A, B, *), a view, as for MLX's own swapaxes (whatever reads
// it copies it if it must), and MLX's op, so every transformation of the gradient works.
std::vector<mx::array> swap_vjp(const Swap&, const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                                const std::vector<int>&, const std::vector<mx::array>&) {
  return {mx::swapaxes(cotangents[0], 0, 1, seqlib_cpu::cpu_stream())};
}

// The argument `name` of op, whose two leading axes it swaps: float32 with at least 2 axes, or a ValueError.
void check_swappable(const char* op, const char* name, const mx::array& a) {
  if (a.ndim() < 2 || a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string(op) + ": expected " + name + " float32 with at least 2 axes, got " +
                                shape_text(a.shape()) + (a.dtype() == mx::float32 ? "" : " not float32"));
  }
}

// x (A, B, *) float32 -> (B, A, *), a row-contiguous copy of x.swapaxes(0, 1), with its gradient.
mx::array swap_leading_axes(const mx::array& x) {
  check_swappable("swap_leading_axes", "x", x);
  return seqlib_cpu::make_loop("SwapLeadingAxes", swap_leading, swapped_shape({x}), {mx::float32}, {&x}, Swap{},
                               swap_vjp, swapped_shape)[0];
}

// ----------------------------------------------------------------- a time-major output, batch-first
//
// A batch_first layer's output is its time-major rows seen as (B, T, H): a view, as MLX's swapaxes, whose
// gradient, though, is swap_leading_axes' threaded copy of the cotangent.  MLX's would be a view of the cotangent,
// which the backward loop, reading d_output row by row, has MLX copy on one thread (the reshape into rows does): a
// GRU layer's forward+backward at (B, T, D, H) = (64, 200, 128, 128) on a 2-core AVX-512 Xeon, medians of 30
// calls in alternated processes, 36.1, 34.4, 34.0 -> 33.1, 33.5, 32.9 ms.
class SwappedView : public mx::UnaryPrimitive {
 public:
  explicit SwappedView(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& in = inputs[0];
    mx::Strides strides = in.strides();
    std::swap(strides[0], strides[1]);
    auto flags = in.flags();  // the same buffer; row- or column-major as its strides say (MLX's Transpose's rule)
    if (flags.contiguous && in.data_size() == in.size()) {
      const auto [unbroadcast_size, row_contiguous, col_contiguous] = mx::check_contiguity(out.shape(), strides);
      flags.row_contiguous = row_contiguous, flags.col_contiguous = col_contiguous;
    }
    out.copy_shared_buffer(in, strides, flags, in.data_size());
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("SwappedView runs on the CPU only");
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                             const std::vector<int>&, const std::vector<mx::array>&) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>&, const std::vector<mx::array>& tangents,
                             const std::vector<int>&) override {
    return {mx::swapaxes(tangents[0], 0, 1, stream())};
  }
  // mapped: MLX's swapaxes of the two axes after the mapped one, moved first
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                           const std::vector<int>& axes) override {
    const mx::array moved = mx::moveaxis(inputs[0], axes[0], 0, stream());
    return {{mx::swapaxes(moved, 1, 2, stream())}, {0}};
  }
  const char* name() const override { return "SwappedView"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return swapped_shape(inputs);
  }
};

// time_major (T, B, *) float32 -> (B, T, *), the view time_major.swapaxes(0, 1), whose gradient is row-contiguous.
mx::array swapped_view(const mx::array& time_major) {
  check_swappable("swapped_view", "time_major", time_major);
  return mx::array(swapped_shape({time_major})[0], mx::float32,
                   std::make_shared<SwappedView>(seqlib_cpu::cpu_stream()), {time_major});
}

std::vector<mx::array> SwappedView::vjp(const std::vector<mx::array>&, const std::vector<mx::array>& cotangents,
                                        const std::vector<int>&, const std::vector<mx::array>&) {
  return {swap_leading_axes(cotangents[0])};
}

}  // namespace

void seqlib_cpu::register_recurrent(nb::module_& m) {
  m.def("lstm_sequence", &lstm_sequence, "x_gates"_a, "w_hh"_a, "h0"_a, "c0"_a, "batch_sizes"_a, "reverse"_a,
        "save"_a, "bias"_a = nb::none());
  m.def("lstm_input_sequence", &lstm_input_sequence, "x"_a, "w_ih"_a, "w_hh"_a, "h0"_a, "c0"_a, "batch_sizes"_a,
        "reverse"_a, "save"_a, "bias"_a = nb::none());
  m.def("lstm_sequence_backward", &lstm_sequence_backward, "w_hh"_a, "saved"_a, "c0"_a,
        "d_output"_a, "d_h_n"_a, "d_c_n"_a, "batch_sizes"_a, "reverse"_a);
  m.def("gru_sequence", &gru_sequence, "x_gates"_a, "w_hh"_a, "b_hh"_a, "h0"_a, "batch_sizes"_a, "reverse"_a,
        "save"_a, "bias"_a = nb::none());
  m.def("gru_input_sequence", &gru_input_sequence, "x"_a, "w_ih"_a, "w_hh"_a, "b_hh"_a, "h0"_a, "batch_sizes"_a,
        "reverse"_a, "save"_a, "bias"_a = nb::none());
  m.def("gru_sequence_backward", &gru_sequence_backward, "w_hh"_a, "saved"_a, "output"_a, "h0"_a,
        "d_output"_a, "d_h_n"_a, "batch_sizes"_a, "reverse"_a);
  m.def("rnn_sequence", &rnn_sequence, "x_gates"_a, "w_hh"_a, "h0"_a, "batch_sizes"_a, "reverse"_a, "relu"_a,
        "save"_a, "bias"_a = nb::none());
  m.def("lstm_step", &lstm_step, "x"_a, "h0"_a, "c0"_a, "weights"_a);
  m.def("gru_step", &gru_step, "x"_a, "h0"_a, "weights"_a);
  m.def("rnn_step", &rnn_step, "x"_a, "h0"_a, "weights"_a, "relu"_a);
  m.def("quantized_step", &quantized_step, "kind"_a, "x"_a, "states"_a, "weights"_a, "group_size"_a, "bits"_a);
  m.def("swap_leading_axes", &swap_leading_axes, "x"_a);
  m.def("swapped_view", &swapped_view, "time_major"_a);
  m.def("rnn_sequence_backward", &rnn_sequence_backward, "w_hh"_a, "output"_a, "d_output"_a, "d_h_n"_a,
        "batch_sizes"_a, "reverse"_a, "relu"_a);
}
