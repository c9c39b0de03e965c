// The one options record: every attribute of an attention call that the
// arrays do not carry, for dense, quantized and paged attention alike. The
// Python signature (mlx_attn/), this record and the kernels' rule header
// (metal/attention_rules.h) are where a new option is written; the bindings
// (csrc/python/options_bindings.cpp) and plans take the record whole.
#pragma once

#include <cmath>

#include "metal/attention_params.h"

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

// The options' invariants and their part of the kernels' parameters (scale,
// softcap, causal / window, lse): one home for every op's description.
// nullptr when they hold, else the broken invariant (each op throws it its way).
inline const char* set_option_params(AttentionParams& params, const AttentionOptions& options) {
  if (!std::isfinite(options.scale)) return "scale finite in float32";
  if (!(std::isfinite(options.softcap) && options.softcap >= 0.0f)) return "softcap finite and >= 0 (0: none)";
  if (options.window_size < 0) return "window_size >= 0 (0: no window)";
  if (options.window_size > 0 && !options.causal) return "window_size > 0 only with causal";
  params.scale = options.scale;
  params.softcap = options.softcap;
  params.causal = options.causal;
  params.window_size = options.window_size;
  params.output_lse = options.output_lse;
  return nullptr;
}

}  // namespace mlx_attn
