// The fused attention backward for the CPU (see backward_kernels.h for the
// algorithm). Included once per instruction set by backward_<isa>.cpp, which
// defines MLX_ATTN_ISA (<isa>_backward) and MLX_ATTN_VEC_BYTES like the
// forward's units. It reuses the forward's vector, element and matmul helpers
// from kernel_impl.h (the forward entry points that come with them in this
// namespace are unused here). Steps mirror the forward's: score, scale
// (saturating: no gradient where a logit is clamped), mask, then
// P = exp(S - lse) instead of the online softmax.

#include "csrc/cpu/backward_kernels.h"
#include "csrc/cpu/kernel_impl.h"

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

inline int64_t row_index(const AttentionProblem& p, int b, int h, int qi) {
  return (int64_t(b) * p.q_heads + h) * p.q_len + qi;
}

inline void zero_tail(float* row, int from, int to) {
  for (int e = from; e < to; ++e) row[e] = 0.0f;
}

// Q [rows][ldq] and dO [rows][lddo] (zero padded), lse (+inf where the row
// saw nothing, so P = exp(S - lse) is 0 there) and delta per row.
template <ElemType T>
void pack_rows(const BackwardCall& call, const TileRows& t, float* q_packed, int ldq,
               float* d_out_packed, int lddo, float* lse_row, float* delta_row) {
  const AttentionProblem& p = call.problem;
  for (int r = 0; r < t.rows(); ++r) {
    const int h = t.head(r), qi = t.query(r);
    load_row<T>(q_packed + r * ldq, 1, call.q,
                t.b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2],
                p.q_strides[3], p.head_dim, 1.0f);
    zero_tail(q_packed + r * ldq, p.head_dim, ldq);
    const int64_t* ds = call.d_out_strides;
    load_row<T>(d_out_packed + r * lddo, 1, call.d_out,
                t.b * ds[0] + h * ds[1] + qi * ds[2], ds[3], p.value_dim, 1.0f);
    zero_tail(d_out_packed + r * lddo, p.value_dim, lddo);
    const int64_t i = row_index(p, t.b, h, qi);
    lse_row[r] = call.lse[i] == -INFINITY ? INFINITY : call.lse[i];
    delta_row[r] = call.delta[i];
  }
}

// K^T [D][KB] and V^T [Dv][KB] of keys kb..kb+n (zero columns past n), and
// when k_rows is set, K [KB][ldk] (zero padded).
template <ElemType T>
void pack_keys(const BackwardCall& call, int b, int kv_head, int kb, int n,
               float* k_t, float* v_t, float* k_rows, int ldk) {
  const AttentionProblem& p = call.problem;
  const int KB = kKeyBlock;
  for (int j = 0; j < n; ++j) {
    const int64_t koff = b * p.k_strides[0] + kv_head * p.k_strides[1] +
        int64_t(kb + j) * p.k_strides[2];
    load_row<T>(k_t + j, KB, call.k, koff, p.k_strides[3], p.head_dim, 1.0f);
    const int64_t voff = b * p.v_strides[0] + kv_head * p.v_strides[1] +
        int64_t(kb + j) * p.v_strides[2];
    load_row<T>(v_t + j, KB, call.v, voff, p.v_strides[3], p.value_dim, 1.0f);
    if (k_rows) {
      load_row<T>(k_rows + j * ldk, 1, call.k, koff, p.k_strides[3], p.head_dim, 1.0f);
      zero_tail(k_rows + j * ldk, p.head_dim, ldk);
    }
  }
  for (int j = n; j < KB; ++j) {
    for (int d = 0; d < p.head_dim; ++d) k_t[d * KB + j] = 0.0f;
    for (int e = 0; e < p.value_dim; ++e) v_t[e * KB + j] = 0.0f;
    if (k_rows) zero_tail(k_rows + j * ldk, 0, ldk);
  }
}

// One tile: P [rows][KB] = exp(S - lse) of the masked, saturated logits and
// dS [rows][KB] = scale * P * (dO . V^T - delta), zero where a logit was
// clamped (gate: a [rows][KB] buffer, only written when something clamped).
template <ElemType T>
void tile_gradients(const BackwardCall& call, const TileRows& t, int kb, int n,
                    const float* q_packed, int ldq, const float* d_out_packed, int lddo,
                    const float* k_t, const float* v_t, const float* lse_row,
                    const float* delta_row, float* probs, float* d_scores, float* gate) {
  const AttentionProblem& p = call.problem;
  const int KB = kKeyBlock, rows = t.rows();
  const int offset = p.kv_len - p.q_len;
  const vfloat limit = splat(kLogitLimit), scale = splat(p.scale);
  bool gated = false;
  auto close_gate = [&](int r, int j) {
    if (!gated) {
      for (int64_t i = 0; i < int64_t(rows) * KB; ++i) gate[i] = 1.0f;
      gated = true;
    }
    gate[r * KB + j] = 0.0f;
  };

  // score
  memset(probs, 0, sizeof(float) * rows * KB);
  matmul_accumulate(q_packed, ldq, k_t, KB, probs, KB, rows, p.head_dim, KB);

  for (int r = 0; r < rows; ++r) {
    float* s = probs + r * KB;
    const int h = t.head(r), qi = t.query(r), pos = qi + offset;
    // scale (saturating)
    vint clamped = vint{};
    for (int c = 0; c < KB; c += kLanes) {
      const vfloat x = load(s + c) * scale;
      clamped |= (x > limit) | (x < -limit);
      store(s + c, saturate(x));
    }
    bool any_clamped = false;
    for (int i = 0; i < kLanes; ++i) any_clamped |= clamped[i] != 0;
    if (any_clamped) {  // rare: recompute which logits clamped
      for (int j = 0; j < n; ++j) {
        float dot = 0.0f;
        for (int d = 0; d < p.head_dim; ++d) dot += q_packed[r * ldq + d] * k_t[d * KB + j];
        if (!(fabsf(dot * p.scale) <= kLogitLimit)) close_gate(r, j);
      }
    }
    // mask
    if (p.mask_kind != MaskKind::none) {
      const int64_t* ms = p.mask_strides;
      const int64_t moff = t.b * ms[0] + h * ms[1] + qi * ms[2] + int64_t(kb) * ms[3];
      if (p.mask_kind == MaskKind::boolean) {
        const bool* m = static_cast<const bool*>(call.mask) + moff;
        for (int j = 0; j < n; ++j) {
          if (!m[j * ms[3]]) s[j] = -INFINITY;
        }
      } else {
        for (int j = 0; j < n; ++j) {
          const float added = load_elem<T>(call.mask, moff + j * ms[3]);
          if (added <= kMaskedLogit) {
            s[j] = -INFINITY;
            continue;
          }
          const float sum = s[j] + added;
          s[j] = saturate(sum);
          if (s[j] != sum && sum == sum) close_gate(r, j);
        }
      }
    }
    if (p.causal) {
      for (int j = 0; j < n; ++j) {
        const int key = kb + j;
        if (key > pos || (p.window_size > 0 && key <= pos - p.window_size)) s[j] = -INFINITY;
      }
    }
    for (int j = n; j < KB; ++j) s[j] = -INFINITY;
    // P = exp(S - lse)
    const vfloat lse = splat(lse_row[r]);
    for (int c = 0; c < KB; c += kLanes) store(s + c, exp2_vec((load(s + c) - lse) * kLog2e));
  }

  // dP = dO . V^T, then dS in place
  memset(d_scores, 0, sizeof(float) * rows * KB);
  matmul_accumulate(d_out_packed, lddo, v_t, KB, d_scores, KB, rows, p.value_dim, KB);
  for (int r = 0; r < rows; ++r) {
    float* ds = d_scores + r * KB;
    const float* pr = probs + r * KB;
    const vfloat delta = splat(delta_row[r]);
    for (int c = 0; c < KB; c += kLanes) {
      vfloat g = load(pr + c) * (load(ds + c) - delta) * scale;
      if (gated) g *= load(gate + r * KB + c);
      store(ds + c, g);
    }
  }
}

// dst [cols][rows] = src [rows][cols] (src row stride KB).
inline void transpose_tile(const float* src, int rows, int cols, float* dst) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) dst[c * rows + r] = src[r * kKeyBlock + c];
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
    sink = saturate(raw);
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

template <ElemType T>
void key_block_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const int KB = kKeyBlock, D = p.head_dim, Dv = p.value_dim;
  const int Dp = int(round_up(D, kLanes)), Dvp = int(round_up(Dv, kLanes));
  const int group = p.group_size();
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  const int kb = int(item / per_block) * KB;  // early key blocks (most work, causal) first
  const int b = int((item % per_block) / p.kv_heads);
  const int kv_head = int(item % p.kv_heads);
  const int n = (p.kv_len - kb) < KB ? (p.kv_len - kb) : KB;
  const int max_rows = group * call.query_block;

  float* q_packed = scratch;                         // [rows][Dp]
  float* d_out_packed = q_packed + max_rows * Dp;    // [rows][Dvp]
  float* probs = d_out_packed + max_rows * Dvp;      // [rows][KB]
  float* d_scores = probs + max_rows * KB;           // [rows][KB]
  float* gate = d_scores + max_rows * KB;            // [rows][KB]
  float* transposed = gate + max_rows * KB;          // [KB][rows]
  float* k_t = transposed + max_rows * KB;           // [D][KB]
  float* v_t = k_t + D * KB;                         // [Dv][KB]
  float* dk_acc = v_t + Dv * KB;                     // [KB][Dp]
  float* dv_acc = dk_acc + KB * Dp;                  // [KB][Dvp]
  float* lse_row = dv_acc + KB * Dvp;                // [rows]
  float* delta_row = lse_row + max_rows;             // [rows]

  pack_keys<T>(call, b, kv_head, kb, n, k_t, v_t, nullptr, 0);
  memset(dk_acc, 0, sizeof(float) * KB * Dp);
  memset(dv_acc, 0, sizeof(float) * KB * Dvp);

  // Query positions that can see a key of this block.
  const int offset = p.kv_len - p.q_len;
  int64_t q_lo = 0, q_hi = p.q_len;
  if (p.causal) {
    q_lo = int64_t(kb) - offset > 0 ? int64_t(kb) - offset : 0;
    if (p.window_size > 0) {
      const int64_t hi = int64_t(kb) + n - 1 - offset + p.window_size;
      q_hi = hi < q_hi ? hi : q_hi;
    }
  }
  for (int64_t qs = q_lo; qs < q_hi; qs += call.query_block) {
    const int qb = int((q_hi - qs) < call.query_block ? (q_hi - qs) : call.query_block);
    const TileRows t{b, kv_head, int(qs), qb, group};
    const int rows = t.rows();
    pack_rows<T>(call, t, q_packed, Dp, d_out_packed, Dvp, lse_row, delta_row);
    tile_gradients<T>(call, t, kb, n, q_packed, Dp, d_out_packed, Dvp, k_t, v_t, lse_row,
                      delta_row, probs, d_scores, gate);
    transpose_tile(probs, rows, n, transposed);  // dV += P^T . dO
    matmul_accumulate(transposed, rows, d_out_packed, Dvp, dv_acc, Dvp, n, rows, Dvp);
    transpose_tile(d_scores, rows, n, transposed);  // dK += dS^T . Q
    matmul_accumulate(transposed, rows, q_packed, Dp, dk_acc, Dp, n, rows, Dp);
  }

  for (int j = 0; j < n; ++j) {
    const int64_t key_row = (int64_t(b) * p.kv_heads + kv_head) * p.kv_len + kb + j;
    for (int d = 0; d < D; ++d) store_elem<T>(call.dk, key_row * D + d, dk_acc[j * Dp + d]);
    for (int e = 0; e < Dv; ++e) store_elem<T>(call.dv, key_row * Dv + e, dv_acc[j * Dvp + e]);
  }
}

template <ElemType T>
void query_block_pass(const BackwardCall& call, int64_t item, float* scratch) {
  const AttentionProblem& p = call.problem;
  const int KB = kKeyBlock, D = p.head_dim, Dv = p.value_dim;
  const int Dp = int(round_up(D, kLanes)), Dvp = int(round_up(Dv, kLanes));
  const int group = p.group_size();
  const int64_t per_block = int64_t(p.batch) * p.kv_heads;
  // Heaviest query blocks (the last ones, under a causal mask) first.
  const int q_start = (call.query_blocks() - 1 - int(item / per_block)) * call.query_block;
  const int b = int((item % per_block) / p.kv_heads);
  const int kv_head = int(item % p.kv_heads);
  const int qb = (p.q_len - q_start) < call.query_block ? (p.q_len - q_start) : call.query_block;
  const TileRows t{b, kv_head, q_start, qb, group};
  const int rows = t.rows(), max_rows = group * call.query_block;

  float* q_packed = scratch;                         // [rows][Dp]
  float* d_out_packed = q_packed + max_rows * Dp;    // [rows][Dvp]
  float* probs = d_out_packed + max_rows * Dvp;      // [rows][KB]
  float* d_scores = probs + max_rows * KB;           // [rows][KB]
  float* gate = d_scores + max_rows * KB;            // [rows][KB]
  float* k_t = gate + max_rows * KB;                 // [D][KB]
  float* v_t = k_t + D * KB;                         // [Dv][KB]
  float* k_rows = v_t + Dv * KB;                     // [KB][Dp]
  float* dq_acc = k_rows + KB * Dp;                  // [rows][Dp]
  float* lse_row = dq_acc + max_rows * Dp;           // [rows]
  float* delta_row = lse_row + max_rows;             // [rows]

  pack_rows<T>(call, t, q_packed, Dp, d_out_packed, Dvp, lse_row, delta_row);
  memset(dq_acc, 0, sizeof(float) * rows * Dp);

  // Key range any row of this block can see (as the forward's).
  const int offset = p.kv_len - p.q_len;
  const int first_pos = q_start + offset, last_pos = q_start + qb - 1 + offset;
  int kv_begin = 0, kv_end = p.kv_len;
  if (p.causal) {
    kv_end = last_pos + 1 < kv_end ? last_pos + 1 : kv_end;
    if (p.window_size > 0) {
      const int lo = first_pos - p.window_size + 1;
      kv_begin = lo > 0 ? lo : 0;
    }
  }
  for (int kb = kv_begin; kb < kv_end; kb += KB) {
    const int n = (kv_end - kb) < KB ? (kv_end - kb) : KB;
    pack_keys<T>(call, b, kv_head, kb, n, k_t, v_t, k_rows, Dp);
    tile_gradients<T>(call, t, kb, n, q_packed, Dp, d_out_packed, Dvp, k_t, v_t, lse_row,
                      delta_row, probs, d_scores, gate);
    matmul_accumulate(d_scores, KB, k_rows, Dp, dq_acc, Dp, rows, n, Dp);  // dQ += dS . K
  }

  for (int r = 0; r < rows; ++r) {
    const int64_t i = row_index(p, b, t.head(r), t.query(r));
    for (int d = 0; d < D; ++d) store_elem<T>(call.dq, i * D + d, dq_acc[r * Dp + d]);
  }
}

}  // namespace

#define MLX_ATTN_BY_DTYPE(function, ...)                                          \
  switch (call.problem.dtype) {                                                 \
    case ElemType::float32: return function<ElemType::float32>(__VA_ARGS__);    \
    case ElemType::float16: return function<ElemType::float16>(__VA_ARGS__);    \
    case ElemType::bfloat16: return function<ElemType::bfloat16>(__VA_ARGS__);  \
  }

void backward_rows(const BackwardCall& call, int64_t head) {
  MLX_ATTN_BY_DTYPE(rows_pass, call, int(head))
}
void backward_key_block(const BackwardCall& call, int64_t item, float* scratch) {
  MLX_ATTN_BY_DTYPE(key_block_pass, call, item, scratch)
}
void backward_query_block(const BackwardCall& call, int64_t item, float* scratch) {
  MLX_ATTN_BY_DTYPE(query_block_pass, call, item, scratch)
}
#undef MLX_ATTN_BY_DTYPE

}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
