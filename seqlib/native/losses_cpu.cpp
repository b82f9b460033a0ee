// losses_cpu.cpp: softmax cross-entropy over the rows of a (N, C) float32 array, as MLX primitives on the CPU.
//
// Why: MLX's CPU backend computes exp one element at a time on x86 (its SIMD layer has no x86 vectors,
// and each exp calls libm's fmaf several times): mx.exp of 200k floats took 2.5 ms (12.7 ns an element)
// with MLX 0.32.4 on a 2-core Sapphire Rapids, torch.exp 0.017 ms.  mlx.nn.losses.cross_entropy takes
// two such passes over the logits (logsumexp forward, softmax backward): 5.8 ms of a 23.6 ms training
// step of chapter 13's character model at H = 128 (logits 2,048 x 97).  Here exp is a polynomial on the
// build's widest vectors and each row is read in cache:
//
//   SoftmaxCrossEntropy          logits (N, C), targets (N,) int32 or none -> nll (N,), lse (N,)
//       lse[i] = log sum_c exp(logits[i, c]), as max + log sum exp(logits - max);
//       nll[i] = lse[i] - logits[i, targets[i]] for a target in [0, C); 0 for the target C (an ignored
//       row: seqlib.losses maps ignore_index there; every row without targets); NaN for any other (never read)
//   SoftmaxCrossEntropyBackward  d_logits[i, c] = (d_nll[i] + d_lse[i]) softmax[i, c] - d_nll[i] [c == targets[i]]
//       with softmax[i, c] = exp(logits[i, c] - lse[i]) computed again (lse saved by the forward)
//
// exp: Cody and Waite's reduction x = n ln 2 + r, |r| <= ln 2 / 2 (ln 2 in two parts, so n ln2_hi is exact), and
// Cephes' polynomial for exp(r) (Cephes' expf), scaled by 2^n through the exponent bits: within 8.0e-8 of float64's exp
// (1.3 ulp), measured over 400,001 points in [-87, -17] through the backward's softmax.  Its arguments here are never
// positive (x - max, x - lse): no overflow to handle, and below -87.33 (where exp is under float32's smallest normal)
// it returns 0.  No FMA: the same rounding with any vector width.  NaN and infinities in a row make its lse NaN, as in
// torch.
//
// Napkin math: the forward reads N C 4 bytes twice (max, then the sum of exps; a row stays in L1 for
// C up to a few thousand) and computes N C exps; the backward reads them once more and writes N C 4 bytes.
// Rows are split over the CPU's threads (parallel_for), each row computed whole by one thread.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "cpu_loop.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

using seqlib_cpu::Floats;
using seqlib_cpu::kLanes;
using seqlib_cpu::load;
using seqlib_cpu::splat;
using seqlib_cpu::store;
typedef int32_t Ints __attribute__((vector_size(4 * kLanes)));

// exp(x) for x <= 0 (or NaN, which stays NaN): see the header.
Floats exp_nonpositive(Floats x) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 2^23: adding and subtracting it rounds to an integer
  constexpr float kLowest = -87.3365478515625f;
  const Floats clamped = x < kLowest ? splat(kLowest) : x;
  Floats n = (clamped * kLog2e + kRound) - kRound;  // in [-126, 0]
  n = n == n ? n : splat(0.0f);                     // NaN: any n (the polynomial keeps the NaN)
  const Floats r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  Floats p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  const Ints exponent = (__builtin_convertvector(n, Ints) + 127) << 23;  // 2^n, n >= -126: a normal float
  Floats scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  const Floats result = p * scale;
  return x < kLowest ? splat(0.0f) : result;
}

Ints lane_numbers() {
  Ints numbers;
  for (int k = 0; k < kLanes; ++k) numbers[k] = k;
  return numbers;
}

// The lanes of v combined pairwise (a tree four deep for 16 lanes, not a chain of 15): op(a, b).
template <class Op>
float combine_lanes(Floats v, Op op) {
  float lanes[kLanes];
  store(lanes, v);
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int k = 0; k < width; ++k) lanes[k] = op(lanes[k], lanes[k + width]);
  }
  return lanes[0];
}

// A row is read kLanes floats at a time, from c = 0; where its length is not a multiple of kLanes, its last vector
// is the one that ends at the row's end, at c = count - kLanes, overlapping the one before (a masked read's
// cost without masks).  A row shorter than kLanes is first copied into one vector, padded with -inf (whose
// exp is 0, and which no max picks): padded_row.
void padded_row(const float* row, int count, float (&padded)[kLanes]) {
  std::fill(std::copy(row, row + count, padded), padded + kLanes, -std::numeric_limits<float>::infinity());
}

// log sum_c exp(row[c]); NaN where the row holds a NaN (its exp is NaN) or +inf (inf - inf).
float row_logsumexp(const float* row, int count) {
  float padded[kLanes];
  if (count < kLanes) {
    padded_row(row, count, padded);
    row = padded, count = kLanes;
  }
  const int last = count - kLanes;
  Floats most = load(row + last);
  for (int c = 0; c < last; c += kLanes) most = load(row + c) > most ? load(row + c) : most;
  const float max = combine_lanes(most, [](float a, float b) { return b > a ? b : a; });
  Floats sum{};
  int c = 0;
  for (; c + kLanes <= count; c += kLanes) sum += exp_nonpositive(load(row + c) - max);
  if (c < count) {  // the last vector's first c - last lanes were summed already
    const Floats tail = exp_nonpositive(load(row + last) - max);
    sum += lane_numbers() >= c - last ? tail : splat(0.0f);
  }
  return max + std::log(combine_lanes(sum, [](float a, float b) { return a + b; }));
}

// d_row[c] = scale exp(row[c] - shift) for the count floats of a row.
void scaled_exps(float* d_row, const float* row, int count, float scale, float shift) {
  if (count < kLanes) {
    float padded[kLanes], out[kLanes];
    padded_row(row, count, padded);
    scaled_exps(out, padded, kLanes, scale, shift);
    std::copy(out, out + count, d_row);
    return;
  }
  int c = 0;
  for (; c + kLanes <= count; c += kLanes) store(d_row + c, scale * exp_nonpositive(load(row + c) - shift));
  if (c < count) {  // writes the overlapped lanes again, with the same values
    store(d_row + count - kLanes, scale * exp_nonpositive(load(row + count - kLanes) - shift));
  }
}

// The loops take everything from their inputs' shapes (N and C from the logits): no parameters.
struct NoParams {
  bool operator==(const NoParams&) const = default;
};

// ins: logits (N, C) [, targets (N,) int32: without them every row is ignored]; outs: nll (N,), lse (N,)
void cross_entropy_forward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const NoParams&) {
  const float* logits = ins[0].data<float>();
  const int32_t* targets = ins.size() > 1 ? ins[1].data<int32_t>() : nullptr;
  float* nll = outs[0].data<float>();
  float* lse = outs[1].data<float>();
  const int64_t rows = ins[0].shape(0), count = ins[0].shape(1);
  seqlib_cpu::parallel_for(rows, rows * count, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = logits + i * count;
      lse[i] = row_logsumexp(row, static_cast<int>(count));
      const int32_t target = targets != nullptr ? targets[i] : static_cast<int32_t>(count);
      nll[i] = target >= 0 && target < count ? lse[i] - row[target]
               : target == count             ? 0.0f
                                             : std::numeric_limits<float>::quiet_NaN();
    }
  });
}

// ins: d_nll (N,), d_lse (N,), logits (N, C), lse (N,) [, targets (N,) int32]; outs: d_logits (N, C)
void cross_entropy_backward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const NoParams&) {
  const float *d_nll = ins[0].data<float>(), *d_lse = ins[1].data<float>(), *logits = ins[2].data<float>();
  const float* lse = ins[3].data<float>();
  const int32_t* targets = ins.size() > 4 ? ins[4].data<int32_t>() : nullptr;
  float* d_logits = outs[0].data<float>();
  const int64_t rows = ins[2].shape(0), count = ins[2].shape(1);
  seqlib_cpu::parallel_for(rows, rows * count, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = logits + i * count;
      float* d_row = d_logits + i * count;
      const int32_t target = targets != nullptr ? targets[i] : static_cast<int32_t>(count);
      const bool picked = target >= 0 && target < count;
      const float d_target = picked ? d_nll[i] : 0.0f;  // an ignored row's nll is 0: no gradient through it
      const float scale = d_target + d_lse[i], shift = lse[i];
      scaled_exps(d_row, row, static_cast<int>(count), scale, shift);
      if (picked) d_row[target] -= d_target;
      else if (target != count) std::fill(d_row, d_row + count, std::numeric_limits<float>::quiet_NaN());
    }
  });
}

// Every input but the logits (N, C), at `logits`, holds one value per row; and the number of classes is the one
// the loop was built for (empty: not built yet).  An std::invalid_argument (a ValueError) otherwise: a shapeless
// compile that changed one shape and not another, or the classes, which seqlib.losses traced as a constant.
void check_rows(const std::vector<mx::array>& inputs, size_t logits, const std::vector<mx::Shape>& built_for) {
  const mx::array& x = inputs[logits];
  if (!built_for.empty() && x.shape(1) != built_for[logits][1]) {
    throw std::invalid_argument("cross_entropy: the number of classes changed from " +
                                std::to_string(built_for[logits][1]) + " to " + std::to_string(x.shape(1)) +
                                " under mx.compile(shapeless=True), which keeps the traced one; compile once per "
                                "number of classes");
  }
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (k != logits && inputs[k].shape() != mx::Shape{x.shape(0)}) {
      throw std::invalid_argument("cross_entropy: expected one target (and one value) per row of the logits, " +
                                  std::to_string(x.shape(0)) + " rows, got an input of " +
                                  std::to_string(inputs[k].size()) + " values");
    }
  }
}

// nll and lse, (N,) each, for logits (N, C) of any N (mx.compile(shapeless=True)); see check_rows.
std::vector<mx::Shape> row_shapes(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>& built_for) {
  check_rows(inputs, 0, built_for);
  return {{inputs[0].shape(0)}, {inputs[0].shape(0)}};
}

// d_logits (N, C) for logits (N, C) of any N; see check_rows.
std::vector<mx::Shape> logits_shape(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>& built_for) {
  check_rows(inputs, 2, built_for);
  return {inputs[2].shape()};
}

// nll and lse's vector-Jacobian product: the backward loop (targets, integers, have none: zeros where asked).
// primals: logits [, targets]; cotangents: d_nll, d_lse; outputs: nll, lse
std::vector<mx::array> cross_entropy_vjp(const NoParams& params, const std::vector<mx::array>& primals,
                                         const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                         const std::vector<mx::array>& outputs) {
  std::vector<const mx::array*> inputs = {&cotangents[0], &cotangents[1], &primals[0], &outputs[1]};
  if (primals.size() > 1) inputs.push_back(&primals[1]);
  std::vector<mx::array> grads;
  for (int argnum : argnums) {
    if (argnum == 0) {
      grads.push_back(seqlib_cpu::make_loop("SoftmaxCrossEntropyBackward", cross_entropy_backward,
                                            {primals[0].shape()}, {mx::float32}, inputs, params, nullptr,
                                            logits_shape)[0]);
    } else {
      grads.push_back(mx::zeros_like(primals[argnum], seqlib_cpu::cpu_stream()));
    }
  }
  return grads;
}

std::vector<mx::array> softmax_cross_entropy(const mx::array& logits, const std::optional<mx::array>& targets) {
  if (logits.ndim() != 2 || logits.dtype() != mx::float32 || logits.shape(1) >= std::numeric_limits<int32_t>::max() ||
      (targets && (targets->ndim() != 1 || targets->dtype() != mx::int32 || targets->shape(0) != logits.shape(0)))) {
    throw std::invalid_argument("softmax_cross_entropy: expected logits (N, C) float32 and targets (N,) int32 or None");
  }
  std::vector<const mx::array*> inputs = {&logits};
  if (targets) inputs.push_back(&*targets);
  return seqlib_cpu::make_loop("SoftmaxCrossEntropy", cross_entropy_forward, {{logits.shape(0)}, {logits.shape(0)}},
                               {mx::float32, mx::float32}, inputs, NoParams{}, cross_entropy_vjp, row_shapes);
}

}  // namespace

void seqlib_cpu::register_losses(nb::module_& m) {
  m.def("softmax_cross_entropy", &softmax_cross_entropy, "logits"_a, "targets"_a.none(),
        "(nll, lse) of each row of logits (N, C) float32 for targets (N,) int32 (C: ignored; outside [0, C]: NaN); "
        "targets None: every row ignored (the log-sum-exps alone)");
}
