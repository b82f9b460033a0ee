// embedding_backward: the gradient of a lookup is a scatter-add.
//
// Body for mx.fast.metal_kernel with atomic_outputs=True, init_value=0 and
//   inputs  = ["d_out", "indices", "grad_scale", "padding_idx"]
//             d_out (N, D): the gradient of the looked-up rows; indices (N,) int32 in [0, V)
//             (checked by seqlib); grad_scale (N,) float: each lookup's factor
//             (1 / its index's count for scale_grad_by_freq; read only if SCALED);
//             padding_idx: int32 scalar, -1 for none
//   outputs = ["d_weight"]   (V, D) float32 (atomic<float>), zero-filled by MLX
//   template T (dtype of d_out), SCALED (bool)
//   grid    = (D, N, 1)
//
// One thread's job: add d_out[n, d] (times its scale) into d_weight[indices[n], d].
// Two lookups of the same row add into the same element, so the add is atomic;
// lookups of padding_idx send nothing (torch's padding row gets no gradient).
// The order of the atomic adds is not fixed, so sums of repeated rows can
// differ from the MLX-ops path in the last bits.
//
// Reference: seqlib.reference.embedding_backward (the MLX-ops path:
// seqlib.functional.embedding's autodiff).
// Napkin math: reads N*D values, N*D atomic read-modify-writes;
// no arithmetic to speak of, so it runs at atomic throughput.

uint d = thread_position_in_grid.x;
uint n = thread_position_in_grid.y;
uint embedding_dim = d_out_shape[1];
uint num_lookups = d_out_shape[0];
if (d >= embedding_dim || n >= num_lookups) {
  return;
}
int row = indices[n];
if (row == padding_idx) {
  return;
}
float grad = float(d_out[n * embedding_dim + d]);
if (SCALED) {
  grad *= grad_scale[n];
}
atomic_fetch_add_explicit(&d_weight[uint(row) * embedding_dim + d], grad, memory_order_relaxed);
