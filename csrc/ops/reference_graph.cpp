#include "csrc/ops/reference_graph.h"

#include <limits>
#include <optional>

#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace mlx_attn {

namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();

mx::array saturate(const mx::array& x, mx::Stream s) {
  return mx::clip(x, mx::array(-MLX_ATTN_LOGIT_LIMIT), mx::array(MLX_ATTN_LOGIT_LIMIT), s);
}

// [B, Hq, ...] -> [B, Hkv, G, ...], no copy (a head axis of 1 broadcasts).
mx::array group_heads(const mx::array& x, int kv_heads, mx::Stream s) {
  if (x.shape(1) == 1) return mx::expand_dims(x, 2, s);
  return mx::unflatten(x, 1, {kv_heads, -1}, s);
}

// True where query i may see key j ([Tq, Tkv], lower-right aligned), built
// from the arrays' shapes through ops, as reference.py's _visibility: a
// shapeless compile then follows every later call's lengths.
mx::array visibility(const mx::array& qf, const mx::array& kf, int window_size, mx::Stream s) {
  auto query_ones = mx::ones_like(mx::sum(qf, {0, 1, 2, 4}, false, s), s);
  auto key_ones = mx::ones_like(mx::sum(kf, {0, 1, 2, 4}, false, s), s);
  query_ones = mx::astype(query_ones, mx::int32, s);
  key_ones = mx::astype(key_ones, mx::int32, s);
  auto one = mx::array(1, mx::int32);
  auto query_index = mx::subtract(mx::cumsum(query_ones, 0, false, true, s), one, s);
  auto key_index = mx::expand_dims(mx::subtract(mx::cumsum(key_ones, 0, false, true, s), one, s), 0, s);
  auto shift = mx::subtract(mx::sum(key_ones, false, s), mx::sum(query_ones, false, s), s);
  auto positions = mx::add(mx::expand_dims(query_index, 1, s), shift, s);
  auto visible = mx::less_equal(key_index, positions, s);
  if (window_size > 0) {
    auto oldest = mx::subtract(positions, mx::array(window_size, mx::int32), s);
    visible = mx::logical_and(visible, mx::greater(key_index, oldest, s), s);
  }
  return visible;
}

// mask: -inf where a key may not be seen; an additive mask's values added
// and saturated (a value at or below the masked sentinel masks the key).
mx::array mask_logits(
    mx::array scores,
    const mx::array& qf,
    const mx::array& kf,
    const std::optional<mx::array>& mask,
    const AttentionOptions& options,
    int kv_heads,
    mx::Stream s) {
  std::optional<mx::array> visible;
  if (options.causal) visible = visibility(qf, kf, options.window_size, s);
  const auto masked = mx::array(-kInfinity);
  if (mask) {
    auto full = *mask;
    while (full.ndim() < 4) full = mx::expand_dims(full, 0, s);
    full = group_heads(full, kv_heads, s);
    if (full.dtype() == mx::bool_) {
      visible = visible ? mx::logical_and(*visible, full, s) : full;
    } else {
      auto added = mx::astype(full, mx::float32, s);
      auto below = mx::less_equal(added, mx::array(MLX_ATTN_MASKED_LOGIT), s);
      scores = mx::where(below, masked, saturate(mx::add(scores, added, s), s), s);
    }
  }
  if (visible) scores = mx::where(*visible, scores, masked, s);
  return scores;
}

struct Softmax {
  mx::array weights;  // normalized; all zero in a row that sees no key
  std::optional<mx::array> lse;
};

// softmax along keys (max, exp, sum; sinks join max and sum), normalize,
// and the row log-sum-exp [B, Hq, Tq] when asked for.
Softmax softmax(const mx::array& scores, const std::optional<mx::array>& sinks, int kv_heads, bool want_lse,
                mx::Stream s) {
  auto row_max = mx::max(scores, -1, true, s);
  std::optional<mx::array> sink_logits;
  if (sinks) {
    auto grouped = mx::expand_dims(saturate(mx::astype(*sinks, mx::float32, s), s), {0, 2, 3}, s);
    sink_logits = group_heads(grouped, kv_heads, s);
    row_max = mx::maximum(row_max, *sink_logits, s);
  }
  const auto zero = mx::array(0.0f);
  const auto one = mx::array(1.0f);
  // A row that sees nothing has max -inf; any finite shift keeps exp = 0.
  row_max = mx::where(mx::equal(row_max, mx::array(-kInfinity), s), zero, row_max, s);
  auto weights = mx::exp(mx::subtract(scores, row_max, s), s);
  auto row_sum = mx::sum(weights, -1, true, s);
  if (sink_logits) row_sum = mx::add(row_sum, mx::exp(mx::subtract(*sink_logits, row_max, s), s), s);
  const auto empty = mx::equal(row_sum, zero, s);
  std::optional<mx::array> lse;
  if (want_lse) {
    // log of a safe sum: log's derivative at 0 would turn where()'s zero cotangent into NaN
    auto safe_log = mx::log(mx::where(empty, one, row_sum, s), s);
    auto row_lse = mx::where(empty, mx::array(-kInfinity), mx::add(row_max, safe_log, s), s);
    lse = mx::flatten(mx::squeeze(row_lse, -1, s), 1, 2, s);
  }
  return {mx::divide(weights, mx::where(empty, one, row_sum, s), s), lse};
}

}  // namespace

std::vector<mx::array> reference_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, mx::Stream s) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  size_t next = 3;
  std::optional<mx::array> mask, sinks;
  if (options.has_mask) mask = inputs[next++];
  if (options.has_sinks) sinks = inputs[next++];
  const int batch = q.shape(0), q_heads = q.shape(1), q_len = q.shape(2);
  const int kv_heads = k.shape(1);
  if (k.shape(2) == 0) {  // no key to see: every row is fully masked
    std::vector<mx::array> out = {mx::zeros({batch, q_heads, q_len, v.shape(3)}, q.dtype(), s)};
    if (options.output_lse) out.push_back(mx::full({batch, q_heads, q_len}, -kInfinity, mx::float32, s));
    return out;
  }
  auto qf = group_heads(mx::astype(q, mx::float32, s), kv_heads, s);  // [B,Hkv,G,Tq,D]
  auto kf = mx::expand_dims(mx::astype(k, mx::float32, s), 2, s);     // [B,Hkv,1,Tkv,D]
  auto vf = mx::expand_dims(mx::astype(v, mx::float32, s), 2, s);     // [B,Hkv,1,Tkv,Dv]
  // score, scale
  auto scores = saturate(mx::multiply(mx::matmul(qf, mx::swapaxes(kf, -1, -2, s), s), mx::array(options.scale), s), s);
  if (options.softcap > 0.0f) {  // softcap_logit, before the mask
    const auto cap = mx::array(options.softcap);
    scores = mx::multiply(cap, mx::tanh(mx::divide(scores, cap, s), s), s);
  }
  scores = mask_logits(scores, qf, kf, mask, options, kv_heads, s);
  auto [weights, lse] = softmax(scores, sinks, kv_heads, options.output_lse, s);
  // aggregate
  auto out = mx::astype(mx::flatten(mx::matmul(weights, vf, s), 1, 2, s), q.dtype(), s);
  std::vector<mx::array> outputs = {out};
  if (lse) outputs.push_back(*lse);
  return outputs;
}

std::vector<mx::array> reference_derivatives(
    bool forward_mode,
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& vectors,
    const std::vector<int>& argnums,
    const AttentionOptions& options,
    mx::Stream s) {
  std::vector<int> active;  // the differentiated inputs that are not constants
  std::vector<mx::array> chosen, tangents;
  for (size_t n = 0; n < argnums.size(); ++n) {
    const int i = argnums[n];
    if (primals[i].dtype() == mx::bool_) continue;
    active.push_back(i);
    chosen.push_back(primals[i]);
    if (forward_mode) tangents.push_back(vectors[n]);
  }
  auto of_active = [&](const std::vector<mx::array>& arrays) {
    std::vector<mx::array> all = primals;
    for (size_t n = 0; n < active.size(); ++n) all[active[n]] = arrays[n];
    return reference_attention(all, options, s);
  };
  if (forward_mode) {
    if (chosen.empty()) {
      std::vector<mx::array> zeros;
      for (const auto& out : reference_attention(primals, options, s)) zeros.push_back(mx::zeros_like(out, s));
      return zeros;
    }
    return mx::jvp(of_active, chosen, tangents).second;
  }
  std::vector<mx::array> grads;
  if (!chosen.empty()) grads = mx::vjp(of_active, chosen, vectors).second;
  std::vector<mx::array> result;
  for (int i : argnums) {
    size_t n = 0;
    while (n < active.size() && active[n] != i) ++n;
    result.push_back(n < active.size() ? grads[n] : mx::zeros_like(primals[i], s));
  }
  return result;
}

}  // namespace mlx_attn
