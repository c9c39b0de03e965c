// Paged, ragged attention for chunked prefill (mlx_attn.paged_attention
// rows of sequences with long query chunks): the kernel template;
// metal/attention_paged_prefill.metal instantiates it.
//
// The dense prefill kernel's MMA tiles over paged K/V: a threadgroup of NSG
// simdgroups owns BQ = 8 x NSG query rows of ONE sequence and one query head
// (grid.x = the query blocks of every sequence the plan routes here, packed:
// PagedSequence::query_block_start / query_blocks; grid.y = query heads).
// Each sequence has its own AttentionParams (its q_len / kv_len), so query i
// of its chunk sits at key position kv_len - q_len + i and every rule of
// metal/attention_rules.h (key_visible, block_key_range, edge blocks, softcap,
// sinks, window) applies as written. Per key block it stages K/V in
// threadgroup memory with the paged loader below, then runs the dense
// kernel's steps (metal/attention_prefill.h: prefill_attend_block, i.e. the
// scores, the logit step, prefill_online_softmax and O += P . V; then
// prefill_write_row: sinks, normalize, out and lse).
//
// The paged loader: simdgroup 0 finds where each key of the next block is
// (a PageWindow, metal/attention_paged.h: lane l reads the block's page l,
// one block-table read per page, and each key's page is a simd_shuffle) and
// writes its K and V row offsets to threadgroup memory; every thread then
// stages K/V from those rows as stage_key_block does from contiguous rows.
// The offsets are double-buffered, so locating block n + 1 overlaps staging
// block n and adds no barrier.
#pragma once

#include <metal_stdlib>

#include "metal/attention_paged.h"
#include "metal/attention_prefill.h"

using namespace metal;

// Element offsets of the K and V rows of keys [kb, kb + BK) of one K/V head.
template <int BK>
struct PagedKeyRows {
  attn_int64 k[BK];
  attn_int64 v[BK];
};

// Simdgroup 0 (every lane): where keys [kb, min(kb + BK, kv_end)) of K/V
// head `kv_head` are. A block of at most 32 keys spans at most 32 pages, one
// per lane.
template <int BK>
inline void locate_paged_keys(constant AttentionParams& p, const device int* table_row, int page_size, int kv_head,
                              int kb, int kv_end, uint lane, threadgroup PagedKeyRows<BK>& rows) {
  static_assert(BK <= 32, "one lane per key of a block");
  const int end = min(kb + BK, kv_end);
  if (kb >= end) {
    return;  // past the last block (uniform)
  }
  PageWindow<1> window;
  window.select(table_row, kb, end, page_size, lane);
  const int key = min(kb + int(lane), end - 1);  // lanes past the block: a shuffle in range, nothing written
  const int page = window.page_of(key);
  if (kb + int(lane) < end) {
    const int slot = key % page_size;
    rows.k[lane] = page * p.k_strides[0] + kv_head * p.k_strides[1] + slot * p.k_strides[2];
    rows.v[lane] = page * p.v_strides[0] + kv_head * p.v_strides[1] + slot * p.v_strides[2];
  }
}

// Stages keys [kb, kb + BK) into `tiles` from the rows `at` located: as
// stage_key_block (metal/attention_steps.h), consecutive threads take
// consecutive elements (aligned: W-element vectors) of a key row; keys at or
// past kv_end are zeros, not read.
template <typename T, int D, int BK, int THREADS>
inline void stage_paged_key_block(constant AttentionParams& p, const device T* k, const device T* v,
                                  threadgroup PagedKeyRows<BK>& at, int kb, int kv_end, bool vector_loads, uint tid,
                                  threadgroup KeyValueTiles<T, D, BK>& tiles) {
  constexpr int LD = KeyValueTiles<T, D, BK>::LD;
  constexpr int W = MLX_ATTN_VECTOR_WIDTH;
  const int step = vector_loads ? W : 1;
  for (int e = int(tid) * step; e < BK * D; e += THREADS * step) {
    const int j = e / D;
    const int col = e % D;
    const bool inside = kb + j < kv_end;
    if (vector_loads) {
      metal::vec<T, W> k_part = metal::vec<T, W>(T(0));
      metal::vec<T, W> v_part = metal::vec<T, W>(T(0));
      if (inside) {
        k_part = *(const device metal::vec<T, W>*)(k + at.k[j] + col);
        v_part = *(const device metal::vec<T, W>*)(v + at.v[j] + col);
      }
      for (int i = 0; i < W; ++i) {
        tiles.k[j * LD + col + i] = k_part[i];
        tiles.v[j * LD + col + i] = v_part[i];
      }
    } else {
      tiles.k[j * LD + col] = inside ? k[at.k[j] + col * p.k_strides[3]] : T(0);
      tiles.v[j * LD + col] = inside ? v[at.v[j] + col * p.v_strides[3]] : T(0);
    }
  }
}

template <typename T, int D, int BK>
[[kernel]] void attention_paged_prefill(
    const device T* q [[buffer(0)]],              // [total_q, Hq, D]
    const device T* k_pages [[buffer(1)]],        // [num_pages, Hkv, page_size, D]
    const device T* v_pages [[buffer(2)]],
    const device int* block_table [[buffer(3)]],  // [B, max_pages]
    constant PagedSequence* sequences [[buffer(4)]],
    const device T* sinks [[buffer(5)]],
    device T* out [[buffer(6)]],                  // [total_q, Hq, D]
    device float* lse [[buffer(7)]],              // [total_q, Hq] when output_lse
    MLX_ATTN_THREAD_POSITION) {
  threadgroup KeyValueTiles<T, D, BK> tiles;
  threadgroup PagedKeyRows<BK> key_rows[2];

  // this threadgroup's sequence: the one whose query blocks hold group_id.x
  // (the grid holds only routed blocks, so the scan stops at a sequence)
  const int block = int(group_id.x);
  int b = 0;
  while (sequences[b].query_block_start + sequences[b].query_blocks <= block) {
    ++b;
  }
  constant PagedSequence& seq = sequences[b];
  constant AttentionParams& p = seq.attn;
  const QueryRows rows =
      query_rows<PrefillGroup::ROWS>(p, uint3(uint(block - seq.query_block_start), group_id.y, 0u), sg, lane);
  const int h = rows.h, qi = rows.qi;

  simdgroup_float8x8 q_tiles[D / 8];
  simdgroup_float8x8 o_tiles[D / 8];
  const bool vector_loads = p.vector_loads != 0;
  const long q_row = (seq.q_start + qi) * p.q_strides[2] + h * p.q_strides[1];
  prefill_load_queries<T, D>(p, q, q_row, rows, vector_loads, q_tiles, o_tiles);
  float m_row = MLX_ATTN_MASKED_LOGIT;
  float l_row = 0.0f;

  // key blocks some row of this threadgroup can see, located one block ahead
  const int kv_begin = rows.keys.begin;
  const int kv_end = rows.keys.end;
  const device int* table_row = block_table + seq.table_start;
  if (sg == 0) {
    locate_paged_keys<BK>(p, table_row, seq.page_size, rows.kv_head, kv_begin, kv_end, lane, key_rows[0]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int buffer = 0;
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    stage_paged_key_block<T, D, BK, PrefillGroup::THREADS>(p, k_pages, v_pages, key_rows[buffer], kb, kv_end,
                                                           vector_loads, tid, tiles);
    if (sg == 0) {  // the other buffer's last reader staged the previous block
      locate_paged_keys<BK>(p, table_row, seq.page_size, rows.kv_head, kb + BK, kv_end, lane, key_rows[1 - buffer]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefill_attend_block<T, D, BK, MLX_ATTN_MASK_NONE>(p, (const device uchar*)q, tiles, rows, kb, q_tiles, o_tiles,
                                                       m_row, l_row);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
    buffer = 1 - buffer;
  }

  const long row = (seq.q_start + qi) * p.q_heads + h;
  prefill_write_row<T, D>(p, sinks, rows, row, D, 0, true, out, lse, o_tiles, m_row, l_row);
}
