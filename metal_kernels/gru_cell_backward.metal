// gru_cell_backward: gradients through one step of gru_cell.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["d_h", "activations", "hidden_side", "h_prev"]
//             d_h (B, H); activations (B, 3H) r, z, n saved by gru_cell;
//             hidden_side (B, 3H) = h W_hh^T + b_hh; h_prev (B, H)
//   outputs = ["d_input_side", "d_hidden_side", "d_h_prev"]
//             d_input_side (B, 3H), d_hidden_side (B, 3H); d_h_prev (B, H): the direct
//             part d_h * z (the caller adds d_hidden_side W_hh)
//   template T; grid = (H, B, 1)
//
// One thread's job: hidden unit j of batch row b.
//   d_n = d_h (1 - z)(1 - n^2)           d_z = d_h (h_prev - n) z (1 - z)
//   d_r = d_n h_n r (1 - r)              (h_n: the hidden side of the n gate)
//   d_input_side  = (d_r, d_z, d_n)      d_hidden_side = (d_r, d_z, d_n * r)
//
// Reference: seqlib.reference.gru_backward (NumPy, one step of it); the MLX-ops
// path is seqlib.pointwise.gru_pointwise_backward.
// Napkin math: reads 8BH values, writes 7BH; ~20 FLOPs per unit: memory-bound.

uint j = thread_position_in_grid.x;
uint b = thread_position_in_grid.y;
uint hidden_size = h_prev_shape[1];
uint batch = h_prev_shape[0];
if (j >= hidden_size || b >= batch) {
  return;
}
uint gate_row = b * 3 * hidden_size;
uint unit = b * hidden_size + j;

float r = float(activations[gate_row + j]);
float z = float(activations[gate_row + hidden_size + j]);
float n = float(activations[gate_row + 2 * hidden_size + j]);
float hidden_n = float(hidden_side[gate_row + 2 * hidden_size + j]);
float grad_h = float(d_h[unit]);

float grad_n = grad_h * (1.0f - z) * (1.0f - n * n);
float grad_z = grad_h * (float(h_prev[unit]) - n) * z * (1.0f - z);
float grad_r = grad_n * hidden_n * r * (1.0f - r);

d_input_side[gate_row + j] = T(grad_r);
d_input_side[gate_row + hidden_size + j] = T(grad_z);
d_input_side[gate_row + 2 * hidden_size + j] = T(grad_n);
d_hidden_side[gate_row + j] = T(grad_r);
d_hidden_side[gate_row + hidden_size + j] = T(grad_z);
d_hidden_side[gate_row + 2 * hidden_size + j] = T(grad_n * r);
d_h_prev[unit] = T(grad_h * z);
