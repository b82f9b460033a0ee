// rnn_cell: the Elman RNN's nonlinearity for one time step.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["pre"]    pre (B, H) = x W_ih^T + b_ih + h W_hh^T + b_hh
//   outputs = ["h"]      h (B, H)
//   template T; RELU (bool): relu instead of tanh
//   grid    = (H, B, 1)
//
// One thread's job: element (b, j):  h = tanh(pre)  or  h = relu(pre).
// relu as torch: NaN stays NaN (a plain max(pre, 0) or "pre > 0 ? pre : 0"
// would turn it into 0), and -0 stays -0.
// Reference: seqlib.reference.rnn_cell (NumPy); the MLX-ops path is
// seqlib.scan.rnn_sequence's activation.
// Napkin math: reads BH values, writes BH; 1 transcendental each: memory-bound.

uint j = thread_position_in_grid.x;
uint b = thread_position_in_grid.y;
uint hidden_size = pre_shape[1];
uint batch = pre_shape[0];
if (j >= hidden_size || b >= batch) {
  return;
}
uint unit = b * hidden_size + j;
float value = float(pre[unit]);
if (RELU) {
  h[unit] = T(value < 0.0f ? 0.0f : value);
} else {
  h[unit] = T(tanh_of(value));
}
