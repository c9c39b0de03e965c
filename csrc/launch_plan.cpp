#include "csrc/launch_plan.h"

#include <cmath>

namespace mlx_attn {

namespace {
constexpr int kPrefillRows = 32;       // BQ: 4 simdgroups x 8 rows
constexpr int kPrefillThreads = 128;
constexpr int kThreadgroupMemoryLimit = 32 * 1024;
constexpr float kLog2e = 1.4426950408889634f;
}  // namespace

int prefill_key_block(int head_dim) {
  switch (head_dim) {  // 2 * BK * D * 4 bytes of K/V tiles <= 16 KB
    case 64: return 32;
    case 80: case 96: case 128: return 16;
    case 256: return 8;
    default: return 0;
  }
}

LaunchPlan plan_attention(const AttentionShape& s) {
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
  if (s.dtype != "float32" && s.dtype != "float16" && s.dtype != "bfloat16") {
    plan.reason = "unsupported dtype " + s.dtype;
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
  p.causal = (s.causal || s.window_size > 0) ? 1 : 0;
  p.window_size = s.window_size;
  p.mask_kind = s.mask_kind;
  p.has_sinks = s.has_sinks ? 1 : 0;
  p.scale_log2 = s.scale * kLog2e;

  KernelDispatch prefill;
  prefill.kernel = "attention_prefill_" + s.dtype + "_d" + std::to_string(s.head_dim);
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
