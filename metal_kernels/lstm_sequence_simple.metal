// lstm_sequence_simple: all T steps of one LSTM layer-direction in one dispatch
// (version 1 of 2: one thread per hidden unit).  See lstm_sequence.metal for version 2.
//
// Body for mx.fast.metal_kernel with header seqlib_math.h and
//   inputs  = ["x_gates", "w_hh", "h0", "c0", "step_offsets", "batch_sizes"]
//             x_gates (N, 4H) = x W_ih^T + b_ih + b_hh for every packed row (one matmul,
//             done before the launch); w_hh (4H, H); h0, c0 (B, H);
//             step_offsets (T,), batch_sizes (T,) int32: step t owns rows
//             step_offsets[t] .. step_offsets[t] + batch_sizes[t] (a PackedSequence)
//   outputs = ["output", "h_n", "c_n", "activations", "tanh_c", "c_prev", "h_prev"]
//             output, tanh_c, c_prev, h_prev (N, H); activations (N, 4H); h_n, c_n (B, H).
//             Everything but output/h_n/c_n is saved for the backward pass, which runs
//             step by step with lstm_cell_backward.
//   template T (storage dtype), REVERSE (bool): walk each sequence from its end
//   grid    = (threads, B, 1), threadgroup = (threads, 1, 1): one threadgroup per sequence
//
// The idea (persistent RNNs, Diamos et al. 2016): instead of one matmul and one
// pointwise launch per step, one threadgroup keeps its sequence's state on chip
// and loops over time itself.  Sequences are independent, so no grid-wide
// barrier is needed (Metal has none); the threads of a group synchronise with
// threadgroup_barrier once per step.
//
// One thread's job: hidden units j = thread, thread + threads, ... of sequence b.
// For each step it computes the four dot products W_hh[g*H + j, :] . h_prev
// serially, then the gate math, and writes h_j into the *other* half of a
// double-buffered h (so nobody overwrites h_prev while others still read it).
//
// Threadgroup memory: h as 2 x 1024 floats plus c as 1024 floats = 12 KB of the
// 32 KB, so it serves H <= 1024 (seqlib checks).  W_hh stays in device memory
// and is read once per step by every group: 16 H^2 bytes per sequence per step
// for 8 H^2 FLOPs, an arithmetic intensity of 0.5 FLOP/byte.  That is why this
// kernel is for small batches (seqlib uses it for B <= 8): W_hh (1 MB at H=256)
// stays in the GPU's cache, and the launch and synchronisation cost of 2T
// dispatches disappears.  For large B one matmul per step (intensity ~B/2) wins.
//
// Reference: seqlib.reference.lstm_forward (NumPy, one sequence at a time).
//
// Version 1's weakness: at inner-loop step k, thread j reads W_hh[j*H + k], so
// neighbouring threads read addresses H floats apart (uncoalesced).

uint b = threadgroup_position_in_grid.y;     // the sequence this group runs
uint thread_index = thread_index_in_threadgroup;
uint threads = threads_per_threadgroup.x;
uint hidden_size = h0_shape[1];
uint batch = h0_shape[0];
uint num_steps = batch_sizes_shape[0];

threadgroup float h_state[2][1024];          // h_prev and h_next, swapped every step
threadgroup float c_state[1024];

if (b >= batch) {
  return;                                    // the whole group leaves together
}
uint length = 0;                             // steps in which sequence b is present
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

uint current = 0;                            // which half of h_state holds h_prev
for (uint s = 0; s < length; ++s) {
  uint t = REVERSE ? length - 1 - s : s;
  uint row = uint(step_offsets[t]) + b;      // this sequence's packed row at step t
  for (uint j = thread_index; j < hidden_size; j += threads) {
    float pre_i = 0.0f;
    float pre_f = 0.0f;
    float pre_g = 0.0f;
    float pre_o = 0.0f;
    for (uint k = 0; k < hidden_size; ++k) {
      float h_k = h_state[current][k];
      pre_i += float(w_hh[j * hidden_size + k]) * h_k;
      pre_f += float(w_hh[(hidden_size + j) * hidden_size + k]) * h_k;
      pre_g += float(w_hh[(2 * hidden_size + j) * hidden_size + k]) * h_k;
      pre_o += float(w_hh[(3 * hidden_size + j) * hidden_size + k]) * h_k;
    }
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
    c_state[j] = c_new;                      // unit j belongs to this thread alone
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  current = 1 - current;
}
for (uint k = thread_index; k < hidden_size; k += threads) {
  h_n[b * hidden_size + k] = T(h_state[current][k]);
  c_n[b * hidden_size + k] = T(c_state[k]);
}
