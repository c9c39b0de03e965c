#include "csrc/backward_launch_plan.h"

#include <string>

namespace mlx_attn {

namespace {
constexpr int kThreads = 128;          // 4 simdgroups
constexpr int kRowsPerThreadgroup = 32;  // dkdv: keys, dq: query rows (8 per simdgroup)
constexpr int kDeltaRowsPerThreadgroup = 4;  // one simdgroup per row
// dK/dV keeps K, V, dK and dV fragments in registers: 4 * D / 4 floats per
// lane, 128 at D = 128; D = 256 would spill.
constexpr int kMaxHeadDim = 128;

std::string kernel_name(const char* kind, const AttentionProblem& s, bool with_head_dim = true) {
  std::string name = std::string(kind) + "_" + elem_type_name(s.dtype);
  return with_head_dim ? name + "_d" + std::to_string(s.head_dim) : name;
}

// The backward primitive: the forward's inputs, then out, lse, d_out, d_lse;
// outputs dq, dk, dv, then d_sinks with sinks.
PrimitiveLayout backward_layout(const AttentionProblem& s) {
  using R = BufferRole;
  PrimitiveLayout layout = forward_layout(s);
  layout.inputs.insert(layout.inputs.end(), {R::out, R::lse, R::d_out, R::d_lse});
  layout.outputs = {R::dq, R::dk, R::dv};
  if (s.has_sinks) layout.outputs.push_back(R::d_sinks);
  return layout;
}
}  // namespace

// Both follow the instantiations at the end of metal/attention_backward.metal.
int backward_query_block(int head_dim) {
  switch (head_dim) {
    case 64: return 32;
    case 80: case 96: case 128: return 16;
    default: return 0;
  }
}

int backward_key_block(int head_dim) {
  switch (head_dim) {
    case 64: return 32;
    case 80: case 96: case 128: return 16;
    default: return 0;
  }
}

LaunchPlan plan_attention_backward(const AttentionProblem& s) {
  const int64_t rows = int64_t(s.batch) * s.q_heads * s.q_len;
  if (rows * s.kv_len == 0) {  // (before the forward's plan, which needs rows)
    LaunchPlan empty;
    empty.reason = "an empty problem has zero gradients: nothing to launch";
    return empty;
  }
  // The backward runs where the forward's kernels did, with their params.
  LaunchPlan plan = plan_attention(s);
  if (!plan.supported) return plan;
  plan.supported = false;
  plan.splits = 1;
  plan.scratch.clear();
  plan.dispatches.clear();
  const int query_block = backward_query_block(s.head_dim);
  if (query_block == 0) {
    plan.reason = "the Metal backward supports head dims 64, 80, 96 and 128 (register budget), got " +
        std::to_string(s.head_dim);
    return plan;
  }
  using R = BufferRole;
  const PrimitiveLayout layout = backward_layout(s);
  const int last = s.has_sinks ? 3 : 2;
  plan.scratch = {{R::delta, rows, 0, last}};

  KernelDispatch delta;
  delta.kernel = kernel_name("attention_backward_delta", s);
  delta.grid = {int((rows + kDeltaRowsPerThreadgroup - 1) / kDeltaRowsPerThreadgroup), 1, 1};
  delta.threadgroup = {32 * kDeltaRowsPerThreadgroup, 1, 1};
  delta.bindings = bind_roles(layout, {R::out, R::d_out, R::d_lse, R::delta, R::params}, plan.scratch, 0);

  KernelDispatch dkdv;
  dkdv.kernel = kernel_name("attention_backward_dkdv", s) + mask_kernel_suffix(s.mask_kind);
  dkdv.grid = {(s.kv_len + kRowsPerThreadgroup - 1) / kRowsPerThreadgroup, s.kv_heads, s.batch};
  dkdv.threadgroup = {kThreads, 1, 1};
  dkdv.bindings = bind_roles(
      layout, {R::k, R::v, R::q, R::d_out, R::lse, R::delta, R::dk, R::dv, R::params, R::mask}, plan.scratch, 1);
  // float32 Q and dO tiles (rows padded by 16 bytes), lse and delta per row
  dkdv.threadgroup_memory_bytes = (2 * query_block * (s.head_dim + 4) + 2 * query_block) * 4;

  KernelDispatch dq;
  dq.kernel = kernel_name("attention_backward_dq", s) + mask_kernel_suffix(s.mask_kind);
  dq.grid = {(s.q_len + kRowsPerThreadgroup - 1) / kRowsPerThreadgroup, s.q_heads, s.batch};
  dq.threadgroup = {kThreads, 1, 1};
  dq.bindings = bind_roles(
      layout, {R::q, R::k, R::v, R::d_out, R::lse, R::delta, R::dq, R::params, R::mask}, plan.scratch, 2);
  // K and V tiles in the input dtype, as the forward prefill's
  const int element_bytes = s.dtype == ElemType::float32 ? 4 : 2;
  dq.threadgroup_memory_bytes = 2 * backward_key_block(s.head_dim) * (s.head_dim * element_bytes + 16);

  plan.dispatches = {delta, dkdv, dq};
  if (s.has_sinks) {
    KernelDispatch sinks;
    sinks.kernel = kernel_name("attention_backward_sinks", s, false);
    sinks.grid = {s.q_heads, 1, 1};
    sinks.threadgroup = {32, 1, 1};
    sinks.bindings = bind_roles(layout, {R::sinks, R::lse, R::delta, R::d_sinks, R::params}, plan.scratch, 3);
    plan.dispatches.push_back(sinks);
  }
  plan.reason.clear();
  plan.supported = true;
  return plan;
}

}  // namespace mlx_attn
