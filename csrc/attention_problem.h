// The one description of an attention problem: shapes, strides, element type,
// mask kind, causal/window, sinks, scale and outputs. Built once from the
// primitive's inputs (describe_attention in csrc/attention.cpp), consumed by
// the CPU kernel (csrc/cpu/) and the Metal launch plan (csrc/launch_plan.cpp).
// Plain C++ (no STL, no MLX): the per-ISA kernel translation units include it.
#pragma once

#include <stdint.h>

#include "metal/attention_params.h"

namespace mlx_attn {

// The one element-type enum: q, k, v, the output, an additive mask and sinks.
enum class ElemType : int32_t { float32 = 0, float16 = 1, bfloat16 = 2 };

inline constexpr const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::float16: return "float16";
    case ElemType::bfloat16: return "bfloat16";
    default: return "float32";
  }
}

// Values shared with the Metal kernels (metal/attention_params.h).
enum class MaskKind : int32_t {
  none = MLX_ATTN_MASK_NONE,
  boolean = MLX_ATTN_MASK_BOOL,   // false = masked
  additive = MLX_ATTN_MASK_ADDITIVE,
};

inline constexpr float kLog2e = MLX_ATTN_LOG2E;
inline constexpr float kLogitLimit = MLX_ATTN_LOGIT_LIMIT;
inline constexpr float kMaskedLogit = MLX_ATTN_MASKED_LOGIT;

struct AttentionProblem {
  // q [B, Hq, Tq, D], k [B, Hkv, Tkv, D], v [B, Hkv, Tkv, Dv]
  int batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim;
  ElemType dtype;
  int64_t q_strides[4];     // in elements; any values (broadcast, transposed)
  int64_t k_strides[4];
  int64_t v_strides[4];
  // where each of q, k, v starts in its buffer, in elements (MLX's
  // array::offset() is in bytes); 0 before the arrays are evaluated
  int64_t q_offset, k_offset, v_offset;
  MaskKind mask_kind;
  int64_t mask_strides[4];  // the mask seen as [B, Hq, Tq, Tkv], 0 where broadcast
  bool causal;              // lower-right aligned: query i sees keys <= i + Tkv - Tq
  int window_size;          // > 0: only the window_size most recent keys (implies causal)
  bool has_sinks;           // sinks [Hq]: one extra logit per query head
  int64_t sinks_stride;     // in elements (0: one value broadcast to every head)
  float scale;              // logit = scale * q.k (finite)
  bool output_lse;          // second output: float32 [B, Hq, Tq] log-sum-exp

  int group_size() const { return q_heads / kv_heads; }
};

}  // namespace mlx_attn
