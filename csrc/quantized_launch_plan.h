// Launch plan of the Metal kernels over quantized K/V
// (metal/attention_quantized.metal): the float decode's split-K structure
// with a partial kernel that dequantizes packed K/V in registers, merged by
// the float decode's merge kernel (same partial layout). Same plan types as
// csrc/launch_plan.h: the Mac host encodes it with the same loop and the
// emulator tests launch it unchanged.
#pragma once

#include "csrc/cpu/quantized_kv.h"
#include "csrc/launch_plan.h"

namespace mlx_attn {

// `problem` as describe_quantized_attention builds it (k/v strides in packed
// uint32 words), `quantized` its bits, group size and scales/biases strides
// (buffer pointers unused). Inputs are bound in the QuantizedAttention
// primitive's order: q, k packed, k scales, k biases, v packed, v scales,
// v biases, then the mask and sinks when present. Any number of query rows.
LaunchPlan plan_quantized_attention(
    const AttentionProblem& problem, const cpu::QuantizedKV& quantized, const GpuTarget& target = {});

}  // namespace mlx_attn
