// Plain description of one attention call for the fused CPU kernel.
// Shared by the MLX primitive and the per-ISA kernel translation units, so it
// uses no STL and no MLX types.
#pragma once

#include <stdint.h>

namespace mlx_attn::cpu {

enum class ElemType : int32_t { float32 = 0, float16 = 1, bfloat16 = 2 };
enum class ArrayMask : int32_t { none = 0, boolean = 1, additive = 2 };

// Keys per key/value block and the largest number of query rows per work item.
// A work item is (batch, kv head, block of query positions); its rows are the
// query positions of every query head of the GQA group, so each K/V block is
// packed once per group and reused by all its rows.
inline constexpr int kKeyBlock = 64;
inline constexpr int kMaxRows = 128;
inline constexpr int kMaxHeadDim = 256;

struct AttentionProblem {
  int batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim;
  ElemType dtype;  // q, k, v, the output, an additive mask and sinks
  const void* q;
  const void* k;
  const void* v;
  void* out;                // row-contiguous [B, Hq, Tq, Dv]
  int64_t q_strides[4];     // in elements; any values (broadcast, transposed)
  int64_t k_strides[4];
  int64_t v_strides[4];
  float scale;
  bool causal;              // lower-right aligned: query i sees keys <= i + Tkv - Tq
  int window_size;          // > 0: also only the window_size most recent keys
  ArrayMask mask_kind;
  const void* mask;         // bool or dtype, read through mask_strides
  int64_t mask_strides[4];  // [B, Hq, Tq, Tkv], 0 where broadcast
  const void* sinks;        // [Hq] in dtype, or null
  int64_t sinks_stride;
  float* lse;               // optional [B, Hq, Tq] natural-log log-sum-exp

  // Work split, chosen by the host (csrc/cpu/dispatch.cpp, plan_work):
  // query positions per work item; rows per item = group size x query_block.
  int query_block;

  int group_size() const { return q_heads / kv_heads; }
  int query_blocks() const { return (q_len + query_block - 1) / query_block; }
  int64_t work_items() const {
    return int64_t(batch) * kv_heads * query_blocks();
  }
};

// Floats of per-thread scratch a work item needs (packed Q, scores, output
// accumulator, packed K and V blocks, running max and sum), for vector width
// `lanes`.
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t scratch_floats(const AttentionProblem& p, int lanes) {
  int64_t rows = int64_t(p.group_size()) * p.query_block;
  int64_t dvp = round_up(p.value_dim, lanes);
  return rows * p.head_dim + rows * kKeyBlock + rows * dvp +
      int64_t(p.head_dim) * kKeyBlock + kKeyBlock * dvp + 2 * rows + 64;
}

}  // namespace mlx_attn::cpu
