// recurrent_cpu.cpp: an LSTM layer-direction over packed rows as MLX primitives on the CPU.
//
// The CPU counterpart of metal_kernels/lstm_sequence.metal.  MLX's own ops run a step as a
// matmul plus about ten elementwise kernels, each one pass over memory with scalar code
// on x86; here the whole time loop runs inside one primitive: per step one BLAS call
// (OpenBLAS, the recurrent matmul) and one loop of gate math that the compiler vectorises
// for the host's vector units (-march=native).  seqlib.native builds this file against the
// installed MLX on first use; seqlib.scan calls it, and wires the backward into autodiff.
//
//   LSTMSequence          forward: output, h_n, c_n, and (save) what the backward needs
//   LSTMSequenceBackward  backward through the steps in reverse: d_x_gates, d_h0, d_c0
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
#include <cmath>
#include <cstring>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

extern "C" void scipy_cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                                  float alpha, const float* a, int lda, const float* b, int ldb,
                                  float beta, float* c, int ldc);

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// seqlib.activations.fast_tanh: x P(x^2) / Q(x^2), exactly +-1 beyond TANH_CLIP, NaN stays NaN.
inline float fast_tanh(float x) {
  const float s = x * x, s2 = s * s, s4 = s2 * s2;
  const float p = (0.99999999846087562f + 0.13127960818606593f * s) +
                  s2 * (0.0031534538885072843f + 1.1687376471272515e-05f * s) +
                  s4 * ((-2.2515741118421894e-08f + 6.4773125632460462e-11f * s) +
                        s2 * -1.1907169347536057e-13f);
  const float q = (1.0f + 0.46461292548968347f * s) +
                  s2 * (0.024691123530499584f + 0.00026190431069089969f * s);
  const float ratio = x * p / q;
  constexpr float clip = 7.90531110763549805f;
  return x > clip ? 1.0f : (x < -clip ? -1.0f : ratio);
}

inline float fast_sigmoid(float x) { return 0.5f * fast_tanh(0.5f * x) + 0.5f; }

struct Step {
  int first;  // first packed row of the step
  int rows;   // sequences still running at the step
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

void allocate(std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
}

class LSTMSequence : public mx::Primitive {
 public:
  LSTMSequence(mx::Stream stream, std::vector<int> batch_sizes, bool reverse, bool save)
      : mx::Primitive(stream), batch_sizes_(std::move(batch_sizes)), reverse_(reverse), save_(save) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    allocate(outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& out : outputs) encoder.set_output_array(out);
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) ins.push_back(mx::array::unsafe_weak_copy(in));
    for (auto& out : outputs) outs.push_back(mx::array::unsafe_weak_copy(out));
    encoder.dispatch([ins, outs, steps = steps_of(batch_sizes_, reverse_), save = save_]() mutable {
      run(ins, outs, steps, save);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("LSTMSequence runs on the CPU only");
  }

  const char* name() const override { return "LSTMSequence"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const LSTMSequence&>(other);
    return batch_sizes_ == o.batch_sizes_ && reverse_ == o.reverse_ && save_ == o.save_;
  }

 private:
  static void run(std::vector<mx::array>& ins, std::vector<mx::array>& outs,
                  const std::vector<Step>& steps, bool save) {
    const float* x_gates = ins[0].data<float>();
    const float* w_hh = ins[1].data<float>();
    const int batch = ins[2].shape(0), hidden = ins[2].shape(1), gates = 4 * hidden;
    float* output = outs[0].data<float>();
    float* h = outs[1].data<float>();  // the state advances in place in h_n and c_n
    float* c = outs[2].data<float>();
    std::memcpy(h, ins[2].data<float>(), sizeof(float) * batch * hidden);
    std::memcpy(c, ins[3].data<float>(), sizeof(float) * batch * hidden);
    std::vector<float> pre(static_cast<size_t>(batch) * gates);
    for (const Step& step : steps) {
      // pre (rows, 4H) = x_gates[rows of the step] + h[:rows] @ w_hh^T
      std::memcpy(pre.data(), x_gates + static_cast<size_t>(step.first) * gates,
                  sizeof(float) * step.rows * gates);
      if (save) {
        std::memcpy(outs[6].data<float>() + static_cast<size_t>(step.first) * hidden, h,
                    sizeof(float) * step.rows * hidden);
        std::memcpy(outs[5].data<float>() + static_cast<size_t>(step.first) * hidden, c,
                    sizeof(float) * step.rows * hidden);
      }
      scipy_cblas_sgemm(kRowMajor, kNoTrans, kTrans, step.rows, gates, hidden, 1.0f, h, hidden,
                        w_hh, hidden, 1.0f, pre.data(), gates);
      for (int r = 0; r < step.rows; ++r) {
        float* a = pre.data() + static_cast<size_t>(r) * gates;  // becomes the activations
        float* h_row = h + static_cast<size_t>(r) * hidden;
        float* c_row = c + static_cast<size_t>(r) * hidden;
        float* out_row = output + static_cast<size_t>(step.first + r) * hidden;
        for (int j = 0; j < hidden; ++j) {
          const float i = fast_sigmoid(a[j]), f = fast_sigmoid(a[hidden + j]);
          const float g = fast_tanh(a[2 * hidden + j]), o = fast_sigmoid(a[3 * hidden + j]);
          const float c_new = f * c_row[j] + i * g;
          const float tanh_c = fast_tanh(c_new);
          a[j] = i, a[hidden + j] = f, a[2 * hidden + j] = g, a[3 * hidden + j] = o;
          c_row[j] = c_new;
          h_row[j] = out_row[j] = o * tanh_c;
          if (save) outs[4].data<float>()[static_cast<size_t>(step.first + r) * hidden + j] = tanh_c;
        }
        if (save) {
          std::memcpy(outs[3].data<float>() + static_cast<size_t>(step.first + r) * gates, a,
                      sizeof(float) * gates);
        }
      }
    }
  }

  std::vector<int> batch_sizes_;
  bool reverse_, save_;
};

class LSTMSequenceBackward : public mx::Primitive {
 public:
  LSTMSequenceBackward(mx::Stream stream, std::vector<int> batch_sizes, bool reverse)
      : mx::Primitive(stream), batch_sizes_(std::move(batch_sizes)), reverse_(reverse) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    allocate(outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& out : outputs) encoder.set_output_array(out);
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) ins.push_back(mx::array::unsafe_weak_copy(in));
    for (auto& out : outputs) outs.push_back(mx::array::unsafe_weak_copy(out));
    encoder.dispatch([ins, outs, steps = steps_of(batch_sizes_, reverse_)]() mutable {
      run(ins, outs, steps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("LSTMSequenceBackward runs on the CPU only");
  }

  const char* name() const override { return "LSTMSequenceBackward"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const LSTMSequenceBackward&>(other);
    return batch_sizes_ == o.batch_sizes_ && reverse_ == o.reverse_;
  }

 private:
  // inputs: w_hh (4H, H), activations (N, 4H), tanh_c, c_prev, d_output (N, H), d_h_n, d_c_n (B, H)
  // outputs: d_x_gates (N, 4H), d_h0, d_c0 (B, H)
  static void run(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const std::vector<Step>& steps) {
    const float* w_hh = ins[0].data<float>();
    const float* activations = ins[1].data<float>();
    const float* tanh_cs = ins[2].data<float>();
    const float* c_prevs = ins[3].data<float>();
    const float* d_output = ins[4].data<float>();
    const int batch = ins[5].shape(0), hidden = ins[5].shape(1), gates = 4 * hidden;
    float* d_x_gates = outs[0].data<float>();
    float* d_h = outs[1].data<float>();  // the gradients flow back in place in d_h0 and d_c0
    float* d_c = outs[2].data<float>();
    std::memcpy(d_h, ins[5].data<float>(), sizeof(float) * batch * hidden);
    std::memcpy(d_c, ins[6].data<float>(), sizeof(float) * batch * hidden);
    for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
      for (int r = 0; r < step->rows; ++r) {
        const size_t row = static_cast<size_t>(step->first + r);
        const float* a = activations + row * gates;
        float* d_a = d_x_gates + row * gates;
        float* d_h_row = d_h + static_cast<size_t>(r) * hidden;
        float* d_c_row = d_c + static_cast<size_t>(r) * hidden;
        for (int j = 0; j < hidden; ++j) {
          const float i = a[j], f = a[hidden + j], g = a[2 * hidden + j], o = a[3 * hidden + j];
          const float tanh_c = tanh_cs[row * hidden + j];
          const float d_out = d_output[row * hidden + j] + d_h_row[j];
          const float dc = d_c_row[j] + d_out * o * (1 - tanh_c * tanh_c);
          d_a[j] = dc * g * i * (1 - i);
          d_a[hidden + j] = dc * c_prevs[row * hidden + j] * f * (1 - f);
          d_a[2 * hidden + j] = dc * i * (1 - g * g);
          d_a[3 * hidden + j] = d_out * tanh_c * o * (1 - o);
          d_c_row[j] = dc * f;
        }
      }
      // d_h[:rows] = d_gates (rows, 4H) @ w_hh (4H, H)
      scipy_cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, step->rows, hidden, gates, 1.0f,
                        d_x_gates + static_cast<size_t>(step->first) * gates, gates, w_hh, hidden, 0.0f,
                        d_h, hidden);
    }
  }

  std::vector<int> batch_sizes_;
  bool reverse_;
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

std::vector<mx::array> lstm_sequence(const mx::array& x_gates, const mx::array& w_hh, const mx::array& h0,
                                     const mx::array& c0, std::vector<int> batch_sizes, bool reverse, bool save) {
  auto s = cpu_stream();
  const int rows = x_gates.shape(0), batch = h0.shape(0), hidden = h0.shape(1);
  std::vector<mx::Shape> shapes = {{rows, hidden}, {batch, hidden}, {batch, hidden}};
  if (save) shapes.insert(shapes.end(), {{rows, 4 * hidden}, {rows, hidden}, {rows, hidden}, {rows, hidden}});
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  std::vector<mx::array> inputs;
  for (auto* array : {&x_gates, &w_hh, &h0, &c0}) inputs.push_back(mx::contiguous(*array, false, s));
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<LSTMSequence>(s, std::move(batch_sizes), reverse, save), inputs);
}

std::vector<mx::array> lstm_sequence_backward(const mx::array& w_hh, const mx::array& activations,
                                              const mx::array& tanh_c, const mx::array& c_prev,
                                              const mx::array& d_output, const mx::array& d_h_n,
                                              const mx::array& d_c_n, std::vector<int> batch_sizes, bool reverse) {
  auto s = cpu_stream();
  const int rows = activations.shape(0), batch = d_h_n.shape(0), hidden = d_h_n.shape(1);
  std::vector<mx::Shape> shapes = {{rows, 4 * hidden}, {batch, hidden}, {batch, hidden}};
  std::vector<mx::array> inputs;
  for (auto* array : {&w_hh, &activations, &tanh_c, &c_prev, &d_output, &d_h_n, &d_c_n}) {
    inputs.push_back(mx::contiguous(*array, false, s));
  }
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32},
                                std::make_shared<LSTMSequenceBackward>(s, std::move(batch_sizes), reverse), inputs);
}

}  // namespace

NB_MODULE(_recurrent_cpu, m) {
  m.doc() = "seqlib's CPU primitives for recurrent layers (built by seqlib.native)";
  m.def("lstm_sequence", &lstm_sequence, "x_gates"_a, "w_hh"_a, "h0"_a, "c0"_a, "batch_sizes"_a, "reverse"_a,
        "save"_a);
  m.def("lstm_sequence_backward", &lstm_sequence_backward, "w_hh"_a, "activations"_a, "tanh_c"_a, "c_prev"_a,
        "d_output"_a, "d_h_n"_a, "d_c_n"_a, "batch_sizes"_a, "reverse"_a);
}
