// Kernels with deliberate faults; the tests expect each to be reported.
#include <metal_stdlib>
using namespace metal;

struct Count {
  uint n;
};

// Reads in[gid + p.n]: past the end of `in` when p.n > 0.
[[kernel]] void read_past_end(
    const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant Count& p [[buffer(2)]],
    uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid + p.n];
}

// Writes threadgroup memory out of bounds when p.n > 0.
[[kernel]] void threadgroup_overrun(
    device float* out [[buffer(0)]],
    constant Count& p [[buffer(1)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[tid + p.n] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[tid];
}

// Casts const away and writes an input buffer.
[[kernel]] void write_const_input(
    const device float* in [[buffer(0)]],
    uint gid [[thread_position_in_grid]]) {
  ((device float*)in)[gid] = 1.0f;
}

// Never returns for p.n > 0.
[[kernel]] void endless(
    device uint* out [[buffer(0)]],
    constant Count& p [[buffer(1)]],
    uint gid [[thread_position_in_grid]]) {
  uint i = 0;
  while (i < p.n) {
    out[gid] = i;
    i = (i + 1) % p.n;
  }
}

// 40 KB of threadgroup memory: more than Metal allows.
[[kernel]] void too_much_threadgroup_memory(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[10 * 1024];
  big[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[tid];
}

// Integer division by p.n.
[[kernel]] void integer_divide(
    device uint* out [[buffer(0)]],
    constant Count& p [[buffer(1)]],
    uint gid [[thread_position_in_grid]]) {
  out[gid] = 100u / p.n;
}

// [[threadgroup(0)]] memory sized by the dispatch; a non-uniform grid.
[[kernel]] void threadgroup_argument(
    device float* out [[buffer(0)]],
    threadgroup float* scratch [[threadgroup(0)]],
    uint gid [[thread_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint size [[threads_per_threadgroup]],
    uint grid [[threads_per_grid]]) {
  scratch[tid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid < grid) out[gid] = scratch[size - 1 - tid] + 1000.0f * float(size);
}
