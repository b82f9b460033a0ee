// lstm_cell_backward: gradients through one step of lstm_cell.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["d_h", "d_c", "activations", "tanh_c", "c_prev"]
//             d_h, d_c (B, H): gradients arriving at this step's h and c;
//             activations (B, 4H), tanh_c (B, H): saved by lstm_cell; c_prev (B, H)
//   outputs = ["d_gates", "d_c_prev"]   d_gates (B, 4H) w.r.t. the pre-activations,
//                                       d_c_prev (B, H): the part that flows through f
//   template T; grid = (H, B, 1)
//
// One thread's job: hidden unit j of batch row b.
//   dc      = d_c + d_h * o * (1 - tanh(c)^2)
//   d_i     = dc * g * i (1 - i)          d_f = dc * c_prev * f (1 - f)
//   d_g     = dc * i * (1 - g^2)          d_o = d_h * tanh(c) * o (1 - o)
//   d_c_prev = dc * f
// (the same formulas as seqlib.reference.lstm_backward, one step of it, and
// the MLX-ops path seqlib.pointwise.lstm_pointwise_backward).
//
// Napkin math: reads 8BH values, writes 5BH; ~25 FLOPs per unit: memory-bound.

uint j = thread_position_in_grid.x;
uint b = thread_position_in_grid.y;
uint hidden_size = c_prev_shape[1];
uint batch = c_prev_shape[0];
if (j >= hidden_size || b >= batch) {
  return;
}
uint gate_row = b * 4 * hidden_size;
uint unit = b * hidden_size + j;

float i = float(activations[gate_row + j]);
float f = float(activations[gate_row + hidden_size + j]);
float g = float(activations[gate_row + 2 * hidden_size + j]);
float o = float(activations[gate_row + 3 * hidden_size + j]);
float tanh_c_value = float(tanh_c[unit]);
float grad_h = float(d_h[unit]);

float grad_c = float(d_c[unit]) + grad_h * o * (1.0f - tanh_c_value * tanh_c_value);
d_gates[gate_row + j] = T(grad_c * g * i * (1.0f - i));
d_gates[gate_row + hidden_size + j] = T(grad_c * float(c_prev[unit]) * f * (1.0f - f));
d_gates[gate_row + 2 * hidden_size + j] = T(grad_c * i * (1.0f - g * g));
d_gates[gate_row + 3 * hidden_size + j] = T(grad_h * tanh_c_value * o * (1.0f - o));
d_c_prev[unit] = T(grad_c * f);
