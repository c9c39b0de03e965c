// Fused attention forward for prefill at large head dims, or key head dim D
// != value head dim DV (absorbed MLA: 576/512, 192/128): the D-split variant
// of metal/attention_prefill.h (same threadgroup shape, same steps, same
// logit step prefill_block_logits); metal/attention_prefill_split.metal
// instantiates it.
//
// Register budget. The register-resident kernel holds Q and O as D/4 floats
// each per lane (128 + 128 at D = 256: the whole register file). Here no lane
// holds more than QC/4 + VC/4 + BK/4 floats of tiles (QC =
// MLX_ATTN_SPLIT_QUERY_CHUNK = 64, VC = min(DV, MLX_ATTN_SPLIT_VALUE_CHUNK =
// 128): 16 + 32 + BK/4, docs/metal_kernels.md "Head dims"):
//   score      S = sum over D chunks of Q[:, chunk] . K[:, chunk]^T: each
//              chunk of QC dims of this lane's Q is read from device memory
//              (cached; the rows are the threadgroup's) into QC/8 fragments,
//              used for all BK keys, and dropped;
//   passes     O is produced VC value dims at a time: pass v recomputes the
//              scores and the online softmax (the same arithmetic, so the
//              same max and sum) and accumulates only O[:, v*VC .. v*VC+VC),
//              staging only that V slice. DV / VC passes (1 at 192/128, 2 at
//              256, 4 at 512): the score work repeats, the registers do not
//              grow.
// Threadgroup memory: BK * (D + 16 / sizeof(T)) + BK * (VC + 16 / sizeof(T))
// elements of T (csrc/metal/launch_plan.cpp).
#pragma once

#include <metal_stdlib>

#include "metal/attention_prefill.h"

using namespace metal;

// One staged block: BK keys of all D dims, and the pass's VC value dims.
template <typename T, int D, int VC, int BK>
struct SplitKeyValueTiles {
  static constexpr int LDK = D + 16 / int(sizeof(T));  // padded rows
  static constexpr int LDV = VC + 16 / int(sizeof(T));
  T k[BK * LDK];
  T v[BK * LDV];
};

// Reads element `col` .. col + W - 1 of row `at` (W-element vectors when
// the plan says rows are aligned, else element by element through `stride`)
// into `dst`; zeros when `inside` is false (nothing read).
template <typename T, int W>
inline void stage_row_part(
    const device T* src, attn_int64 at, attn_int64 stride, bool inside, bool vector_loads, threadgroup T* dst) {
  if (vector_loads) {
    const metal::vec<T, W> part = inside ? *(const device metal::vec<T, W>*)(src + at) : metal::vec<T, W>(T(0));
    for (int i = 0; i < W; ++i) {
      dst[i] = part[i];
    }
  } else {
    for (int i = 0; i < W; ++i) {
      dst[i] = inside ? src[at + i * stride] : T(0);
    }
  }
}

// Stages keys [kb, kb + BK) (all D dims) and value dims [v0, v0 + VC) of one
// K/V head: consecutive threads take consecutive W-element parts of a row
// (coalesced device reads); keys at or past kv_end are zeros, not read.
template <typename T, int D, int VC, int BK, int THREADS>
inline void stage_split_block(
    constant AttentionParams& p, const device T* k, const device T* v, attn_int64 k_head, attn_int64 v_head,
    int kb, int kv_end, int v0, bool vector_loads, uint tid, threadgroup SplitKeyValueTiles<T, D, VC, BK>& tiles) {
  using Tiles = SplitKeyValueTiles<T, D, VC, BK>;
  constexpr int W = MLX_ATTN_VECTOR_WIDTH;  // D and VC are multiples of 8
  for (int e = int(tid) * W; e < BK * D; e += THREADS * W) {
    const int j = e / D;
    const int col = e % D;
    stage_row_part<T, W>(k, k_head + (kb + j) * p.k_strides[2] + col * p.k_strides[3], p.k_strides[3],
                         kb + j < kv_end, vector_loads, &tiles.k[j * Tiles::LDK + col]);
  }
  for (int e = int(tid) * W; e < BK * VC; e += THREADS * W) {
    const int j = e / VC;
    const int col = e % VC;
    stage_row_part<T, W>(v, v_head + (kb + j) * p.v_strides[2] + (v0 + col) * p.v_strides[3], p.v_strides[3],
                         kb + j < kv_end, vector_loads, &tiles.v[j * Tiles::LDV + col]);
  }
}

// score: S[8 x BK] = sum over the D chunks of Q[:, chunk] . K[:, chunk]^T,
// this simdgroup's rows against the staged keys. Each chunk of QC dims of
// this lane's Q row is read from device memory (cached) into QC/8 fragments,
// used for all BK keys, and dropped.
template <typename T, int D, int VC, int BK>
inline void split_block_scores(constant AttentionParams& p, const device T* q, attn_int64 q_row,
                               thread const QueryRows& rows, bool vector_loads,
                               threadgroup SplitKeyValueTiles<T, D, VC, BK>& tiles,
                               thread simdgroup_float8x8* s_tiles) {
  using Tiles = SplitKeyValueTiles<T, D, VC, BK>;
  constexpr int QC = MLX_ATTN_SPLIT_QUERY_CHUNK;
  const int r = rows.r, c = rows.c;
  for (int j = 0; j < BK / 8; ++j) {
    s_tiles[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (int d0 = 0; d0 < D; d0 += QC) {
    simdgroup_float8x8 q_tiles[QC / 8];
    for (int d = 0; d < QC / 8; ++d) {
      float pair[2] = {0.0f, 0.0f};
      if (rows.qi < p.q_len) {
        RowLoad<T, 2>::read(q, q_row + (d0 + d * 8 + c) * p.q_strides[3], p.q_strides[3], vector_loads, pair);
      }
      for (int t = 0; t < 2; ++t) {
        q_tiles[d].thread_elements()[t] = pair[t];
      }
    }
    for (int j = 0; j < BK / 8; ++j) {
      for (int d = 0; d < QC / 8; ++d) {
        simdgroup_float8x8 k_t;  // K^T block: row = dim d0 + d*8 + r, column = key j*8 + c
        for (int t = 0; t < 2; ++t) {
          k_t.thread_elements()[t] = float(tiles.k[(j * 8 + c + t) * Tiles::LDK + d0 + d * 8 + r]);
        }
        simdgroup_multiply_accumulate(s_tiles[j], q_tiles[d], k_t, s_tiles[j]);
      }
    }
  }
}

// O += P . V[:, v0 .. v0 + VC): this pass's O slice (VC/8 tiles) from P (the
// S tiles after the online softmax) and the staged value slice.
template <typename T, int D, int VC, int BK>
inline void split_accumulate_values(threadgroup SplitKeyValueTiles<T, D, VC, BK>& tiles,
                                    thread simdgroup_float8x8* s_tiles, thread simdgroup_float8x8* o_tiles, int r,
                                    int c) {
  using Tiles = SplitKeyValueTiles<T, D, VC, BK>;
  for (int d = 0; d < VC / 8; ++d) {
    for (int j = 0; j < BK / 8; ++j) {
      simdgroup_float8x8 v_part;  // row = key j*8 + r, column = value dim v0 + d*8 + c
      for (int t = 0; t < 2; ++t) {
        v_part.thread_elements()[t] = float(tiles.v[(j * 8 + r) * Tiles::LDV + d * 8 + c + t]);
      }
      simdgroup_multiply_accumulate(o_tiles[d], s_tiles[j], v_part, o_tiles[d]);
    }
  }
}

template <typename T, int D, int DV, int BK, int MASK>
[[kernel]] void attention_prefill_split(
    const device T* q [[buffer(0)]],    // [B, Hq, Tq, D]
    const device T* k [[buffer(1)]],    // [B, Hkv, Tkv, D]
    const device T* v [[buffer(2)]],    // [B, Hkv, Tkv, DV]
    device T* out [[buffer(3)]],        // [B, Hq, Tq, DV]
    constant AttentionParams& p [[buffer(4)]],
    const device uchar* mask [[buffer(5)]],
    const device T* sinks [[buffer(6)]],
    device float* lse [[buffer(7)]],  // [B, Hq, Tq] when p.output_lse
    MLX_ATTN_THREAD_POSITION) {
  constexpr int QC = MLX_ATTN_SPLIT_QUERY_CHUNK;
  constexpr int VC = DV < MLX_ATTN_SPLIT_VALUE_CHUNK ? DV : MLX_ATTN_SPLIT_VALUE_CHUNK;
  static_assert(D % QC == 0 && DV % VC == 0 && VC % 8 == 0, "head dims: whole query and value chunks");
  using Tiles = SplitKeyValueTiles<T, D, VC, BK>;
  threadgroup Tiles tiles;

  const QueryRows rows = query_rows<PrefillGroup::ROWS>(p, group_id, sg, lane);
  const int b = rows.b, h = rows.h, r = rows.r, c = rows.c, qi = rows.qi;
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  const bool vector_loads = p.vector_loads != 0;
  const int kv_begin = rows.keys.begin;
  const int kv_end = rows.keys.end;
  const long k_head = b * p.k_strides[0] + rows.kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + rows.kv_head * p.v_strides[1];
  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;

  for (int v0 = 0; v0 < DV; v0 += VC) {
    simdgroup_float8x8 o_tiles[VC / 8];
    for (int d = 0; d < VC / 8; ++d) {
      o_tiles[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    float m_row = MLX_ATTN_MASKED_LOGIT;
    float l_row = 0.0f;

    for (int kb = kv_begin; kb < kv_end; kb += BK) {
      stage_split_block<T, D, VC, BK, PrefillGroup::THREADS>(p, k, v, k_head, v_head,
                                                      kb, kv_end, v0, vector_loads, tid, tiles);
      threadgroup_barrier(mem_flags::mem_threadgroup);

      simdgroup_float8x8 s_tiles[BK / 8];
      split_block_scores<T, D, VC, BK>(p, q, q_row, rows, vector_loads, tiles, s_tiles);

      // scale, mask, online max / rescale (as the register-resident kernel)
      const bool edge = key_block_on_edge(p, rows, kb, BK);
      const float block_max =
          prefill_block_logits<T, BK, MASK>(p, mask, s_tiles, b, h, qi, rows.pos, kb, c, edge);
      // accumulate: P = exp2(S - m_new), l = l * alpha + rowsum P
      const float alpha = prefill_online_softmax<BK>(s_tiles, block_max, m_row, l_row);

      // rescale this pass's O slice by alpha, then O += P . V[:, v0 .. v0 + VC)
      prefill_rescale<VC / 8>(o_tiles, alpha);
      split_accumulate_values<T, D, VC, BK>(tiles, s_tiles, o_tiles, r, c);
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
    }

    // normalize this pass's slice; the row's log-sum-exp once, from the first pass
    prefill_write_row<T, VC>(p, sinks, rows, row, DV, v0, v0 == 0, out, lse, o_tiles, m_row, l_row);
  }
}
