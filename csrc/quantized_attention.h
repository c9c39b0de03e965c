// Fused attention over keys and values quantized by mx.quantize: the same
// problem and CPU kernel as FusedAttention (csrc/attention.h), with K/V
// blocks dequantized inside the kernel's tile (csrc/cpu/quantized_kv.h).
#pragma once

#include <optional>
#include <utility>

#include "csrc/attention.h"

namespace mlx_attn {

struct Quantization {
  int bits = 8;         // 4 or 8
  int group_size = 64;  // 32, 64 or 128 features per scale and bias
  bool operator==(const Quantization&) const = default;
};

// The problem and quantized K/V description of the primitive's inputs
// (q, k_packed, k_scales, k_biases, v_packed, v_scales, v_biases, then the
// mask and sinks when the options say so): every check of describe_attention
// on the dequantized shapes, plus uint32 words, scales and biases of q's dtype
// and one shape [B, H, T, D / group_size]. Buffer
// pointers are left null. Throws std::invalid_argument naming the argument.
std::pair<AttentionProblem, cpu::QuantizedKV> describe_quantized_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const Quantization& quantization);

// CPU streams only (no Metal kernel reads quantized K/V); the forward pass
// only (not differentiable).
std::vector<mx::array> quantized_attention(
    const mx::array& q,
    const std::vector<mx::array>& k_quant,
    const std::vector<mx::array>& v_quant,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    Quantization quantization,
    mx::StreamOrDevice s = {});

class QuantizedAttention : public mx::Primitive {
 public:
  QuantizedAttention(mx::Stream stream, AttentionOptions options, Quantization quantization)
      : mx::Primitive(stream), options_(options), quantization_(quantization) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "QuantizedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  AttentionOptions options_;
  Quantization quantization_;
};

}  // namespace mlx_attn
