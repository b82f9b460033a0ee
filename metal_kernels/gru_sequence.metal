// gru_sequence: all T steps of one GRU layer-direction in one dispatch.
//
// The GRU counterpart of lstm_sequence.metal (version 2: one SIMD group per
// hidden unit, coalesced reads of W_hh, simd_sum); read lstm_sequence_simple.metal
// for the persistent-kernel idea.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["x_gates", "w_hh", "b_hh", "h0", "step_offsets", "batch_sizes"]
//             x_gates (N, 3H) = x W_ih^T + b_ih (gate order r, z, n); w_hh (3H, H);
//             b_hh (3H,): kept apart because r multiplies W_hn h + b_hn (torch);
//             h0 (B, H); step_offsets, batch_sizes (T,) int32 as in lstm_sequence
//   outputs = ["output", "h_n", "activations", "hidden_side", "h_prev"]
//             output, h_prev (N, H); activations (N, 3H): r, z, n;
//             hidden_side (N, 3H) = h_prev W_hh^T + b_hh (the backward needs its n block);
//             h_n (B, H)
//   template T, REVERSE (bool)
//   grid    = (threads, B, 1), threadgroup = (threads, 1, 1), threads a multiple of 32
//
// One SIMD group's job: hidden units j = simdgroup, simdgroup + simdgroups, ...
// of sequence b, for every step:
//   r = sigmoid(x_r + h_r), z = sigmoid(x_z + h_z), n = tanh(x_n + r h_n),
//   h = n + z (h_prev - n)
// Threadgroup memory: h double-buffered, 2 x 1024 floats = 8 KB: H <= 1024.
// Reference: seqlib.reference.gru_forward (NumPy, one sequence at a time).
// Napkin math per sequence and step: 6 H^2 FLOPs for 12 H^2 bytes of W_hh:
// 0.5 FLOP/byte, so, as for the LSTM, a kernel for small batches (B <= 8).

uint b = threadgroup_position_in_grid.y;
uint thread_index = thread_index_in_threadgroup;
uint threads = threads_per_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint simdgroup = simdgroup_index_in_threadgroup;
uint simdgroups = threads / 32;
uint hidden_size = h0_shape[1];
uint batch = h0_shape[0];
uint num_steps = batch_sizes_shape[0];

threadgroup float h_state[2][1024];

if (b >= batch) {
  return;
}
uint length = 0;
for (uint t = 0; t < num_steps; ++t) {
  if (uint(batch_sizes[t]) > b) {
    length += 1;
  }
}
for (uint k = thread_index; k < hidden_size; k += threads) {
  h_state[0][k] = float(h0[b * hidden_size + k]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

uint current = 0;
for (uint s = 0; s < length; ++s) {
  uint t = REVERSE ? length - 1 - s : s;
  uint row = uint(step_offsets[t]) + b;
  for (uint j = simdgroup; j < hidden_size; j += simdgroups) {
    float dot_r = 0.0f;
    float dot_z = 0.0f;
    float dot_n = 0.0f;
    for (uint k = lane; k < hidden_size; k += 32) {
      float h_k = h_state[current][k];
      dot_r += float(w_hh[j * hidden_size + k]) * h_k;
      dot_z += float(w_hh[(hidden_size + j) * hidden_size + k]) * h_k;
      dot_n += float(w_hh[(2 * hidden_size + j) * hidden_size + k]) * h_k;
    }
    dot_r = simd_sum(dot_r);
    dot_z = simd_sum(dot_z);
    dot_n = simd_sum(dot_n);
    if (lane == 0) {
      uint gate_row = row * 3 * hidden_size;
      float hidden_r = dot_r + float(b_hh[j]);
      float hidden_z = dot_z + float(b_hh[hidden_size + j]);
      float hidden_n = dot_n + float(b_hh[2 * hidden_size + j]);
      float r = sigmoid_of(float(x_gates[gate_row + j]) + hidden_r);
      float z = sigmoid_of(float(x_gates[gate_row + hidden_size + j]) + hidden_z);
      float n = tanh_of(float(x_gates[gate_row + 2 * hidden_size + j]) + r * hidden_n);
      float previous = h_state[current][j];
      float h_new = n + z * (previous - n);

      uint unit = row * hidden_size + j;
      h_prev[unit] = T(previous);
      output[unit] = T(h_new);
      activations[gate_row + j] = T(r);
      activations[gate_row + hidden_size + j] = T(z);
      activations[gate_row + 2 * hidden_size + j] = T(n);
      hidden_side[gate_row + j] = T(hidden_r);
      hidden_side[gate_row + hidden_size + j] = T(hidden_z);
      hidden_side[gate_row + 2 * hidden_size + j] = T(hidden_n);
      h_state[1 - current][j] = h_new;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  current = 1 - current;
}
for (uint k = thread_index; k < hidden_size; k += threads) {
  h_n[b * hidden_size + k] = T(h_state[current][k]);
}
