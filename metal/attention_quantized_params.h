// Parameters of the kernels over quantized K/V (metal/attention_quantized.metal)
// beyond AttentionParams, shared with the launch plan
// (csrc/metal/quantized_launch_plan.cpp) so the layout cannot drift. K/V packed
// words are read through AttentionParams::k_strides / v_strides (in uint32
// words); scales and biases through these.
#pragma once

#include "metal/attention_params.h"

struct QuantizedAttentionParams {
  attn_int64 k_scale_strides[4];  // in elements, [batch, head, position, group]
  attn_int64 k_bias_strides[4];
  attn_int64 v_scale_strides[4];
  attn_int64 v_bias_strides[4];
  attn_int32 group_size;          // features per scale and bias: 32, 64 or 128
  attn_int32 unused;              // keeps the size a multiple of 8 on both sides
};

#ifndef __METAL_VERSION__
static_assert(sizeof(QuantizedAttentionParams) == 16 * 8 + 2 * 4, "QuantizedAttentionParams layout");
#endif
