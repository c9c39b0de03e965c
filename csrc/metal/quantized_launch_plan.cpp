#include "csrc/metal/quantized_launch_plan.h"

#include <cstring>

#include "metal/attention_quantized_params.h"

namespace mlx_attn {

namespace {

QuantizedAttentionParams quantized_params(const cpu::QuantizedKV& qz) {
  QuantizedAttentionParams qp{};
  for (int i = 0; i < 4; ++i) {
    qp.k_scale_strides[i] = qz.k_scale_strides[i];
    qp.k_bias_strides[i] = qz.k_bias_strides[i];
    qp.v_scale_strides[i] = qz.v_scale_strides[i];
    qp.v_bias_strides[i] = qz.v_bias_strides[i];
  }
  qp.group_size = qz.group_size;
  return qp;
}

// ---- the quantized prefill branch (quantized_rows_take_prefill) ----
// One dispatch of the quantized prefill kernel: the dense prefill's grid
// (query blocks of BQ rows x query heads x batch), its key block and its
// tiles in q's dtype (csrc/metal/launch_plan.cpp plan_attention).
void plan_quantized_prefill(const AttentionProblem& s, const cpu::QuantizedKV& qz, const GpuTarget& target,
                            LaunchPlan& plan) {
  using R = BufferRole;
  const int simdgroups = gpu_tuning(target.family).prefill_simdgroups;
  const int query_block = 8 * simdgroups;  // BQ: 8 rows per simdgroup
  const int key_block = prefill_key_block(s.head_dim, s.dtype, target);
  KernelDispatch prefill;
  prefill.id = kernel_id(KernelFamily::quantized_prefill, s).with("b", qz.bits).with("bk", key_block);
  prefill.grid = {(s.q_len + query_block - 1) / query_block, s.q_heads, s.batch};
  prefill.threadgroup = {32 * simdgroups, 1, 1};
  prefill.bindings = bind_roles(forward_layout(s, /*quantized=*/true),
                                {R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases, R::out,
                                 R::params, R::quantized_params, R::mask, R::sinks, R::lse},
                                plan.scratch, 0);
  // K and V tiles of the dequantized block in q's dtype, rows padded by 16 bytes
  const int element_bytes = s.dtype == ElemType::float32 ? 4 : 2;
  prefill.threadgroup_memory_bytes = 2 * key_block * (s.head_dim * element_bytes + 16);
  plan.dispatches = {prefill};
  plan.splits = 1;
}
// ---- end of the quantized prefill branch ----

}  // namespace

bool quantized_rows_take_prefill(const AttentionProblem& s, const cpu::QuantizedKV& qz) {
  const bool prefill_rows = s.q_len > kDecodeMaxQueries || s.group_size() * s.q_len > kDecodeMaxRows;
  const bool instantiated = s.head_dim <= kRegisterPrefillMaxHeadDim && s.head_dim == s.value_dim &&
      prefill_key_block(s.head_dim, s.dtype) != 0 && decode_group_shape(s.head_dim).rows != 0;
  // a staged run of 32 features reads one scale and bias (stage_quantized_key_block)
  return prefill_rows && instantiated && (qz.bits == 4 || qz.bits == 8) && qz.group_size % 32 == 0;
}

LaunchPlan plan_quantized_attention(const AttentionProblem& s, const cpu::QuantizedKV& qz, const GpuTarget& target,
                                    DecodeShapeChoice decode_choice) {
  if (int64_t(s.batch) * s.q_heads * s.q_len == 0) {
    LaunchPlan empty;  // an empty output: nothing to launch
    empty.problem = s;
    empty.supported = true;
    return empty;
  }
  // The float plan's checks (head dims, GQA) and its AttentionParams, which
  // the quantized kernels read too; its dispatches are replaced.
  LaunchPlan plan = plan_attention(s, target);
  if (!plan.supported) return plan;
  plan.supported = false;
  plan.dispatches.clear();
  if (qz.bits != 4 && qz.bits != 8) {
    plan.reason = "the quantized Metal kernels read 4- or 8-bit codes, got bits=" + std::to_string(qz.bits);
    return plan;
  }
  const int slice = s.head_dim / 32;  // features per lane: one scale and bias each
  if (decode_group_shape(s.head_dim).rows == 0 || qz.group_size <= 0 || qz.group_size % slice != 0) {
    plan.reason = "the quantized Metal kernels need a head dim of 64, 128, 256 or 512 (key = value) that is a multiple of group_size, "
                  "got head dim " + std::to_string(s.head_dim) + " and group_size " + std::to_string(qz.group_size);
    return plan;
  }

  // ---- prefill rows: the quantized prefill kernel (its own branch; the decode structure below) ----
  if (quantized_rows_take_prefill(s, qz)) {
    plan_quantized_prefill(s, qz, target, plan);
    const QuantizedAttentionParams qp = quantized_params(qz);
    plan.quantized_params.resize(sizeof(qp));
    std::memcpy(plan.quantized_params.data(), &qp, sizeof(qp));
    plan.supported = true;
    return plan;
  }
  // ---- end of the prefill rows ----

  using R = BufferRole;
  const int rows = s.group_size() * s.q_len;
  // the float decode's body in the float decode's shapes, chosen by its rule
  const DecodeShape shape =
      decode_shape(s.batch, s.kv_heads, rows, s.kv_len, s.head_dim, target, decode_choice, {}, DecodeKeys::dequantized);
  const int row_chunks = (rows + shape.rows - 1) / shape.rows;
  const int splits = decode_splits(s.batch, s.kv_heads, rows, s.kv_len, shape, target, DecodeKeys::dequantized);
  plan.splits = splits;
  // the float decode's partials and merge: none with one split
  plan.scratch = decode_partials_scratch(s, splits);

  KernelDispatch partial;
  partial.id = kernel_id(KernelFamily::quantized_decode_partial, s).with("b", qz.bits);
  shape.add_fields(partial.id);
  partial.grid = {splits, s.kv_heads * row_chunks, s.batch};
  partial.threadgroup = {shape.threads(), 1, 1};
  const PrimitiveLayout layout = forward_layout(s, /*quantized=*/true);
  partial.bindings = bind_roles(layout, {R::q, R::k, R::k_scales, R::k_biases, R::v, R::v_scales, R::v_biases, R::params,
                                  R::quantized_params, R::mask, R::partial_out, R::partial_stats, R::sinks,
                                  R::out, R::lse},
                              plan.scratch, 0);
  partial.threadgroup_memory_bytes = shape.states_bytes(s.head_dim);

  plan.dispatches = {partial};
  add_decode_merge(s, layout, plan);  // the float decode's (metal/attention_decode.metal)

  const QuantizedAttentionParams qp = quantized_params(qz);
  plan.quantized_params.resize(sizeof(qp));
  std::memcpy(plan.quantized_params.data(), &qp, sizeof(qp));
  plan.supported = true;
  return plan;
}

}  // namespace mlx_attn
