#include "csrc/metal/backward_launch_plan.h"

#include <algorithm>
#include <string>

namespace mlx_attn {

namespace {
constexpr int kThreads = 128;          // 4 simdgroups
constexpr int kRowsPerThreadgroup = 32;  // dkdv: keys, dq: query rows (8 per simdgroup)
constexpr int kDeltaRowsPerThreadgroup = 4;  // one simdgroup per row
// The D-split kernels (metal/attention_backward_split.metal): columns per
// chunk of a gradient (one threadgroup each), rows per streamed block (query
// rows of dkdv, keys of dq); both follow the instantiations there.
constexpr int kBackwardChunk = 64;
constexpr int kSplitStreamRows = 32;

bool forward_split_pair(int head_dim, int value_dim) {
  for (const auto& dims : kSplitPrefillHeadDims) {
    if (dims[0] == head_dim && dims[1] == value_dim) return true;
  }
  return false;
}

// "64, 80, 96 (key = value head dim), 128, 192/128, ...": the head dims the
// backward kernels are instantiated for, for reasons.
std::string backward_head_dims_text() {
  std::string text = "64, 80, 96, 128 (key = value head dim)";
  for (const auto& dims : kSplitPrefillHeadDims) {
    text += ", " + std::to_string(dims[0]) + "/" + std::to_string(dims[1]);
  }
  return text;
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
    case 80: case 96: return 16;
    default: return 0;  // D = 128 included: backward_splits_key_gradients
  }
}

int backward_key_block(int head_dim) {
  switch (head_dim) {
    case 64: return 32;
    case 80: case 96: case 128: return 16;
    default: return 0;
  }
}

bool backward_splits_key_gradients(int head_dim, int value_dim) {
  return forward_split_pair(head_dim, value_dim) || (head_dim == 128 && value_dim == 128);
}

bool backward_splits_query_gradients(int head_dim, int value_dim) {
  return forward_split_pair(head_dim, value_dim);
}

namespace {

using R = BufferRole;

// The D-split kernels' ids carry both head dims.
KernelId split_kernel(const AttentionProblem& s, KernelFamily family) {
  return kernel_id(family, s).with("dv", s.value_dim).with("bk", kSplitStreamRows);
}

int row_blocks(int rows) {
  return (rows + kRowsPerThreadgroup - 1) / kRowsPerThreadgroup;
}

// delta = rowsum(out * dO) per query row (rows of the value head dim).
KernelDispatch delta_dispatch(const AttentionProblem& s, const PrimitiveLayout& layout, const LaunchPlan& plan,
                              int64_t rows) {
  KernelDispatch delta;
  delta.id = {KernelFamily::backward_delta, s.dtype, {{"d", s.value_dim}}};  // rows of the value head dim
  delta.grid = {int((rows + kDeltaRowsPerThreadgroup - 1) / kDeltaRowsPerThreadgroup), 1, 1};
  delta.threadgroup = {32 * kDeltaRowsPerThreadgroup, 1, 1};
  delta.bindings = bind_roles(layout, {R::out, R::d_out, R::d_lse, R::delta, R::params}, plan.scratch, 0);
  return delta;
}

KernelDispatch key_gradients_dispatch(const AttentionProblem& s, const PrimitiveLayout& layout,
                                      const LaunchPlan& plan, bool split_keys) {
  KernelDispatch dkdv;
  dkdv.threadgroup = {kThreads, 1, 1};
  dkdv.bindings = bind_roles(
      layout, {R::k, R::v, R::q, R::d_out, R::lse, R::delta, R::dk, R::dv, R::params, R::mask}, plan.scratch, 1);
  if (split_keys) {  // one threadgroup per (key block, chunk of dK and dV columns)
    const int chunks = std::max(s.head_dim, s.value_dim) / kBackwardChunk;
    dkdv.id = split_kernel(s, KernelFamily::backward_split_dkdv);
    dkdv.grid = {row_blocks(s.kv_len) * chunks, s.kv_heads, s.batch};
    // float32 chunks of Q and dO (rows padded by 16 bytes), lse and delta per row
    dkdv.threadgroup_memory_bytes = (2 * kSplitStreamRows * (kBackwardChunk + 4) + 2 * kSplitStreamRows) * 4;
  } else {
    const int query_block = backward_query_block(s.head_dim);
    dkdv.id = kernel_id(KernelFamily::backward_dkdv, s);
    dkdv.grid = {row_blocks(s.kv_len), s.kv_heads, s.batch};
    // float32 Q and dO tiles (rows padded by 16 bytes), lse and delta per row
    dkdv.threadgroup_memory_bytes = (2 * query_block * (s.head_dim + 4) + 2 * query_block) * 4;
  }
  return dkdv;
}

KernelDispatch query_gradients_dispatch(const AttentionProblem& s, const PrimitiveLayout& layout,
                                        const LaunchPlan& plan, bool split_queries) {
  KernelDispatch dq;
  dq.threadgroup = {kThreads, 1, 1};
  dq.bindings = bind_roles(
      layout, {R::q, R::k, R::v, R::d_out, R::lse, R::delta, R::dq, R::params, R::mask}, plan.scratch, 2);
  if (split_queries) {  // one threadgroup per (row block, chunk of dQ columns)
    dq.id = split_kernel(s, KernelFamily::backward_split_dq);
    dq.grid = {row_blocks(s.q_len) * (s.head_dim / kBackwardChunk), s.q_heads, s.batch};
    // float32 chunks of K and V (rows padded by 16 bytes)
    dq.threadgroup_memory_bytes = 2 * kSplitStreamRows * (kBackwardChunk + 4) * 4;
  } else {
    dq.id = kernel_id(KernelFamily::backward_dq, s);
    dq.grid = {row_blocks(s.q_len), s.q_heads, s.batch};
    // K and V tiles in the input dtype, as the forward prefill's
    const int element_bytes = s.dtype == ElemType::float32 ? 4 : 2;
    dq.threadgroup_memory_bytes = 2 * backward_key_block(s.head_dim) * (s.head_dim * element_bytes + 16);
  }
  return dq;
}

KernelDispatch sinks_gradient_dispatch(const AttentionProblem& s, const PrimitiveLayout& layout,
                                       const LaunchPlan& plan) {
  KernelDispatch sinks;
  sinks.id = {KernelFamily::backward_sinks, s.dtype, {}};
  sinks.grid = {s.q_heads, 1, 1};
  sinks.threadgroup = {32, 1, 1};
  sinks.bindings = bind_roles(layout, {R::sinks, R::lse, R::delta, R::d_sinks, R::params}, plan.scratch, 3);
  return sinks;
}

}  // namespace

LaunchPlan plan_attention_backward(const AttentionProblem& s) {
  const int64_t rows = int64_t(s.batch) * s.q_heads * s.q_len;
  if (rows * s.kv_len == 0) {  // (before the forward's plan, which needs rows)
    LaunchPlan empty;
    empty.problem = s;
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
  const bool split_keys = backward_splits_key_gradients(s.head_dim, s.value_dim);
  const bool split_queries = backward_splits_query_gradients(s.head_dim, s.value_dim);
  const bool equal_dims = s.head_dim == s.value_dim;
  const bool keys_served = split_keys || (equal_dims && backward_query_block(s.head_dim) != 0);
  const bool queries_served = split_queries || (equal_dims && backward_key_block(s.head_dim) != 0);
  if (!keys_served || !queries_served) {
    plan.reason = "the Metal backward supports head dims (key/value) " + backward_head_dims_text() + ", got " +
        std::to_string(s.head_dim) + "/" + std::to_string(s.value_dim);
    return plan;
  }
  const PrimitiveLayout layout = backward_layout(s);
  plan.scratch = {{R::delta, rows, 0, s.has_sinks ? 3 : 2}};
  plan.dispatches = {delta_dispatch(s, layout, plan, rows), key_gradients_dispatch(s, layout, plan, split_keys),
                     query_gradients_dispatch(s, layout, plan, split_queries)};
  if (s.has_sinks) plan.dispatches.push_back(sinks_gradient_dispatch(s, layout, plan));
  plan.reason.clear();
  plan.supported = true;
  return plan;
}

}  // namespace mlx_attn
