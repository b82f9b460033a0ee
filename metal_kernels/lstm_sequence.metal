// lstm_sequence: all T steps of one LSTM layer-direction in one dispatch
// (version 2 of 2: one SIMD group per hidden unit).
//
// Same interface, outputs and threadgroup memory as lstm_sequence_simple.metal
// (version 1), which explains the persistent-kernel idea; read it first.
//
//   inputs  = ["x_gates", "w_hh", "h0", "c0", "step_offsets", "batch_sizes"]
//   outputs = ["output", "h_n", "c_n", "activations", "tanh_c", "c_prev", "h_prev"]
//   template T, REVERSE (bool)
//   grid    = (threads, B, 1), threadgroup = (threads, 1, 1), threads a multiple of 32
//
// What changes from version 1: a hidden unit j is computed by a whole SIMD
// group of 32 lanes.  Lane l reads W_hh[g*H + j, k] for k = l, l + 32, ...,
// so the 32 lanes read 32 consecutive floats (one coalesced 128-byte load)
// instead of 32 addresses H floats apart; simd_sum then adds the 32 partial
// dot products without touching threadgroup memory.  Lane 0 does the gate math.
// Version 1 also serialises H multiply-adds per thread; here each lane does H/32.
//
// One SIMD group's job: hidden units j = simdgroup, simdgroup + simdgroups, ...
// of sequence b, for every step.
//
// Reference: seqlib.reference.lstm_forward (NumPy, one sequence at a time).
//
// Napkin math, per sequence and step: 8 H^2 FLOPs, 16 H^2 bytes of W_hh read
// (from cache when it fits), 4H + 4H reads of x_gates and writes of 8H saved
// values.  Intensity 0.5 FLOP/byte: bandwidth-bound at any H, so it serves
// small batches (B <= 8) and H <= 1024, like version 1.

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
threadgroup float c_state[1024];

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
  c_state[k] = float(c0[b * hidden_size + k]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

uint current = 0;
for (uint s = 0; s < length; ++s) {
  uint t = REVERSE ? length - 1 - s : s;
  uint row = uint(step_offsets[t]) + b;
  for (uint j = simdgroup; j < hidden_size; j += simdgroups) {
    float pre_i = 0.0f;
    float pre_f = 0.0f;
    float pre_g = 0.0f;
    float pre_o = 0.0f;
    for (uint k = lane; k < hidden_size; k += 32) {
      float h_k = h_state[current][k];
      pre_i += float(w_hh[j * hidden_size + k]) * h_k;
      pre_f += float(w_hh[(hidden_size + j) * hidden_size + k]) * h_k;
      pre_g += float(w_hh[(2 * hidden_size + j) * hidden_size + k]) * h_k;
      pre_o += float(w_hh[(3 * hidden_size + j) * hidden_size + k]) * h_k;
    }
    pre_i = simd_sum(pre_i);
    pre_f = simd_sum(pre_f);
    pre_g = simd_sum(pre_g);
    pre_o = simd_sum(pre_o);
    if (lane == 0) {
      uint gate_row = row * 4 * hidden_size;
      float i = sigmoid_of(float(x_gates[gate_row + j]) + pre_i);
      float f = sigmoid_of(float(x_gates[gate_row + hidden_size + j]) + pre_f);
      float g = tanh_of(float(x_gates[gate_row + 2 * hidden_size + j]) + pre_g);
      float o = sigmoid_of(float(x_gates[gate_row + 3 * hidden_size + j]) + pre_o);
      float c_old = c_state[j];
      float c_new = f * c_old + i * g;
      float tanh_c_new = tanh_of(c_new);
      float h_new = o * tanh_c_new;

      uint unit = row * hidden_size + j;
      h_prev[unit] = T(h_state[current][j]);
      c_prev[unit] = T(c_old);
      output[unit] = T(h_new);
      tanh_c[unit] = T(tanh_c_new);
      activations[gate_row + j] = T(i);
      activations[gate_row + hidden_size + j] = T(f);
      activations[gate_row + 2 * hidden_size + j] = T(g);
      activations[gate_row + 3 * hidden_size + j] = T(o);
      h_state[1 - current][j] = h_new;
      c_state[j] = c_new;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  current = 1 - current;
}
for (uint k = thread_index; k < hidden_size; k += threads) {
  h_n[b * hidden_size + k] = T(h_state[current][k]);
  c_n[b * hidden_size + k] = T(c_state[k]);
}
