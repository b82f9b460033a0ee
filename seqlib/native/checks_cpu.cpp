// checks_cpu.cpp: argument checks that read array values, as MLX primitives that run when the
// values exist, and the graph introspection seqlib needs to decide between the host and the graph.
//
// An index check that reads values on the host at the call (mx.eval of the indices) fails under
// every MLX transformation (mx.compile, mx.vmap, mx.export_function trace arrays that have no
// values yet) and stalls a lazy program.  seqlib checks values on the host only where they
// already exist (NumPy, or an evaluated array that no transformation traces: is_available and
// not is_tracer); otherwise the check is a node of the graph:
//
//   CheckedIndices  out = the indices as int32, when every one lies in [0, upper); otherwise the
//                   task throws the same message the host check gives, and MLX raises it (a
//                   RuntimeError) where the result is evaluated.  Its output is clamped into
//                   [0, upper) either way: an MLX task that throws does not stop the tasks after
//                   it, so whatever reads the table with these indices never reads out of bounds.
//   CheckedBounds   bounds (B + 1,) int32 of bags from offsets, with torch's rules on offsets
//                   (start at 0, non-decreasing, within the input, and with include_last_offset
//                   the last equal to its length); clamped likewise into a valid layout.
//
// Shapes: indices any shape, any integer dtype; offsets (B,) (or (B + 1,) with
// include_last_offset), any integer dtype.
//
// Where the values do exist, a bag's call checks them on the host, and host_bag_bounds does that in one
// pass over each array: the bounds (B + 1,) int32 where every index and offset passes, else None (and
// the caller raises with seqlib._checks's and seqlib._bags's messages).  A mean bag's call (84,570 indices, 4,096
// offsets), each after a 96 MB write, 2-core Zen 5, interleaved: its graph built in 0.15-0.18 ms against
// 0.28-0.29 with NumPy's checks.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "cpu_loop.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

struct Range {
  int64_t upper;      // indices must lie in [0, upper)
  std::string name;   // the argument, for the message ("input")
  std::string what;   // what upper is ("num_embeddings")
  bool operator==(const Range&) const = default;
};

// An integer of any width as int64 (a uint64 beyond int64's range: as the maximum, which no bound admits).
template <class T>
int64_t as_int64(T value) {
  if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8) {
    return value > static_cast<T>(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                                        : static_cast<int64_t>(value);
  }
  return static_cast<int64_t>(value);
}

// visit(T{}) with the C++ type T of an integer dtype; an invalid_argument for any other dtype.
template <class Visit>
void visit_integer(mx::Dtype dtype, Visit visit) {
  switch (dtype) {
    case mx::int8: return visit(int8_t{});
    case mx::int16: return visit(int16_t{});
    case mx::int32: return visit(int32_t{});
    case mx::int64: return visit(int64_t{});
    case mx::uint8: return visit(uint8_t{});
    case mx::uint16: return visit(uint16_t{});
    case mx::uint32: return visit(uint32_t{});
    case mx::uint64: return visit(uint64_t{});
    default: throw std::invalid_argument("expected an integer array");
  }
}

// Every element of a row-contiguous integer array of any width, as int64 (as_int64).
std::vector<int64_t> int64_values(const mx::array& array) {
  std::vector<int64_t> values(array.size());
  visit_integer(array.dtype(), [&](auto zero) {
    const auto* data = array.data<decltype(zero)>();
    for (size_t i = 0; i < values.size(); ++i) values[i] = as_int64(data[i]);
  });
  return values;
}

// ins: indices (any shape, integer); outs: checked (same shape, int32), clamped into [0, upper)
void check_indices(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Range& range) {
  const std::vector<int64_t> values = int64_values(ins[0]);
  int32_t* out = outs[0].data<int32_t>();
  int64_t low = std::numeric_limits<int64_t>::max(), high = std::numeric_limits<int64_t>::min();
  const int64_t last = std::max<int64_t>(range.upper - 1, 0);
  for (size_t i = 0; i < values.size(); ++i) {
    low = std::min(low, values[i]);
    high = std::max(high, values[i]);
    out[i] = static_cast<int32_t>(std::clamp<int64_t>(values[i], 0, last));
  }
  if (!values.empty() && (low < 0 || high >= range.upper)) {  // seqlib._checks.check_index_range's message
    throw std::out_of_range(range.name + ": every index must lie in [0, " + std::to_string(range.upper) + ") (" +
                            range.what + "=" + std::to_string(range.upper) + "); got values from " +
                            std::to_string(low) + " to " + std::to_string(high));
  }
}

struct BagRule {
  int64_t input_size;        // N, the entries of the flat input
  bool include_last_offset;  // offsets are the B + 1 bounds
  bool operator==(const BagRule&) const = default;
};

// The first of torch's rules that offsets (not empty) break, in seqlib._bags.checked_offsets's words: start at 0,
// do not decrease, lie within the input, and with include_last_offset end at its length.  Empty where they keep all.
std::string offsets_error(const std::vector<int64_t>& offsets, const BagRule& rule) {
  for (size_t b = 0; b < offsets.size(); ++b) {
    const int64_t offset = offsets[b];
    if (b == 0 && offset != 0) {
      return "offsets: the first bag must start at 0, got offsets[0] = " + std::to_string(offset);
    }
    if (b > 0 && offset < offsets[b - 1]) {
      return "offsets: must be non-decreasing, got offsets[" + std::to_string(b - 1) + "] = " +
             std::to_string(offsets[b - 1]) + " > offsets[" + std::to_string(b) + "] = " + std::to_string(offset);
    }
    if (offset > rule.input_size) {
      return "offsets: may not point past the end of input (length " + std::to_string(rule.input_size) +
             "), got offsets[" + std::to_string(b) + "] = " + std::to_string(offset);
    }
  }
  if (rule.include_last_offset && offsets.back() != rule.input_size) {
    return "offsets: with include_last_offset=True the last offset must be the length of input (" +
           std::to_string(rule.input_size) + "), got offsets[-1] = " + std::to_string(offsets.back());
  }
  return {};
}

// ins: offsets (B,) or (B + 1,); outs: bounds (B + 1,) int32, made valid (non-decreasing in [0, N],
// from 0 to N) whatever the offsets were; then the first broken rule (offsets_error) is thrown.
void check_bounds(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const BagRule& rule) {
  const std::vector<int64_t> offsets = int64_values(ins[0]);
  int32_t* bounds = outs[0].data<int32_t>();
  int64_t previous = 0;
  for (size_t b = 0; b < offsets.size(); ++b) {
    previous = b == 0 ? 0 : std::clamp<int64_t>(offsets[b], previous, rule.input_size);
    bounds[b] = static_cast<int32_t>(previous);
  }
  bounds[outs[0].size() - 1] = static_cast<int32_t>(rule.input_size);  // the last bag ends at the end
  const std::string error = offsets_error(offsets, rule);
  if (!error.empty()) throw std::invalid_argument(error);
}

void check_integer(const mx::array& array, const char* name) {
  if (!mx::issubdtype(array.dtype(), mx::integer)) {
    throw std::invalid_argument(std::string(name) + ": expected an integer array");
  }
}

// CheckedIndices' output has its input's shape, whatever that is (mx.compile(shapeless=True)).
std::vector<mx::Shape> same_shape(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>&) {
  return {inputs[0].shape()};
}

mx::array checked_indices(const mx::array& indices, int64_t upper, std::string name, std::string what) {
  check_integer(indices, "indices");
  if (upper < 0 || upper > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("checked_indices: upper must lie in [0, 2**31)");
  }
  return seqlib_cpu::make_loop("CheckedIndices", check_indices, {indices.shape()}, {mx::int32}, {&indices},
                               Range{upper, std::move(name), std::move(what)}, nullptr, same_shape)[0];
}

mx::array checked_bounds(const mx::array& offsets, int64_t input_size, bool include_last_offset) {
  check_integer(offsets, "offsets");
  if (offsets.ndim() != 1 || (include_last_offset && offsets.size() == 0)) {
    throw std::invalid_argument("checked_bounds: expected 1-D offsets (non-empty with include_last_offset)");
  }
  if (input_size < 0 || input_size > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("checked_bounds: input_size must lie in [0, 2**31)");
  }
  const int bags = static_cast<int>(offsets.size()) - (include_last_offset ? 1 : 0);
  if (bags == 0 && !include_last_offset) {  // no offsets: no bags, one bound at the end
    return mx::array({static_cast<int32_t>(input_size)});
  }
  return seqlib_cpu::make_loop("CheckedBounds", check_bounds, {{bags + 1}}, {mx::int32}, {&offsets},
                               BagRule{input_size, include_last_offset})[0];
}

// The smallest and largest elements of a non-empty row-contiguous integer array, as int64 (as_int64).
std::pair<int64_t, int64_t> min_max(const mx::array& array) {
  std::pair<int64_t, int64_t> range;
  visit_integer(array.dtype(), [&](auto zero) {
    const auto* data = array.data<decltype(zero)>();
    auto low = data[0], high = data[0];
    for (size_t i = 1; i < array.size(); ++i) {
      low = std::min(low, data[i]);
      high = std::max(high, data[i]);
    }
    range = {as_int64(low), as_int64(high)};
  });
  return range;
}

// Whether the host may read the array's values as they lie: evaluated, not traced, row-contiguous.
bool on_host(const mx::array& array) {
  return !array.is_tracer() && array.is_available() && array.flags().row_contiguous;
}

// indices (N,) and offsets (B,) (or (B + 1,) with include_last_offset), integer arrays whose values exist: the
// bounds (B + 1,) int32 where every index lies in [0, rows) and the offsets keep torch's rules (see check_bounds),
// else None, also where the arrays are not as this reads them (then the caller checks them its own way).
std::optional<mx::array> host_bag_bounds(const mx::array& indices, const mx::array& offsets, int64_t rows,
                                         bool include_last_offset) {
  const int64_t entries = static_cast<int64_t>(indices.size());
  const auto readable = [](const mx::array& array) {
    return on_host(array) && array.ndim() == 1 && mx::issubdtype(array.dtype(), mx::integer);
  };
  if (!readable(indices) || !readable(offsets) || offsets.size() == 0 ||
      entries > std::numeric_limits<int32_t>::max()) {
    return std::nullopt;
  }
  if (entries > 0) {
    const auto [low, high] = min_max(indices);
    if (low < 0 || high >= rows) return std::nullopt;
  }
  const std::vector<int64_t> values = int64_values(offsets);
  if (!offsets_error(values, BagRule{entries, include_last_offset}).empty()) return std::nullopt;
  const size_t bags = values.size() - (include_last_offset ? 1 : 0);
  std::vector<int32_t> bounds(bags + 1, static_cast<int32_t>(entries));  // the last: the end of the input
  std::transform(values.begin(), values.begin() + bags, bounds.begin(), [](int64_t v) { return int32_t(v); });
  return mx::array(bounds.begin(), mx::Shape{static_cast<int>(bags + 1)}, mx::int32);
}

}  // namespace

void seqlib_cpu::register_checks(nb::module_& m) {
  m.def("is_tracer", [](const mx::array& array) { return array.is_tracer(); }, "array"_a,
        "Whether a transformation (mx.grad, mx.vjp, mx.vmap, mx.compile, mx.export_function) traces the array.");
  m.def("is_available", [](const mx::array& array) { return array.is_available(); }, "array"_a,
        "Whether the array's values exist (it was evaluated, or made from data), without evaluating it.");
  m.def("checked_indices", &checked_indices, "indices"_a, "upper"_a, "name"_a, "what"_a);
  m.def("checked_bounds", &checked_bounds, "offsets"_a, "input_size"_a, "include_last_offset"_a);
  m.def("host_bag_bounds", &host_bag_bounds, "indices"_a, "offsets"_a, "rows"_a, "include_last_offset"_a);
}
