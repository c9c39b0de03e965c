// What the per-ISA copies of the fused CPU attention backward see: the
// problem, the forward's buffers and the gradients' (BackwardCall), the
// per-thread scratch layout and their entry points. Plain C++ (no STL, no
// MLX), like kernels.h.
//
// FlashAttention-2 style: the forward's row log-sum-exp lets every tile
// recompute P = exp(S - lse) directly; delta = rowsum(dO * O) - dlse turns
// the softmax derivative into dS = P * (dP - delta) with dP = dO . V^T.
// A tile (query rows x kKeyBlock keys) costs five products, through the
// forward's micro-kernel (bf16 on the avx512amx copy: on AMX tiles):
// S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K. First a rows pass writes delta per query row and the sinks'
// gradient (per head); then one of two schemes, each writing disjoint
// outputs (no races, no atomics):
//   single pass  one work item per (batch, kv head): key blocks outer, query
//                blocks inner, dK/dV of the key block in scratch and dQ of the
//                whole GQA group accumulated by the item itself (in place in
//                a float32 dq, else in its thread's scratch): 5 products/tile
//   two passes   one over (batch, kv head, key block) for dK/dV, one over
//                (batch, kv head, query block) for dQ, which recomputes S
//                and dP: 7 products/tile, but enough items for every thread
//                when batch x kv heads is small (plan_backward chooses)
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
  bool single_pass;          // the single-pass scheme (else two passes)

  int query_blocks() const { return (problem.q_len + query_block - 1) / query_block; }
  int key_blocks() const { return (problem.kv_len + kKeyBlock - 1) / kKeyBlock; }
};

// The single pass accumulates dQ straight into dq when dq is float32 with
// rows padded to nothing (head_dim a multiple of the vector width).
inline bool dq_accumulates_in_place(const BackwardCall& call, int lanes) {
  return call.problem.dtype == ElemType::float32 && call.problem.head_dim % lanes == 0;
}

// Floats of the single pass's float32 dQ accumulator for a whole GQA group
// [group][Tq][Dp] in a thread's scratch; none when dQ accumulates in place.
inline int64_t single_pass_dq_floats(const BackwardCall& call, int lanes) {
  const AttentionProblem& p = call.problem;
  if (dq_accumulates_in_place(call, lanes)) return 0;
  return int64_t(p.group_size()) * p.q_len * round_up(p.head_dim, lanes);
}

// Offsets (in floats, 64-byte aligned) of one thread's buffers, for vector
// width `lanes`: packed Q [rows][Dp] and dO [rows][Dvp]; P, dS and the
// clamp gate [rows][KB]; K^T [D][KB], V^T [Dv][KB], K rows [KB][Dp]; dK, dV
// accumulators [KB][Dp], [KB][Dvp]; the dQ accumulator (a tile's [rows][Dp],
// or the single pass's whole group [group][Tq][Dp] unless in place, else
// nothing); one tile's dQ [rows][Dp] (the AMX tiles'); lse and delta per row.
// Rows are counted in whole 32-row tiles (kBackwardRowMultiple), as the
// avx512amx copy's bf16 tiles take them.
inline constexpr int kBackwardRowMultiple = 32;

struct BackwardScratch {
  int64_t q_packed, d_out_packed, probs, d_scores, gate, k_t, v_t, k_rows,
      dk_acc, dv_acc, dq_acc, dq_tile, lse_row, delta_row, total;
};

inline BackwardScratch backward_scratch(const BackwardCall& call, int lanes) {
  const AttentionProblem& p = call.problem;
  const int64_t rows = round_up(int64_t(p.group_size()) * call.query_block, kBackwardRowMultiple);
  const int64_t dp = round_up(p.head_dim, lanes), dvp = round_up(p.value_dim, lanes);
  const int64_t dq_floats = call.single_pass ? single_pass_dq_floats(call, lanes) : rows * dp;
  BackwardScratch s{};
  int64_t at = 0;
  auto take = [&at](int64_t floats) {
    const int64_t offset = at;
    at += round_up(floats, 16);
    return offset;
  };
  s.q_packed = take(rows * dp);
  s.d_out_packed = take(rows * dvp);
  s.probs = take(rows * kKeyBlock);
  s.d_scores = take(rows * kKeyBlock);
  s.gate = take(rows * kKeyBlock);
  s.k_t = take(int64_t(p.head_dim) * kKeyBlock);
  s.v_t = take(int64_t(p.value_dim) * kKeyBlock);
  s.k_rows = take(kKeyBlock * dp);
  s.dk_acc = take(kKeyBlock * dp);
  s.dv_acc = take(kKeyBlock * dvp);
  s.dq_acc = take(dq_floats);
  s.dq_tile = take(rows * dp);
  s.lse_row = take(rows);
  s.delta_row = take(rows);
  s.total = at;
  return s;
}

// Each copy: its vector width, the three passes' items, and the floats it
// needs past backward_scratch's total per thread (backward_panel_floats: the
// avx512amx copy's packed query tiles of a single-pass item; 0 elsewhere).
#define MLX_ATTN_DECLARE_BACKWARD_ISA(isa)                          \
  namespace isa {                                                   \
  int backward_vector_lanes();                                      \
  int64_t backward_panel_floats(const BackwardCall&);               \
  void backward_rows(const BackwardCall&, int64_t head);            \
  void backward_group(const BackwardCall&, int64_t, float*);        \
  void backward_key_block(const BackwardCall&, int64_t, float*);    \
  void backward_query_block(const BackwardCall&, int64_t, float*);  \
  }
MLX_ATTN_DECLARE_BACKWARD_ISA(generic_backward)
#ifdef MLX_ATTN_X86_KERNELS
MLX_ATTN_DECLARE_BACKWARD_ISA(avx2_backward)
MLX_ATTN_DECLARE_BACKWARD_ISA(avx512_backward)
MLX_ATTN_DECLARE_BACKWARD_ISA(avx512amx_backward)
#endif
#ifdef MLX_ATTN_ARM64_KERNELS
MLX_ATTN_DECLARE_BACKWARD_ISA(neon_backward)
#endif
#undef MLX_ATTN_DECLARE_BACKWARD_ISA

}  // namespace mlx_attn::cpu
