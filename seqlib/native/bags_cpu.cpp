// bags_cpu.cpp: EmbeddingBag's pooling as MLX primitives on the CPU, the table read in one pass.
//
// The CPU counterpart of metal_kernels/embedding_bag.metal.  MLX's own ops pool bags as a gather
// of every entry's row (an (N, D) array written and read back) and one reduction per bucket of
// equally long bags; here each bag's rows are read straight from the table and summed in
// vector registers, 64 columns at a time, with the rows of the next entries prefetched, since
// the reads are random and the cost is memory latency.  (Summing into the output row in
// memory instead cost twice torch's time: a load and a store of it per entry.)
// seqlib.functional.embedding_bag calls these where seqlib.native is available.
//
//   EmbeddingBagPool          forward: out[b] = sum / mean / max of weight[indices[i]]
//                             (times entry_weights[i]) over the entries i of bag b
//   TakeRows                  rows[i] = weight[indices[i]]: the rows that
//                             seqlib.sparse.value_and_grad differentiates
//   EmbeddingBagPoolBackward  the gradient of the table (a dense (V, D) array: under
//                             seqlib.sparse.value_and_grad the "table" is the looked-up rows only),
//                             and of the entry weights
//
// Shapes: weight (V, D) float32; indices (N,) int32, already checked to lie in [0, V);
// bounds (B + 1,) int32, bag b holds entries bounds[b] to bounds[b + 1]; entry_weights (N,)
// float32 or none.  Entries equal to padding_idx (-1: none) are skipped and not counted by
// mean; an empty bag gives zeros.  Max follows torch's CPU rule: a column starts at the bag's
// first entry and moves only to a strictly greater value (so NaN wins only as the first entry).
// The arithmetic is the MLX-ops path's: products, then a sum in entry order, then a division
// by the count; built without FMA contraction.
//
// Work is split over the CPU's threads (the process's affinity, at most OMP_NUM_THREADS): the
// forward by bags, the backward's scatter by ranges of table rows (256 KB each, at least four per
// thread), each zeroed and then computed whole by one thread in entry order, so the result does
// not depend on the thread count or on which thread took what.  Sum and mean first group the
// entries by range (a counting sort), so each range reads only its own entries.  Indices and
// bounds are checked once more before any row is read (check_layout; positions of sparse rows
// chunk by chunk, ChunkRows).
//
// Napkin math: the forward reads N D 4 bytes of rows at random and writes B D 4; the backward
// zeroes V D 4 bytes, then reads B D 4 and adds N D 4 at random within each range.


#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "cpu_loop.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

enum Mode { kSum = 0, kMean = 1, kMax = 2 };  // seqlib._bags.BAG_MODES, in this order

struct Bag {
  int mode;
  int padding_idx;  // -1: none
  bool weighted;    // entry_weights given
  bool operator==(const Bag&) const = default;
};

// The loops below trust indices and bounds: the Python callers check them first (on the host, or
// in seqlib's CheckedIndices/CheckedBounds primitives).  This is the last line for a direct call
// of the bindings: one pass over the layout before any row is read, throwing where it would read or
// write out of bounds (check_layout).  It costs O(N + B) against the loops' O(N D).  The lookups of
// sparse rows check only their bounds first (check_bounds): their positions are checked chunk by
// chunk as the loop reads them (ChunkRows).
void check_bounds(const mx::array& bounds, int64_t entries) {
  const int32_t* bound = bounds.data<int32_t>();
  for (size_t b = 0; b < bounds.size(); ++b) {
    const int32_t previous = b == 0 ? 0 : bound[b - 1];
    if (bound[b] < previous || bound[b] > entries || (b == 0 && bound[0] != 0)) {
      throw std::out_of_range("bounds: expected non-decreasing bounds from 0 within the " + std::to_string(entries) +
                              " indices");
    }
  }
}

void check_layout(const mx::array& indices, const mx::array* bounds, int64_t rows) {
  const int32_t* index = indices.data<int32_t>();
  for (size_t i = 0; i < indices.size(); ++i) {
    if (index[i] < 0 || index[i] >= rows) {
      throw std::out_of_range("indices: every index must lie in [0, " + std::to_string(rows) + "), got " +
                              std::to_string(index[i]));
    }
  }
  if (bounds != nullptr) check_bounds(*bounds, static_cast<int64_t>(indices.size()));
}

using seqlib_cpu::parallel_for;

// How many entries ahead rows are prefetched: one row as each entry is added (as torch's FBGEMM kernel does), not a
// bag's worth of rows in a burst at the bag's start (9 lines a row, 32 entries past the bag: tuned so on Sapphire
// Rapids, where 16 took 6.87-7.01 ms, 32 6.41-6.42, 64 6.14-6.46, torch 6.28-6.75). The burst was the slower on
// mean bags of 1-40 entries from a 1M x 128 table, 2-core Zen 5, interleaved builds, each call after an idle,
// ms: one thread 3.08-3.11 in a burst against 2.87-2.95 (one row at a time), two threads 1.97-2.11 against
// 1.88-2.04. One row at a time, 16 and 32 entries ahead were even there; the gather (below) was even too.  The
// pooling prefetches its rows as read once (prefetchnta), same machine, builds interleaved in pairs, ms: one thread
// 2.36 / 2.10 and 2.39 / 2.11 (t0 / nta), two threads 1.75 / 1.67, 1.77 / 1.77, 2.22 / 1.95, 2.20 / 2.13
// (prefetcht1 was slower: 2.50 on one thread); the gather, which writes what it reads, was not faster so.  Not
// measured on Intel, where prefetchnta also fills L1 but not L2.
constexpr int kAhead = 16;

// Every cache line of a row: MLX's CPU buffers need not start on a line, so a 512-byte row can
// span nine lines, and the one left out would be a full memory miss per row.  kLocality is __builtin_prefetch's:
// 3 (prefetcht0) keeps the lines in every level, 0 (prefetchnta) marks them as read once.
template <int kLocality = 3>
inline void prefetch(const float* row, int64_t width) {
  const char* first = reinterpret_cast<const char*>(row);
  const char* last = reinterpret_cast<const char*>(row + width) - 1;
  for (const char* line = first; line < last; line += 64) __builtin_prefetch(line, 0, kLocality);
  __builtin_prefetch(last, 0, kLocality);
}

// A bag's columns are pooled kTile at a time, in kVectors of the build's widest vectors: a row of 128 floats in
// one pass over the bag's entries where AVX-512 holds it.
using seqlib_cpu::Floats;
using seqlib_cpu::kLanes;
using seqlib_cpu::load;
constexpr int64_t kVectors = 8, kTile = kVectors * kLanes;

// Sum and mean, kTile columns from `column` of one bag: each counted entry adds its row (times its weight where
// kWeighted) in vector registers into total; returns how many entries counted.  Where prefetch_end > 0 (the
// first pass over a bag's columns), the row kAhead entries on (or the last before prefetch_end) is prefetched:
// kInterleaved (rows of kVectors lines or more), a line after each vector's load, as FBGEMM's kernel interleaves
// them, then its other lines; else the whole row before the loads.  On the 2-core Zen 5 (1M x 128 table, builds
// interleaved in pairs) one thread took 2.73 / 2.94 ms against 3.36 / 3.57 with the row's nine prefetches together
// before the loads, two threads 1.91 / 1.93 against 2.09 / 2.11; torch 2.34-2.54 on one.
template <bool kWeighted, bool kInterleaved>
int64_t sum_tile(const float* __restrict table, int64_t dim, const int32_t* __restrict indices, int64_t begin,
                 int64_t end, const float* __restrict entry_weights, int32_t padding_idx, int64_t column,
                 int64_t prefetch_end, float* __restrict total) {
  Floats sums[kVectors] = {};
  int64_t count = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float* ahead = prefetch_end > 0 ? table + indices[std::min(i + kAhead, prefetch_end - 1)] * dim : nullptr;
    const bool padding = indices[i] == padding_idx;
    if (ahead != nullptr && (padding || !kInterleaved)) prefetch<0>(ahead, dim);  // the whole row at once
    if (padding) continue;
    const float* __restrict row = table + indices[i] * dim + column;
    const char* line = reinterpret_cast<const char*>(ahead);
    for (int64_t v = 0; v < kVectors; ++v) {
      sums[v] += kWeighted ? load(row + v * kLanes) * entry_weights[i] : load(row + v * kLanes);
      if (kInterleaved) __builtin_prefetch(line + 64 * v, 0, 0);  // line v of the row ahead, read once
    }
    if (kInterleaved) {
      for (int64_t at = 64 * kVectors; at < 4 * dim; at += 64) __builtin_prefetch(line + at, 0, 0);
      __builtin_prefetch(line + 4 * dim - 1, 0, 0);  // the ninth line of a row that does not start on one
    }
    ++count;
  }
  for (int64_t v = 0; v < kVectors; ++v) seqlib_cpu::store(total + v * kLanes, sums[v]);
  return count;
}

// Columns [column, column + width) of one bag (entries begin to end), pooled in total: a full tile of sum or mean
// by sum_tile, else in a local array (with the constant width kTile the compiler keeps it in vector registers too).
// Entry i prefetches the row of entry i + kAhead where that lies before prefetch_end (the first pass over a bag's
// columns asks; the others find the rows in cache).
template <int kMode, int64_t kWidth>
inline void pool_columns(const float* __restrict table, int64_t dim, const int32_t* __restrict indices,
                         int64_t begin, int64_t end, const float* __restrict entry_weights, int32_t padding_idx,
                         int64_t column, int64_t width, float* __restrict out, int64_t prefetch_end) {
  const int64_t columns = kWidth > 0 ? kWidth : width;
  float total[kTile] = {};
  int64_t count = 0;
  if (kMode != kMax && kWidth == kTile) {
    auto sum = prefetch_end > 0 && 4 * dim >= 64 * kVectors
        ? (entry_weights != nullptr ? sum_tile<true, true> : sum_tile<false, true>)
        : (entry_weights != nullptr ? sum_tile<true, false> : sum_tile<false, false>);
    count = sum(table, dim, indices, begin, end, entry_weights, padding_idx, column, prefetch_end, total);
  } else {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < prefetch_end) prefetch<0>(table + indices[i + kAhead] * dim, dim);  // read once, here
      if (indices[i] == padding_idx) continue;
      const float* __restrict row = table + indices[i] * dim + column;
      if (kMode == kMax) {
        for (int64_t d = 0; d < columns; ++d) total[d] = (count == 0 || row[d] > total[d]) ? row[d] : total[d];
      } else if (entry_weights != nullptr) {
        const float scale = entry_weights[i];
        for (int64_t d = 0; d < columns; ++d) total[d] += scale * row[d];
      } else {
        for (int64_t d = 0; d < columns; ++d) total[d] += row[d];
      }
      ++count;
    }
  }
  if (kMode == kMean && count > 0) {
    const float size = static_cast<float>(count);
    for (int64_t d = 0; d < columns; ++d) total[d] /= size;
  }
  for (int64_t d = 0; d < columns; ++d) out[column + d] = total[d];
}

// Bags [first_bag, end_bag) of one mode (a template argument, so the inner loops have no branch).
template <int kMode>
void pool_bag_range(const float* __restrict table, int64_t dim, const int32_t* __restrict indices,
                    const int32_t* __restrict bounds, const float* __restrict entry_weights, int32_t padding_idx,
                    float* __restrict pooled, int64_t first_bag, int64_t end_bag) {
  const int64_t end_entry = bounds[end_bag];
  for (int64_t i = bounds[first_bag]; i < std::min<int64_t>(bounds[first_bag] + kAhead, end_entry); ++i) {
    prefetch<0>(table + indices[i] * dim, dim);  // the rows before the first entry's prefetch reaches
  }
  for (int64_t b = first_bag; b < end_bag; ++b) {
    const int64_t begin = bounds[b], end = bounds[b + 1];
    float* out = pooled + b * dim;
    int64_t column = 0;
    for (; column + kTile <= dim; column += kTile) {
      pool_columns<kMode, kTile>(table, dim, indices, begin, end, entry_weights, padding_idx, column, kTile, out,
                                 column == 0 ? end_entry : 0);
    }
    if (column < dim) {
      pool_columns<kMode, 0>(table, dim, indices, begin, end, entry_weights, padding_idx, column, dim - column, out,
                             column == 0 ? end_entry : 0);
    }
  }
}

// Where a loop reads rows unique[positions[i]] of a table (seqlib.sparse's rows, see rows_of_table): unique (U,)
// and the table's row count V.  Each thread renumbers the entries of its own chunk into table rows as it takes the
// chunk, checking each position and row before any row is read, so that no pass over all N entries runs on one
// thread (it took 0.09 ms of a 1.5 ms forward of 84,570 entries, 2-core Zen 5).
struct RowsAt {
  const int32_t* unique;
  int64_t count;  // U
  int64_t table_rows;  // V
};

[[noreturn]] void throw_outside(const RowsAt& at) {
  throw std::out_of_range("indices: every position must lie in [0, " + std::to_string(at.count) +
                          ") and every row of unique in [0, " + std::to_string(at.table_rows) + ")");
}

// The table rows that a parallel loop's chunks of entries read: `indices` themselves, or with `at` the chunk's
// positions renumbered into table rows, each checked before any row is read.  A chunk with a position or a row
// outside gets nullptr (it reads nothing), and throw_if_outside, after the loop, throws.
class ChunkRows {
 public:
  ChunkRows(const RowsAt* at, const int32_t* indices, int64_t entries)
      : at_(at), indices_(indices), renumbered_(at != nullptr ? new int32_t[entries] : nullptr) {}

  const int32_t* of(int64_t begin, int64_t end) {  // entries [begin, end)
    if (at_ == nullptr) return indices_;
    for (int64_t i = begin; i < end; ++i) {
      const int32_t position = indices_[i];
      if (position < 0 || position >= at_->count || at_->unique[position] < 0 ||
          at_->unique[position] >= at_->table_rows) {
        outside_.store(true, std::memory_order_relaxed);
        return nullptr;
      }
      renumbered_[i] = at_->unique[position];
    }
    return renumbered_.get();
  }

  void throw_if_outside() const {
    if (outside_.load()) throw_outside(*at_);
  }

 private:
  const RowsAt* at_;
  const int32_t* indices_;
  std::unique_ptr<int32_t[]> renumbered_;
  std::atomic<bool> outside_{false};
};

// Bags of `indices` (rows of table, dim columns; with `at`, positions of at->unique's rows) into pooled (B, D), on
// every core.
void pool_bags(const float* table, int64_t dim, const int32_t* indices, const int32_t* bounds,
               const float* entry_weights, const Bag& bag, int64_t bags, float* pooled,
               const RowsAt* at = nullptr) {
  auto range = bag.mode == kMax ? pool_bag_range<kMax> : (bag.mode == kMean ? pool_bag_range<kMean>
                                                                            : pool_bag_range<kSum>);
  ChunkRows chunk_rows(at, indices, bounds[bags]);
  parallel_for(bags, bounds[bags] * dim, [&](int64_t first_bag, int64_t end_bag) {
    const int32_t* read = chunk_rows.of(bounds[first_bag], bounds[end_bag]);
    if (read != nullptr) range(table, dim, read, bounds, entry_weights, bag.padding_idx, pooled, first_bag, end_bag);
  });
  chunk_rows.throw_if_outside();
}

// ins: weight (V, D), indices (N,), bounds (B + 1,) [, entry_weights (N,)]; outs: pooled (B, D)
void pool_forward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Bag& bag) {
  check_layout(ins[1], &ins[2], ins[0].shape(0));
  const float* entry_weights = bag.weighted ? ins[3].data<float>() : nullptr;
  pool_bags(ins[0].data<float>(), ins[0].shape(1), ins[1].data<int32_t>(), ins[2].data<int32_t>(), entry_weights,
            bag, outs[0].shape(0), outs[0].data<float>());
}

// rows[i] = table[indices[i]] bit for bit, count rows of dim floats, on every core (with `at`, indices are positions
// of at->unique's rows); rows that outgrow the caches written past them (seqlib_cpu::streams_output)
void gather_rows(const float* table, int64_t dim, const int32_t* indices, int64_t count, float* rows,
                 const RowsAt* at = nullptr) {
  const bool streams = seqlib_cpu::streams_output(int64_t{4} * count * dim);
  ChunkRows chunk_rows(at, indices, count);
  parallel_for(count, count * dim, [&](int64_t first, int64_t end) {
    const int32_t* read = chunk_rows.of(first, end);
    if (read == nullptr) return;
    for (int64_t i = first; i < end; ++i) {
      if (i + kAhead < end) prefetch(table + read[i + kAhead] * dim, dim);
      if (streams) {
        seqlib_cpu::copy_streaming(rows + i * dim, table + read[i] * dim, dim);
      } else {
        std::memcpy(rows + i * dim, table + read[i] * dim, sizeof(float) * dim);
      }
    }
    if (streams) seqlib_cpu::stream_fence();
  });
  chunk_rows.throw_if_outside();
}

// ins: table (V, D), indices (N,) [, unread inputs]; outs: rows (N, D)
void gather(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Bag&) {
  check_layout(ins[1], nullptr, ins[0].shape(0));
  gather_rows(ins[0].data<float>(), ins[0].shape(1), ins[1].data<int32_t>(), ins[1].size(), outs[0].data<float>());
}

// Max mode: the table row whose value won each column of bags [first_bag, end_bag), by the
// forward's rule, into winners (B, D); -1 for an empty bag.
void find_max_winners(const float* __restrict table, int64_t dim, const int32_t* __restrict indices,
                      const int32_t* __restrict bounds, int32_t padding_idx, int32_t* __restrict winners,
                      int64_t first_bag, int64_t end_bag) {
  std::vector<float> best(dim);
  for (int64_t b = first_bag; b < end_bag; ++b) {
    int32_t* winner = winners + b * dim;
    std::fill(winner, winner + dim, -1);
    int64_t count = 0;
    for (int64_t i = bounds[b]; i < bounds[b + 1]; ++i) {
      if (indices[i] == padding_idx) continue;
      const float* __restrict row = table + indices[i] * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const bool wins = count == 0 || row[d] > best[d];
        best[d] = wins ? row[d] : best[d];
        winner[d] = wins ? indices[i] : winner[d];
      }
      ++count;
    }
  }
}

// The table's gradient is computed by ranges of its rows, one range at a time per thread: the range is
// zeroed, then every counted entry that reads one of its rows adds into it, in entry order, so no two
// threads write the same float and the sums never depend on the thread count.  Sum and mean use ranges
// of at most kSpanBytes, which stay in L2 while their entries add into them; max mode, whose every range reads
// all the bags' winners, uses four ranges per thread.
constexpr int64_t kSpanBytes = 256 << 10;

// A range holds a power of two of rows (for sum and mean, at most kSpanBytes), so that an entry finds its range
// with a shift, not a division.  Mean bags, 84,570 entries into 81,025 rows of 128 (seqlib.sparse's rows), 2-core
// Zen 5, builds interleaved, ms: grouping the entries (below) 0.40 -> 0.20 (ranges of 512 rows); the whole backward
// 2.29 / 2.33 -> 2.09 / 2.11, and in another pair of runs 2.34 / 2.49 -> 2.20 / 2.32 (256 rows, as here).  Writing
// each range through an L2 scratch with non-temporal stores (no read for ownership) was slower there: 2.54-2.57
// against 2.30-2.31.
struct RowRanges {
  int shift;  // a range's rows: 1 << shift
  int64_t count;  // ranges
  int64_t of(int32_t row) const { return row >> shift; }
  int64_t first(int64_t range) const { return range << shift; }
  int64_t end(int64_t range, int64_t rows) const { return std::min(rows, (range + 1) << shift); }
};

RowRanges row_ranges(int64_t rows, int64_t dim, bool by_span) {
  const int64_t per_thread = 4 * seqlib_cpu::thread_budget();
  const int64_t wanted = by_span ? std::max<int64_t>(per_thread, rows * dim * 4 / kSpanBytes) : per_thread;
  const int64_t span = (rows + wanted - 1) / wanted;  // rounded down to a power of two: at most kSpanBytes
  int shift = 0;
  while ((int64_t{2} << shift) <= span) ++shift;
  return {shift, (rows + (int64_t{1} << shift) - 1) >> shift};
}

// Sum and mean: the counted entries grouped by the row range their index falls in, each group in
// entry order (a counting sort, by chunks of bags in parallel): group r is positions start[r] to
// start[r + 1] - 1 of entry and bag.  Mean also needs each bag's count of counted entries (size).
struct EntriesByRange {
  std::vector<int32_t> entry, bag;
  std::vector<int64_t> start;
  std::vector<float> size;
};

// The grouping's work for parallel_for, per entry: a counter bumped and two ints stored at random cost about what 16
// floats streamed do.  Counted as one float (one thread below 131,072 entries), the two passes took 0.22 ms of a 1.6
// ms backward (84,570 entries into 81,025 rows of 128, 2-core Zen 5); on two threads the backward took 0.09 ms less.
constexpr int64_t kGroupingWork = 16;

EntriesByRange group_entries(const int32_t* indices, const int32_t* bounds, int64_t bags, int32_t padding_idx,
                             const RowRanges& ranges) {
  const int64_t entries = bounds[bags];
  const int64_t chunks = std::max<int64_t>(std::min<int64_t>(seqlib_cpu::thread_budget(), bags), 1);
  const auto bags_of = [&](int64_t chunk) { return seqlib_cpu::share_of<int64_t>(0, bags, chunk, chunks); };
  EntriesByRange grouped{std::vector<int32_t>(entries), std::vector<int32_t>(entries),
                         std::vector<int64_t>(ranges.count + 1), std::vector<float>(bags)};
  std::vector<int64_t> at(chunks * ranges.count);  // chunk c's count in range r at [c * R + r], then its cursor
  parallel_for(chunks, kGroupingWork * entries, [&](int64_t first_chunk, int64_t end_chunk) {
    for (int64_t c = first_chunk; c < end_chunk; ++c) {
      int64_t* count = at.data() + c * ranges.count;
      for (int64_t b = bags_of(c).first; b < bags_of(c).second; ++b) {
        int64_t size = 0;
        for (int64_t i = bounds[b]; i < bounds[b + 1]; ++i) {
          if (indices[i] == padding_idx) continue;
          ++count[ranges.of(indices[i])];
          ++size;
        }
        grouped.size[b] = static_cast<float>(size);  // as the forward divides
      }
    }
  });
  int64_t total = 0;  // range by range, and within a range chunk by chunk: entry order
  for (int64_t r = 0; r < ranges.count; ++r) {
    grouped.start[r] = total;
    for (int64_t c = 0; c < chunks; ++c) total += std::exchange(at[c * ranges.count + r], total);
  }
  grouped.start[ranges.count] = total;
  parallel_for(chunks, kGroupingWork * entries, [&](int64_t first_chunk, int64_t end_chunk) {
    for (int64_t c = first_chunk; c < end_chunk; ++c) {
      int64_t* cursor = at.data() + c * ranges.count;
      for (int64_t b = bags_of(c).first; b < bags_of(c).second; ++b) {
        for (int64_t i = bounds[b]; i < bounds[b + 1]; ++i) {
          if (indices[i] == padding_idx) continue;
          const int64_t to = cursor[ranges.of(indices[i])]++;
          grouped.entry[to] = static_cast<int32_t>(i), grouped.bag[to] = static_cast<int32_t>(b);
        }
      }
    }
  });
  return grouped;
}

// Sum and mean, one range's rows: each of its entries adds its bag's cotangent, times its weight
// (sum) or 1 / the bag's count (mean).
template <int kMode>
void scatter_entries(int64_t dim, const int32_t* __restrict indices, const float* __restrict entry_weights,
                     const EntriesByRange& grouped, int64_t range, const float* __restrict cotangent,
                     float* __restrict d_table) {
  for (int64_t k = grouped.start[range]; k < grouped.start[range + 1]; ++k) {
    const int32_t i = grouped.entry[k], b = grouped.bag[k];
    const float* __restrict grad = cotangent + b * dim;
    float* __restrict out = d_table + indices[i] * dim;
    if (kMode == kMean) {  // times 1 / size, as torch's backward scales (not divides): its bits, and no divide
      const float scale = 1.0f / grouped.size[b];
      for (int64_t d = 0; d < dim; ++d) out[d] += grad[d] * scale;
    } else if (entry_weights != nullptr) {
      const float scale = entry_weights[i];
      for (int64_t d = 0; d < dim; ++d) out[d] += grad[d] * scale;
    } else {
      for (int64_t d = 0; d < dim; ++d) out[d] += grad[d];
    }
  }
}

// Max, rows [first_row, end_row): each column's cotangent goes to the row that won it (winners, from
// find_max_winners), bag by bag.
void scatter_winners(int64_t dim, int64_t bags, const int32_t* __restrict winners, const float* __restrict cotangent,
                     float* __restrict d_table, int64_t first_row, int64_t end_row) {
  for (int64_t b = 0; b < bags; ++b) {
    const float* __restrict grad = cotangent + b * dim;
    const int32_t* winner = winners + b * dim;
    for (int64_t d = 0; d < dim; ++d) {
      if (winner[d] >= first_row && winner[d] < end_row) d_table[winner[d] * dim + d] += grad[d];
    }
  }
}

// Whether the backward reads the table: max mode (which row won each column) and entry weights (their gradients
// are dot products with the rows).  Sum and mean need only its shape: they do not take it as an input, so that
// the table's rows are not computed for them (seqlib.sparse's rows, sparse_rows below).
bool reads_table(const Bag& bag) { return bag.mode == kMax || bag.weighted; }

// ins: cotangent (B, D), indices (N,), bounds (B + 1,) [, entry_weights (N,)] [, table (V, D): reads_table]
// outs: d_table (V, D) [, d_entry_weights (N,)]
void pool_backward(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Bag& bag) {
  check_layout(ins[1], &ins[2], outs[0].shape(0));
  const float* cotangent = ins[0].data<float>();
  const int32_t* indices = ins[1].data<int32_t>();
  const int32_t* bounds = ins[2].data<int32_t>();
  const float* entry_weights = bag.weighted ? ins[3].data<float>() : nullptr;
  const float* table = reads_table(bag) ? ins.back().data<float>() : nullptr;
  float* d_table = outs[0].data<float>();
  const int64_t rows = outs[0].shape(0), dim = outs[0].shape(1), bags = ins[0].shape(0), entries = bounds[bags];
  if (rows == 0 || dim == 0) {  // no table to scatter into; every entry weight's dot product is empty
    if (entry_weights != nullptr) std::fill(outs[1].data<float>(), outs[1].data<float>() + entries, 0.0f);
    return;
  }

  const RowRanges ranges = row_ranges(rows, dim, bag.mode != kMax);
  std::vector<int32_t> winners(bag.mode == kMax ? bags * dim : 0);
  EntriesByRange grouped;
  if (bag.mode == kMax) {
    parallel_for(bags, entries * dim, [&](int64_t first_bag, int64_t end_bag) {
      find_max_winners(table, dim, indices, bounds, bag.padding_idx, winners.data(), first_bag, end_bag);
    });
  } else {
    grouped = group_entries(indices, bounds, bags, bag.padding_idx, ranges);
  }
  auto scatter = bag.mode == kMean ? scatter_entries<kMean> : scatter_entries<kSum>;
  parallel_for(ranges.count, rows * dim + entries * dim, [&](int64_t first_range, int64_t end_range) {
    for (int64_t r = first_range; r < end_range; ++r) {
      const int64_t first_row = ranges.first(r), end_row = ranges.end(r, rows);
      std::fill(d_table + first_row * dim, d_table + end_row * dim, 0.0f);
      if (bag.mode == kMax) {
        scatter_winners(dim, bags, winners.data(), cotangent, d_table, first_row, end_row);
      } else {
        scatter(dim, indices, entry_weights, grouped, r, cotangent, d_table);
      }
    }
  });
  if (entry_weights == nullptr) return;
  float* d_entry_weights = outs[1].data<float>();  // sum(cotangent[b] * row) for each counted entry of bag b
  parallel_for(bags, entries * dim, [&](int64_t first_bag, int64_t end_bag) {
    for (int64_t b = first_bag; b < end_bag; ++b) {
      const float* grad = cotangent + b * dim;
      for (int64_t i = bounds[b]; i < bounds[b + 1]; ++i) {
        float total = 0.0f;
        if (indices[i] != bag.padding_idx) {
          const float* row = table + indices[i] * dim;
          for (int64_t d = 0; d < dim; ++d) total += grad[d] * row[d];
        }
        d_entry_weights[i] = total;
      }
    }
  });
}

// ----------------------------------------------------------------- the operations Python calls

// A ValueError in Python unless the arrays are what the loops read (the library passes them so).
void check_bag_arrays(const mx::array& weight, const mx::array& indices, const mx::array& bounds,
                      const std::optional<mx::array>& entry_weights) {
  const bool ok = weight.ndim() == 2 && weight.dtype() == mx::float32 && indices.ndim() == 1 &&
                  indices.dtype() == mx::int32 && bounds.ndim() == 1 && bounds.size() >= 1 &&
                  bounds.dtype() == mx::int32 &&
                  (!entry_weights ||
                   (entry_weights->dtype() == mx::float32 && entry_weights->shape() == indices.shape()));
  if (!ok) {
    throw std::invalid_argument(
        "bag_pool: expected weight (V, D) float32, indices (N,) int32, bounds (B + 1,) int32 and entry_weights "
        "(N,) float32 or None");
  }
}

std::vector<const mx::array*> with_weights(std::vector<const mx::array*> inputs,
                                           const std::optional<mx::array>& entry_weights) {
  if (entry_weights) inputs.push_back(&*entry_weights);
  return inputs;
}

// The backward loop of bags of `indices` (into `rows` rows) for `cotangent`: d_rows (rows, D) [, d_entry_weights];
// `table` (rows, D) is an input only where the loop reads it (reads_table).
std::vector<mx::array> bag_backward(const mx::array& cotangent, const mx::array& indices, const mx::array& bounds,
                                    const std::optional<mx::array>& entry_weights, const mx::array& table,
                                    const Bag& bag) {
  std::vector<mx::Shape> shapes = {table.shape()};
  if (bag.weighted) shapes.push_back(entry_weights->shape());
  std::vector<const mx::array*> inputs = with_weights({&cotangent, &indices, &bounds}, entry_weights);
  if (reads_table(bag)) inputs.push_back(&table);
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return seqlib_cpu::make_loop("EmbeddingBagPoolBackward", pool_backward, std::move(shapes), std::move(dtypes),
                               inputs, bag);
}

// The forward's vector-Jacobian product: the backward loop (the table's gradient, and the entry
// weights'); indices and bounds are integers and have none (zeros where MLX asks).
// primals: weight, indices, bounds [, entry_weights]; cotangents: (B, D)
std::vector<mx::array> pool_vjp(const Bag& bag, const std::vector<mx::array>& primals,
                                const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                const std::vector<mx::array>&) {
  const auto entry_weights = bag.weighted ? std::optional<mx::array>(primals[3]) : std::nullopt;
  auto d = bag_backward(cotangents[0], primals[1], primals[2], entry_weights, primals[0], bag);
  std::vector<mx::array> grads;
  for (int argnum : argnums) {
    if (argnum == 0) grads.push_back(d[0]);
    else if (argnum == 3) grads.push_back(d[1]);
    else grads.push_back(mx::zeros_like(primals[argnum], seqlib_cpu::cpu_stream()));
  }
  return grads;
}

// ----------------------------------------------------------------- the rows of a sparse gradient
//
// seqlib.sparse differentiates a loss with respect to the U rows a batch reads of a (V, D) table, never the
// table.  sparse_rows(table, unique, delta) stands for those rows: table[unique] in value, with delta (U, D),
// zeros that no loop reads (a broadcast: no memory), carrying their gradient.  A bag or a gather that reads
// these rows at positions (indices into unique) reads the table itself at unique[positions] instead (see
// rows_of_table), so the (U, D) rows are never copied out unless something else reads them; the lookup's
// gradient still goes to delta, by positions.  A sparse mean bag's forward+backward, loss and gradient evaluated
// (V = 1M, D = 128, 84,570 entries in 4,096 bags; 2-core Zen 5): 11.2 ms when the rows were gathered first (the
// copy, 41 MB, took a third of it), 6.6-7.4 ms reading the table; torch 5.7-6.4.

constexpr const char* kSparseRows = "SparseRows";

struct RowsOfTable {
  mx::array table, unique, delta;
};

// The table, unique rows and delta of `rows` if sparse_rows made it and it is still a node of the graph.
std::optional<RowsOfTable> rows_of_table(const mx::array& rows) {
  if (!rows.has_primitive() || std::strcmp(rows.primitive().name(), kSparseRows) != 0) return std::nullopt;
  const auto& inputs = rows.inputs();
  return RowsOfTable{inputs[0], inputs[1], inputs[2]};
}

// The rows of `table` at `unique` (U,), for a loop that reads them by position.
RowsAt rows_at(const mx::array& table, const mx::array& unique) {
  return {unique.data<int32_t>(), static_cast<int64_t>(unique.size()), table.shape(0)};
}

// ins: table (V, D), unique (U,), positions (N,), bounds (B + 1,) [, entry_weights (N,)] [, delta: unread];
// outs: pooled (B, D), bags of table rows unique[positions]; padding_idx is a position.
void pool_forward_at(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Bag& bag) {
  check_bounds(ins[3], static_cast<int64_t>(ins[2].size()));  // the positions are checked as they are read
  const RowsAt at = rows_at(ins[0], ins[1]);
  Bag by_row = bag;
  if (bag.padding_idx >= 0) {
    if (bag.padding_idx >= at.count) throw_outside(at);
    by_row.padding_idx = at.unique[bag.padding_idx];
  }
  const float* entry_weights = bag.weighted ? ins[4].data<float>() : nullptr;
  pool_bags(ins[0].data<float>(), ins[0].shape(1), ins[2].data<int32_t>(), ins[3].data<int32_t>(), entry_weights,
            by_row, outs[0].shape(0), outs[0].data<float>(), &at);
}

// ins: table (V, D), unique (U,), positions (*) [, delta: unread]; outs: (*, D) rows unique[positions] of table.
void gather_at(std::vector<mx::array>& ins, std::vector<mx::array>& outs, const Bag&) {
  const RowsAt at = rows_at(ins[0], ins[1]);
  gather_rows(ins[0].data<float>(), ins[0].shape(1), ins[2].data<int32_t>(), ins[2].size(), outs[0].data<float>(),
              &at);
}

mx::array sparse_rows_of(const mx::array& table, const mx::array& unique, const mx::array& delta);
mx::array gather_backward(const mx::array& cotangent, const mx::array& indices, const mx::array& rows);

// The gradients of a lookup at positions of sparse rows (primals: table, unique, positions, ..., delta last):
// to delta, d_rows of the lookup's backward loop by positions, backward(rows) (the rows, sparse_rows', are read
// only where the loop reads them); to the entry weights (argnum_weights), that loop's second output; to the
// table (where asked: seqlib.sparse freezes it), d_rows scattered to the rows unique, the same bits.
template <class Backward>
std::vector<mx::array> gradients_at(const std::vector<mx::array>& primals, const std::vector<int>& argnums,
                                    int argnum_weights, Backward backward) {
  const auto s = seqlib_cpu::cpu_stream();
  const int delta = static_cast<int>(primals.size()) - 1;
  const std::vector<mx::array> d = backward(sparse_rows_of(primals[0], primals[1], primals[delta]));
  std::vector<mx::array> grads;
  for (int argnum : argnums) {
    if (argnum == delta) grads.push_back(d[0]);
    else if (argnum == argnum_weights) grads.push_back(d[1]);
    else if (argnum == 0) grads.push_back(gather_backward(d[0], primals[1], primals[0]));
    else grads.push_back(mx::zeros_like(primals[argnum], s));
  }
  return grads;
}

// primals: table, unique, positions, bounds [, entry_weights], delta; cotangents: (B, D)
std::vector<mx::array> pool_at_vjp(const Bag& bag, const std::vector<mx::array>& primals,
                                   const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                   const std::vector<mx::array>&) {
  const auto entry_weights = bag.weighted ? std::optional<mx::array>(primals[4]) : std::nullopt;
  return gradients_at(primals, argnums, bag.weighted ? 4 : -1, [&](const mx::array& rows) {
    return bag_backward(cotangents[0], primals[2], primals[3], entry_weights, rows, bag);
  });
}

mx::array bag_pool(const mx::array& weight, const mx::array& indices, const mx::array& bounds,
                   const std::optional<mx::array>& entry_weights, int mode, int padding_idx) {
  check_bag_arrays(weight, indices, bounds, entry_weights);
  const int bags = bounds.shape(0) - 1, dim = weight.shape(1);
  const Bag bag{mode, padding_idx, entry_weights.has_value()};
  if (auto at = rows_of_table(weight)) {  // sparse rows: pool the table's own rows
    auto inputs = with_weights({&at->table, &at->unique, &indices, &bounds}, entry_weights);
    const size_t read = inputs.size();
    inputs.push_back(&at->delta);
    return seqlib_cpu::make_loop("EmbeddingBagPoolAt", pool_forward_at, {{bags, dim}}, {mx::float32}, inputs, bag,
                                 pool_at_vjp, nullptr, read)[0];
  }
  return seqlib_cpu::make_loop("EmbeddingBagPool", pool_forward, {{bags, dim}}, {mx::float32},
                               with_weights({&weight, &indices, &bounds}, entry_weights), bag, pool_vjp)[0];
}

std::vector<mx::array> bag_pool_backward(const mx::array& cotangent, const mx::array& weight,
                                         const mx::array& indices, const mx::array& bounds,
                                         const std::optional<mx::array>& entry_weights, int mode, int padding_idx) {
  check_bag_arrays(weight, indices, bounds, entry_weights);
  if (cotangent.dtype() != mx::float32 || cotangent.shape() != mx::Shape{bounds.shape(0) - 1, weight.shape(1)}) {
    throw std::invalid_argument("bag_pool_backward: expected a (B, D) float32 cotangent");
  }
  const Bag bag{mode, padding_idx, entry_weights.has_value()};
  return bag_backward(cotangent, indices, bounds, entry_weights, weight, bag);
}

// The gather's backward: every looked-up row adds its cotangent row into d_rows (rows.shape), which is the
// sum-mode bag backward with one entry per bag (bounds 0, 1, ..., N).  indices (*), cotangent (*, D).
mx::array gather_backward(const mx::array& cotangent, const mx::array& indices, const mx::array& rows) {
  const auto s = seqlib_cpu::cpu_stream();
  const int count = static_cast<int>(indices.size()), dim = rows.shape(1);
  const mx::array flat = mx::reshape(indices, {count}, s);  // (N,)
  return bag_backward(mx::reshape(cotangent, {count, dim}, s), flat, mx::arange(0, count + 1, mx::int32, s),
                      std::nullopt, rows, Bag{kSum, -1, false})[0];
}

// The gather's vector-Jacobian product.  primals: table (V, D), indices (*); cotangents: (*, D)
std::vector<mx::array> take_rows_vjp(const Bag&, const std::vector<mx::array>& primals,
                                     const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                     const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int argnum : argnums) {
    grads.push_back(argnum == 0 ? gather_backward(cotangents[0], primals[1], primals[0])
                                : mx::zeros_like(primals[argnum], seqlib_cpu::cpu_stream()));
  }
  return grads;
}

// primals: table, unique, positions, delta; cotangents: (*, D)
std::vector<mx::array> take_at_vjp(const Bag&, const std::vector<mx::array>& primals,
                                   const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                   const std::vector<mx::array>&) {
  return gradients_at(primals, argnums, -1, [&](const mx::array& rows) {
    return std::vector<mx::array>{gather_backward(cotangents[0], primals[2], rows)};
  });
}

// SparseRows' vector-Jacobian product.  primals: table (V, D), unique (U,), delta (U, D); cotangents: (U, D)
std::vector<mx::array> sparse_rows_vjp(const Bag&, const std::vector<mx::array>& primals,
                                       const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                       const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int argnum : argnums) {
    if (argnum == 2) grads.push_back(cotangents[0]);
    else if (argnum == 0) grads.push_back(gather_backward(cotangents[0], primals[1], primals[0]));
    else grads.push_back(mx::zeros_like(primals[argnum], seqlib_cpu::cpu_stream()));
  }
  return grads;
}

// TakeRows' output, (*, D), for a table (V, D) and indices (*) of any shape (mx.compile(shapeless=True)).
std::vector<mx::Shape> gathered_shape(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>& = {}) {
  mx::Shape shape = inputs[1].shape();
  shape.push_back(inputs[0].shape(1));
  return {shape};
}

// table (V, D) float32, indices (*) int32 in [0, V) -> rows (*, D): a copy of each looked-up row, with a
// gradient for the table.  Rows of sparse_rows are read from their table (see rows_of_table).
mx::array take_rows(const mx::array& table, const mx::array& indices) {
  check_bag_arrays(table, mx::reshape(indices, {-1}), mx::array({0}), std::nullopt);
  if (auto at = rows_of_table(table)) {
    return seqlib_cpu::make_loop("TakeRowsAt", gather_at, gathered_shape({table, indices}), {mx::float32},
                                 {&at->table, &at->unique, &indices, &at->delta}, Bag{kSum, -1, false}, take_at_vjp,
                                 nullptr, 3)[0];
  }
  return seqlib_cpu::make_loop("TakeRows", gather, gathered_shape({table, indices}), {mx::float32},
                               {&table, &indices}, Bag{kSum, -1, false}, take_rows_vjp, gathered_shape)[0];
}

// table (V, D) float32, unique (U,) int32 in [0, V), delta (U, D) float32 (never read) -> table[unique], whose
// gradient is delta's.
mx::array sparse_rows_of(const mx::array& table, const mx::array& unique, const mx::array& delta) {
  return seqlib_cpu::make_loop(kSparseRows, gather, {delta.shape()}, {mx::float32}, {&table, &unique, &delta},
                               Bag{kSum, -1, false}, sparse_rows_vjp, nullptr, 2)[0];
}

mx::array sparse_rows(const mx::array& table, const mx::array& unique, const mx::array& delta) {
  check_bag_arrays(table, unique, mx::array({0}), std::nullopt);
  if (delta.dtype() != mx::float32 || delta.shape() != mx::Shape{unique.shape(0), table.shape(1)}) {
    throw std::invalid_argument("sparse_rows: expected delta (U, D) float32 for unique (U,) and table (V, D)");
  }
  return sparse_rows_of(table, unique, delta);
}

}  // namespace

void seqlib_cpu::register_bags(nb::module_& m) {
  m.def("take_rows", &take_rows, "table"_a, "indices"_a);
  m.def("bag_pool", &bag_pool, "weight"_a, "indices"_a, "bounds"_a, "entry_weights"_a.none(), "mode"_a,
        "padding_idx"_a);
  m.def("sparse_rows", &sparse_rows, "table"_a, "unique"_a, "delta"_a);
  m.def("bag_pool_backward", &bag_pool_backward, "cotangent"_a, "weight"_a, "indices"_a, "bounds"_a,
        "entry_weights"_a.none(), "mode"_a, "padding_idx"_a);
}
