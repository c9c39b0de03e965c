// The fused attention backward for the CPU (see backward_kernels.h for the
// algorithm and the two schemes). Included once per instruction set by
// backward_<isa>.cpp, which defines MLX_ATTN_ISA (<isa>_backward) and
// MLX_ATTN_VEC_BYTES like the forward's units. It shares the forward's vector
// basics (simd.h), element conversion (elements.h) and register-blocked
// micro-kernel (micro_kernel.h), but none of the forward itself. Steps mirror
// the forward's: score, scale (saturating: no gradient where a logit is
// clamped), softcap (the gradient times 1 - tanh^2), mask, then
// P = exp(S - lse) instead of the online softmax; the
// rules they apply are the ones every kernel shares (metal/attention_rules.h,
// through csrc/cpu/rules.h).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "csrc/cpu/backward_kernels.h"
#include "csrc/cpu/elements.h"
#include "csrc/cpu/micro_kernel.h"
#include "csrc/cpu/rules.h"
#include "csrc/cpu/simd.h"

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

// A tile's rows are (head in group, query position): row = g * qb + i, as in
// the forward's work items.
struct TileRows {
  int b, kv_head, q_start, qb, group;
  int rows() const { return group * qb; }
  int head(int r) const { return kv_head * group + r / qb; }
  int query(int r) const { return q_start + r % qb; }
};

// One thread's buffers (backward_scratch in backward_kernels.h).
struct Buffers {
  float *q_packed, *d_out_packed, *probs, *d_scores, *gate, *k_t, *v_t, *k_rows,
      *dk_acc, *dv_acc, *dq_acc, *lse_row, *delta_row;
};

Buffers buffers_of(const BackwardCall& call, float* scratch) {
  const BackwardScratch s = backward_scratch(call, kLanes);
  return {scratch + s.q_packed, scratch + s.d_out_packed, scratch + s.probs,
          scratch + s.d_scores, scratch + s.gate,         scratch + s.k_t,
          scratch + s.v_t,      scratch + s.k_rows,       scratch + s.dk_acc,
          scratch + s.dv_acc,   scratch + s.dq_acc,       scratch + s.lse_row,
          scratch + s.delta_row};
}

inline int64_t row_index(const AttentionProblem& p, int b, int h, int qi) {
  return (int64_t(b) * p.q_heads + h) * p.q_len + qi;
}

inline void zero_tail(float* row, int from, int to) {
  for (int e = from; e < to; ++e) row[e] = 0.0f;
}

// Q [rows][Dp] and dO [rows][Dvp] (zero padded), lse (+inf where the row saw
// nothing, so P = exp(S - lse) is 0 there) and delta per row.
template <ElemType T>
void pack_rows(const BackwardCall& call, const TileRows& t, const Buffers& buf, int ldq, int lddo) {
  const AttentionProblem& p = call.problem;
  for (int r = 0; r < t.rows(); ++r) {
    const int h = t.head(r), qi = t.query(r);
    float* q_row = buf.q_packed + r * ldq;
    load_row<T>(q_row, 1, call.q, t.b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2],
                p.q_strides[3], p.head_dim, 1.0f);
    zero_tail(q_row, p.head_dim, ldq);
    const int64_t* ds = call.d_out_strides;
    float* d_out_row = buf.d_out_packed + r * lddo;
    load_row<T>(d_out_row, 1, call.d_out, t.b * ds[0] + h * ds[1] + qi * ds[2], ds[3], p.value_dim, 1.0f);
    zero_tail(d_out_row, p.value_dim, lddo);
    const int64_t i = row_index(p, t.b, h, qi);
    buf.lse_row[r] = call.lse[i] == -INFINITY ? INFINITY : call.lse[i];
    buf.delta_row[r] = call.delta[i];
  }
}

// K^T [D][KB], V^T [Dv][KB] of keys kb..kb+n (zero columns past n) and
// K [KB][ldk] (zero padded), the B panels of the tile's products.
template <ElemType T>
void pack_keys(const BackwardCall& call, int b, int kv_head, int kb, int n, const Buffers& buf, int ldk) {
  const AttentionProblem& p = call.problem;
  const int KB = kKeyBlock;
  for (int j = 0; j < n; ++j) {
    const int64_t koff = b * p.k_strides[0] + kv_head * p.k_strides[1] + int64_t(kb + j) * p.k_strides[2];
    float* k_row = buf.k_rows + j * ldk;
    load_row<T>(k_row, 1, call.k, koff, p.k_strides[3], p.head_dim, 1.0f);
    zero_tail(k_row, p.head_dim, ldk);
    for (int d = 0; d < p.head_dim; ++d) buf.k_t[d * KB + j] = k_row[d];
    const int64_t voff = b * p.v_strides[0] + kv_head * p.v_strides[1] + int64_t(kb + j) * p.v_strides[2];
    load_row<T>(buf.v_t + j, KB, call.v, voff, p.v_strides[3], p.value_dim, 1.0f);
  }
  for (int j = n; j < KB; ++j) {
    for (int d = 0; d < p.head_dim; ++d) buf.k_t[d * KB + j] = 0.0f;
    for (int e = 0; e < p.value_dim; ++e) buf.v_t[e * KB + j] = 0.0f;
    zero_tail(buf.k_rows + j * ldk, 0, ldk);
  }
}

// The gradient gate of a tile's logits, [rows][KB]: the softcap's slope
// (softcap_slope) with a softcap, and 0 where a logit was clamped (no
// gradient there). It is only written once one of them applies; until then
// every entry counts as 1.
struct Gate {
  float* values;
  int rows;
  bool active;
  // Closes the gate of (row r, key j), first opening every entry.
  void close(int r, int j) {
    if (!active) {
      for (int64_t i = 0; i < int64_t(rows) * kKeyBlock; ++i) values[i] = 1.0f;
      active = true;
    }
    values[r * kKeyBlock + j] = 0.0f;
  }
};

// scale (saturating), then softcap (its slopes into the gate) of row r's
// logits s[0, KB); closes the gate where scale * q.k clamped.
MLX_ATTN_STEP void scale_logits(const AttentionProblem& p, const Buffers& buf, int ldq, int r, int n, float* s,
                                Gate& gate) {
  const vfloat limit = splat(kLogitLimit), scale = splat(p.scale);
  vint clamped = vint{};
  for (int c = 0; c < kKeyBlock; c += kLanes) {
    const vfloat x = load(s + c) * scale;
    clamped |= (x > limit) | (x < -limit);
    store(s + c, saturate(x));
  }
  if (p.softcap > 0.0f) {
    for (int c = 0; c < kKeyBlock; c += kLanes) {
      const vfloat y = softcap_logit(load(s + c), p.softcap);
      store(s + c, y);
      store(gate.values + r * kKeyBlock + c, softcap_slope(y, p.softcap));
    }
  }
  bool any_clamped = false;
  for (int i = 0; i < kLanes; ++i) any_clamped |= clamped[i] != 0;
  if (any_clamped) {  // rare: recompute which logits clamped
    for (int j = 0; j < n; ++j) {
      float dot = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) dot += buf.q_packed[r * ldq + d] * buf.k_t[d * kKeyBlock + j];
      if (!(fabsf(dot * p.scale) <= kLogitLimit)) gate.close(r, j);
    }
  }
}

// mask of row r's logits s[0, KB): explicit masks (an additive sum that
// clamped closes the gate), causal / window on edge tiles, the sentinel past
// key n.
template <ElemType T>
MLX_ATTN_STEP void mask_logits(const BackwardCall& call, const TileRows& t, int r, int kb, int n, bool on_edge,
                               float* s, Gate& gate) {
  const AttentionProblem& p = call.problem;
  const int qi = t.query(r);
  if (p.mask_kind != MaskKind::none) {
    const int64_t ms = p.mask_strides[3];
    const int64_t moff = mask_offset(p, t.b, t.head(r), qi, kb);
    if (p.mask_kind == MaskKind::boolean) {
      const bool* m = static_cast<const bool*>(call.mask) + moff;
      for (int j = 0; j < n; ++j) s[j] = bool_masked_logit(s[j], m[j * ms]);
    } else {
      for (int j = 0; j < n; ++j) {
        const float added = load_elem<T>(call.mask, moff + j * ms);
        const float x = additive_masked_logit(s[j], added);
        // the sum clamped (not masked, not NaN): no gradient
        if (!logit_masked(x) && x == x && x != s[j] + added) gate.close(r, j);
        s[j] = x;
      }
    }
  }
  if (on_edge) mask_hidden_keys(p, query_position(p, qi), kb, n, s, 1);
  for (int j = n; j < kKeyBlock; ++j) s[j] = MLX_ATTN_MASKED_LOGIT;
}

// dP = dO . V^T, then dS = scale * P * (dP - delta) * gate in place.
MLX_ATTN_STEP void score_gradients(const AttentionProblem& p, const Buffers& buf, int rows, int lddo,
                                   const Gate& gate) {
  const vfloat scale = splat(p.scale);
  matmul_overwrite(buf.d_out_packed, lddo, buf.v_t, kKeyBlock, buf.d_scores, kKeyBlock, rows, p.value_dim,
                   kKeyBlock);
  for (int r = 0; r < rows; ++r) {
    float* ds = buf.d_scores + r * kKeyBlock;
    const float* pr = buf.probs + r * kKeyBlock;
    const vfloat delta = splat(buf.delta_row[r]);
    for (int c = 0; c < kKeyBlock; c += kLanes) {
      vfloat g = load(pr + c) * (load(ds + c) - delta) * scale;
      if (gate.active) g *= load(gate.values + r * kKeyBlock + c);
      store(ds + c, g);
    }
  }
}

// One tile: P [rows][KB] = exp(S - lse) of the masked, saturated (and
// softcapped) logits and dS [rows][KB] = scale * P * (dO . V^T - delta) *
// gate (Gate). Columns past n are 0.
template <ElemType T>
void tile_gradients(const BackwardCall& call, const TileRows& t, int kb, int n, const Buffers& buf,
                    int ldq, int lddo) {
  const AttentionProblem& p = call.problem;
  const int rows = t.rows();
  // with a softcap every row writes its slopes into the gate before a clamp closes one
  Gate gate{buf.gate, rows, p.softcap > 0.0f};
  // Only tiles that straddle the causal diagonal or the window's edge mask
  // per key (as the forward's).
  const bool on_edge =
      block_on_edge(p, kb, n, query_position(p, t.q_start), query_position(p, t.q_start + t.qb - 1));

  // score
  matmul_overwrite(buf.q_packed, ldq, buf.k_t, kKeyBlock, buf.probs, kKeyBlock, rows, p.head_dim, kKeyBlock);
  for (int r = 0; r < rows; ++r) {
    float* s = buf.probs + r * kKeyBlock;
    scale_logits(p, buf, ldq, r, n, s, gate);
    mask_logits<T>(call, t, r, kb, n, on_edge, s, gate);
    // P = exp(S - lse)
    const vfloat lse = splat(buf.lse_row[r]);
    for (int c = 0; c < kKeyBlock; c += kLanes) store(s + c, exp2_vec((load(s + c) - lse) * kLog2e));
  }
  score_gradients(p, buf, rows, lddo, gate);
}

// dV += P^T . dO and dK += dS^T . Q of one tile (P and dS read transposed in
// place by the micro-kernel).
inline void accumulate_key_gradients(const Buffers& buf, int rows, int n, int Dp, int Dvp) {
  matmul_accumulate_transposed_a(buf.probs, kKeyBlock, buf.d_out_packed, Dvp, buf.dv_acc, Dvp, n, rows, Dvp);
  matmul_accumulate_transposed_a(buf.d_scores, kKeyBlock, buf.q_packed, Dp, buf.dk_acc, Dp, n, rows, Dp);
}

template <ElemType T>
void store_key_gradients(const BackwardCall& call, int b, int kv_head, int kb, int n, const Buffers& buf,
                         int Dp, int Dvp) {
  const AttentionProblem& p = call.problem;
  for (int j = 0; j < n; ++j) {
    const int64_t key_row = (int64_t(b) * p.kv_heads + kv_head) * p.kv_len + kb + j;
    for (int d = 0; d < p.head_dim; ++d) store_elem<T>(call.dk, key_row * p.head_dim + d, buf.dk_acc[j * Dp + d]);
    for (int e = 0; e < p.value_dim; ++e) store_elem<T>(call.dv, key_row * p.value_dim + e, buf.dv_acc[j * Dvp + e]);
  }
}

template <ElemType T>
void rows_pass(const BackwardCall& call, int h) {
  const AttentionProblem& p = call.problem;
  const int Dv = p.value_dim;
  float o[kMaxHeadDim], d_o[kMaxHeadDim];
  float sink = 0.0f;
  bool sink_clamped = false;
  if (p.has_sinks) {
    const float raw = load_elem<T>(call.sinks, h * p.sinks_stride);
    sink = saturate_logit(raw);
    sink_clamped = sink != raw;
  }
  float d_sink = 0.0f;
  for (int b = 0; b < p.batch; ++b) {
    for (int qi = 0; qi < p.q_len; ++qi) {
      const int64_t* os = call.out_strides;
      const int64_t* ds = call.d_out_strides;
      load_row<T>(o, 1, call.out, b * os[0] + h * os[1] + qi * os[2], os[3], Dv, 1.0f);
      load_row<T>(d_o, 1, call.d_out, b * ds[0] + h * ds[1] + qi * ds[2], ds[3], Dv, 1.0f);
      float dot = 0.0f;
      for (int e = 0; e < Dv; ++e) dot += o[e] * d_o[e];
      if (call.d_lse) {
        const int64_t* ls = call.d_lse_strides;
        dot -= call.d_lse[b * ls[0] + h * ls[1] + qi * ls[2]];
      }
      const int64_t i = row_index(p, b, h, qi);
      call.delta[i] = dot;
      // the sink's probability exp(sink - lse), whose dP is 0: dS = -P * delta
      if (p.has_sinks && call.lse[i] != -INFINITY) {
        d_sink -= expf(sink - call.lse[i]) * dot;
      }
    }
  }
  if (p.has_sinks) store_elem<T>(call.d_sinks, h, sink_clamped ? 0.0f : d_sink);
}

// Row widths of a problem's packed buffers (padded to whole vectors) and its
// GQA group size.
struct Widths {
  int D, Dp, Dvp, group;
};
inline Widths widths_of(const AttentionProblem& p) {
  return {p.head_dim, int(round_up(p.head_dim, kLanes)), int(round_up(p.value_dim, kLanes)), p.group_size()};
}

// dK, dV of keys kb..kb+n of (batch b, kv head) over every query tile that
// can see one of them (zero where none can), calling after_tile(t) once the
// tile's dS is in buf.d_scores.
template <ElemType T, class AfterTile>
void key_block_gradients(const BackwardCall& call, int b, int kv_head, int kb, int n, const Buffers& buf,
                         const Widths& w, AfterTile after_tile) {
  memset(buf.dk_acc, 0, sizeof(float) * kKeyBlock * w.Dp);
  memset(buf.dv_acc, 0, sizeof(float) * kKeyBlock * w.Dvp);
  const QueryRange range = block_query_range(call.problem, kb, kb + n - 1);
  if (range.begin < range.end) pack_keys<T>(call, b, kv_head, kb, n, buf, w.Dp);
  for (int qs = range.begin; qs < range.end; qs += call.query_block) {
    const int qb = (range.end - qs) < call.query_block ? (range.end - qs) : call.query_block;
    const TileRows t{b, kv_head, qs, qb, w.group};
    pack_rows<T>(call, t, buf, w.Dp, w.Dvp);
    tile_gradients<T>(call, t, kb, n, buf, w.Dp, w.Dvp);
    accumulate_key_gradients(buf, t.rows(), n, w.Dp, w.Dvp);
    after_tile(t);
  }
  store_key_gradients<T>(call, b, kv_head, kb, n, buf, w.Dp, w.Dvp);
}

// The single pass: all of dK, dV and dQ of one (batch, kv head).
template <ElemType T>
void group_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const Widths w = widths_of(p);
  const int b = int(item / p.kv_heads), kv_head = int(item % p.kv_heads);
  const Buffers buf = buffers_of(call, scratch);
  // dQ rows of head g of the group, position qi: dq_group + (g * Tq + qi) * Dp.
  const bool in_place = dq_accumulates_in_place(call, kLanes);
  float* const dq_group = in_place
      ? static_cast<float*>(call.dq) + row_index(p, b, kv_head * w.group, 0) * w.D
      : buf.dq_acc;
  memset(dq_group, 0, sizeof(float) * w.group * p.q_len * w.Dp);

  for (int kb = 0; kb < p.kv_len; kb += kKeyBlock) {
    const int n = (p.kv_len - kb) < kKeyBlock ? (p.kv_len - kb) : kKeyBlock;
    key_block_gradients<T>(call, b, kv_head, kb, n, buf, w, [&](const TileRows& t) {
      for (int g = 0; g < w.group; ++g) {  // dQ += dS . K, per head of the group
        matmul_accumulate(buf.d_scores + g * t.qb * kKeyBlock, kKeyBlock, buf.k_rows, w.Dp,
                          dq_group + (int64_t(g) * p.q_len + t.q_start) * w.Dp, w.Dp, t.qb, n, w.Dp);
      }
    });
  }
  if (!in_place) {
    for (int g = 0; g < w.group; ++g) {
      const int64_t first = row_index(p, b, kv_head * w.group + g, 0);
      for (int qi = 0; qi < p.q_len; ++qi) {
        const float* acc = dq_group + (int64_t(g) * p.q_len + qi) * w.Dp;
        for (int d = 0; d < w.D; ++d) store_elem<T>(call.dq, (first + qi) * w.D + d, acc[d]);
      }
    }
  }
}

// Two passes, first: dK, dV of one (batch, kv head, key block).
template <ElemType T>
void key_block_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  const int kb = int(item / per_block) * kKeyBlock;  // early key blocks (most work, causal) first
  const int b = int((item % per_block) / p.kv_heads);
  const int kv_head = int(item % p.kv_heads);
  const int n = (p.kv_len - kb) < kKeyBlock ? (p.kv_len - kb) : kKeyBlock;
  key_block_gradients<T>(call, b, kv_head, kb, n, buffers_of(call, scratch), widths_of(p), [](const TileRows&) {});
}

// Two passes, second: dQ of one (batch, kv head, query block), as the forward.
template <ElemType T>
void query_block_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const Widths w = widths_of(p);
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  // Heaviest query blocks (the last ones, under a causal mask) first.
  const int q_start = (call.query_blocks() - 1 - int(item / per_block)) * call.query_block;
  const int b = int((item % per_block) / p.kv_heads);
  const int kv_head = int(item % p.kv_heads);
  const int qb = (p.q_len - q_start) < call.query_block ? (p.q_len - q_start) : call.query_block;
  const TileRows t{b, kv_head, q_start, qb, w.group};
  const int rows = t.rows();
  const Buffers buf = buffers_of(call, scratch);

  pack_rows<T>(call, t, buf, w.Dp, w.Dvp);
  memset(buf.dq_acc, 0, sizeof(float) * rows * w.Dp);

  const KeyRange keys = block_key_range(p, query_position(p, q_start), query_position(p, q_start + qb - 1));
  for (int kb = keys.begin; kb < keys.end; kb += kKeyBlock) {
    const int n = (keys.end - kb) < kKeyBlock ? (keys.end - kb) : kKeyBlock;
    pack_keys<T>(call, b, kv_head, kb, n, buf, w.Dp);
    tile_gradients<T>(call, t, kb, n, buf, w.Dp, w.Dvp);
    matmul_accumulate(buf.d_scores, kKeyBlock, buf.k_rows, w.Dp, buf.dq_acc, w.Dp, rows, n, w.Dp);  // dQ += dS . K
  }

  for (int r = 0; r < rows; ++r) {
    const int64_t i = row_index(p, b, t.head(r), t.query(r));
    for (int d = 0; d < w.D; ++d) store_elem<T>(call.dq, i * w.D + d, buf.dq_acc[r * w.Dp + d]);
  }
}

}  // namespace

#define MLX_ATTN_BY_DTYPE(function, ...)                                          \
  switch (call.problem.dtype) {                                                 \
    case ElemType::float32: return function<ElemType::float32>(__VA_ARGS__);    \
    case ElemType::float16: return function<ElemType::float16>(__VA_ARGS__);    \
    case ElemType::bfloat16: return function<ElemType::bfloat16>(__VA_ARGS__);  \
  }

int backward_vector_lanes() { return kLanes; }
void backward_rows(const BackwardCall& call, int64_t head) {
  MLX_ATTN_BY_DTYPE(rows_pass, call, int(head))
}
void backward_group(const BackwardCall& call, int64_t item, float* scratch) {
  MLX_ATTN_BY_DTYPE(group_pass, call, item, scratch)
}
void backward_key_block(const BackwardCall& call, int64_t item, float* scratch) {
  MLX_ATTN_BY_DTYPE(key_block_pass, call, item, scratch)
}
void backward_query_block(const BackwardCall& call, int64_t item, float* scratch) {
  MLX_ATTN_BY_DTYPE(query_block_pass, call, item, scratch)
}
#undef MLX_ATTN_BY_DTYPE

}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
