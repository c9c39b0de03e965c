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
#include "csrc/cpu/bf16_pair_scale.h"
#include "csrc/cpu/elements.h"
#include "csrc/cpu/micro_kernel.h"
#include "csrc/cpu/rules.h"
#include "csrc/cpu/simd.h"
#if defined(MLX_ATTN_AMX_BF16)
#include "csrc/cpu/amx_tiles.h"
#endif

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
      *dk_acc, *dv_acc, *dq_acc, *dq_tile, *lse_row, *delta_row;
  float* past;  // backward_panel_floats(call) floats past the layout
};

Buffers buffers_of(const BackwardCall& call, float* scratch) {
  const BackwardScratch s = backward_scratch(call, kLanes);
  return {scratch + s.q_packed, scratch + s.d_out_packed, scratch + s.probs,
          scratch + s.d_scores, scratch + s.gate,         scratch + s.k_t,
          scratch + s.v_t,      scratch + s.k_rows,       scratch + s.dk_acc,
          scratch + s.dv_acc,   scratch + s.dq_acc,       scratch + s.dq_tile,
          scratch + s.lse_row,  scratch + s.delta_row,    scratch + s.total};
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
void backward_pack_rows(const BackwardCall& call, const TileRows& t, const Buffers& buf, int ldq, int lddo) {
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
void backward_pack_keys(const BackwardCall& call, int b, int kv_head, int kb, int n, const Buffers& buf, int ldk) {
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
// logits s[0, KB) by logit_scale (what the score product's sums are
// multiplied by); closes the gate where scale * q.k clamped, q.k recomputed
// in float32 by logit_dot(r, j).
template <class LogitDot>
MLX_ATTN_STEP void scale_logits(const AttentionProblem& p, float logit_scale, int r, int n, float* s, Gate& gate,
                                LogitDot logit_dot) {
  const vfloat limit = splat(kLogitLimit), scale = splat(logit_scale);
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
      if (!(fabsf(logit_dot(r, j) * p.scale) <= kLogitLimit)) gate.close(r, j);
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

// dS = ds_scale * P * (dP - delta) * gate in place over dP [rows][KB].
MLX_ATTN_STEP void score_gradient_values(const Buffers& buf, int rows, const Gate& gate, float ds_scale) {
  const vfloat scale = splat(ds_scale);
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

// scale, mask, then P = exp(S - lse) of the logits of rows [0, rows) of
// buf.probs in place.
template <ElemType T, class LogitDot>
MLX_ATTN_STEP void logit_probabilities(const BackwardCall& call, const TileRows& t, int kb, int n, const Buffers& buf,
                                       float logit_scale, Gate& gate, LogitDot logit_dot) {
  const AttentionProblem& p = call.problem;
  // Only tiles that straddle the causal diagonal or the window's edge mask
  // per key (as the forward's).
  const bool on_edge =
      block_on_edge(p, kb, n, query_position(p, t.q_start), query_position(p, t.q_start + t.qb - 1));
  for (int r = 0; r < t.rows(); ++r) {
    float* s = buf.probs + r * kKeyBlock;
    scale_logits(p, logit_scale, r, n, s, gate, logit_dot);
    mask_logits<T>(call, t, r, kb, n, on_edge, s, gate);
    // P = exp(S - lse)
    const vfloat lse = splat(buf.lse_row[r]);
    for (int c = 0; c < kKeyBlock; c += kLanes) store(s + c, exp2_vec((load(s + c) - lse) * kLog2e));
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
  // score
  matmul_overwrite(buf.q_packed, ldq, buf.k_t, kKeyBlock, buf.probs, kKeyBlock, rows, p.head_dim, kKeyBlock);
  logit_probabilities<T>(call, t, kb, n, buf, p.scale, gate, [&](int r, int j) {
    float dot = 0.0f;
    for (int d = 0; d < p.head_dim; ++d) dot += buf.q_packed[r * ldq + d] * buf.k_t[d * kKeyBlock + j];
    return dot;
  });
  // dP = dO . V^T, then dS
  matmul_overwrite(buf.d_out_packed, lddo, buf.v_t, kKeyBlock, buf.d_scores, kKeyBlock, rows, p.value_dim,
                   kKeyBlock);
  score_gradient_values(buf, rows, gate, p.scale);
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

// ------------------------------------------------------------ tile products
// The passes below are written once over a tile policy, which owns the
// packing, the five products and the stores of dK / dV:
//   FloatTiles  float32 panels through the micro-kernel (every dtype)
//   AmxTiles    bf16 panels on AMX tiles (avx512amx copy, bf16; see there)
// Each has kGridTiles (whether a key block's query tiles start on the
// query_block grid), pack_keys, pack_rows, gradients (P and dS of a tile),
// accumulate_key_gradients, add_query_gradients (dQ rows (g, i) of a tile
// into dq + (g * head_stride + i) * Dp) and store_key_gradients, and says by
// what it multiplies dQ when stored (dq_store_scale).
template <ElemType T>
struct FloatTiles {
  const BackwardCall& call;
  const Buffers& buf;
  Widths w;

  static constexpr bool kGridTiles = false;
  FloatTiles(const BackwardCall& c, const Buffers& b, const Widths& widths) : call(c), buf(b), w(widths) {}
  void pack_keys(int b, int kv_head, int kb, int n) const { backward_pack_keys<T>(call, b, kv_head, kb, n, buf, w.Dp); }
  void pack_rows(const TileRows& t) const { backward_pack_rows<T>(call, t, buf, w.Dp, w.Dvp); }
  void gradients(const TileRows& t, int kb, int n) const { tile_gradients<T>(call, t, kb, n, buf, w.Dp, w.Dvp); }
  // dV += P^T . dO and dK += dS^T . Q (P and dS read transposed in place by
  // the micro-kernel).
  void accumulate_key_gradients(const TileRows& t, int n) const {
    matmul_accumulate_transposed_a(buf.probs, kKeyBlock, buf.d_out_packed, w.Dvp, buf.dv_acc, w.Dvp, n, t.rows(), w.Dvp);
    matmul_accumulate_transposed_a(buf.d_scores, kKeyBlock, buf.q_packed, w.Dp, buf.dk_acc, w.Dp, n, t.rows(), w.Dp);
  }
  void add_query_gradients(const TileRows& t, int n, float* dq, int64_t head_stride) const {
    for (int g = 0; g < w.group; ++g) {  // dQ += dS . K, per head of the group
      matmul_accumulate(buf.d_scores + g * t.qb * kKeyBlock, kKeyBlock, buf.k_rows, w.Dp,
                        dq + g * head_stride * w.Dp, w.Dp, t.qb, n, w.Dp);
    }
  }
  void store_key_gradients(int b, int kv_head, int kb, int n) const {
    const AttentionProblem& p = call.problem;
    for (int j = 0; j < n; ++j) {
      const int64_t key_row = (int64_t(b) * p.kv_heads + kv_head) * p.kv_len + kb + j;
      for (int d = 0; d < p.head_dim; ++d) store_elem<T>(call.dk, key_row * p.head_dim + d, buf.dk_acc[j * w.Dp + d]);
      for (int e = 0; e < p.value_dim; ++e) {
        store_elem<T>(call.dv, key_row * p.value_dim + e, buf.dv_acc[j * w.Dvp + e]);
      }
    }
  }
  float dq_store_scale() const { return 1.0f; }
};

#if defined(MLX_ATTN_AMX_BF16)
// The avx512amx copy's bf16 tiles (amx_tiles.h), for D and Dv multiples of 32
// with unit feature strides of q, k, v (amx_applies; dO is gathered, any
// strides): all five products on tiles with
// float32 accumulation, on the float path's [rows][KB] tile, so scale, mask,
// P and dS are the same steps:
//   S    [Rp][KB]  = Q rows . K feature pairs     (depth D)
//   dP   [Rp][KB]  = dO rows . V feature pairs    (depth Dv)
//   dV^T [Dv][KB] += dO^T . P row pairs           (depth Rp)
//   dK^T [D][KB]  += Q^T . dS row pairs           (depth Rp)
//   dQ   [Rp][D]  += dS rows . K key pairs        (depth KB; in place where
//                                                  a head's rows are whole
//                                                  tiles, else added)
// P and dS are rounded to bf16 only as inputs of these products (the
// forward rounds P likewise); S, P, dP, dS and every accumulator stay
// float32. dS leaves out the scale, which dK and dQ take when stored, so a
// tiny scale flushes no dS (TDPBF16PS flushes subnormal inputs). Rows are
// padded to Rp, a multiple of 32 (the depth of the row-pair products), with
// zero Q and dO rows, whose S and dP, left as the products give them, are
// then 0 and stand for P and dS. The score product keeps the
// forward's exactness guard (bf16_pair_scale on the packed Q rows); where it
// fails, the tile scores in float32.
static_assert(kBackwardRowMultiple % kAmxDepth == 0, "scratch rows are whole row-pair tiles");
inline constexpr int kAmxRowMultiple = kAmxDepth;
static_assert(kKeyBlock % kAmxDepth == 0, "a key block is whole tiles deep");

bool amx_applies(const BackwardCall& call) {
  const AttentionProblem& p = call.problem;
  return p.dtype == ElemType::bfloat16 && p.head_dim % kAmxDepth == 0 && p.value_dim % kAmxDepth == 0 &&
      p.q_strides[3] == 1 && p.k_strides[3] == 1 && p.v_strides[3] == 1;
}

struct AmxTiles {
  const BackwardCall& call;
  const Buffers& buf;
  Widths w;
  int D, Dv;
  // bf16 views of the thread's buffers (backward_scratch sizes rows to whole
  // 32-row tiles): Q rows [Rp][D] then Q^T [D][Rp] in q_packed, dO rows and
  // dO^T likewise in d_out_packed, dS rows [Rp][KB] in gate (free once dS is
  // computed); K and V feature pairs [D / 2][KB] words in k_t, v_t; K key
  // pairs [KB / 2][D] words in k_rows. dK^T, dV^T accumulate in dk_acc,
  // dv_acc; dq_tile [Rp][D] holds a tile's dQ.
  uint16_t* d_scores_rows;
  uint32_t *k_feature_pairs, *v_feature_pairs, *k_key_pairs;
  // The single pass revisits each query tile once per key block: its packed
  // panels are kept (query_panels, when they fit kQueryPanelBytes), a record
  // per query tile: a header (the guard, whether packed) and Q rows, Q^T,
  // dO rows, dO^T. Null: every visit packs into q_packed / d_out_packed.
  float* query_panels;
  // Of the current query tile (pack_rows): its rows padded (Rp), its panels,
  // the score product's guard.
  mutable int rp = 0;
  mutable uint16_t *q_rows = nullptr, *q_t = nullptr, *d_out_rows = nullptr, *d_out_t = nullptr;
  mutable PairScale pair = {0.0f, false};

  static constexpr bool kGridTiles = true;  // query tiles keep their packed panels, by index
  static constexpr int kPanelHeader = 16;  // floats: guard scale, exact, moved, packed
  static constexpr int64_t kQueryPanelBytes = int64_t(16) << 20;
  static int64_t panel_record_floats(const BackwardCall& c) {
    const AttentionProblem& p = c.problem;
    const int64_t rows = round_up(int64_t(p.group_size()) * c.query_block, kAmxRowMultiple);
    return kPanelHeader + rows * (p.head_dim + p.value_dim);  // 2 x rows x (D + Dv) bf16
  }
  static int64_t panel_floats(const BackwardCall& c) {
    if (!c.single_pass) return 0;
    const int64_t floats = panel_record_floats(c) * c.query_blocks();
    return floats * int64_t(sizeof(float)) <= kQueryPanelBytes ? floats : 0;
  }

  AmxTiles(const BackwardCall& c, const Buffers& b, const Widths& widths)
      : call(c), buf(b), w(widths), D(c.problem.head_dim), Dv(c.problem.value_dim),
        d_scores_rows(reinterpret_cast<uint16_t*>(b.gate)), k_feature_pairs(reinterpret_cast<uint32_t*>(b.k_t)),
        v_feature_pairs(reinterpret_cast<uint32_t*>(b.v_t)), k_key_pairs(reinterpret_cast<uint32_t*>(b.k_rows)),
        query_panels(panel_floats(c) > 0 ? b.past : nullptr) {
    if (!query_panels) return;
    for (int qt = 0; qt < c.query_blocks(); ++qt) query_panels[qt * panel_record_floats(c) + 3] = 0.0f;
  }

  void pack_keys(int b, int kv_head, int kb, int n) const {
    const AttentionProblem& p = call.problem;
    const uint16_t *k_rows[kKeyBlock], *v_rows[kKeyBlock];
    for (int j = 0; j < n; ++j) {
      k_rows[j] = static_cast<const uint16_t*>(call.k) + b * p.k_strides[0] + kv_head * p.k_strides[1] +
          int64_t(kb + j) * p.k_strides[2];
      v_rows[j] = static_cast<const uint16_t*>(call.v) + b * p.v_strides[0] + kv_head * p.v_strides[1] +
          int64_t(kb + j) * p.v_strides[2];
    }
    for (int j0 = 0; j0 < kKeyBlock; j0 += kAmxTile) {
      for (int p0 = 0; p0 < D / 2; p0 += 16) amx_pack_feature_pairs(k_rows, n, j0, p0, k_feature_pairs, kKeyBlock);
      for (int p0 = 0; p0 < Dv / 2; p0 += 16) amx_pack_feature_pairs(v_rows, n, j0, p0, v_feature_pairs, kKeyBlock);
    }
    for (int jp = 0; jp < kKeyBlock / 2; ++jp) {
      amx_pack_row_pairs(2 * jp < n ? k_rows[2 * jp] : nullptr, 2 * jp + 1 < n ? k_rows[2 * jp + 1] : nullptr, D,
                         k_key_pairs + jp * D);
    }
  }

  // Q and dO rows (zero rows up to Rp), their transposes, lse and delta;
  // then the guard (bf16_pair_scale's rule on the Q rows' magnitudes,
  // gathered while copying them), which may move a power of two of the
  // scale into the Q rows (the score product's A only).
  void pack_rows(const TileRows& t) const {
    const AttentionProblem& p = call.problem;
    const int rows = t.rows();
    rp = int(round_up(rows, kAmxRowMultiple));
    for (int r = 0; r < rows; ++r) {
      const int64_t i = row_index(p, t.b, t.head(r), t.query(r));
      buf.lse_row[r] = call.lse[i] == -INFINITY ? INFINITY : call.lse[i];
      buf.delta_row[r] = call.delta[i];
    }
    float* record = query_panels ? query_panels + (t.q_start / call.query_block) * panel_record_floats(call) : nullptr;
    q_rows = record ? reinterpret_cast<uint16_t*>(record + kPanelHeader) : reinterpret_cast<uint16_t*>(buf.q_packed);
    q_t = q_rows + int64_t(rp) * D;
    d_out_rows = record ? q_t + int64_t(D) * rp : reinterpret_cast<uint16_t*>(buf.d_out_packed);
    d_out_t = d_out_rows + int64_t(rp) * Dv;
    if (record && record[3] != 0.0f) {  // packed on an earlier key block
      pair = {record[0], record[1] != 0.0f, int(record[2])};
      return;
    }
    const int64_t* ds = call.d_out_strides;
    // |q| as bf16 magnitude bits, whose integer order is the values' (NaN
    // above infinity): the largest, and the smallest nonzero (0xffff: none)
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    __m512i largest = _mm512_setzero_si512(), smallest = _mm512_set1_epi16(-1);
    for (int r = 0; r < rows; ++r) {
      const int h = t.head(r), qi = t.query(r);
      const uint16_t* q = static_cast<const uint16_t*>(call.q) + t.b * p.q_strides[0] + h * p.q_strides[1] +
          qi * p.q_strides[2];
      for (int d = 0; d < D; d += 32) {
        const __m512i x = _mm512_loadu_si512(q + d);
        _mm512_storeu_si512(q_rows + int64_t(r) * D + d, x);
        const __m512i bits = _mm512_and_si512(x, magnitude);
        largest = _mm512_max_epu16(largest, bits);
        smallest = _mm512_mask_min_epu16(smallest, _mm512_test_epi16_mask(bits, bits), smallest, bits);
      }
      const uint16_t* d_out = static_cast<const uint16_t*>(call.d_out) + t.b * ds[0] + h * ds[1] + qi * ds[2];
      uint16_t* d_out_row = d_out_rows + int64_t(r) * Dv;
      if (ds[3] == 1) {
        memcpy(d_out_row, d_out, sizeof(uint16_t) * Dv);
      } else {  // e.g. the broadcast cotangent of a sum (strides 0)
        for (int e = 0; e < Dv; ++e) d_out_row[e] = d_out[e * ds[3]];
      }
    }
    memset(q_rows + int64_t(rows) * D, 0, sizeof(uint16_t) * (rp - rows) * D);
    memset(d_out_rows + int64_t(rows) * Dv, 0, sizeof(uint16_t) * (rp - rows) * Dv);
    transpose_rows(q_rows, D, q_t);
    transpose_rows(d_out_rows, Dv, d_out_t);
    uint16_t largest_bits[32], smallest_bits[32];
    _mm512_storeu_si512(largest_bits, largest);
    _mm512_storeu_si512(smallest_bits, smallest);
    uint16_t most = 0, least = 0xffff;
    for (int i = 0; i < 32; ++i) {
      most = largest_bits[i] > most ? largest_bits[i] : most;
      least = smallest_bits[i] < least ? smallest_bits[i] : least;
    }
    pair = bf16_pair_scale_of(bfloat_to_float(most), least == 0xffff ? INFINITY : bfloat_to_float(least), p.scale, D);
    bf16_pair_scale_move(q_rows, int64_t(rp) * D, pair.moved);
    if (record) record[0] = pair.scale, record[1] = pair.exact, record[2] = float(pair.moved), record[3] = 1.0f;
  }

  // rows [Rp][width] bf16 -> [width][Rp], 16 x 16 words at a time.
  void transpose_rows(const uint16_t* rows, int width, uint16_t* out) const {
    const uint16_t* pair_rows[2 * 16];
    for (int jp0 = 0; jp0 < rp / 2; jp0 += 16) {
      for (int i = 0; i < 2 * 16; ++i) pair_rows[i] = rows + int64_t(2 * jp0 + i) * width;
      for (int e0 = 0; e0 < width; e0 += 16) {
        amx_pack_value_words(pair_rows, 2 * 16, 0, e0, reinterpret_cast<uint32_t*>(out) + jp0, rp / 2);
      }
    }
  }

  // q.k of row r and key j in float32 from the unscaled Q^T and the K key pairs.
  float logit_dot(int r, int j) const {
    const uint16_t* k = reinterpret_cast<const uint16_t*>(k_key_pairs) + int64_t(j / 2) * 2 * D + (j & 1);
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) dot += bfloat_to_float(q_t[int64_t(d) * rp + r]) * bfloat_to_float(k[2 * d]);
    return dot;
  }

  void gradients(const TileRows& t, int kb, int n) const {
    const AttentionProblem& p = call.problem;
    const int rows = t.rows();
    Gate gate{buf.gate, rows, p.softcap > 0.0f};
    float logit_scale = pair.scale;
    if (pair.exact) {  // score
      amx_matmul<false>(q_rows, D, reinterpret_cast<const uint16_t*>(k_feature_pairs), 2 * kKeyBlock, buf.probs,
                        kKeyBlock, rp / kAmxTile, kKeyBlock / kAmxTile, D);
    } else {  // rare: the guard failed, score in float32
      logit_scale = p.scale;
      for (int r = 0; r < rp; ++r) {
        for (int j = 0; j < kKeyBlock; ++j) buf.probs[r * kKeyBlock + j] = logit_dot(r, j);
      }
    }
    logit_probabilities<ElemType::bfloat16>(call, t, kb, n, buf, logit_scale, gate,
                                           [this](int r, int j) { return logit_dot(r, j); });
    amx_matmul<false>(d_out_rows, Dv, reinterpret_cast<const uint16_t*>(v_feature_pairs), 2 * kKeyBlock,
                      buf.d_scores, kKeyBlock, rp / kAmxTile, kKeyBlock / kAmxTile, Dv);  // dP = dO . V^T
    // padding rows keep S = dP = 0 (zero Q and dO): P = dS = 0 there
    score_gradient_values(buf, rows, gate, 1.0f);
    amx_pack_probabilities(buf.probs, kKeyBlock, rp);  // P as row pairs in place (dV's B)
    pack_score_gradients();
  }

  // dS in bf16 twice from one read: as rows (dQ's A) and as row pairs in
  // place over dS (dK's B; pair row i overwrites float row i <= 2i once read).
  void pack_score_gradients() const {
    uint16_t* const pairs = reinterpret_cast<uint16_t*>(buf.d_scores);
    for (int i = 0; i < rp / 2; ++i) {
      const float* even = buf.d_scores + int64_t(2 * i) * kKeyBlock;
      uint16_t* even_row = d_scores_rows + int64_t(2 * i) * kKeyBlock;
      for (int c = 0; c < kKeyBlock; c += 16) {
        const __m512 e = _mm512_loadu_ps(even + c), o = _mm512_loadu_ps(even + kKeyBlock + c);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + c), (__m256i)_mm512_cvtneps_pbh(e));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + kKeyBlock + c), (__m256i)_mm512_cvtneps_pbh(o));
        amx_store_probability_pairs(pairs + int64_t(i) * 2 * kKeyBlock + 2 * c, e, o);
      }
    }
  }

  void accumulate_key_gradients(const TileRows&, int) const {
    amx_matmul<true>(d_out_t, rp, reinterpret_cast<const uint16_t*>(buf.probs), 2 * kKeyBlock, buf.dv_acc, kKeyBlock,
                     Dv / kAmxTile, kKeyBlock / kAmxTile, rp);
    amx_matmul<true>(q_t, rp, reinterpret_cast<const uint16_t*>(buf.d_scores), 2 * kKeyBlock, buf.dk_acc, kKeyBlock,
                     D / kAmxTile, kKeyBlock / kAmxTile, rp);
  }

  void add_query_gradients(const TileRows& t, int, float* dq, int64_t head_stride) const {
    const uint16_t* k_pairs = reinterpret_cast<const uint16_t*>(k_key_pairs);
    if (t.qb % kAmxTile == 0) {  // each head's rows are whole tiles: accumulate in place
      for (int g = 0; g < w.group; ++g) {
        amx_matmul<true>(d_scores_rows + int64_t(g) * t.qb * kKeyBlock, kKeyBlock, k_pairs, 2 * D,
                         dq + g * head_stride * w.Dp, w.Dp, t.qb / kAmxTile, D / kAmxTile, kKeyBlock);
      }
      return;
    }
    amx_matmul<false>(d_scores_rows, kKeyBlock, k_pairs, 2 * D, buf.dq_tile, D, rp / kAmxTile, D / kAmxTile,
                      kKeyBlock);
    for (int r = 0; r < t.rows(); ++r) {
      float* dst = dq + ((r / t.qb) * head_stride + r % t.qb) * w.Dp;
      const float* src = buf.dq_tile + int64_t(r) * D;
      for (int d = 0; d < D; d += kLanes) store(dst + d, load(dst + d) + load(src + d));
    }
  }

  // dK^T [D][KB] and dV^T [Dv][KB], dK times the scale dS left out.
  void store_key_gradients(int b, int kv_head, int kb, int n) const {
    const AttentionProblem& p = call.problem;
    for (int j = 0; j < n; ++j) {
      const int64_t key_row = (int64_t(b) * p.kv_heads + kv_head) * p.kv_len + kb + j;
      for (int d = 0; d < D; ++d) {
        store_elem<ElemType::bfloat16>(call.dk, key_row * D + d, buf.dk_acc[d * kKeyBlock + j] * p.scale);
      }
      for (int e = 0; e < Dv; ++e) store_elem<ElemType::bfloat16>(call.dv, key_row * Dv + e, buf.dv_acc[e * kKeyBlock + j]);
    }
  }
  float dq_store_scale() const { return call.problem.scale; }
};
#endif

// dK, dV of keys kb..kb+n of (batch b, kv head) over every query tile that
// can see one of them (zero where none can), calling after_tile(t) once the
// tile's dS is ready for the dQ product.
template <class Tiles, class AfterTile>
void key_block_gradients(const Tiles& tiles, int b, int kv_head, int kb, int n, AfterTile after_tile) {
  const BackwardCall& call = tiles.call;
  memset(tiles.buf.dk_acc, 0, sizeof(float) * kKeyBlock * tiles.w.Dp);
  memset(tiles.buf.dv_acc, 0, sizeof(float) * kKeyBlock * tiles.w.Dvp);
  const QueryRange range = block_query_range(call.problem, kb, kb + n - 1);
  if (range.begin < range.end) tiles.pack_keys(b, kv_head, kb, n);
  // Whole tiles of the query_block grid where the policy keeps packed tiles
  // (rows of the first and last tile outside the range see none of these
  // keys: masked, P = 0).
  const int first = Tiles::kGridTiles ? range.begin - range.begin % call.query_block : range.begin;
  const int end = Tiles::kGridTiles ? call.problem.q_len : range.end;
  for (int qs = first; qs < range.end; qs += call.query_block) {
    const int qb = (end - qs) < call.query_block ? (end - qs) : call.query_block;
    const TileRows t{b, kv_head, qs, qb, tiles.w.group};
    tiles.pack_rows(t);
    tiles.gradients(t, kb, n);
    tiles.accumulate_key_gradients(t, n);
    after_tile(t);
  }
  tiles.store_key_gradients(b, kv_head, kb, n);
}

// The single pass: all of dK, dV and dQ of one (batch, kv head).
template <ElemType T, class Tiles>
void group_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const Widths w = widths_of(p);
  const int b = int(item / p.kv_heads), kv_head = int(item % p.kv_heads);
  const Buffers buf = buffers_of(call, scratch);
  const Tiles tiles(call, buf, w);
  // dQ rows of head g of the group, position qi: dq_group + (g * Tq + qi) * Dp.
  const bool in_place = dq_accumulates_in_place(call, kLanes);
  float* const dq_group = in_place
      ? static_cast<float*>(call.dq) + row_index(p, b, kv_head * w.group, 0) * w.D
      : buf.dq_acc;
  memset(dq_group, 0, sizeof(float) * w.group * p.q_len * w.Dp);

  for (int kb = 0; kb < p.kv_len; kb += kKeyBlock) {
    const int n = (p.kv_len - kb) < kKeyBlock ? (p.kv_len - kb) : kKeyBlock;
    key_block_gradients(tiles, b, kv_head, kb, n, [&](const TileRows& t) {
      tiles.add_query_gradients(t, n, dq_group + int64_t(t.q_start) * w.Dp, p.q_len);
    });
  }
  if (!in_place) {
    const float scale = tiles.dq_store_scale();
    for (int g = 0; g < w.group; ++g) {
      const int64_t first = row_index(p, b, kv_head * w.group + g, 0);
      for (int qi = 0; qi < p.q_len; ++qi) {
        const float* acc = dq_group + (int64_t(g) * p.q_len + qi) * w.Dp;
        for (int d = 0; d < w.D; ++d) store_elem<T>(call.dq, (first + qi) * w.D + d, acc[d] * scale);
      }
    }
  }
}

// Two passes, first: dK, dV of one (batch, kv head, key block).
template <ElemType T, class Tiles>
void key_block_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  const int kb = int(item / per_block) * kKeyBlock;  // early key blocks (most work, causal) first
  const int b = int((item % per_block) / p.kv_heads);
  const int kv_head = int(item % p.kv_heads);
  const int n = (p.kv_len - kb) < kKeyBlock ? (p.kv_len - kb) : kKeyBlock;
  const Buffers buf = buffers_of(call, scratch);
  key_block_gradients(Tiles(call, buf, widths_of(p)), b, kv_head, kb, n, [](const TileRows&) {});
}

// Two passes, second: dQ of one (batch, kv head, query block), as the forward.
template <ElemType T, class Tiles>
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
  const Tiles tiles(call, buf, w);

  tiles.pack_rows(t);
  memset(buf.dq_acc, 0, sizeof(float) * rows * w.Dp);

  const KeyRange keys = block_key_range(p, query_position(p, q_start), query_position(p, q_start + qb - 1));
  for (int kb = keys.begin; kb < keys.end; kb += kKeyBlock) {
    const int n = (keys.end - kb) < kKeyBlock ? (keys.end - kb) : kKeyBlock;
    tiles.pack_keys(b, kv_head, kb, n);
    tiles.gradients(t, kb, n);
    tiles.add_query_gradients(t, n, buf.dq_acc, qb);  // dQ += dS . K
  }

  const float scale = tiles.dq_store_scale();
  for (int r = 0; r < rows; ++r) {
    const int64_t i = row_index(p, b, t.head(r), t.query(r));
    for (int d = 0; d < w.D; ++d) store_elem<T>(call.dq, i * w.D + d, buf.dq_acc[r * w.Dp + d] * scale);
  }
}

// Every item kind of a pass, on the AMX tiles where they apply (the tile
// configuration held for the item's length), else on float32 tiles.
template <template <ElemType, class> class Pass>
void run_item(const BackwardCall& call, int64_t item, float* scratch) {
#if defined(MLX_ATTN_AMX_BF16)
  if (amx_applies(call)) {
    amx_configure();
    Pass<ElemType::bfloat16, AmxTiles>::run(call, item, scratch);
    amx_release();
    return;
  }
#endif
  switch (call.problem.dtype) {
    case ElemType::float32: return Pass<ElemType::float32, FloatTiles<ElemType::float32>>::run(call, item, scratch);
    case ElemType::float16: return Pass<ElemType::float16, FloatTiles<ElemType::float16>>::run(call, item, scratch);
    case ElemType::bfloat16: return Pass<ElemType::bfloat16, FloatTiles<ElemType::bfloat16>>::run(call, item, scratch);
  }
}

template <ElemType T, class Tiles>
struct GroupPass {
  static void run(const BackwardCall& c, int64_t i, float* s) { group_pass<T, Tiles>(c, i, s); }
};
template <ElemType T, class Tiles>
struct KeyBlockPass {
  static void run(const BackwardCall& c, int64_t i, float* s) { key_block_pass<T, Tiles>(c, i, s); }
};
template <ElemType T, class Tiles>
struct QueryBlockPass {
  static void run(const BackwardCall& c, int64_t i, float* s) { query_block_pass<T, Tiles>(c, i, s); }
};

}  // namespace

int backward_vector_lanes() { return kLanes; }
int64_t backward_panel_floats(const BackwardCall& call) {
#if defined(MLX_ATTN_AMX_BF16)
  if (amx_applies(call)) return AmxTiles::panel_floats(call);
#endif
  (void)call;
  return 0;
}
void backward_rows(const BackwardCall& call, int64_t head) {
  switch (call.problem.dtype) {
    case ElemType::float32: return rows_pass<ElemType::float32>(call, int(head));
    case ElemType::float16: return rows_pass<ElemType::float16>(call, int(head));
    case ElemType::bfloat16: return rows_pass<ElemType::bfloat16>(call, int(head));
  }
}
void backward_group(const BackwardCall& call, int64_t item, float* scratch) {
  run_item<GroupPass>(call, item, scratch);
}
void backward_key_block(const BackwardCall& call, int64_t item, float* scratch) {
  run_item<KeyBlockPass>(call, item, scratch);
}
void backward_query_block(const BackwardCall& call, int64_t item, float* scratch) {
  run_item<QueryBlockPass>(call, item, scratch);
}

}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
