// What the per-ISA copies of the fused CPU kernel see: the problem plus its
// buffers and work split (KernelCall), and their entry points. Plain C++ (no
// STL, no MLX), so code compiled for a wide instruction set cannot leak.
#pragma once

#include "csrc/core/attention_problem.h"
#include "csrc/cpu/paged_kv.h"
#include "csrc/cpu/quantized_kv.h"

namespace mlx_attn::cpu {

// Keys per key/value block and the number of query rows per work item (at
// most; the dense AMX bf16 path takes twice as many, dispatch.cpp max_rows).
// A work item is (batch, kv head, block of query positions); its rows are the
// query positions of every query head of the GQA group, so each K/V block is
// packed once per group and reused by all its rows.
inline constexpr int kKeyBlock = 64;
// The AMX bf16 path's key block (kernel_impl.h): its output accumulator tiles
// are loaded and stored once per block, so a longer block halves that traffic.
inline constexpr int kMaxKeyBlock = 2 * kKeyBlock;
inline constexpr int kMaxRows = 128;
// Floats a copy may add to the row stride of its score panel S^T (the
// copy's MLX_ATTN_SCORE_ROW_PAD, kernel_impl.h): scratch_floats holds it.
inline constexpr int kMaxScoreRowPad = 16;
// Largest head dim (D and Dv) the kernel's row buffers hold: every tile is
// sized from the problem's D and Dv (scratch_floats), only the per-row stack
// buffers (elements.h load_row, the quantized row, the backward's rows) use
// this bound; 1024 covers absorbed MLA (Dk 576 / Dv 512) with room.
inline constexpr int kMaxHeadDim = 1024;

struct KernelCall {
  AttentionProblem problem;
  const void* q;
  const void* k;
  const void* v;
  const void* mask;   // bool or problem.dtype, read through problem.mask_strides
  const void* sinks;  // problem.dtype, read through problem.sinks_stride
  void* out;          // row-contiguous [B, Hq, Tq, Dv]
  float* lse;         // row-contiguous [B, Hq, Tq] natural-log log-sum-exp, or null
  QuantizedKV quantized;  // bits > 0: k and v are packed words (csrc/cpu/quantized_kv.h)
  PagedKV paged;          // active(): k and v are pages, q / out packed rows (csrc/cpu/paged_kv.h)
  // Query positions per work item (csrc/cpu/dispatch.cpp, plan_work); rows per
  // item = group size x query_block.
  int query_block;

  int query_blocks() const { return (problem.q_len + query_block - 1) / query_block; }
  int64_t work_items() const {
    if (paged.active()) return paged.item_count * problem.kv_heads;
    return int64_t(problem.batch) * problem.kv_heads * query_blocks();
  }
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Floats of per-thread scratch a work item needs (packed Q^T and the scores,
// both with rows padded to the vector width, output accumulator, K and V
// block buffers, running max, sum and rescale factors), for vector width `lanes`.
inline int64_t scratch_floats(const KernelCall& call, int lanes) {
  const AttentionProblem& p = call.problem;
  int64_t rows = int64_t(p.group_size()) * call.query_block;
  int64_t rows_padded = round_up(rows, lanes);
  int64_t dvp = round_up(p.value_dim, lanes);
  return rows_padded * p.head_dim + (rows_padded + kMaxScoreRowPad) * kMaxKeyBlock + rows_padded * dvp +
      int64_t(p.head_dim) * kMaxKeyBlock + kMaxKeyBlock * dvp + 3 * rows_padded + 64;
}

#define MLX_ATTN_DECLARE_ISA(isa)                               \
  namespace isa {                                               \
  int vector_lanes();                                           \
  void process_work_item(const KernelCall&, int64_t, float*);   \
  }
MLX_ATTN_DECLARE_ISA(generic)
#ifdef MLX_ATTN_X86_KERNELS
MLX_ATTN_DECLARE_ISA(avx2)
MLX_ATTN_DECLARE_ISA(avx512)
MLX_ATTN_DECLARE_ISA(avx512bf16)
MLX_ATTN_DECLARE_ISA(avx512amx)
#endif
#ifdef MLX_ATTN_ARM64_KERNELS
MLX_ATTN_DECLARE_ISA(neon)
MLX_ATTN_DECLARE_ISA(neonfhm)
MLX_ATTN_DECLARE_ISA(neonbf16)
#endif
#undef MLX_ATTN_DECLARE_ISA

}  // namespace mlx_attn::cpu
