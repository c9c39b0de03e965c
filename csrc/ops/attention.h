// The fused attention MLX primitive: one node in the graph whose eval_cpu runs
// the tiled online-softmax kernel (csrc/cpu/) and whose eval_gpu runs the
// Metal kernels (csrc/metal/, only where MLX is built with Metal).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "csrc/core/attention_options.h"
#include "csrc/core/attention_problem.h"
#include "csrc/cpu/kernels.h"
#include "csrc/metal/launch_plan.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_attn {

namespace mx = mlx::core;

// Builds the problem description from the primitive's inputs (q, k, v, then
// the mask and sinks when the options say so) and checks every invariant the
// kernels rely on: ranks, dtypes, shapes that agree, GQA divisibility, a mask
// that broadcasts to [B, Hq, Tq, Tkv], sinks [Hq], a finite scale, a finite
// softcap >= 0. Throws
// std::invalid_argument naming the argument. Strides are the arrays' own (row
// contiguous until evaluated); the mask's are those of its broadcast view.
AttentionProblem describe_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options);

// Empty when the fused kernels of `device` handle the problem, else why not:
// the CPU kernel's rule (csrc/cpu/) or the Metal launch plan's.
std::string unsupported_reason(const AttentionProblem& problem, mx::Device::DeviceType device);

// q [B,Hq,Tq,D], k [B,Hkv,Tkv,D], v [B,Hkv,Tkv,Dv] of one float dtype; mask
// (rank <= 4) broadcastable to [B,Hq,Tq,Tkv], bool or of q's dtype; sinks
// [Hq] of q's dtype. Validates everything (std::invalid_argument), including
// the support rule of the stream's device. Returns [out] or [out, lse].
// While MLX traces a transformation on the CPU the primitive also keeps the
// lse for its fused backward (plain inference pays nothing for it).
std::vector<mx::array> fused_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s = {});

// Runs the fused CPU kernel for `call` (buffers set, outputs allocated) on
// the stream's command encoder, with tile scratch from MLX's allocator.
void run_cpu_kernel(
    cpu::KernelCall call,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    mx::Stream stream);

// Gradients come from the fused backward (FusedAttentionBackward, CPU or
// Metal) whenever the forward kept its lse and no additive mask is among the
// differentiated inputs; other gradients (an additive mask's: the score
// gradient reduced over its broadcast dimensions) and forward-mode
// derivatives are those of the reference path's graph
// (csrc/ops/reference_graph.h), all in C++.

// What the attention primitives (FusedAttention, QuantizedAttention) share:
// their options, outputs [B, Hq, Tq, Dv] (and the float32 [B, Hq, Tq] lse
// with options.output_lse), equivalence, and the GPU evaluation: encode the
// Metal launch plan of the inputs (csrc/metal/attention_metal.h).
class AttentionPrimitive : public mx::Primitive {
 public:
  AttentionPrimitive(mx::Stream stream, AttentionOptions options)
      : mx::Primitive(stream), options_(options) {}

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // MLX compares primitives of one type only.
  bool is_equivalent(const mx::Primitive& other) const override;
  const AttentionOptions& options() const {
    return options_;
  }

 protected:
  // Dv, from the primitive's inputs.
  virtual int value_dim(const std::vector<mx::array>& inputs) const = 0;
  virtual LaunchPlan launch_plan(const std::vector<mx::array>& inputs, const GpuTarget& target) const = 0;

  AttentionOptions options_;
};

class FusedAttention : public AttentionPrimitive {
 public:
  using AttentionPrimitive::AttentionPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;
  const char* name() const override {
    return "FusedAttention";
  }

 protected:
  int value_dim(const std::vector<mx::array>& inputs) const override {
    return inputs[2].shape(3);
  }
  LaunchPlan launch_plan(const std::vector<mx::array>& inputs, const GpuTarget& target) const override;
};

// The fused backward: inputs q, k, v, [mask], [sinks], out, lse, d_out,
// d_lse (the forward's inputs, outputs and their cotangents); outputs dq, dk,
// dv and, with sinks, d_sinks, in q's dtype. Not differentiable itself.
class FusedAttentionBackward : public mx::Primitive {
 public:
  FusedAttentionBackward(mx::Stream stream, AttentionOptions options)
      : mx::Primitive(stream), options_(options) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "FusedAttentionBackward";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  AttentionOptions options_;
};

}  // namespace mlx_attn
