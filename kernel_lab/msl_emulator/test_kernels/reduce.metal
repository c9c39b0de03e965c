// Self-test kernels for the emulator: a threadgroup-tiled row sum, simd
// collectives and a simdgroup_matrix product.
#include <metal_stdlib>
using namespace metal;

struct RowParams {
  uint columns;
  float scale;
};

// out[row] = scale * sum(in[row, :]); one threadgroup per row.
template <typename T, int THREADS>
[[kernel]] void row_sum(
    const device T* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant RowParams& params [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup float partial[THREADS / 32];
  float acc = 0.0f;
  for (uint c = tid; c < params.columns; c += THREADS) {
    acc += float(in[row * params.columns + c]);
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    partial[simd] = acc;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // BARRIER
  if (tid == 0) {
    float total = 0.0f;
    for (int s = 0; s < THREADS / 32; ++s) total += partial[s];
    out[row] = total * params.scale;
  }
}

template [[host_name("row_sum_float")]] [[kernel]] decltype(row_sum<float, 128>) row_sum<float, 128>;
template [[host_name("row_sum_half")]] [[kernel]] decltype(row_sum<half, 64>) row_sum<half, 64>;

// out[i] = (prefix sum, shuffle_xor 1, max, broadcast of lane 3) of x per simdgroup
[[kernel]] void simd_ops(
    const device float* x [[buffer(0)]],
    device float4* out [[buffer(1)]],
    uint gid [[thread_position_in_grid]]) {
  float v = x[gid];
  out[gid] = float4(simd_prefix_inclusive_sum(v), simd_shuffle_xor(v, 1), simd_max(v), simd_broadcast(v, 3));
}

// C = A * B for 8x8 tiles: one simdgroup per 8x8 block of C.
[[kernel]] void tile_matmul(
    const device float* a [[buffer(0)]],
    const device float* b [[buffer(1)]],
    device float* c [[buffer(2)]],
    constant uint& n [[buffer(3)]],
    uint2 tile [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k = 0; k < n; k += 8) {
    simdgroup_float8x8 ta, tb;
    simdgroup_load(ta, a, n, ulong2(k, tile.y * 8));
    simdgroup_load(tb, b, n, ulong2(tile.x * 8, k));
    simdgroup_multiply_accumulate(acc, ta, tb, acc);
  }
  simdgroup_store(acc, c, n, ulong2(tile.x * 8, tile.y * 8));
}
