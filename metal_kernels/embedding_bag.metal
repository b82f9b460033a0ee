// embedding_bag: sum, mean or max of bags of embedding rows, without building
// the (N, D) matrix of looked-up rows.
//
// Body for mx.fast.metal_kernel with
//   inputs  = ["weight", "indices", "bag_bounds", "per_sample_weights", "padding_idx"]
//             weight (V, D); indices (N,) int32 in [0, V) (checked by seqlib);
//             bag_bounds (B + 1,) int32: bag b holds entries bag_bounds[b] .. bag_bounds[b + 1]
//             (the CSR form; seqlib appends the end when include_last_offset=False);
//             per_sample_weights (N,) T (read only when WEIGHTED);
//             padding_idx int32 scalar, -1 for none: those entries are skipped
//   outputs = ["out", "max_entry"]
//             out (B, D); max_entry (B, D) int32: for MODE_MAX, the entry that won the
//             max of column d (the first one on ties, as torch), -1 for an empty bag;
//             the backward sends the gradient there.  Other modes write -1.
//   template T, MODE (int): MODE_SUM, MODE_MEAN or MODE_MAX (seqlib_math.h); WEIGHTED (bool)
//   grid    = (D, B, 1)
//
// One thread's job: column d of bag b.  It walks the bag's entries, reading
// one element of each looked-up row: a gather fused with the reduction, so
// the only traffic is the rows themselves.  Empty bags (and bags of padding
// only) give 0 in every mode; mean divides by the entries that count.
//
// Reference: seqlib.reference.embedding_bag (the MLX-ops path:
// seqlib.functional.embedding_bag).
// Napkin math: reads N*D table values and N indices per column
// pass (the index reads are shared through the cache), writes B*D: one FLOP
// per value read, memory-bound; Embedding + reduce would also write and
// re-read the (N, D) matrix, 3x the traffic.

uint d = thread_position_in_grid.x;
uint b = thread_position_in_grid.y;
uint embedding_dim = weight_shape[1];
uint num_bags = bag_bounds_shape[0] - 1;
if (d >= embedding_dim || b >= num_bags) {
  return;
}
uint start = uint(bag_bounds[b]);
uint end = uint(bag_bounds[b + 1]);
float total = 0.0f;
float best = 0.0f;
int best_entry = -1;
uint count = 0;
for (uint n = start; n < end; ++n) {
  int row = indices[n];
  if (row == padding_idx) {
    continue;
  }
  float value = float(weight[uint(row) * embedding_dim + d]);
  if (MODE == MODE_MAX) {
    // torch's CPU rule: the first entry, then only strictly greater values.  NaN compares
    // false both ways, so it wins only as the first entry (MLX compiles without fast math).
    if (count == 0 || value > best) {
      best = value;
      best_entry = int(n);
    }
  } else if (WEIGHTED) {
    total += float(per_sample_weights[n]) * value;
  } else {
    total += value;
  }
  count += 1;
}
float result = total;
if (MODE == MODE_MEAN && count > 0) {
  result = total / float(count);
} else if (MODE == MODE_MAX) {
  result = best;
}
out[b * embedding_dim + d] = T(result);
max_entry[b * embedding_dim + d] = best_entry;
