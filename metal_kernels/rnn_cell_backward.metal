// rnn_cell_backward: the gradient through rnn_cell's nonlinearity.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["d_h", "h"]   d_h (B, H): gradient at the output; h (B, H): rnn_cell's output
//   outputs = ["d_pre"]      d_pre (B, H)
//   template T; RELU (bool)
//   grid    = (H, B, 1)
//
// One thread's job: element (b, j), from the output alone:
//   tanh:  d_pre = d_h * (1 - h^2)         relu:  d_pre = 0 if h <= 0 else d_h
// (relu's derivative at 0 is taken as 0, and a NaN output passes d_h on, as torch's
// threshold_backward does: "h <= 0 ? 0 : d_h").
// Reference: seqlib.reference.rnn_backward (NumPy, one step of it); the MLX-ops
// path is seqlib.pointwise.rnn_activation_backward.
// Napkin math: reads 2BH values, writes BH; 2-3 FLOPs each: memory-bound.

uint j = thread_position_in_grid.x;
uint b = thread_position_in_grid.y;
uint hidden_size = h_shape[1];
uint batch = h_shape[0];
if (j >= hidden_size || b >= batch) {
  return;
}
uint unit = b * hidden_size + j;
float output = float(h[unit]);
float grad = float(d_h[unit]);
if (RELU) {
  d_pre[unit] = T(output <= 0.0f ? 0.0f : grad);
} else {
  d_pre[unit] = T(grad * (1.0f - output * output));
}
