// The one options record: every attribute of an attention call that the
// arrays do not carry, for dense, quantized and paged attention alike. The
// Python signature (mlx_attn/), this record and the kernels' rule header
// (metal/attention_rules.h) are where a new option is written; the bindings
// (csrc/python/options_bindings.cpp) and plans take the record whole.
#pragma once

namespace mlx_attn {

// K/V as mx.quantize triples: bits 4 or 8 with group_size 32, 64 or 128
// features per scale and bias; bits 0: float K/V.
struct Quantization {
  int bits = 0;
  int group_size = 0;
  bool operator==(const Quantization&) const = default;
};

struct AttentionOptions {
  float scale = 1.0f;
  bool causal = false;     // lower-right aligned
  int window_size = 0;     // > 0: sliding window (implies causal)
  bool has_mask = false;   // a bool or additive mask follows K/V among the inputs
  bool has_sinks = false;  // last input is sinks [Hq]
  bool output_lse = false; // second output: the float32 row log-sum-exp
  // The lse output exists only for the fused backward (set while MLX traces
  // a transformation): fused_attention does not return it.
  bool lse_for_backward = false;
  // Whether the Metal backward's kernel variant passed its first-use
  // self-check: Python resolves it when it picks the fused Metal forward
  // (mlx_attn/ops.py, AttentionCall) and hands the answer here, so the vjp
  // never calls back into Python for it. Not read on the CPU.
  bool metal_backward_trusted = true;
  // > 0: every logit becomes softcap * tanh(logit / softcap) before the mask
  // (metal/attention_rules.h softcap_logit); 0: no softcap.
  float softcap = 0.0f;
  Quantization quantization;
  bool operator==(const AttentionOptions&) const = default;
};

}  // namespace mlx_attn
