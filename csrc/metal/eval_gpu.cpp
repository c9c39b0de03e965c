// The primitives' GPU evaluation (Mac only; csrc/metal/no_metal.cpp stands in
// elsewhere): each builds its launch plan from the evaluated inputs and
// encodes it (csrc/metal/attention_metal.h). The plans themselves are
// portable (csrc/metal/*launch_plan.cpp) and tested on Linux.
#include "csrc/metal/attention_metal.h"
#include "csrc/metal/backend.h"
#include "csrc/metal/backward_launch_plan.h"
#include "csrc/ops/attention.h"
#include "csrc/ops/metal_paged_attention.h"

namespace mlx_attn {

namespace {

void allocate(std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
}

}  // namespace

bool metal::available() {
  return true;
}

void AttentionPrimitive::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  if (outputs[0].size() == 0) return;  // no plan for an empty problem
  metal::encode_launch_plan(stream(), launch_plan(inputs, metal::gpu_target(stream())), inputs, outputs);
}

void FusedAttentionBackward::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const size_t forward_inputs = 3 + options_.has_mask + options_.has_sinks;
  const std::vector<mx::array> primals(inputs.begin(), inputs.begin() + forward_inputs);
  metal::encode_launch_plan(stream(), plan_attention_backward(describe_attention(primals, options_)), inputs, outputs);
}

void MetalPagedAttention::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const PagedProblem problem = describe_paged_attention(inputs, options_, q_lens_, kv_lens_);
  metal::encode_launch_plan(stream(), plan_paged_attention(problem, metal::gpu_target(stream())), inputs, outputs);
}

void MetalCascadePagedAttention::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  allocate(outputs);
  const CascadeProblem problem =
      describe_cascade_paged_attention(inputs, options_, lengths_[0], lengths_[1], lengths_[2], lengths_[3]);
  metal::encode_launch_plan(stream(), plan_cascade_paged_attention(problem, metal::gpu_target(stream())), inputs,
                            outputs);
}

}  // namespace mlx_attn
