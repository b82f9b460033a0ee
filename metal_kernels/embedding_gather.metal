// embedding_gather: the embedding lookup out[n, :] = weight[indices[n], :].
//
// Body for mx.fast.metal_kernel with
//   inputs  = ["weight", "indices"]   weight (V, D) float, indices (N,) int32, checked in [0, V) by seqlib
//   outputs = ["out"]                 out (N, D), same dtype as weight
//   grid    = (D, N, 1)               one thread per output element
//
// One thread's job: copy one element, out[n, d] = weight[indices[n], d].
// Threads along x walk one row, so neighbouring threads read neighbouring
// addresses (coalesced loads and stores).
//
// Reference: seqlib.reference.embedding (NumPy).
//
// Napkin math: no FLOPs; it moves 2 * N * D * sizeof(T) bytes (read a row
// element, write it), so it runs at memory bandwidth.

uint d = thread_position_in_grid.x;            // column within the embedding
uint n = thread_position_in_grid.y;            // which index / output row
uint embedding_dim = weight_shape[1];
uint num_indices = indices_shape[0];
if (d >= embedding_dim || n >= num_indices) {
  return;                                      // partial threadgroup at the edge
}
uint row = uint(indices[n]);
out[n * embedding_dim + d] = weight[row * embedding_dim + d];
