// Fused attention over keys and values quantized by mx.quantize: the same
// problem and CPU kernel as FusedAttention (csrc/ops/attention.h), with K/V
// blocks dequantized inside the kernel's tile (csrc/cpu/quantized_kv.h); on
// the GPU the kernels of metal/attention_quantized.metal, through
// csrc/metal/quantized_launch_plan.h.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "csrc/ops/attention.h"

namespace mlx_attn {

// The problem and quantized K/V description of the primitive's inputs
// (q, k_packed, k_scales, k_biases, v_packed, v_scales, v_biases, then the
// mask and sinks when the options say so): every check of describe_attention
// on the dequantized shapes, plus uint32 words, scales and biases of q's dtype
// and one shape [B, H, T, D / group_size]. Buffer
// pointers are left null. Throws std::invalid_argument naming the argument.
std::pair<AttentionProblem, cpu::QuantizedKV> describe_quantized_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options);

// Empty when the fused kernels of `device` handle the problem, else why not
// (the CPU kernel's rule or the quantized Metal launch plan's).
std::string quantized_unsupported_reason(
    const AttentionProblem& problem, const cpu::QuantizedKV& quantized, mx::Device::DeviceType device);

// CPU and GPU streams; the forward pass only (not differentiable).
std::vector<mx::array> quantized_attention(
    const mx::array& q,
    const std::vector<mx::array>& k_quant,
    const std::vector<mx::array>& v_quant,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s = {});

class QuantizedAttention : public AttentionPrimitive {
 public:
  using AttentionPrimitive::AttentionPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "QuantizedAttention";
  }

 protected:
  int value_dim(const std::vector<mx::array>& inputs) const override {
    return inputs[4].shape(3) * (32 / options_.quantization.bits);
  }
  LaunchPlan launch_plan(const std::vector<mx::array>& inputs, const GpuTarget& target) const override;
};

}  // namespace mlx_attn
