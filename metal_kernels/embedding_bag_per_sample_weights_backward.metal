// embedding_bag_per_sample_weights_backward: the gradient of embedding_bag
// (mode sum) w.r.t. per_sample_weights.
//
// Body for mx.fast.metal_kernel with
//   inputs  = ["d_out", "weight", "indices", "bag_of_entry", "padding_idx"]
//             d_out (B, D); weight (V, D); indices (N,) int32; bag_of_entry (N,) int32
//             (the bag of each entry); padding_idx int32 scalar, -1 for none
//   outputs = ["d_per_sample_weights"]   (N,)
//   template T
//   grid    = (32, N, 1), threadgroup = (32, k, 1): one SIMD group per entry
//
// One SIMD group's job: entry n.  d/dw_n of sum_n w_n weight[indices[n]] is
// that row, so the gradient is the dot product d_out[bag] . weight[indices[n]].
// Lane l multiplies columns l, l + 32, ...; simd_sum adds the 32 partial sums.
// Padding entries get 0.
//
// Reference: seqlib.reference.embedding_bag_backward (its d_per_sample_weights).
// Napkin math: reads 2*N*D values, 2 FLOPs each: memory-bound.

uint lane = thread_index_in_simdgroup;
uint n = thread_position_in_grid.y;
uint embedding_dim = d_out_shape[1];
uint num_entries = indices_shape[0];
if (n >= num_entries) {
  return;                                    // the whole SIMD group leaves together
}
int bag = bag_of_entry[n];
int row = indices[n];
float partial = 0.0f;
if (row != padding_idx) {
  for (uint d = lane; d < embedding_dim; d += 32) {
    partial += float(d_out[uint(bag) * embedding_dim + d]) * float(weight[uint(row) * embedding_dim + d]);
  }
}
float total = simd_sum(partial);
if (lane == 0) {
  d_per_sample_weights[n] = T(total);
}
