// The merge step of cascade (shared-prefix) paged attention
// (mlx_attn/paged_cascade.py): the query rows' partials of the prefix pass (one
// per key split), the suffix pass and the direct rows, merged by their
// log-sum-exp with the sinks counted once, in one primitive on the CPU (the
// n-way form of the split-K decode merge). Inference only.
#pragma once

#include <vector>

#include "csrc/ops/attention.h"

namespace mlx_attn {

// out [T, Hq, Dv] in `dtype` and lse float32 [T, Hq] of the call's T rows.
// Each pass gives (out [rows, Hq, Dv] in `dtype`, lse float32 [rows, Hq]);
// suffix_index [T], prefix_index [splits, T] and direct_index [T] (int32)
// name each call row's row in its pass, -1 for none; a direct row is taken as
// it is. sinks: float32 [Hq], already saturated (-inf: no sink). Row t's
// result: the weighted sum of its partials and the sink (value zero) with
// weights exp(lse - max); zeros and -inf where no partial has a key and there
// is no sink. Throws std::invalid_argument naming the argument.
std::vector<mx::array> cascade_merge(
    const mx::array& suffix_out, const mx::array& suffix_lse,
    const mx::array& prefix_out, const mx::array& prefix_lse,
    const mx::array& direct_out, const mx::array& direct_lse,
    const mx::array& suffix_index, const mx::array& prefix_index, const mx::array& direct_index,
    const mx::array& sinks, mx::Dtype dtype, mx::StreamOrDevice s = {});

class CascadeMerge : public mx::Primitive {
 public:
  explicit CascadeMerge(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  const char* name() const override {
    return "CascadeMerge";
  }
};

}  // namespace mlx_attn
