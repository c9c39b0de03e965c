// Cascade (shared-prefix) paged attention on the CPU as one primitive
// (mlx_attn/paged.py's runner; the plan: mlx_attn/paged_cascade.py): the
// prefix, suffix and direct passes of the fused paged kernel, each over its
// rows of q (gathered when the primitive runs), then the log-sum-exp merge
// (csrc/ops/cascade_merge_splits.h), in one evaluation. Inference only.
#pragma once

#include <optional>
#include <vector>

#include "csrc/ops/attention.h"

namespace mlx_attn {

// The passes, in this order: prefix (not causal, no window, no sinks),
// suffix (options' causal and window, no sinks), direct (options' causal,
// window and sinks); each as (block_table, kv_lens, q_lens, rows): the
// paged kernel's tables of its pseudo-sequences and, int32 [n], the rows of
// q they hold in pass order. suffix_index / prefix_index / direct_index and
// merge_sinks as cascade_merge (csrc/ops/cascade_merge.h). Returns [out, lse]:
// out [total_q, Hq, Dv] in q's dtype, lse float32 [total_q, Hq]. Throws
// std::invalid_argument naming the argument.
std::vector<mx::array> cascade_paged_attention(
    const mx::array& q, const std::vector<mx::array>& k_parts, const std::vector<mx::array>& v_parts,
    const std::vector<mx::array>& passes, const mx::array& suffix_index, const mx::array& prefix_index,
    const mx::array& direct_index, const mx::array& merge_sinks, const std::optional<mx::array>& sinks,
    AttentionOptions options, mx::StreamOrDevice s = {});

class CascadePagedAttention : public mx::Primitive {
 public:
  CascadePagedAttention(mx::Stream stream, AttentionOptions options) : mx::Primitive(stream), options_(options) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // Inference only: each transform raises (ValueError in Python), so the
  // runner needs no mx.custom_function around the call (a node and tens of
  // microseconds of Python per layer).
  std::vector<mx::array> vjp(const std::vector<mx::array>&, const std::vector<mx::array>&, const std::vector<int>&,
                             const std::vector<mx::array>&) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                             const std::vector<int>&) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>&,
                                                           const std::vector<int>&) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "CascadePagedAttention";
  }

 private:
  AttentionOptions options_;
};

}  // namespace mlx_attn
