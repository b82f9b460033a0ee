// cpu_loop.h: the one MLX primitive class behind seqlib's CPU operations.
//
// Each of seqlib's C++ operations (a recurrent time loop in recurrent_cpu.cpp, a bag pooling in
// bags_cpu.cpp) is a plain function, a Runner, that reads the primitive's inputs and fills its
// outputs.  CpuLoop<Params> wraps a Runner and its parameters as an mlx::core::Primitive: it
// allocates the outputs, registers the arrays with the CPU stream's command encoder and runs the
// Runner there, so MLX schedules it like any of its own CPU operations.  make_loop builds the
// output arrays of one call.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace seqlib_cpu {

namespace mx = mlx::core;

// Ask Linux to back a large new buffer with 2 MB pages (transparent huge pages, as NumPy does for
// its large arrays): its first touch then takes one page fault per 2 MB instead of one per 4 KB
// (about 0.7 ms per MB of 4 KB faults in a virtual machine), and random reads of it miss the TLB
// far less.  Only the whole 2 MB pages inside the buffer are advised; it changes no data.
inline void advise_huge_pages(char* data, size_t bytes) {
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  if (bytes < 4 * kHugePage) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice: errors ignored
}

template <class Params>
class CpuLoop : public mx::Primitive {
 public:
  using Runner = void (*)(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Params& params);

  CpuLoop(mx::Stream stream, const char* name, Runner runner, Params params)
      : mx::Primitive(stream), name_(name), runner_(runner), params_(std::move(params)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      advise_huge_pages(out.data<char>(), out.nbytes());
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) {
      encoder.set_input_array(in);
      ins.push_back(mx::array::unsafe_weak_copy(in));
    }
    for (auto& out : outputs) {
      encoder.set_output_array(out);
      outs.push_back(mx::array::unsafe_weak_copy(out));
    }
    encoder.dispatch([ins, outs, runner = runner_, params = params_]() mutable { runner(ins, outs, params); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }

  const char* name() const override { return name_; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuLoop&>(other);
    return runner_ == o.runner_ && params_ == o.params_;
  }

 private:
  const char* name_;
  Runner runner_;
  Params params_;
};

inline mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

// The outputs (given shapes and dtypes) of one CpuLoop call on row-contiguous copies of its inputs.
template <class Params>
std::vector<mx::array> make_loop(const char* name, typename CpuLoop<Params>::Runner runner,
                                 std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                                 const std::vector<const mx::array*>& inputs, Params params) {
  auto s = cpu_stream();
  std::vector<mx::array> contiguous;
  for (auto* array : inputs) {  // an evaluated row-contiguous array (a weight, a state) is used as it is
    const bool ready = array->is_available() && array->flags().row_contiguous;
    contiguous.push_back(ready ? *array : mx::contiguous(*array, false, s));
  }
  auto primitive = std::make_shared<CpuLoop<Params>>(s, name, runner, std::move(params));
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), primitive, contiguous);
}

// A row of a row-major 2-D float32 array.
inline float* row_of(mx::array& array, size_t row) { return array.data<float>() + row * array.shape(1); }
inline const float* row_of(const mx::array& array, size_t row) {
  return array.data<float>() + row * array.shape(1);
}

// Each translation unit adds its operations to the extension module.
void register_recurrent(nanobind::module_& m);
void register_bags(nanobind::module_& m);

}  // namespace seqlib_cpu
