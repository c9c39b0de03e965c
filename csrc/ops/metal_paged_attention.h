// The fused Metal paged attention (mlx_attn.paged_attention on a GPU stream):
// describe_paged_attention turns the primitive's inputs into the
// PagedProblem of csrc/metal/paged_launch_plan.h, and MetalPagedAttention's
// eval_gpu encodes that plan (csrc/metal/attention_metal.h). Lengths are
// host values the caller (mlx_attn/paged.py) has checked; they are
// attributes of the primitive, not inputs.
#pragma once

#include <optional>
#include <vector>

#include "csrc/ops/attention.h"
#include "csrc/metal/paged_launch_plan.h"

namespace mlx_attn {

// inputs: q [total_q, Hq, D], k and v pages [num_pages, Hkv, page_size, D]
// (quantized: the six packed / scales / biases arrays), block_table int32
// [B, max_pages], then sinks. Throws std::invalid_argument for inputs that
// break the kernels' invariants (shapes, dtypes, lengths).
PagedProblem describe_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& kv_lens);

class MetalPagedAttention : public mx::Primitive {
 public:
  MetalPagedAttention(mx::Stream stream, AttentionOptions options, std::vector<int32_t> q_lens,
                      std::vector<int32_t> kv_lens)
      : mx::Primitive(stream), options_(options), q_lens_(std::move(q_lens)), kv_lens_(std::move(kv_lens)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MetalPagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  AttentionOptions options_;
  std::vector<int32_t> q_lens_, kv_lens_;
};

// Cascade attention on the GPU (csrc/metal/paged_launch_plan.h
// plan_cascade_paged_attention): inputs as describe_paged_attention with the
// own pages' block_table, then prefix_table int32 [groups, max_prefix_pages];
// own_kv_lens: each sequence's keys after its group's prefix.
CascadeProblem describe_cascade_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& own_kv_lens, const std::vector<int32_t>& prefix_lens,
    const std::vector<int32_t>& prefix_groups);

class MetalCascadePagedAttention : public mx::Primitive {
 public:
  MetalCascadePagedAttention(mx::Stream stream, AttentionOptions options, std::vector<std::vector<int32_t>> lengths)
      : mx::Primitive(stream), options_(options), lengths_(std::move(lengths)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MetalCascadePagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  AttentionOptions options_;
  std::vector<std::vector<int32_t>> lengths_;  // q_lens, own_kv_lens, prefix_lens, prefix_groups
};

// [out] or [out, lse] of cascade attention on a GPU stream; inputs as
// describe_cascade_paged_attention.
std::vector<mx::array> metal_cascade_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& own_kv_lens, const std::vector<int32_t>& prefix_lens,
    const std::vector<int32_t>& prefix_groups, mx::StreamOrDevice s = {});

// out [total_q, Hq, D] (and lse float32 [total_q, Hq] with output_lse) on a
// GPU stream; inputs as describe_paged_attention.
std::vector<mx::array> metal_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& kv_lens, mx::StreamOrDevice s = {});

}  // namespace mlx_attn
