// The fused attention MLX primitive: one node in the graph whose eval_cpu runs
// the tiled online-softmax kernel (csrc/cpu/) and whose eval_gpu runs the
// Metal kernels (csrc/metal/, only where MLX is built with Metal).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_attn {

namespace mx = mlx::core;

struct AttentionOptions {
  float scale = 1.0f;
  bool causal = false;     // lower-right aligned
  int window_size = 0;     // > 0: sliding window (implies causal)
  bool has_mask = false;   // inputs[3] is a bool or additive mask
  bool has_sinks = false;  // last input is sinks [Hq]
  bool output_lse = false; // second output: float32 [B, Hq, Tq] log-sum-exp
  bool operator==(const AttentionOptions&) const = default;
};

// q [B,Hq,Tq,D], k [B,Hkv,Tkv,D], v [B,Hkv,Tkv,Dv] of one float dtype; mask
// already broadcast (a view) to [B,Hq,Tq,Tkv], bool or of q's dtype; sinks
// [Hq] of q's dtype. Inputs are validated in Python (mlx_attn/ops.py).
std::vector<mx::array> fused_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s = {});

class FusedAttention : public mx::Primitive {
 public:
  FusedAttention(mx::Stream stream, AttentionOptions options)
      : mx::Primitive(stream), options_(options) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "FusedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  const AttentionOptions& options() const {
    return options_;
  }

 private:
  AttentionOptions options_;
};

}  // namespace mlx_attn
