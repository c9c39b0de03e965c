// Portable description of how the fused Metal kernels are launched for a
// problem: kernel names, grids, threadgroup sizes, the parameter struct and
// the buffer binding order. The Mac host (csrc/metal/) only translates a plan
// into encoder calls; the MSL emulator tests launch from the same plan.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/attention_problem.h"

namespace mlx_attn {

struct KernelDispatch {
  std::string kernel;                  // host name in mlx_attn.metallib
  std::array<int, 3> grid{};           // threadgroups
  std::array<int, 3> threadgroup{};    // threads per threadgroup
  std::vector<std::string> buffers;    // binding order: q k v out params mask sinks
  int threadgroup_memory_bytes = 0;
};

// A float32 buffer the host allocates for the duration of the call.
struct ScratchBuffer {
  std::string name;
  int64_t elements = 0;
};

struct LaunchPlan {
  bool supported = false;
  std::string reason;  // why not, when unsupported
  AttentionParams params{};
  int32_t splits = 1;  // decode: threadgroups along the key/value length ("splits" buffer)
  std::vector<ScratchBuffer> scratch;
  std::vector<KernelDispatch> dispatches;
};

// The decode kernels serve at most this many query positions and rows
// (query heads of a GQA group x positions).
inline constexpr int kDecodeMaxQueries = 8;
inline constexpr int kDecodeMaxRows = 32;

// Keys per staged block of the prefill kernel for a head dim (0: unsupported).
int prefill_key_block(int head_dim);
// Keys per staged block of the decode kernel (0: head dim not a multiple of 32).
int decode_key_block(int head_dim);

LaunchPlan plan_attention(const AttentionProblem& problem);

}  // namespace mlx_attn
