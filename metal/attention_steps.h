// Kernel steps shared by the Metal kernel families (prefill, decode,
// quantized, backward): the kernels' thread position (their one signature
// macro) and tile geometry, the 8x8 tile lane layout, the logit step (scale,
// visibility, mask) specialized at compile time, the sink join / normalize
// step and the row log-sum-exp, and the staging of a K/V block in
// threadgroup memory. The rules themselves (saturation, visibility,
// key ranges, mask offsets, the sentinel) live in metal/attention_rules.h,
// shared with the CPU kernels.
//
// Specialization: MASK (MLX_ATTN_MASK_NONE / _BOOL / _ADDITIVE), EDGE and
// SOFTCAP are template parameters. An interior block (attention_rules.h
// block_on_edge false, every key and query in bounds) runs EDGE = false: no
// per-element visibility test at all; only edge blocks test causal, window
// and bounds. SOFTCAP (AttentionParams::softcap > 0) adds the softcap step;
// without it the logit step has none of its code. The kernels pick EDGE and
// SOFTCAP once per block (uniform branches), so the per-element code never
// branches on the mask kind, the visibility rule or the softcap.
#pragma once

#include <metal_stdlib>

#include "metal/attention_rules.h"

using namespace metal;

// Every kernel's thread position, its last parameters. Metal passes these
// builtins only as kernel parameters (no struct can carry them), so this is
// the kernels' one signature macro; a kernel reads the ones it needs.
#define MLX_ATTN_THREAD_POSITION                   \
  uint3 group_id [[threadgroup_position_in_grid]], \
  uint3 groups [[threadgroups_per_grid]],          \
  uint tid [[thread_index_in_threadgroup]],        \
  uint sg [[simdgroup_index_in_threadgroup]],      \
  uint lane [[thread_index_in_simdgroup]]

// The threadgroup of the kernels whose simdgroups own 8-row tiles: NSG
// simdgroups of 32 lanes, 8 query rows (or keys) each.
template <int NSG>
struct TileGroup {
  static constexpr int ROWS = 8 * NSG;
  static constexpr int THREADS = 32 * NSG;
};
// The four prefill kernels' (dense, D-split, paged, quantized).
using PrefillGroup = TileGroup<MLX_ATTN_PREFILL_SIMDGROUPS>;
// The backward dK/dV and dQ kernels' (csrc/metal/backward_launch_plan.cpp kThreads).
using BackwardGroup = TileGroup<4>;

// The two elements a lane owns in every 8x8 simdgroup matrix (Apple's
// layout): row (lane / 16) * 4 + (lane / 2) % 4, columns col and col + 1
// with col = ((lane / 8) % 2) * 4 + (lane % 2) * 2.
struct TileLane {
  int row;
  int col;
};
inline TileLane tile_lane(uint lane) {
  TileLane at;
  at.row = int(lane) / 16 * 4 + int(lane) / 2 % 4;
  at.col = int(lane) / 8 % 2 * 4 + int(lane) % 2 * 2;
  return at;
}

// An additive mask value, finite: at or below the sentinel (-inf included)
// it becomes the sentinel. max() runs before any arithmetic because fast
// math has no infinities.
template <typename T>
inline float additive_mask_value(const device uchar* mask, attn_int64 at) {
  return metal::max(float(((const device T*)mask)[at]), MLX_ATTN_MASKED_LOGIT);
}

// The logit of (query qi at key position pos, key) from its raw scaled score:
// saturated, softcapped (SOFTCAP: p.softcap > 0), then hidden (the sentinel)
// when the visibility rule (EDGE only) or the mask hides the key. `exact`: no
// saturation changed it (the backward gives no gradient through a saturated
// logit); `slope`: d value / d saturated logit (the softcap's, else 1).
struct MaskedLogit {
  float value;
  bool exact;
  float slope;
};
template <typename T, int MASK, bool EDGE, bool SOFTCAP>
inline MaskedLogit masked_logit(
    constant AttentionParams& p, const device uchar* mask, float raw, int b, int h, int qi, int key, int pos) {
  MaskedLogit logit;
  logit.value = saturate_logit(raw);
  logit.exact = logit.value == raw;
  logit.slope = 1.0f;
  if (SOFTCAP) {
    logit.value = softcap_logit(logit.value, p.softcap);
    logit.slope = softcap_slope(logit.value, p.softcap);
  }
  if (EDGE && !(key < p.kv_len && qi < p.q_len && key_visible(p, key, pos))) {
    logit.value = MLX_ATTN_MASKED_LOGIT;
    return logit;
  }
  if (MASK == MLX_ATTN_MASK_BOOL) {
    logit.value = bool_masked_logit(logit.value, mask[mask_offset(p, b, h, qi, key)] != 0);
  } else if (MASK == MLX_ATTN_MASK_ADDITIVE) {
    const float added = additive_mask_value<T>(mask, mask_offset(p, b, h, qi, key));
    const float sum = logit.value + added;
    logit.value = additive_masked_logit(logit.value, added);
    logit.exact = logit.exact && logit.value == sum;
  }
  return logit;
}

// normalize: the head's sink joins the row's running max and sum, so (m, l)
// become the final ones (the log-sum-exp's); returns the factor that scales
// the row's output (0 for a row that saw nothing). The prefill kernels' last
// step and the decode kernels' (decode_write_row).
template <typename T>
inline float row_normalizer(constant AttentionParams& p, const device T* sinks, int h, thread float& m_row,
                            thread float& l_row) {
  float correction = 1.0f;
  if (p.has_sinks != 0) {
    const float sink = saturate_logit(float(sinks[h * p.sinks_stride]));
    const float m_final = max(m_row, sink);
    correction = fast::exp2((m_row - m_final) * MLX_ATTN_LOG2E);
    l_row = l_row * correction + fast::exp2((sink - m_final) * MLX_ATTN_LOG2E);
    m_row = m_final;
  }
  return l_row > 0.0f ? correction / l_row : 0.0f;
}

// A row's log-sum-exp from its final max and sum: -inf for a row that saw
// nothing, written as bits (fast math has no infinities).
inline float row_log_sum_exp(float m_final, float l_final) {
  return l_final > 0.0f ? m_final + log(l_final) : as_type<float>(0xff800000u);
}

// Whether a key block needs the per-element visibility tests (EDGE): the
// causal / window rule hides one of its keys from one of the queries at
// [first_pos, last_pos], or a key or query falls out of bounds.
inline bool block_needs_tests(
    constant AttentionParams& p, int first_key, int keys, int key_end, int first_pos, int last_pos, bool rows_past_end) {
  return rows_past_end || first_key + keys > key_end || block_on_edge(p, first_key, keys, first_pos, last_pos);
}

// The query rows of a threadgroup that owns BQ = 8 x simdgroups rows of one
// (batch, query head) (prefill, backward dQ; grid (row blocks, Hq, B)): this
// lane's tile row and columns, its query row and key position, the keys some
// row of the threadgroup may see, and its simdgroup's 8 positions, against
// which a key block is an edge block or interior (key_block_on_edge).
struct QueryRows {
  int b, h, kv_head, q0;
  int r, c;        // this lane's row and first column in every 8x8 tile
  int qi, pos;     // this lane's query row, its key position
  KeyRange keys;   // keys any row of the threadgroup may see
  int sg_first_pos, sg_last_pos;
  bool sg_rows_past_end;
};
template <int BQ>
inline QueryRows query_rows(constant AttentionParams& p, uint3 group_id, uint sg, uint lane) {
  QueryRows rows;
  rows.b = int(group_id.z);
  rows.h = int(group_id.y);
  rows.kv_head = rows.h / p.group;
  rows.q0 = int(group_id.x) * BQ;
  const TileLane at = tile_lane(lane);
  rows.r = at.row;
  rows.c = at.col;
  rows.qi = rows.q0 + int(sg) * 8 + rows.r;
  rows.pos = query_position(p, rows.qi);
  rows.keys = block_key_range(p, query_position(p, rows.q0), query_position(p, min(rows.q0 + BQ, p.q_len) - 1));
  const int sg_row = rows.q0 + int(sg) * 8;
  rows.sg_first_pos = query_position(p, sg_row);
  rows.sg_last_pos = query_position(p, min(sg_row + 8, p.q_len) - 1);
  rows.sg_rows_past_end = sg_row + 8 > p.q_len;
  return rows;
}
// Whether keys [kb, kb + BK) need per-element tests for this simdgroup's rows.
inline bool key_block_on_edge(constant AttentionParams& p, thread const QueryRows& rows, int kb, int bk) {
  return block_needs_tests(p, kb, bk, rows.keys.end, rows.sg_first_pos, rows.sg_last_pos, rows.sg_rows_past_end);
}

// A block of BK keys and values in threadgroup memory, in the input dtype,
// rows padded by 16 bytes against bank conflicts (prefill, backward dQ).
template <typename T, int D, int BK>
struct KeyValueTiles {
  static constexpr int LD = D + 16 / int(sizeof(T));  // padded row
  T k[BK * LD];
  T v[BK * LD];
};

// Stages keys [kb, kb + BK) of one K/V head into `tiles`: consecutive
// threads take consecutive elements (aligned inputs: consecutive W-element
// vectors) of a key row, coalesced device reads; keys at or past kv_end are
// zeros, not read.
template <typename T, int D, int BK, int THREADS>
inline void stage_key_block(
    constant AttentionParams& p, const device T* k, const device T* v, attn_int64 k_head, attn_int64 v_head,
    int kb, int kv_end, bool vector_loads, uint tid, threadgroup KeyValueTiles<T, D, BK>& tiles) {
  constexpr int LD = KeyValueTiles<T, D, BK>::LD;
  if (vector_loads) {
    constexpr int W = MLX_ATTN_VECTOR_WIDTH;
    for (int e = int(tid) * W; e < BK * D; e += THREADS * W) {
      const int j = e / D;
      const int col = e % D;
      const int key = kb + j;
      metal::vec<T, W> k_part = metal::vec<T, W>(T(0));
      metal::vec<T, W> v_part = metal::vec<T, W>(T(0));
      if (key < kv_end) {
        k_part = *(const device metal::vec<T, W>*)(k + k_head + key * p.k_strides[2] + col);
        v_part = *(const device metal::vec<T, W>*)(v + v_head + key * p.v_strides[2] + col);
      }
      for (int i = 0; i < W; ++i) {
        tiles.k[j * LD + col + i] = k_part[i];
        tiles.v[j * LD + col + i] = v_part[i];
      }
    }
  } else {
    for (int e = int(tid); e < BK * D; e += THREADS) {
      const int j = e / D;
      const int col = e % D;
      const int key = kb + j;
      const bool inside = key < kv_end;
      tiles.k[j * LD + col] = inside ? k[k_head + key * p.k_strides[2] + col * p.k_strides[3]] : T(0);
      tiles.v[j * LD + col] = inside ? v[v_head + key * p.v_strides[2] + col * p.v_strides[3]] : T(0);
    }
  }
}

// The kernels are instantiated once per mask kind; the host name ends with
// the kind's suffix (none: no suffix), the one the launch plans name
// (csrc/metal/launch_plan.cpp mask_kernel_suffix). INSTANCE(suffix, mask, args...)
// is the family's single-instantiation macro.
#define MLX_ATTN_FOR_EACH_MASK(INSTANCE, ...)                    \
  INSTANCE("", MLX_ATTN_MASK_NONE, __VA_ARGS__)                  \
  INSTANCE("_mask_bool", MLX_ATTN_MASK_BOOL, __VA_ARGS__)        \
  INSTANCE("_mask_additive", MLX_ATTN_MASK_ADDITIVE, __VA_ARGS__)
