// Row softmax tiled through threadgroup memory: one threadgroup per row,
// each thread a strided slice of the columns; simd_max / simd_sum within
// simdgroups, then across simdgroups through threadgroup memory.
#include <metal_stdlib>
#include "emulator_test/softmax_params.h"
using namespace metal;

#ifndef SOFTMAX_EXP
#define SOFTMAX_EXP exp
#endif

template <typename T, int THREADS>
[[kernel]] void softmax_rows(
    const device T* in [[buffer(0)]],
    device T* out [[buffer(1)]],
    constant SoftmaxParams& p [[buffer(2)]],
    uint3 group [[threadgroup_position_in_grid]],
    ushort tid [[thread_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]],
    ushort simd [[simdgroup_index_in_threadgroup]]) {
  constexpr int SIMDGROUPS = THREADS / 32;
  threadgroup float row_tile[1024];
  threadgroup float partial[SIMDGROUPS];
  const uint row = group.x;
  const uint n = p.columns;

  // stage the row in threadgroup memory, scaled, in float
  for (uint c = tid; c < n; c += THREADS) {
    row_tile[c] = static_cast<float>(in[row * n + c]) * p.scale;
  }
  // no barrier: each thread reads back only the columns it staged itself

  float local_max = -numeric_limits<float>::infinity();
  for (uint c = tid; c < n; c += THREADS) {
    local_max = max(local_max, row_tile[c]);
  }
  local_max = simd_max(local_max);
  if (lane == 0) {
    partial[simd] = local_max;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // MAX WRITTEN
  float row_max = partial[0];
  for (int s = 1; s < SIMDGROUPS; ++s) row_max = max(row_max, partial[s]);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // MAX READ

  float local_sum = 0.0f;
  for (uint c = tid; c < n; c += THREADS) {
    const float e = SOFTMAX_EXP(row_tile[c] - row_max);
    row_tile[c] = e;
    local_sum += e;
  }
  local_sum = simd_sum(local_sum);
  if (lane == 0) {
    partial[simd] = local_sum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // SUM WRITTEN
  float row_sum = 0.0f;
  for (int s = 0; s < SIMDGROUPS; ++s) row_sum += partial[s];

  for (uint c = tid; c < n; c += THREADS) {
    out[row * n + c] = static_cast<T>(row_tile[c] / row_sum);
  }
}

#define INSTANTIATE_SOFTMAX(tname, type, threads) \
  template [[host_name("softmax_" #tname "_" #threads)]] [[kernel]] \
  decltype(softmax_rows<type, threads>) softmax_rows<type, threads>;

INSTANTIATE_SOFTMAX(float32, float, 128)
INSTANTIATE_SOFTMAX(float16, half, 64)
INSTANTIATE_SOFTMAX(bfloat16, bfloat, 96)
