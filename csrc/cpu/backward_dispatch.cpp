// Runs the fused CPU backward over the thread pool with the kernel copy of
// the instruction set the forward uses (cpu::current_isa), choosing between
// the single-pass and the two-pass scheme (backward_kernels.h).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "csrc/cpu/backward_host.h"
#include "csrc/cpu/copies.h"
#include "csrc/cpu/host.h"
#include "csrc/cpu/thread_pool.h"

namespace mlx_attn::cpu {
namespace {

int64_t delta_floats(const BackwardCall& call) {
  const AttentionProblem& p = call.problem;
  return round_up(int64_t(p.batch) * p.q_heads * p.q_len, 16);
}

int64_t thread_stride(const BackwardCall& call) {
  const BackwardCopy& copy = active_backward_copy();
  return round_up(backward_scratch(call, copy.lanes()).total + copy.panel_floats(call), 16);
}

// The single pass has batch x kv heads equal work items; the two passes do
// 7 tile products for its 5. Single pass unless its items would leave the
// threads idle more than that (busy fraction below 5/7), or its per-thread
// dQ accumulators (float32 [group][Tq][D] outside the in-place case) would
// exceed kSinglePassScratchBytes in all.
// MLX_ATTN_CPU_BACKWARD=single|two forces a scheme (tests cover both).
constexpr int64_t kSinglePassScratchBytes = int64_t(64) << 20;

bool single_pass_pays(const BackwardCall& call, int threads) {
  const char* forced = std::getenv("MLX_ATTN_CPU_BACKWARD");
  if (forced && *forced) {
    if (std::strcmp(forced, "single") == 0) return true;
    if (std::strcmp(forced, "two") == 0) return false;
    throw std::invalid_argument(std::string("[mlx_attn] MLX_ATTN_CPU_BACKWARD must be 'single' or 'two', got '") +
                                forced + "'");
  }
  const AttentionProblem& p = call.problem;
  const int64_t items = int64_t(p.batch) * p.kv_heads;
  const int64_t rounds = (items + threads - 1) / threads;
  const int64_t dq_bytes =
      single_pass_dq_floats(call, active_backward_copy().lanes()) * int64_t(sizeof(float)) * threads;
  return 7 * items >= 5 * rounds * threads && dq_bytes <= kSinglePassScratchBytes;
}

}  // namespace

void plan_backward(BackwardCall& call) {
  const AttentionProblem& p = call.problem;
  int qb = kMaxRows / p.group_size();
  qb = qb < 1 ? 1 : qb;
  call.query_block = qb < p.q_len ? qb : (p.q_len > 0 ? p.q_len : 1);
  call.single_pass = single_pass_pays(call, thread_pool().size());
}

int64_t backward_scratch_size(const BackwardCall& call) {
  return delta_floats(call) + thread_stride(call) * thread_pool().size() + 16;
}

void run_backward(BackwardCall call, float* scratch) {
  const AttentionProblem& p = call.problem;
  const BackwardCopy& isa = active_backward_copy();
  const int64_t stride = thread_stride(call);
  call.delta = scratch;
  // Each thread's buffers aligned to 64 bytes.
  float* base = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(scratch + delta_floats(call)) + 63) & ~uintptr_t(63));
  auto& pool = thread_pool();
  pool.parallel_for(p.q_heads, [&](int64_t head, int) { isa.rows(call, head); });
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  if (call.single_pass) {
    pool.parallel_for(per_block, [&](int64_t item, int slot) {
      isa.group(call, item, base + stride * slot);
    });
    return;
  }
  pool.parallel_for(per_block * call.key_blocks(), [&](int64_t item, int slot) {
    isa.key_block(call, item, base + stride * slot);
  });
  pool.parallel_for(per_block * call.query_blocks(), [&](int64_t item, int slot) {
    isa.query_block(call, item, base + stride * slot);
  });
}

}  // namespace mlx_attn::cpu
