// SIMD-group functions, one output column per function, compared with NumPy.
#include <metal_stdlib>
using namespace metal;

constant int SIMD_OUTPUTS = 16;

[[kernel]] void simd_float_ops(
    const device float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]]) {
  const uint active = min(32u, threads - simdgroup * 32);  // lanes in this (maybe partial) simdgroup
  const float v = x[gid];
  device float* o = out + gid * SIMD_OUTPUTS;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_prefix_inclusive_sum(v);
  o[4] = simd_prefix_exclusive_sum(v);
  o[5] = simd_shuffle(v, ushort((lane * 7 + 3) % active));
  o[6] = simd_shuffle_xor(v, ushort(active == 32 ? 5 : 1));
  o[7] = simd_shuffle_down(v, ushort(3));
  o[8] = simd_shuffle_up(v, ushort(3));
  o[9] = simd_shuffle_rotate_down(v, ushort(5));
  o[10] = simd_shuffle_rotate_up(v, ushort(5));
  o[11] = simd_broadcast(v, ushort(7));
  o[12] = simd_broadcast_first(v);
  o[13] = simd_all(v > -3.0f) ? 1.0f : 0.0f;
  o[14] = simd_any(v > 2.0f) ? 1.0f : 0.0f;
  o[15] = simd_product(1.0f + v * 0.01f);
}

// Bitwise reductions and vector-valued shuffles.
[[kernel]] void simd_int_ops(
    const device uint* x [[buffer(0)]],
    device uint4* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]]) {
  const uint v = x[gid];
  const uint2 pair = uint2(v, v + 1);
  const uint2 swapped = simd_shuffle_xor(pair, ushort(1));
  out[gid] = uint4(simd_and(v), simd_or(v), simd_xor(v), swapped.y);
}
