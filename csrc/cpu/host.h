// The host side of the fused CPU kernel: its support rule, work split,
// scratch size, and the choice of instruction set.
#pragma once

#include <string>

#include "csrc/cpu/kernels.h"

namespace mlx_attn::cpu {

// Empty when the CPU kernel handles the problem, else why not. The one home
// of the CPU support rule (Python asks it through _ext).
std::string unsupported_reason(const AttentionProblem& problem);

// Sets call.query_block: as many query rows per work item as fit kMaxRows,
// fewer when that would leave threads idle.
void plan_work(KernelCall& call);
// Scratch floats run_attention needs (tile buffers for every pool thread).
int64_t scratch_size(const KernelCall& call);
// Runs the whole problem on the calling thread plus the kernel's worker pool;
// `scratch` holds scratch_size(call) floats.
void run_attention(const KernelCall& call, float* scratch);
// Runs several calls' work items as one pool run, in call order (no barrier
// between them: a thread done with one call's items takes the next call's);
// `scratch` holds the largest scratch_size of the calls.
void run_attention_calls(const KernelCall* calls, int count, float* scratch);

// The instruction set in use ("generic", "avx2", "avx512", "neon") and the ones this
// CPU and build support; set_isa overrides the choice (tests use it).
const char* current_isa();
void set_isa(const char* name);  // throws std::invalid_argument if unsupported
const char* const* supported_isas(int* count);
// The backward copy that serves the forward copy in use (copies.h).
struct BackwardCopy;
const BackwardCopy& active_backward_copy();
// Its name ("avx512amx_backward", "avx512_backward", ...).
const char* current_backward_copy();

}  // namespace mlx_attn::cpu
