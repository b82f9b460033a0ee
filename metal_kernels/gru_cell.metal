// gru_cell: the GRU's gate math for one time step, with PyTorch's placement of r.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["input_side", "hidden_side", "h_prev"]
//             input_side (B, 3H) = x W_ih^T + b_ih, hidden_side (B, 3H) = h W_hh^T + b_hh,
//             both in the gate order r, z, n; h_prev (B, H)
//   outputs = ["h", "activations"]   h (B, H); activations (B, 3H): r, z, n, saved for the backward
//   template T; grid = (H, B, 1)
//
// One thread's job: hidden unit j of batch row b.
//   r = sigmoid(i_r + h_r)      z = sigmoid(i_z + h_z)
//   n = tanh(i_n + r * h_n)     (h_n includes b_hn: r scales W_hn h + b_hn, as torch)
//   h = (1 - z) * n + z * h_prev, computed as n + z * (h_prev - n) like torch
//
// Reference: seqlib.reference.gru_cell (NumPy); the MLX-ops path is
// seqlib.pointwise.gru_pointwise.
// Napkin math: reads 7BH values, writes 4BH; ~20 FLOPs per unit: memory-bound.

uint j = thread_position_in_grid.x;
uint b = thread_position_in_grid.y;
uint hidden_size = h_prev_shape[1];
uint batch = h_prev_shape[0];
if (j >= hidden_size || b >= batch) {
  return;
}
uint gate_row = b * 3 * hidden_size;
uint unit = b * hidden_size + j;

float r = sigmoid_of(float(input_side[gate_row + j]) + float(hidden_side[gate_row + j]));
float z = sigmoid_of(float(input_side[gate_row + hidden_size + j]) +
                     float(hidden_side[gate_row + hidden_size + j]));
float n = tanh_of(float(input_side[gate_row + 2 * hidden_size + j]) +
                  r * float(hidden_side[gate_row + 2 * hidden_size + j]));
float previous = float(h_prev[unit]);

h[unit] = T(n + z * (previous - n));
activations[gate_row + j] = T(r);
activations[gate_row + hidden_size + j] = T(z);
activations[gate_row + 2 * hidden_size + j] = T(n);
