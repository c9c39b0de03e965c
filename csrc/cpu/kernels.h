// Entry points of the per-ISA copies of the fused CPU kernel.
#pragma once

#include "csrc/cpu/attention_problem.h"

namespace mlx_attn::cpu {

#define MLX_ATTN_DECLARE_ISA(isa)                                      \
  namespace isa {                                                      \
  int vector_lanes();                                                  \
  void process_work_item(const AttentionProblem&, int64_t, float*);    \
  }
MLX_ATTN_DECLARE_ISA(generic)
#ifdef MLX_ATTN_X86_KERNELS
MLX_ATTN_DECLARE_ISA(avx2)
MLX_ATTN_DECLARE_ISA(avx512)
#endif
#undef MLX_ATTN_DECLARE_ISA

// Sets problem.query_block: as many query rows per work item as fit
// kMaxRows, fewer when that would leave threads idle.
void plan_work(AttentionProblem& problem);
// Scratch floats run_attention needs (tile buffers for every pool thread).
int64_t scratch_size(const AttentionProblem& problem);
// Runs the whole problem on the calling thread plus the kernel's worker pool;
// `scratch` holds scratch_size(problem) floats, 64-byte aligned.
void run_attention(const AttentionProblem& problem, float* scratch);

// The instruction set in use ("generic", "avx2", "avx512") and the ones this
// CPU and build support; set_isa overrides the choice (tests use it).
const char* current_isa();
void set_isa(const char* name);  // throws std::invalid_argument if unsupported
const char* const* supported_isas(int* count);

}  // namespace mlx_attn::cpu
