// Fused attention forward for prefill (FlashAttention-2 style, in registers):
// the kernel template; metal/attention_prefill.metal instantiates it.
//
// One threadgroup of NSG = 4 simdgroups (128 threads; PrefillGroup,
// metal/attention_steps.h) owns BQ = 32 query rows of one
// (batch, query head); each simdgroup owns 8 rows, held as D/8 8x8 float
// simdgroup matrices of Q and of the output accumulator O. Key/value blocks
// of BK keys are staged in threadgroup memory in the input dtype (rows padded
// by 16 bytes against bank conflicts) and read into float fragments:
//   score      S = Q . K^T                              (8x8 MMAs)
//   scale      S = saturate(scale * S)                 (natural-log units)
//   softcap    S = softcap * tanh(S / softcap)         (when params.softcap > 0)
//   mask       additive (saturated; -inf masks), causal / window / bool -> the sentinel
//              (metal/attention_steps.h masked_logit; only edge blocks test
//              causal / window / bounds, the mask kind is a template choice)
//   online max / rescale   m_new = max(m, rowmax S); O *= exp(m - m_new)
//              (lazily: the max moves only by more than 8 in log2 units, so
//              most blocks skip the rescale; prefill_online_softmax)
//   accumulate P = exp(S - m_new); l = l * alpha + rowsum P; O += P . V
//   normalize  sinks join l; O *= 1 / l (rows that saw nothing: 0)
//              (row_normalizer, the decode kernels' step too; prefill_write_row)
// S, P, the row max / sum and the rescale never leave registers: each lane
// works on the two elements per 8x8 tile it owns (thread_elements(): row
// (lane / 16) * 4 + (lane / 2) % 4, columns c, c + 1 with
// c = ((lane / 8) % 2) * 4 + (lane % 2) * 2), and the 4 lanes sharing a row
// combine with simd_shuffle_xor 1 and 8.
// exp(x) = exp2(x * log2 e) of differences of saturated logits, which stay
// finite (metal/attention_params.h). Finite sentinels instead of infinities:
// Metal compiles with fast math.
// K/V head = query head / group: keys and values are never repeated.
// Device loads: W = 4-element vectors (Q: pairs) when params.vector_loads
// says every row start is aligned (csrc/metal/launch_plan.cpp), else per element.
// Threadgroup memory: 2 * BK * (D + 16 / sizeof(T)) * sizeof(T) bytes
// (csrc/metal/launch_plan.cpp, docs/metal_kernels.md).
#pragma once

#include <metal_stdlib>

#include "metal/attention_steps.h"

using namespace metal;

// scale, softcap and mask one block's scores in place (S tiles of this
// simdgroup's 8 rows x BK keys); returns this lane's part of the block's row max
template <typename T, int BK, int MASK, bool EDGE, bool SOFTCAP>
inline float prefill_logits(
    constant AttentionParams& p, const device uchar* mask, thread simdgroup_float8x8* s_tiles,
    int b, int h, int qi, int pos, int kb, int c) {
  float block_max = MLX_ATTN_MASKED_LOGIT;
  for (int j = 0; j < BK / 8; ++j) {
    for (int t = 0; t < 2; ++t) {
      const int key = kb + j * 8 + c + t;
      const float s = masked_logit<T, MASK, EDGE, SOFTCAP>(
          p, mask, s_tiles[j].thread_elements()[t] * p.scale, b, h, qi, key, pos).value;
      s_tiles[j].thread_elements()[t] = s;
      block_max = max(block_max, s);
    }
  }
  return block_max;
}

// The variant for this block: edge or interior, with or without the
// softcap, of the kernel's mask kind.
template <typename T, int BK, int MASK>
inline float prefill_block_logits(
    constant AttentionParams& p, const device uchar* mask, thread simdgroup_float8x8* s_tiles,
    int b, int h, int qi, int pos, int kb, int c, bool edge) {
  if (p.softcap > 0.0f) {
    return edge ? prefill_logits<T, BK, MASK, true, true>(p, mask, s_tiles, b, h, qi, pos, kb, c)
                : prefill_logits<T, BK, MASK, false, true>(p, mask, s_tiles, b, h, qi, pos, kb, c);
  }
  return edge ? prefill_logits<T, BK, MASK, true, false>(p, mask, s_tiles, b, h, qi, pos, kb, c)
              : prefill_logits<T, BK, MASK, false, false>(p, mask, s_tiles, b, h, qi, pos, kb, c);
}

// online max / rescale and accumulate, one key block of this simdgroup's
// rows (S tiles through the logit step; `block_max` this lane's part of their
// row max): m_new = rowmax S where it moves the max (below), else m; S
// becomes P = exp(S - m_new) in place;
// l = l * alpha + rowsum P; m = m_new. Returns alpha = exp(m - m_new), the
// factor the caller rescales its O rows by. Shared by the register-resident
// and the D-split prefill kernels.
//
// The max is lazy: it moves only when the block's exceeds it by more than
// MLX_ATTN_LAZY_MAX_LOG2 in log2 units, else the row keeps its max and
// alpha is exactly 1 (P <= 2^8 then: no float32 overflow), so most blocks
// need no O rescale (prefill_rescale). Exact: P, l, O and the row's
// log-sum-exp all use the max the row holds. Fully masked blocks never move it.
#define MLX_ATTN_LAZY_MAX_LOG2 8.0f
template <int BK>
inline float prefill_online_softmax(thread simdgroup_float8x8* s_tiles, float block_max, thread float& m_row,
                                    thread float& l_row) {
  // the 4 lanes of a row differ in lane bits 0 and 3
  block_max = max(block_max, simd_shuffle_xor(block_max, 1));
  block_max = max(block_max, simd_shuffle_xor(block_max, 8));
  const bool moves = (block_max - m_row) * MLX_ATTN_LOG2E > MLX_ATTN_LAZY_MAX_LOG2;
  const float m_new = moves ? block_max : m_row;
  const float alpha = moves ? fast::exp2((m_row - m_new) * MLX_ATTN_LOG2E) : 1.0f;
  float p_sum = 0.0f;
  for (int j = 0; j < BK / 8; ++j) {
    for (int t = 0; t < 2; ++t) {
      const float s = s_tiles[j].thread_elements()[t];
      const float prob = s > 0.5f * MLX_ATTN_MASKED_LOGIT ? fast::exp2((s - m_new) * MLX_ATTN_LOG2E) : 0.0f;
      s_tiles[j].thread_elements()[t] = prob;
      p_sum += prob;
    }
  }
  p_sum += simd_shuffle_xor(p_sum, 1);
  p_sum += simd_shuffle_xor(p_sum, 8);
  l_row = l_row * alpha + p_sum;
  m_row = m_new;
  return alpha;
}

// O *= alpha (each row by its own), skipped when no row of the simdgroup
// moved its max (alpha 1 on every lane: most blocks under the lazy max).
template <int TILES>
inline void prefill_rescale(thread simdgroup_float8x8* o_tiles, float alpha) {
  if (simd_any(alpha != 1.0f)) {
    for (int d = 0; d < TILES; ++d) {
      o_tiles[d].thread_elements() *= alpha;
    }
  }
}

// Q rows of this lane (query row rows.qi, element `q_row` on) into the 8x8
// tiles, zeros past q_len; the output accumulator O zeroed.
template <typename T, int D>
inline void prefill_load_queries(constant AttentionParams& p, const device T* q, attn_int64 q_row,
                                 thread const QueryRows& rows, bool vector_loads, thread simdgroup_float8x8* q_tiles,
                                 thread simdgroup_float8x8* o_tiles) {
  for (int d = 0; d < D / 8; ++d) {
    float pair[2] = {0.0f, 0.0f};
    if (rows.qi < p.q_len) {
      RowLoad<T, 2>::read(q, q_row + (d * 8 + rows.c) * p.q_strides[3], p.q_strides[3], vector_loads, pair);
    }
    for (int t = 0; t < 2; ++t) {
      q_tiles[d].thread_elements()[t] = pair[t];
      o_tiles[d].thread_elements()[t] = 0.0f;
    }
  }
}

// One staged key block [kb, kb + BK) for this simdgroup's rows: score
// S = Q . K^T from the tiles, the logit step, the online softmax, then
// O = O * alpha + P . V. Shared by the dense prefill kernel and the paged one
// (metal/attention_paged_prefill.h): they differ only in how the tiles are
// staged.
template <typename T, int D, int BK, int MASK>
inline void prefill_attend_block(constant AttentionParams& p, const device uchar* mask,
                                 threadgroup KeyValueTiles<T, D, BK>& tiles, thread const QueryRows& rows, int kb,
                                 thread simdgroup_float8x8* q_tiles, thread simdgroup_float8x8* o_tiles,
                                 thread float& m_row, thread float& l_row) {
  constexpr int LD = KeyValueTiles<T, D, BK>::LD;
  const int b = rows.b, h = rows.h, r = rows.r, c = rows.c, qi = rows.qi;
  // score: S[8 x BK] = Q . K^T, tile j holds keys kb + 8j ..
  simdgroup_float8x8 s_tiles[BK / 8];
  for (int j = 0; j < BK / 8; ++j) {
    s_tiles[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int d = 0; d < D / 8; ++d) {
      simdgroup_float8x8 k_t;  // K^T block: row = dim d*8 + r, column = key j*8 + c
      for (int t = 0; t < 2; ++t) {
        k_t.thread_elements()[t] = float(tiles.k[(j * 8 + c + t) * LD + d * 8 + r]);
      }
      simdgroup_multiply_accumulate(s_tiles[j], q_tiles[d], k_t, s_tiles[j]);
    }
  }

  // scale, mask (per-element visibility tests on edge blocks only), then
  // online max / rescale
  const bool edge = key_block_on_edge(p, rows, kb, BK);
  const float block_max = prefill_block_logits<T, BK, MASK>(p, mask, s_tiles, b, h, qi, rows.pos, kb, c, edge);
  // accumulate: P = exp2(S - m_new), l = l * alpha + rowsum P
  const float alpha = prefill_online_softmax<BK>(s_tiles, block_max, m_row, l_row);

  // rescale O by alpha (its row's), then O += P . V
  prefill_rescale<D / 8>(o_tiles, alpha);
  for (int d = 0; d < D / 8; ++d) {
    for (int j = 0; j < BK / 8; ++j) {
      simdgroup_float8x8 v_part;  // row = key j*8 + r, column = dim d*8 + c
      for (int t = 0; t < 2; ++t) {
        v_part.thread_elements()[t] = float(tiles.v[(j * 8 + r) * LD + d * 8 + c + t]);
      }
      simdgroup_multiply_accumulate(o_tiles[d], s_tiles[j], v_part, o_tiles[d]);
    }
  }
}

// normalize and write: the head's sink joins the row's max and sum
// (row_normalizer); this lane's columns of O (COLUMNS of them), scaled, go to
// output row `row` (`width` elements, the pass's first column `first`) and,
// when `writes_lse`, its log-sum-exp to lse[row]. Rows that saw nothing give
// zeros; rows past q_len write nothing. The four prefill kernels' last step.
template <typename T, int COLUMNS>
inline void prefill_write_row(constant AttentionParams& p, const device T* sinks, thread const QueryRows& rows,
                              attn_int64 row, int width, int first, bool writes_lse, device T* out,
                              device float* lse, thread simdgroup_float8x8* o_tiles, float m_row, float l_row) {
  const float factor = row_normalizer(p, sinks, rows.h, m_row, l_row);
  if (rows.qi < p.q_len) {
    device T* out_row = out + row * width + first;
    for (int d = 0; d < COLUMNS / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        out_row[d * 8 + rows.c + t] = T(o_tiles[d].thread_elements()[t] * factor);
      }
    }
    if (writes_lse && p.output_lse != 0 && rows.c == 0) {
      lse[row] = row_log_sum_exp(m_row, l_row);
    }
  }
}

template <typename T, int D, int BK, int MASK>
[[kernel]] void attention_prefill(
    const device T* q [[buffer(0)]],    // [B, Hq, Tq, D]
    const device T* k [[buffer(1)]],    // [B, Hkv, Tkv, D]
    const device T* v [[buffer(2)]],    // [B, Hkv, Tkv, D]
    device T* out [[buffer(3)]],        // [B, Hq, Tq, D]
    constant AttentionParams& p [[buffer(4)]],
    const device uchar* mask [[buffer(5)]],
    const device T* sinks [[buffer(6)]],
    device float* lse [[buffer(7)]],  // [B, Hq, Tq] when p.output_lse
    MLX_ATTN_THREAD_POSITION) {
  using Tiles = KeyValueTiles<T, D, BK>;
  threadgroup Tiles tiles;

  // this lane's rows and columns of the 8x8 tiles, the visible keys
  const QueryRows rows = query_rows<PrefillGroup::ROWS>(p, group_id, sg, lane);
  const int b = rows.b, h = rows.h, qi = rows.qi;

  simdgroup_float8x8 q_tiles[D / 8];
  simdgroup_float8x8 o_tiles[D / 8];
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  const bool vector_loads = p.vector_loads != 0;
  prefill_load_queries<T, D>(p, q, q_row, rows, vector_loads, q_tiles, o_tiles);
  float m_row = MLX_ATTN_MASKED_LOGIT;
  float l_row = 0.0f;

  // skip key blocks no row of this threadgroup can see
  const int kv_begin = rows.keys.begin;
  const int kv_end = rows.keys.end;

  const long k_head = b * p.k_strides[0] + rows.kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + rows.kv_head * p.v_strides[1];
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    // stage K/V in the input dtype
    stage_key_block<T, D, BK, PrefillGroup::THREADS>(p, k, v, k_head, v_head, kb, kv_end, vector_loads, tid, tiles);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefill_attend_block<T, D, BK, MASK>(p, mask, tiles, rows, kb, q_tiles, o_tiles, m_row, l_row);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;
  prefill_write_row<T, D>(p, sinks, rows, row, D, 0, true, out, lse, o_tiles, m_row, l_row);
}
