// optim_cpu.cpp: torch's Adam update of one float32 parameter, as one MLX primitive on the CPU.
//
// Why: mlx.optimizers.Adam is five to eight MLX elementwise kernels per parameter, and on x86 MLX runs each on
// one thread, element by element: the update of chapter 13's character model at H = 512 (3.27M parameters)
// took 6.4 ms compiled, 10.4 eager, against torch's 3.7 (its default for-loop) and 1.8 (fused=True), 2-core
// Zen 5.  Here it is one pass over the parameter on every core:
//
//   AdamUpdate  param, grad, exp_avg, exp_avg_sq [, max_exp_avg_sq], step () uint64, learning_rate () float32
//            -> param, exp_avg, exp_avg_sq [, max_exp_avg_sq]
//
// where step is the parameter's step number, already counted (1 on its first update).  As torch's Python does, in
// float64: step_size = learning_rate / (1 - beta1^step), bias_correction2_sqrt = sqrt(1 - beta2^step), each then
// rounded to float32; and per element, in the order and roundings of torch's AVX2 and AVX-512 CPU kernels for its
// default (for-loop) Adam:
//
//   g  = maximize ? -grad : grad;  g = fma(param, weight_decay, g) where weight_decay != 0     (torch's add)
//   m  = fma(w, g - m, m) for w = 1 - beta1 < 0.5, else fma(w - 1, g - m, g)                  (torch's lerp)
//   v  = fma((1 - beta2) g, g, v beta2)                          (mul_, then addcmul_, which torch's build fuses)
//   v_max = max(v_max, v) with amsgrad (NaN wins, as torch.maximum)
//   param = param + (-step_size m) / (sqrt(v or v_max) / bias_correction2_sqrt + eps)      (torch's addcdiv)
//
// Every operation is rounded once (IEEE add, multiply, divide, square root and fma), so the numbers are the same
// for every vector width and for the scalar tail.  exp_avg and exp_avg_sq equal torch's bit for bit where torch runs
// its AVX2 or AVX-512 kernels (its scalar "default" ones round lerp and addcmul in two steps each) and the parameter
// does (weight decay feeds a difference in the parameter back into the moments); torch takes
// its square roots from MKL's vsSqrt, which is not correctly rounded (one ulp off for about 17% of floats), and its
// learning rate is a float64 where MLX's is a float32, so the parameter can differ from torch's by an ulp.
//
// Napkin math: 4 floats read and 3 written per element (5 and 4 with amsgrad), the 3 into new buffers, whose lines
// x86 reads before it writes them: 40 bytes, 131 MB for the character model at H = 512 (torch's in-place update
// moves 28), about 2.6 ms at the 50 GB/s that this 2-core Zen 5 VM streams.  A few flops an element: memory-bound.
// (Non-temporal stores, which skip that read, need outputs aligned to the vector; MLX's CPU buffers start 8 or 24
// bytes past a 64-byte line.  Nor would they pay on that VM: 41 MB written by two threads took 1.05-1.10 ms with
// them against 0.73-0.90 with plain stores; only memset wrote faster, 0.43-0.50.)  Parameters under about 19k
// elements run on one thread (parallel_for's threshold).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
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

// a b + c rounded once, and the square root, lane by lane: the instruction where the build has it.
Floats fused_multiply_add(Floats a, Floats b, Floats c) {
#if defined(__AVX512F__)
  return (Floats)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (Floats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  for (int k = 0; k < kLanes; ++k) a[k] = std::fma(a[k], b[k], c[k]);
  return a;
#endif
}

Floats square_root(Floats a) {
#if defined(__AVX512F__)
  return (Floats)_mm512_sqrt_ps((__m512)a);
#elif defined(__AVX__)
  return (Floats)_mm256_sqrt_ps((__m256)a);
#else
  for (int k = 0; k < kLanes; ++k) a[k] = std::sqrt(a[k]);
  return a;
#endif
}

// The hyperparameters: beta1 and beta2 as given (for the bias corrections), the rest as torch casts them to float32
// (see adam_update_op).
struct AdamParams {
  double beta1_power_base;  // beta1, for beta1^step
  double beta2_power_base;
  float lerp_weight;  // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  bool amsgrad;
  bool maximize;
  bool operator==(const AdamParams&) const = default;
};

// The update of kLanes elements: p, g, m, v, v_max in, p, m, v, v_max out (v_max only with amsgrad).
struct Lanes {
  Floats p, g, m, v, v_max;
};

void update_lanes(Lanes& x, const AdamParams& params, Floats neg_step_size, Floats bias_correction2_sqrt) {
  Floats g = params.maximize ? -x.g : x.g;
  if (params.weight_decay != 0.0f) g = fused_multiply_add(x.p, splat(params.weight_decay), g);
  const Floats w = splat(params.lerp_weight);
  x.m = params.lerp_weight < 0.5f ? fused_multiply_add(w, g - x.m, x.m)
                                  : fused_multiply_add(w - 1.0f, g - x.m, g);
  x.v = fused_multiply_add(params.one_minus_beta2 * g, g, x.v * params.beta2);
  Floats second = x.v;
  if (params.amsgrad) {
    x.v_max = (x.v_max > x.v) | (x.v_max != x.v_max) ? x.v_max : x.v;  // NaN in either wins
    second = x.v_max;
  }
  const Floats denominator = square_root(second) / bias_correction2_sqrt + params.eps;
  x.p = x.p + (neg_step_size * x.m) / denominator;
}

// ins: param, grad, exp_avg, exp_avg_sq [, max_exp_avg_sq], step, learning_rate; outs: param, exp_avg, exp_avg_sq
// [, max_exp_avg_sq], in buffers of their own: MLX never donates an input to a primitive with several outputs (each
// output holds the inputs, so none is held once), so the update cannot run in place as torch's does.
void adam_update(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const AdamParams& params) {
  const double step = static_cast<double>(*ins[ins.size() - 2].data<uint64_t>());
  const double learning_rate = *ins.back().data<float>();
  const double step_size = learning_rate / (1.0 - std::pow(params.beta1_power_base, step));
  const Floats neg_step_size = splat(static_cast<float>(-step_size));
  const double bias_correction2 = 1.0 - std::pow(params.beta2_power_base, step);
  const Floats bias_correction2_sqrt = splat(static_cast<float>(std::sqrt(bias_correction2)));
  const float *p_in = ins[0].data<float>(), *g_in = ins[1].data<float>(), *m_in = ins[2].data<float>();
  const float* v_in = ins[3].data<float>();
  const float* v_max_in = params.amsgrad ? ins[4].data<float>() : nullptr;
  float *p_out = outs[0].data<float>(), *m_out = outs[1].data<float>(), *v_out = outs[2].data<float>();
  float* v_max_out = params.amsgrad ? outs[3].data<float>() : nullptr;
  const int64_t count = static_cast<int64_t>(ins[0].size());
  constexpr int64_t kBlock = 64 * kLanes;  // threads take whole blocks: every vector but the last is full
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  const int64_t arrays = params.amsgrad ? 9 : 7;
  seqlib_cpu::parallel_for(blocks, count * arrays, [&](int64_t first, int64_t last) {
    const int64_t end = std::min(last * kBlock, count);
    for (int64_t i = first * kBlock; i < end; i += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, end - i);
      Lanes x{};
      if (n == kLanes) {
        x = {load(p_in + i), load(g_in + i), load(m_in + i), load(v_in + i), v_max_in ? load(v_max_in + i) : Floats{}};
      } else {  // the tail: past the end, lanes computed and not stored (v = 1: no 0 / 0 there, even with eps = 0)
        x.v = x.v_max = splat(1.0f);
        for (int64_t k = 0; k < n; ++k) {
          x.p[k] = p_in[i + k], x.g[k] = g_in[i + k], x.m[k] = m_in[i + k], x.v[k] = v_in[i + k];
          if (v_max_in) x.v_max[k] = v_max_in[i + k];
        }
      }
      update_lanes(x, params, neg_step_size, bias_correction2_sqrt);
      if (n == kLanes) {
        store(p_out + i, x.p), store(m_out + i, x.m), store(v_out + i, x.v);
        if (v_max_out) store(v_max_out + i, x.v_max);
      } else {
        for (int64_t k = 0; k < n; ++k) {
          p_out[i + k] = x.p[k], m_out[i + k] = x.m[k], v_out[i + k] = x.v[k];
          if (v_max_out) v_max_out[i + k] = x.v_max[k];
        }
      }
    }
  });
}

// The gradient and every state array have the parameter's shape, step and learning_rate one element each: an
// std::invalid_argument (a ValueError) otherwise, also where a shapeless compile changed one shape and not the others.
void check_update(const std::vector<mx::array>& inputs) {
  for (size_t k = 1; k + 2 < inputs.size(); ++k) {
    if (inputs[k].shape() != inputs[0].shape()) {
      throw std::invalid_argument("adam_update: expected the gradient and every state array in the parameter's shape, "
                                  "got an array of " + std::to_string(inputs[k].size()) + " elements for " +
                                  std::to_string(inputs[0].size()));
    }
  }
  if (inputs[inputs.size() - 2].size() != 1 || inputs.back().size() != 1) {
    throw std::invalid_argument("adam_update: expected one step and one learning rate, got " +
                                std::to_string(inputs[inputs.size() - 2].size()) + " and " +
                                std::to_string(inputs.back().size()));
  }
}

// The outputs follow the parameter's shape (mx.compile(shapeless=True)); see check_update.
std::vector<mx::Shape> update_shapes(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>&) {
  check_update(inputs);
  return std::vector<mx::Shape>(inputs.size() - 3, inputs[0].shape());  // all but grad, step and learning_rate
}

std::vector<mx::array> adam_update_op(const mx::array& param, const mx::array& grad,
                                      const std::vector<mx::array>& state, const mx::array& step,
                                      const mx::array& learning_rate, double beta1, double beta2, double eps,
                                      double weight_decay, bool amsgrad, bool maximize) {
  const size_t moments = amsgrad ? 3 : 2;
  bool float32 = param.dtype() == mx::float32 && grad.dtype() == mx::float32 && learning_rate.dtype() == mx::float32;
  for (auto& array : state) float32 = float32 && array.dtype() == mx::float32;
  if (!float32 || step.dtype() != mx::uint64 || state.size() != moments) {
    std::ostringstream given;
    given << param.dtype() << ", " << grad.dtype() << " and " << learning_rate.dtype() << ", a " << step.dtype()
          << " step and " << state.size() << " state arrays";
    for (auto& array : state) given << " " << array.dtype();
    throw std::invalid_argument("adam_update: expected float32 param, grad and learning_rate, a uint64 step and " +
                                std::to_string(moments) + " float32 state arrays (exp_avg, exp_avg_sq" +
                                (amsgrad ? ", max_exp_avg_sq)" : ")") + "; got " + given.str());
  }
  std::vector<const mx::array*> inputs = {&param, &grad};
  for (auto& array : state) inputs.push_back(&array);
  inputs.push_back(&step);
  inputs.push_back(&learning_rate);
  std::vector<mx::array> shapes_of;
  for (auto* array : inputs) shapes_of.push_back(*array);
  check_update(shapes_of);
  // Python's doubles, as torch rounds them: 1 - beta1 and 1 - beta2 in double, then each to float32
  const AdamParams params{beta1, beta2, static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                          static_cast<float>(1.0 - beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                          amsgrad, maximize};
  const size_t outputs = 1 + moments;
  return seqlib_cpu::make_loop("AdamUpdate", adam_update, std::vector<mx::Shape>(outputs, param.shape()),
                               std::vector<mx::Dtype>(outputs, mx::float32), inputs, params, nullptr, update_shapes);
}

}  // namespace

void seqlib_cpu::register_optim(nb::module_& m) {
  m.def("adam_update", &adam_update_op, "param"_a, "grad"_a, "state"_a, "step"_a, "learning_rate"_a, "beta1"_a,
        "beta2"_a, "eps"_a, "weight_decay"_a, "amsgrad"_a, "maximize"_a,
        "torch's Adam step of one float32 parameter: (param, exp_avg, exp_avg_sq[, max_exp_avg_sq]) from the "
        "parameter, its gradient, state [exp_avg, exp_avg_sq(, max_exp_avg_sq)], its step number (uint64, counted "
        "already) and the learning rate (float32)");
}
