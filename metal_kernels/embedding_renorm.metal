// embedding_renorm: the max_norm rescaling factor of each looked-up row.
//
// Body for mx.fast.metal_kernel with
//   inputs  = ["weight", "rows", "max_norm", "norm_type"]
//             weight (V, D); rows (U,) int32: the distinct rows a batch looks up;
//             max_norm, norm_type: float scalars (norm_type read only when NORM == NORM_P)
//   outputs = ["scale"]      (U,) float32: max_norm / (norm + 1e-7) where norm > max_norm, else 1
//   template T, NORM (int): NORM_L1 and NORM_L2 for those p-norms, NORM_MAX for p = inf,
//            NORM_P for any other p (uses pow); constants in seqlib_math.h
//   grid    = (threads, U, 1), threadgroup = (threads, 1, 1), threads a multiple of 32
//
// One threadgroup's job: one row.  Its threads stride over the D columns and
// accumulate |w|, |w|^2, max |w| or |w|^p; simd_sum (or simd_max) combines the
// 32 lanes of each SIMD group; lane 0 of each group leaves its partial in
// threadgroup memory; after a barrier, thread 0 combines the partials and
// writes the factor.  seqlib then multiplies the rows by it (torch's
// embedding_renorm_, which does this in place under no_grad).
//
// Reference: seqlib.reference.embedding_renorm (the MLX-ops path:
// seqlib.functional.embedding_renorm).
// Napkin math: reads U*D values, ~2 FLOPs each
// (pow: ~20): memory-bound.

uint u = threadgroup_position_in_grid.y;
uint thread_index = thread_index_in_threadgroup;
uint threads = threads_per_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint simdgroup = simdgroup_index_in_threadgroup;
uint embedding_dim = weight_shape[1];
uint num_rows = rows_shape[0];

threadgroup float partial[32];               // one value per SIMD group (at most 1024 / 32)

if (u >= num_rows) {
  return;                                    // the whole group leaves together
}
uint row = uint(rows[u]);
float total = 0.0f;
for (uint d = thread_index; d < embedding_dim; d += threads) {
  float magnitude = metal::abs(float(weight[row * embedding_dim + d]));
  if (NORM == NORM_MAX) {
    total = metal::max(total, magnitude);
  } else if (NORM == NORM_L1) {
    total += magnitude;
  } else if (NORM == NORM_L2) {
    total += magnitude * magnitude;
  } else {
    total += metal::pow(magnitude, norm_type);
  }
}
total = NORM == NORM_MAX ? simd_max(total) : simd_sum(total);
if (lane == 0) {
  partial[simdgroup] = total;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (thread_index == 0) {
  float combined = 0.0f;
  for (uint group = 0; group < (threads + 31) / 32; ++group) {
    combined = NORM == NORM_MAX ? metal::max(combined, partial[group]) : combined + partial[group];
  }
  float norm = combined;
  if (NORM == NORM_L2) {
    norm = metal::sqrt(combined);
  } else if (NORM == NORM_P) {
    norm = metal::pow(combined, 1.0f / norm_type);
  }
  scale[u] = norm > max_norm ? max_norm / (norm + 1e-7f) : 1.0f;
}
