// Fused prefill attention over keys and values quantized by mx.quantize (the
// kernel template; metal/attention_quantized_prefill.metal instantiates it).
//
// The dense prefill kernel's MMA tiles (metal/attention_prefill.h): a
// threadgroup of NSG simdgroups owns BQ = 8 x NSG query rows of one (batch,
// query head), Q and O in registers as 8x8 float tiles; per key block it
// stages K/V in threadgroup memory, in q's dtype, then runs the dense
// kernel's steps (prefill_attend_block: scores, the logit step, the online
// softmax, O += P . V; then prefill_write_row). The
// only new part is the block loader: it reads the packed uint32 codes and
// the per-group scales and biases (metal/attention_quantized_params.h) and
// writes scale * code + bias, computed in float as the decode loader does
// (dequantize_slice, metal/attention_quantized.h), rounded to q's dtype, into
// the same tiles the float loader fills. K/V are read once per query block
// and dequantized once per element staged, where the decode structure
// re-reads and re-dequantizes them for every chunk of R rows.
#pragma once

#include <metal_stdlib>

#include "metal/attention_prefill.h"
#include "metal/attention_quantized.h"

using namespace metal;

// Features one thread stages at a time: a run of 32 that never straddles a
// quantization group (group sizes are multiples of 32), so it reads one
// scale and one bias and BITS consecutive words.
constant constexpr int MLX_ATTN_QUANTIZED_STAGE_RUN = 32;

// Where one key's row of a triple is: its packed words, scale and bias
// offsets and strides (QuantizedKV::at rows FIRST .. FIRST + 2: 0 the key
// triple, 3 the value's; constant indices, so `at` stays in registers).
struct QuantizedRowAt {
  attn_int64 words, word_stride, scales, scale_stride, biases, bias_stride;
};
template <int FIRST, typename KV>
inline QuantizedRowAt quantized_row_at(thread const KV& kv, int key) {
  return {kv.at[FIRST][0] + key * kv.at[FIRST][1],         kv.at[FIRST][2],
          kv.at[FIRST + 1][0] + key * kv.at[FIRST + 1][1], kv.at[FIRST + 1][2],
          kv.at[FIRST + 2][0] + key * kv.at[FIRST + 2][1], kv.at[FIRST + 2][2]};
}

// Dequantizes one run of MLX_ATTN_QUANTIZED_STAGE_RUN features (from column
// `col`) of row `key` of the entry `kv` selected, its key (value: its value)
// row, into `row`. The run reads one scale, one bias and BITS words.
template <typename T, int D, int BITS>
inline void stage_quantized_run(thread const QuantizedKV<T, D, BITS>& kv, int key, bool value, int col,
                                threadgroup T* row) {
  constexpr int CODES_PER_WORD = 32 / BITS;
  constexpr int RUN_WORDS = MLX_ATTN_QUANTIZED_STAGE_RUN / CODES_PER_WORD;
  constexpr uint CODE_MASK = (1u << BITS) - 1u;
  const QuantizedRowAt at = value ? quantized_row_at<3>(kv, key) : quantized_row_at<0>(kv, key);
  const device uint* packed = value ? kv.v : kv.k;
  const device T* scales = value ? kv.v_scales : kv.k_scales;
  const device T* biases = value ? kv.v_biases : kv.k_biases;
  const int group = col / kv.group_size;
  const float scale = float(scales[at.scales + group * at.scale_stride]);
  const float bias = float(biases[at.biases + group * at.bias_stride]);
  for (int w = 0; w < RUN_WORDS; ++w) {
    const uint word = packed[at.words + (col / CODES_PER_WORD + w) * at.word_stride];
    for (int c = 0; c < CODES_PER_WORD; ++c) {
      row[w * CODES_PER_WORD + c] = T(scale * float((word >> (c * BITS)) & CODE_MASK) + bias);
    }
  }
}

// Stages keys [kb, kb + BK) of the head `kv` selected into `tiles`,
// dequantized: the block's K runs then its V runs are dealt out to the
// threads (BK * D / 32 runs each; K and V split between simdgroups when that
// count is a multiple of 32). Keys at or past kv_end are zeros, not read.
template <typename T, int D, int BK, int BITS, int THREADS>
inline void stage_quantized_key_block(thread const QuantizedKV<T, D, BITS>& kv, int kb, int kv_end, uint tid,
                                      threadgroup KeyValueTiles<T, D, BK>& tiles) {
  constexpr int LD = KeyValueTiles<T, D, BK>::LD;
  constexpr int RUN = MLX_ATTN_QUANTIZED_STAGE_RUN;
  constexpr int ROW_RUNS = D / RUN;
  constexpr int TILE_RUNS = BK * ROW_RUNS;
  static_assert(D % RUN == 0, "whole runs per row");
  for (int u = int(tid); u < 2 * TILE_RUNS; u += THREADS) {
    const bool value = u >= TILE_RUNS;
    const int run = value ? u - TILE_RUNS : u;
    const int j = run / ROW_RUNS;
    const int col = (run % ROW_RUNS) * RUN;
    const int key = kb + j;
    threadgroup T* row = (value ? tiles.v : tiles.k) + j * LD + col;
    if (key >= kv_end) {
      for (int e = 0; e < RUN; ++e) {
        row[e] = T(0);
      }
      continue;
    }
    stage_quantized_run<T, D, BITS>(kv, key, value, col, row);
  }
}

template <typename T, int D, int BK, int BITS, int MASK>
[[kernel]] void attention_quantized_prefill(
    const device T* q [[buffer(0)]],
    const device uint* k [[buffer(1)]],
    const device T* k_scales [[buffer(2)]],
    const device T* k_biases [[buffer(3)]],
    const device uint* v [[buffer(4)]],
    const device T* v_scales [[buffer(5)]],
    const device T* v_biases [[buffer(6)]],
    device T* out [[buffer(7)]],
    constant AttentionParams& p [[buffer(8)]],
    constant QuantizedAttentionParams& qp [[buffer(9)]],
    const device uchar* mask [[buffer(10)]],
    const device T* sinks [[buffer(11)]],
    device float* lse [[buffer(12)]],  // [B, Hq, Tq] when p.output_lse
    MLX_ATTN_THREAD_POSITION) {
  threadgroup KeyValueTiles<T, D, BK> tiles;

  // this lane's rows and columns of the 8x8 tiles, the visible keys
  const QueryRows rows = query_rows<PrefillGroup::ROWS>(p, group_id, sg, lane);
  const int b = rows.b, h = rows.h, qi = rows.qi;

  simdgroup_float8x8 q_tiles[D / 8];
  simdgroup_float8x8 o_tiles[D / 8];
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  prefill_load_queries<T, D>(p, q, q_row, rows, p.vector_loads != 0, q_tiles, o_tiles);
  float m_row = MLX_ATTN_MASKED_LOGIT;
  float l_row = 0.0f;

  // the quantized loader of this K/V head (the decode's, metal/attention_quantized.h)
  QuantizedKV<T, D, BITS> kv = quantized_kv<T, D, BITS>(k, k_scales, k_biases, v, v_scales, v_biases, qp);
  kv.select_head(p, b, rows.kv_head);

  // skip key blocks no row of this threadgroup can see
  const int kv_begin = rows.keys.begin;
  const int kv_end = rows.keys.end;
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    stage_quantized_key_block<T, D, BK, BITS, PrefillGroup::THREADS>(kv, kb, kv_end, tid, tiles);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefill_attend_block<T, D, BK, MASK>(p, mask, tiles, rows, kb, q_tiles, o_tiles, m_row, l_row);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block's staging overwrites the tiles
  }

  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;
  prefill_write_row<T, D>(p, sinks, rows, row, D, 0, true, out, lse, o_tiles, m_row, l_row);
}
