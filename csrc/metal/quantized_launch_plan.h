// Launch plan of the Metal kernels over quantized K/V
// (metal/attention_quantized.metal): the float decode's split-K structure
// with a partial kernel that dequantizes packed K/V in registers, merged by
// the float decode's merge kernel (same partial layout); prefill-sized
// problems take the quantized prefill kernel
// (metal/attention_quantized_prefill.metal) instead. Same plan types as
// csrc/metal/launch_plan.h: the Mac host encodes it with the same loop and the
// emulator tests launch it unchanged.
#pragma once

#include "csrc/cpu/quantized_kv.h"
#include "csrc/metal/launch_plan.h"

namespace mlx_attn {

// Which kernel serves a quantized call's query rows, the one routing rule:
// the quantized prefill kernel (metal/attention_quantized_prefill.h, the
// dense prefill kernel's MMA tiles with a loader that dequantizes while
// staging) for more rows than the decode kernel serves well, by the dense
// plan's decode limits (more than kDecodeMaxQueries positions or
// kDecodeMaxRows rows = GQA group x positions, as paged_rows_take_prefill),
// at the head dims it is instantiated for (64, 128: both the register-resident
// prefill and the quantized decode take them); the quantized decode kernel
// otherwise: decode rows, short chunks, and D = 256 / 512, whose dense prefill
// is the D-split kernel (a register-resident tile there would exceed the
// register budget).
bool quantized_rows_take_prefill(const AttentionProblem& problem, const cpu::QuantizedKV& quantized);

// `problem` as describe_quantized_attention builds it (k/v strides in packed
// uint32 words), `quantized` its bits, group size and scales/biases strides
// (buffer pointers unused). Inputs are bound in the QuantizedAttention
// primitive's order: q, k packed, k scales, k biases, v packed, v scales,
// v biases, then the mask and sinks when present. Any number of query rows:
// quantized_rows_take_prefill picks the kernel; the decode kernel has the
// float decode's two threadgroup shapes, chosen by its rule (decode_shape)
// or named by `decode_choice`.
LaunchPlan plan_quantized_attention(const AttentionProblem& problem, const cpu::QuantizedKV& quantized,
                                    const GpuTarget& target = {},
                                    DecodeShapeChoice decode_choice = DecodeShapeChoice::automatic);

}  // namespace mlx_attn
