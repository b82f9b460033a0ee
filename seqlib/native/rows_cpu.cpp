// rows_cpu.cpp: the rows of a table that a batch reads, for seqlib.sparse.value_and_grad, on the host.
//
// A batch looks up N rows of a (V, D) table.  seqlib.sparse differentiates only its U distinct
// rows: it needs them sorted, and every index renumbered to its row's position among them.  NumPy
// does this with a sort and a (V,) map from row to position; for N = 85k and V = 1M that took
// about 2.5 ms, most of it page faults of the fresh 4 MB map.  Here one bitmap of the V rows
// (V / 8 bytes: 125 KB for a million rows, which stays in L2) and the count of set bits before
// each 64-row word do both in O(V / 64 + N), on contiguous 1-D NumPy arrays (int32 or int64):
//
//   unique_rows(indices, rows)            (unique, positions): the distinct values of indices, sorted,
//                                         and where each index is among them, both int32 (NumPy's
//                                         unique with return_inverse); every index must lie in
//                                         [0, rows) (an IndexError otherwise)
//   row_positions(unique, indices, rows)  int32, where each index is in unique (sorted distinct
//                                         values in [0, rows)); -1 where it is not, or not in [0, rows)
//
// The caller chooses these where V / 64 words are few against N (seqlib.sparse decides).

#include <algorithm>
#include <bit>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include "cpu_loop.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <class T>
using Indices = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>;

// A set of rows in [0, rows): one bit each, and the number of set bits before each word (rank), so
// that a row's position among the set rows is rank[row / 64] + the set bits below it in its word.
class RowSet {
 public:
  explicit RowSet(int64_t rows) : rows_(rows), bits_((rows + 63) / 64, 0), rank_(bits_.size() + 1, 0) {}

  bool inside(int64_t row) const { return row >= 0 && row < rows_; }
  void add(int64_t row) { bits_[row >> 6] |= uint64_t{1} << (row & 63); }
  bool has(int64_t row) const { return (bits_[row >> 6] >> (row & 63)) & 1; }

  void count() {  // after the last add: rank_
    for (size_t w = 0; w < bits_.size(); ++w) rank_[w + 1] = rank_[w] + std::popcount(bits_[w]);
  }
  int64_t size() const { return rank_.back(); }
  int32_t position(int64_t row) const {  // of a row in the set, after count()
    const uint64_t below = bits_[row >> 6] & ((uint64_t{1} << (row & 63)) - 1);
    return static_cast<int32_t>(rank_[row >> 6] + std::popcount(below));
  }

 private:
  int64_t rows_;
  std::vector<uint64_t> bits_;
  std::vector<int64_t> rank_;
};

// A (count,) int32 NumPy array that owns its buffer.
Rows new_rows(size_t count, int32_t** data) {
  int32_t* buffer = new int32_t[std::max<size_t>(count, 1)];
  nb::capsule owner(buffer, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  *data = buffer;
  return Rows(buffer, {count}, owner);
}

void check_rows(int64_t rows) {
  if (rows < 0 || rows > INT32_MAX) {
    throw std::invalid_argument("rows: expected a table's row count in [0, 2**31 - 1], got " + std::to_string(rows));
  }
}

template <class T>
std::pair<Rows, Rows> unique_rows(Indices<T> indices, int64_t rows) {
  check_rows(rows);
  RowSet set(rows);
  const T* index = indices.data();
  for (size_t i = 0; i < indices.shape(0); ++i) {
    if (!set.inside(index[i])) {
      throw std::out_of_range("indices: every index must lie in [0, " + std::to_string(rows) + "), got " +
                              std::to_string(index[i]));
    }
    set.add(index[i]);
  }
  set.count();
  // Each index writes itself at its position: that lists the rows in order without a loop over the words, whose
  // exits at every set bit mispredict (84,570 indices of a 1M-row table, cold, interleaved builds: 0.27-0.29 ms
  // with that loop, 0.19-0.20 so).
  int32_t *row, *at;
  Rows unique = new_rows(set.size(), &row);
  Rows positions = new_rows(indices.shape(0), &at);
  for (size_t i = 0; i < indices.shape(0); ++i) {
    at[i] = set.position(index[i]);
    row[at[i]] = static_cast<int32_t>(index[i]);
  }
  return {unique, positions};
}

template <class T>
Rows row_positions(Indices<int32_t> unique, Indices<T> indices, int64_t rows) {
  check_rows(rows);
  RowSet set(rows);
  const int32_t* row = unique.data();
  for (size_t u = 0; u < unique.shape(0); ++u) {
    if (!set.inside(row[u]) || (u > 0 && row[u] <= row[u - 1])) {
      throw std::invalid_argument("unique: expected sorted distinct rows in [0, " + std::to_string(rows) + ")");
    }
    set.add(row[u]);
  }
  set.count();
  int32_t* out;
  Rows positions = new_rows(indices.shape(0), &out);
  const T* index = indices.data();
  for (size_t i = 0; i < indices.shape(0); ++i) {
    out[i] = set.inside(index[i]) && set.has(index[i]) ? set.position(index[i]) : -1;
  }
  return positions;
}

}  // namespace

// The arrays are taken as they are (noconvert): another dtype is a TypeError, never a cast that would
// wrap or truncate an index into some row.
void seqlib_cpu::register_rows(nb::module_& m) {
  m.def("unique_rows", &unique_rows<int32_t>, "indices"_a.noconvert(), "rows"_a);
  m.def("unique_rows", &unique_rows<int64_t>, "indices"_a.noconvert(), "rows"_a);
  m.def("row_positions", &row_positions<int32_t>, "unique"_a.noconvert(), "indices"_a.noconvert(), "rows"_a);
  m.def("row_positions", &row_positions<int64_t>, "unique"_a.noconvert(), "indices"_a.noconvert(), "rows"_a);
}
