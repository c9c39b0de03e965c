// simdgroup_matrix: a tiled GEMM staged through threadgroup memory, a
// transposed-load variant from device memory, and per-lane thread_elements.
#include <metal_stdlib>
using namespace metal;

struct GemmParams {
  uint m, n, k;  // C[m, n] = A[m, k] * B[k, n], all multiples of 8
};

// One threadgroup of 2 simdgroups per 8 x 16 block of C; A and B tiles of
// 8 columns of K are staged (converted to float) in threadgroup memory by
// all 64 threads.
template <typename T>
[[kernel]] void gemm_tg(
    const device T* a [[buffer(0)]],
    const device T* b [[buffer(1)]],
    device float* c [[buffer(2)]],
    constant GemmParams& p [[buffer(3)]],
    uint2 block [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float a_tile[8 * 8];
  threadgroup float b_tile[8 * 16];
  threadgroup float c_tile[8 * 16];
  const uint row0 = block.y * 8, col0 = block.x * 16;
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k0 = 0; k0 < p.k; k0 += 8) {
    a_tile[tid] = float(a[(row0 + tid / 8) * p.k + k0 + tid % 8]);
    for (uint e = tid; e < 128; e += 64) b_tile[e] = float(b[(k0 + e / 16) * p.n + col0 + e % 16]);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // TILES STAGED
    simdgroup_float8x8 ta, tb;
    simdgroup_load(ta, a_tile, 8);
    simdgroup_load(tb, b_tile, 16, ulong2(sg * 8, 0));
    simdgroup_multiply_accumulate(acc, ta, tb, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // TILES READ
  }
  simdgroup_store(acc, c_tile, 16, ulong2(sg * 8, 0));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < 128; e += 64) c[(row0 + e / 16) * p.n + col0 + e % 16] = c_tile[e];
}

template [[host_name("gemm_tg_float")]] [[kernel]] decltype(gemm_tg<float>) gemm_tg<float>;
template [[host_name("gemm_tg_half")]] [[kernel]] decltype(gemm_tg<half>) gemm_tg<half>;

// C = A * B^T, B stored [n, k]: transposed loads straight from device memory.
[[kernel]] void gemm_bt(
    const device float* a [[buffer(0)]],
    const device float* b [[buffer(1)]],
    device float* c [[buffer(2)]],
    constant GemmParams& p [[buffer(3)]],
    uint2 block [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 acc(0.0f);  // the diagonal constructor with zero: a zero matrix
  for (uint k0 = 0; k0 < p.k; k0 += 8) {
    simdgroup_float8x8 ta, tb;
    simdgroup_load(ta, a + block.y * 8 * p.k + k0, p.k);
    simdgroup_load(tb, b + block.x * 8 * p.k + k0, p.k, ulong2(0, 0), true);
    simdgroup_multiply_accumulate(acc, ta, tb, acc);
  }
  simdgroup_store(acc, c + block.y * 8 * p.n + block.x * 8, p.n);
}

// out = 2 * (lane-owned elements + lane) as a matrix, then times a diagonal 3:
// exercises the per-lane layout of thread_elements().
[[kernel]] void lane_elements(
    device float* layout [[buffer(0)]],
    device float* product [[buffer(1)]],
    uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  m.thread_elements()[0] = float(lane * 2);
  m.thread_elements()[1] = float(lane * 2 + 1);
  simdgroup_store(m, layout, 8);
  simdgroup_float8x8 result;
  simdgroup_multiply(result, m, simdgroup_float8x8(3.0f));
  simdgroup_store(result, product, 8);
}
