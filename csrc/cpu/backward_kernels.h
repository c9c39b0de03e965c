// What the per-ISA copies of the fused CPU attention backward see: the
// problem, the forward's buffers and the gradients' (BackwardCall), and their
// entry points. Plain C++ (no STL, no MLX), like kernels.h.
//
// FlashAttention-2 style: the forward's row log-sum-exp lets every tile
// recompute P = exp(S - lse) directly; delta = rowsum(dO * O) - dlse turns
// the softmax derivative into dS = P * (dP - delta) with dP = dO . V^T.
// Three passes, each writing disjoint outputs (no races, no atomics):
//   rows        delta per query row, and the sinks' gradient (per head)
//   key blocks  dK, dV of one (batch, kv head, key block), summed over every
//               query head of the GQA group and every query block
//   query rows  dQ of one (batch, kv head, query block), as the forward
// No Tq x Tkv buffer exists: tiles are at most kMaxRows x kKeyBlock.
#pragma once

#include "csrc/cpu/kernels.h"

namespace mlx_attn::cpu {

struct BackwardCall {
  AttentionProblem problem;  // of q, k, v, mask, sinks (as the forward's)
  const void* q;
  const void* k;
  const void* v;
  const void* mask;
  const void* sinks;
  const void* out;           // the forward's output, problem.dtype
  int64_t out_strides[4];
  const float* lse;          // the forward's row-contiguous [B, Hq, Tq] lse
  const void* d_out;         // cotangent of out, problem.dtype (any strides)
  int64_t d_out_strides[4];
  const float* d_lse;        // cotangent of lse [B, Hq, Tq] float32, or null
  int64_t d_lse_strides[3];
  void* dq;                  // row-contiguous [B, Hq, Tq, D], problem.dtype
  void* dk;                  // row-contiguous [B, Hkv, Tkv, D]
  void* dv;                  // row-contiguous [B, Hkv, Tkv, Dv]
  void* d_sinks;             // [Hq] problem.dtype, or null (no sinks)
  float* delta;              // [B, Hq, Tq] float32 work buffer (pass rows)
  int query_block;           // query positions per tile (rows = group x this)

  int query_blocks() const { return (problem.q_len + query_block - 1) / query_block; }
  int key_blocks() const { return (problem.kv_len + kKeyBlock - 1) / kKeyBlock; }
};

// Floats of per-thread scratch either tile pass needs, for vector width `lanes`.
inline int64_t backward_scratch_floats(const BackwardCall& call, int lanes) {
  const AttentionProblem& p = call.problem;
  const int64_t rows = int64_t(p.group_size()) * call.query_block;
  const int64_t dp = round_up(p.head_dim, lanes), dvp = round_up(p.value_dim, lanes);
  const int64_t tile = rows * kKeyBlock;
  // packed Q, dO; P, dS, gate and a transposed tile; K^T, V^T, K rows;
  // dQ or dK+dV accumulators; lse and delta per row
  return rows * dp + rows * dvp + 4 * tile + (p.head_dim + p.value_dim) * int64_t(kKeyBlock) +
      kKeyBlock * dp + rows * dp + kKeyBlock * (dp + dvp) + 2 * rows + 64;
}

#define MLX_ATTN_DECLARE_BACKWARD_ISA(isa)                          \
  namespace isa {                                                   \
  void backward_rows(const BackwardCall&, int64_t head);            \
  void backward_key_block(const BackwardCall&, int64_t, float*);    \
  void backward_query_block(const BackwardCall&, int64_t, float*);  \
  }
MLX_ATTN_DECLARE_BACKWARD_ISA(generic_backward)
#ifdef MLX_ATTN_X86_KERNELS
MLX_ATTN_DECLARE_BACKWARD_ISA(avx2_backward)
MLX_ATTN_DECLARE_BACKWARD_ISA(avx512_backward)
#endif
#undef MLX_ATTN_DECLARE_BACKWARD_ISA

}  // namespace mlx_attn::cpu
