// Runs the fused CPU backward over the thread pool with the kernel copy of
// the instruction set the forward uses (cpu::current_isa).
#include <cstring>

#include "csrc/cpu/backward_host.h"
#include "csrc/cpu/host.h"
#include "csrc/cpu/thread_pool.h"

namespace mlx_attn::cpu {
namespace {

struct BackwardIsa {
  const char* name;
  int (*lanes)();
  void (*rows)(const BackwardCall&, int64_t);
  void (*key_block)(const BackwardCall&, int64_t, float*);
  void (*query_block)(const BackwardCall&, int64_t, float*);
};

const BackwardIsa kBackwardIsas[] = {
#ifdef MLX_ATTN_X86_KERNELS
    {"avx512", avx512::vector_lanes, avx512_backward::backward_rows,
     avx512_backward::backward_key_block, avx512_backward::backward_query_block},
    {"avx2", avx2::vector_lanes, avx2_backward::backward_rows,
     avx2_backward::backward_key_block, avx2_backward::backward_query_block},
#endif
    {"generic", generic::vector_lanes, generic_backward::backward_rows,
     generic_backward::backward_key_block, generic_backward::backward_query_block},
};

const BackwardIsa& active_backward_isa() {
  const char* name = current_isa();
  for (const BackwardIsa& isa : kBackwardIsas) {
    if (std::strcmp(isa.name, name) == 0) return isa;
  }
  return kBackwardIsas[sizeof(kBackwardIsas) / sizeof(kBackwardIsas[0]) - 1];
}

int64_t delta_floats(const BackwardCall& call) {
  const AttentionProblem& p = call.problem;
  return round_up(int64_t(p.batch) * p.q_heads * p.q_len, 16);
}

int64_t thread_stride(const BackwardCall& call) {
  return round_up(backward_scratch_floats(call, active_backward_isa().lanes()), 16);
}

}  // namespace

void plan_backward(BackwardCall& call) {
  const AttentionProblem& p = call.problem;
  int qb = kMaxRows / p.group_size();
  qb = qb < 1 ? 1 : qb;
  call.query_block = qb < p.q_len ? qb : (p.q_len > 0 ? p.q_len : 1);
}

int64_t backward_scratch_size(const BackwardCall& call) {
  return delta_floats(call) + thread_stride(call) * thread_pool().size() + 16;
}

void run_backward(BackwardCall call, float* scratch) {
  const AttentionProblem& p = call.problem;
  const BackwardIsa& isa = active_backward_isa();
  const int64_t stride = thread_stride(call);
  call.delta = scratch;
  // Each thread's tile block aligned to 64 bytes.
  float* base = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(scratch + delta_floats(call)) + 63) & ~uintptr_t(63));
  auto& pool = thread_pool();
  pool.parallel_for(p.q_heads, [&](int64_t head, int) { isa.rows(call, head); });
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  pool.parallel_for(per_block * call.key_blocks(), [&](int64_t item, int slot) {
    isa.key_block(call, item, base + stride * slot);
  });
  pool.parallel_for(per_block * call.query_blocks(), [&](int64_t item, int slot) {
    isa.query_block(call, item, base + stride * slot);
  });
}

}  // namespace mlx_attn::cpu
