// embedding_bag_backward: the dense gradient of embedding_bag w.r.t. the table, by atomics.
//
// Body for mx.fast.metal_kernel with atomic_outputs=True, init_value=0 and
//   inputs  = ["d_out", "indices", "bag_of_entry", "bag_size", "per_sample_weights",
//              "max_entry", "padding_idx"]
//             d_out (B, D); indices (N,) int32; bag_of_entry (N,) int32: the bag each
//             entry is in (every entry is in one); bag_size (B,) int32:
//             entries that count in each bag (padding left out); per_sample_weights (N,)
//             (read only when WEIGHTED); max_entry (B, D) from embedding_bag (MODE_MAX only);
//             padding_idx int32 scalar, -1 for none
//   outputs = ["d_weight"]   (V, D) float32 (atomic<float>), zero-filled by MLX
//   template T, MODE (MODE_SUM, MODE_MEAN or MODE_MAX of seqlib_math.h), WEIGHTED (bool)
//   grid    = (D, N, 1) for sum and mean, (D, B, 1) for max
//
// One thread's job, sum and mean: entry n, column d:
//   d_weight[indices[n], d] += d_out[bag, d] * (per_sample_weights[n] or 1 / bag_size)
// max: bag b, column d: d_weight[indices[max_entry[b, d]], d] += d_out[b, d].
// Entries of padding_idx send nothing.
//
// Reference: seqlib.reference.embedding_bag_backward (its d_weight).
// Napkin math: reads N*D (max: B*D) gradient values and does as many atomic
// adds; no arithmetic to speak of, so it runs at atomic throughput.

uint d = thread_position_in_grid.x;
uint item = thread_position_in_grid.y;       // entry n (sum, mean) or bag b (max)
uint embedding_dim = d_out_shape[1];
uint num_bags = d_out_shape[0];
uint num_entries = indices_shape[0];
if (d >= embedding_dim) {
  return;
}
if (MODE == MODE_MAX) {
  if (item >= num_bags) {
    return;
  }
  int entry = max_entry[item * embedding_dim + d];
  if (entry < 0) {
    return;                                  // an empty bag
  }
  uint row = uint(indices[entry]);
  atomic_fetch_add_explicit(&d_weight[row * embedding_dim + d], float(d_out[item * embedding_dim + d]),
                            memory_order_relaxed);
} else {
  if (item >= num_entries) {
    return;
  }
  int bag = bag_of_entry[item];
  int row = indices[item];
  if (row == padding_idx) {
    return;
  }
  float grad = float(d_out[uint(bag) * embedding_dim + d]);
  if (MODE == MODE_MEAN) {
    grad /= float(bag_size[bag]);
  }
  if (WEIGHTED) {
    grad *= float(per_sample_weights[item]);
  }
  atomic_fetch_add_explicit(&d_weight[uint(row) * embedding_dim + d], grad, memory_order_relaxed);
}
