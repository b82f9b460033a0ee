// lstm_cell: the LSTM's gate math for one time step, fused into one kernel.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["gates", "c_prev"]   gates (B, 4H) pre-activations in the order i, f, g, o
//                                   (x W_ih^T + b_ih + h W_hh^T + b_hh), c_prev (B, H)
//   outputs = ["h", "c", "activations", "tanh_c"]
//             h, c, tanh_c (B, H); activations (B, 4H): sigmoid(i), sigmoid(f), tanh(g),
//             sigmoid(o), saved with tanh_c for lstm_cell_backward
//   template T: the storage dtype (float, float16_t, bfloat16_t); math in float32
//   grid    = (H, B, 1)
//
// One thread's job: hidden unit j of batch row b.
//   c = f * c_prev + i * g,   h = o * tanh(c)
//
// Reference: seqlib.reference.lstm_cell (NumPy); the MLX-ops path is
// seqlib.pointwise.lstm_pointwise.  This is the "fused pointwise" stage: the
// ops path launches ~10 elementwise kernels per step, this one launches one.
//
// Napkin math per step: reads 5BH values, writes 7BH (48 bytes per unit in
// float32); ~30 FLOPs and 5 transcendentals per unit, so ~0.6 FLOP/byte:
// memory-bound, and tiny next to the recurrent matmul h W_hh^T (8BH^2 FLOPs).

uint j = thread_position_in_grid.x;          // hidden unit
uint b = thread_position_in_grid.y;          // batch row
uint hidden_size = c_prev_shape[1];
uint batch = c_prev_shape[0];
if (j >= hidden_size || b >= batch) {
  return;                                    // thread outside the arrays
}
uint gate_row = b * 4 * hidden_size;         // start of row b of gates
uint unit = b * hidden_size + j;             // element (b, j) of a (B, H) array

float i = sigmoid_of(float(gates[gate_row + j]));
float f = sigmoid_of(float(gates[gate_row + hidden_size + j]));
float g = tanh_of(float(gates[gate_row + 2 * hidden_size + j]));
float o = sigmoid_of(float(gates[gate_row + 3 * hidden_size + j]));

float c_new = f * float(c_prev[unit]) + i * g;
float tanh_c_new = tanh_of(c_new);

c[unit] = T(c_new);
tanh_c[unit] = T(tanh_c_new);
h[unit] = T(o * tanh_c_new);
activations[gate_row + j] = T(i);
activations[gate_row + hidden_size + j] = T(f);
activations[gate_row + 2 * hidden_size + j] = T(g);
activations[gate_row + 3 * hidden_size + j] = T(o);
