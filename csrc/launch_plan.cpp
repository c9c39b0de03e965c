#include "csrc/launch_plan.h"

#include <algorithm>
#include <cmath>

namespace mlx_attn {

namespace {
constexpr int kPrefillRows = 32;       // BQ: 4 simdgroups x 8 rows
constexpr int kPrefillThreads = 128;
constexpr int kThreadgroupMemoryLimit = 32 * 1024;
}  // namespace

int prefill_key_block(int head_dim) {
  switch (head_dim) {  // 2 * BK * D * 4 bytes of K/V tiles <= 16 KB
    case 64: return 32;
    case 80: case 96: case 128: return 16;
    case 256: return 8;
    default: return 0;
  }
}

int decode_key_block(int head_dim) {
  return head_dim % 32 == 0 ? prefill_key_block(head_dim) : 0;
}

namespace {
constexpr int kDecodeThreads = 128;
constexpr int kDecodeKeysPerSplit = 64;
constexpr int kDecodeMaxSplits = 32;

void plan_decode(const AttentionProblem& s, LaunchPlan& plan) {
  const int rows = (s.q_heads / s.kv_heads) * s.q_len;
  const int splits = std::max(1, std::min(kDecodeMaxSplits, (s.kv_len + kDecodeKeysPerSplit - 1) / kDecodeKeysPerSplit));
  const int64_t partials = int64_t(s.batch) * s.kv_heads * splits * rows;
  plan.splits = splits;
  plan.scratch = {{"partial_out", partials * s.head_dim}, {"partial_stats", partials * 2}};
  const int key_block = decode_key_block(s.head_dim);
  KernelDispatch partial;
  partial.kernel = "attention_decode_partial_" + std::string(elem_type_name(s.dtype)) + "_d" + std::to_string(s.head_dim);
  partial.grid = {splits, s.kv_heads, s.batch};
  partial.threadgroup = {kDecodeThreads, 1, 1};
  partial.buffers = {"q", "k", "v", "params", "mask", "partial_out", "partial_stats"};
  partial.threadgroup_memory_bytes = 2 * key_block * s.head_dim * 4;
  KernelDispatch merge;
  merge.kernel = "attention_decode_merge_" + std::string(elem_type_name(s.dtype)) + "_d" + std::to_string(s.head_dim);
  merge.grid = {rows, s.kv_heads, s.batch};
  merge.threadgroup = {32, 1, 1};
  merge.buffers = {"partial_out", "partial_stats", "sinks", "out", "params", "splits"};
  plan.dispatches = {partial, merge};
}
}  // namespace

LaunchPlan plan_attention(const AttentionProblem& s) {
  LaunchPlan plan;
  const int key_block = prefill_key_block(s.head_dim);
  if (key_block == 0) {
    plan.reason = "the Metal kernels support head dims 64, 80, 96, 128 and 256, got " + std::to_string(s.head_dim);
    return plan;
  }
  if (s.value_dim != s.head_dim) {
    plan.reason = "the Metal kernels need equal query/key and value head dims, got " + std::to_string(s.head_dim) +
        " and " + std::to_string(s.value_dim);
    return plan;
  }
  if (s.output_lse) {
    plan.reason = "the Metal kernels do not return the log-sum-exp";
    return plan;
  }
  if (s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) {
    plan.reason = "q_heads must be a multiple of kv_heads";
    return plan;
  }
  AttentionParams& p = plan.params;
  for (int i = 0; i < 4; ++i) {
    p.q_strides[i] = s.q_strides[i];
    p.k_strides[i] = s.k_strides[i];
    p.v_strides[i] = s.v_strides[i];
    p.mask_strides[i] = s.mask_strides[i];
  }
  p.batch = s.batch;
  p.q_heads = s.q_heads;
  p.kv_heads = s.kv_heads;
  p.group = s.q_heads / s.kv_heads;
  p.q_len = s.q_len;
  p.kv_len = s.kv_len;
  p.causal = s.causal ? 1 : 0;
  p.window_size = s.window_size;
  p.mask_kind = int32_t(s.mask_kind);
  p.has_sinks = s.has_sinks ? 1 : 0;
  p.scale = s.scale;

  const int rows = (s.q_heads / s.kv_heads) * s.q_len;
  if (s.q_len <= kDecodeMaxQueries && rows <= kDecodeMaxRows && decode_key_block(s.head_dim) != 0) {
    plan_decode(s, plan);
    plan.supported = true;
    return plan;
  }

  KernelDispatch prefill;
  prefill.kernel = "attention_prefill_" + std::string(elem_type_name(s.dtype)) + "_d" + std::to_string(s.head_dim);
  prefill.grid = {(s.q_len + kPrefillRows - 1) / kPrefillRows, s.q_heads, s.batch};
  prefill.threadgroup = {kPrefillThreads, 1, 1};
  prefill.buffers = {"q", "k", "v", "out", "params", "mask", "sinks"};
  prefill.threadgroup_memory_bytes = 2 * key_block * s.head_dim * 4 + kPrefillRows * key_block * 4 +
      4 * 64 * 4 + kPrefillRows * 4;
  if (prefill.threadgroup_memory_bytes > kThreadgroupMemoryLimit) {
    plan.reason = "threadgroup memory over 32 KB";
    return plan;
  }
  plan.dispatches.push_back(prefill);
  plan.supported = true;
  return plan;
}

}  // namespace mlx_attn
