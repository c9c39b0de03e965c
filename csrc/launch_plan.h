// Portable description of how the fused Metal kernels are launched for a
// problem: kernel names, grids, threadgroup sizes, the parameter struct and
// every buffer binding (its role, access and where its memory comes from,
// placeholders and scratch producers/consumers included). The plan decides
// everything; the Mac host (csrc/metal/) only encodes it, and the MSL
// emulator tests (tests/metal_runner.py) launch the identical plan.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/attention_problem.h"

namespace mlx_attn {

// What a kernel parameter is.
enum class BufferRole : int32_t {
  q, k, v, mask, sinks, out, lse, params, splits, partial_out, partial_stats,
  // the backward's (csrc/backward_launch_plan.h)
  d_out, d_lse, dq, dk, dv, d_sinks, delta,
};
enum class Access : int32_t { read, write };
// Where the bound memory comes from.
enum class Source : int32_t {
  input,    // the primitive's inputs[source_index] (q, k, v, then mask, sinks)
  output,   // the primitive's outputs[source_index]
  scratch,  // LaunchPlan::scratch[source_index], allocated for the call
  params,   // LaunchPlan::params, as bytes
  splits,   // LaunchPlan::splits (int32), as bytes
};

struct Binding {
  int index = 0;  // [[buffer(index)]]
  BufferRole role = BufferRole::q;
  Access access = Access::read;
  Source source = Source::input;
  int source_index = 0;
};

struct KernelDispatch {
  std::string kernel;                  // host name in mlx_attn.metallib
  std::array<int, 3> grid{};           // threadgroups
  std::array<int, 3> threadgroup{};    // threads per threadgroup
  std::vector<Binding> bindings;
  int threadgroup_memory_bytes = 0;
};

// A float32 buffer allocated for the duration of the call: written by
// dispatches[producer], read by dispatches[consumer].
struct ScratchBuffer {
  BufferRole role = BufferRole::partial_out;
  int64_t elements = 0;
  int producer = 0;
  int consumer = 0;
};

struct LaunchPlan {
  bool supported = false;
  std::string reason;  // why not, when unsupported
  AttentionParams params{};
  int32_t splits = 1;  // decode: threadgroups along the key/value length
  std::vector<ScratchBuffer> scratch;
  std::vector<KernelDispatch> dispatches;
};

const char* role_name(BufferRole role);
const char* source_name(Source source);

// The decode kernels serve at most this many query positions and rows
// (query heads of a GQA group x positions).
inline constexpr int kDecodeMaxQueries = 8;
inline constexpr int kDecodeMaxRows = 32;

// Keys per staged block of the prefill kernel for a head dim (0: unsupported).
int prefill_key_block(int head_dim);
// Rows (query heads x positions) one decode threadgroup serves for a head dim
// (its register budget, metal/attention_params.h); 0: D not a multiple of 32.
int decode_rows_per_threadgroup(int head_dim);
// Threadgroups along the key/value length for a decode problem: enough to
// fill the GPU, while each split keeps enough keys that its partial's traffic
// stays small next to its K/V (docs/metal_kernels.md).
int decode_splits(int batch, int kv_heads, int rows, int kv_len, int head_dim);

LaunchPlan plan_attention(const AttentionProblem& problem);

}  // namespace mlx_attn
