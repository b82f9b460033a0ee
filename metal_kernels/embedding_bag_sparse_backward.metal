// embedding_bag_sparse_backward: embedding_bag's gradient as one row per entry (torch's
// sparse=True gradient before coalescing), with no atomics.
//
// Body for mx.fast.metal_kernel with
//   inputs  = ["d_out", "indices", "bag_of_entry", "bag_size", "per_sample_weights",
//              "max_entry", "padding_idx"]   (as embedding_bag_backward)
//   outputs = ["d_rows"]     (N, D): row n is the gradient that entry n sends to
//             weight[indices[n]]; zero for padding entries and entries in no bag
//   template T, MODE (0 sum, 1 mean, 2 max), WEIGHTED (bool)
//   grid    = (D, N, 1)
//
// One thread's job: entry n, column d: the value embedding_bag_backward would
// add atomically, written to its own element instead (for max: d_out[bag, d]
// if entry n won column d of its bag, else 0).  Summing equal indices
// (coalescing) is left to the caller, which already knows the unique rows.
//
// Napkin math: reads N*D values of d_out (through the cache: entries of a bag
// share a row), writes N*D; no atomics, so deterministic.

uint d = thread_position_in_grid.x;
uint n = thread_position_in_grid.y;
uint embedding_dim = d_out_shape[1];
uint num_entries = indices_shape[0];
if (d >= embedding_dim || n >= num_entries) {
  return;
}
int bag = bag_of_entry[n];
int row = indices[n];
float grad = 0.0f;
if (bag >= 0 && row != padding_idx) {
  uint at = uint(bag) * embedding_dim + d;
  grad = float(d_out[at]);
  if (MODE == 1) {
    grad /= float(bag_size[bag]);
  } else if (MODE == 2 && max_entry[at] != int(n)) {
    grad = 0.0f;
  }
  if (WEIGHTED) {
    grad *= float(per_sample_weights[n]);
  }
}
d_rows[n * embedding_dim + d] = T(grad);
