// Small kernels whose costs can be counted by hand (test_msl_emulator.py).
#include <metal_stdlib>
using namespace metal;

// Reads n floats and writes n floats: 4n device bytes each way.
kernel void scale_copy(const device float* in [[buffer(0)]], device float* out [[buffer(1)]],
                       constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  if (i < n) out[i] = 2.0f * in[i];
}

// Per threadgroup of 64 threads: 3 barriers, 64 floats of threadgroup memory
// written once and read twice, one exp and one simd_sum per thread.
kernel void staged_exp(const device float* in [[buffer(0)]], device float* out [[buffer(1)]],
                       uint i [[thread_position_in_grid]], uint t [[thread_index_in_threadgroup]]) {
  threadgroup float stage[64];
  stage[t] = in[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float mine = exp(stage[t]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float neighbour = stage[63 - t];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = simd_sum(mine) + neighbour;
}

// One simdgroup: C = A * B for 8x8 half tiles loaded from device memory.
kernel void one_product(const device half* a [[buffer(0)]], const device half* b [[buffer(1)]],
                        device float* c [[buffer(2)]]) {
  simdgroup_half8x8 ma, mb;
  simdgroup_float8x8 mc;
  simdgroup_load(ma, a);
  simdgroup_load(mb, b);
  simdgroup_multiply(mc, ma, mb);
  simdgroup_store(mc, c);
}

// A per-thread array the compiler cannot keep in registers (written and
// read at run-time indices): 64 floats = 256 bytes per thread.
kernel void thread_array(const device float* in [[buffer(0)]], device float* out [[buffer(1)]],
                         constant uint& pick [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float values[64];
  for (uint j = 0; j < 64; ++j) values[(j * pick) % 64] = in[i * 64 + j];
  out[i] = values[(i + pick) % 64];
}

// Per thread: one half4 load (8 bytes) and two scalar half loads (4 bytes):
// 3 device load operations, 12 bytes. The half4 load needs an 8-byte
// aligned address: bound 2 bytes into a buffer, the dispatch fails.
kernel void vector_and_scalar_loads(const device half* in [[buffer(0)]], device float* out [[buffer(1)]],
                                    uint i [[thread_position_in_grid]]) {
  const half4 four = *(const device half4*)(in + 8 * i);
  const half fifth = in[8 * i + 4];
  const half sixth = in[8 * i + 5];
  out[i] = float(four.x) + float(four.y) + float(four.z) + float(four.w) + float(fifth) + float(sixth);
}
