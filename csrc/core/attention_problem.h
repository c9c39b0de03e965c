// The one description of an attention problem: shapes, strides, element type,
// mask kind, causal/window, sinks, scale and outputs. Built once from the
// primitive's inputs (describe_attention in csrc/ops/attention.cpp), consumed by
// the CPU kernel (csrc/cpu/) and the Metal launch plan (csrc/metal/launch_plan.cpp).
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

// MaskKind: metal/attention_params.h (the kernels read the same values).

inline constexpr float kLog2e = MLX_ATTN_LOG2E;
inline constexpr float kLogitLimit = MLX_ATTN_LOGIT_LIMIT;
inline constexpr float kMaskedLogit = MLX_ATTN_MASKED_LOGIT;

// The kernels' parameters (AttentionParams: strides, sizes, causal / window,
// mask kind, sinks, scale, lse; set by describe_attention, except
// vector_loads, which the Metal launch plan decides) plus what only the host
// needs. q [B, Hq, Tq, D], k [B, Hkv, Tkv, D], v [B, Hkv, Tkv, Dv]; strides in
// elements, any values (broadcast, transposed); mask strides seen as
// [B, Hq, Tq, Tkv], 0 where broadcast; causal is lower-right aligned (query i
// sees keys <= i + Tkv - Tq); window_size > 0 implies causal; sinks_stride 0
// broadcasts one sink to every head.
struct AttentionProblem : AttentionParams {
  int head_dim, value_dim;
  ElemType dtype;
  // where each of q, k, v starts in its buffer, in elements (MLX's
  // array::offset() is in bytes); 0 before the arrays are evaluated
  int64_t q_offset, k_offset, v_offset;

  int group_size() const { return q_heads / kv_heads; }
};

}  // namespace mlx_attn
