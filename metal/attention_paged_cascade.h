// Cascade (shared-prefix) paged attention: the prefix pass's kernel
// templates; metal/attention_paged_cascade.metal instantiates them.
//
// A cascade group is sequences whose keys begin with the same prefix pages
// (csrc/metal/paged_launch_plan.h plan_cascade_paged_attention). Three
// dispatches compute it:
//   1. prefix (here): the group's query rows of one KV head, every (member
//      row, query head of the GQA group) pair, are the rows of one MMA tile
//      of CascadeTile::ROWS rows (matrix-matrix, the dense prefill's steps:
//      prefill_attend_block), so each prefix page is read once per tile, not
//      once per sequence. Split-K over the prefix (grid.x); each row keeps
//      its own key position, so causal, window and softcap apply as the paged
//      op defines them (a row whose window excludes the prefix gets an empty
//      partial). It writes partials (max, sum, unnormalized output) into each
//      member's partial rows after its own splits', no sinks;
//   2. suffix: the paged decode partial (metal/attention_paged.h) over each
//      sequence's own pages (PagedSequence kv_len = its own keys, so the
//      bottom-right rule over them is the full rule), partials only;
//   3. merge: attention_paged_decode_merge, merge_splits over the sequence's
//      own splits then its prefix splits (the split-K decode's log-sum-exp
//      merge, unchanged), where the sinks join once.
#pragma once

#include <metal_stdlib>

#include "metal/attention_paged_prefill.h"
#include "metal/attention_quantized_prefill.h"

using namespace metal;

// A prefix tile: MLX_ATTN_CASCADE_SIMDGROUPS simdgroups of 8 rows.
using CascadeTile = TileGroup<MLX_ATTN_CASCADE_SIMDGROUPS>;

// The pages of keys [kb, min(kb + BK, kv_end)) of a block (simdgroup 0,
// every lane): one block-table read per page, a key's page by shuffle.
template <int BK>
struct PagedKeyPages {
  int page[BK];
};
template <int BK>
inline void locate_key_pages(const device int* table_row, int page_size, int kb, int kv_end, uint lane,
                             threadgroup PagedKeyPages<BK>& at) {
  static_assert(BK <= 32, "one lane per key of a block");
  const int end = min(kb + BK, kv_end);
  if (kb >= end) {
    return;
  }
  PageWindow<1> window;
  window.select(table_row, kb, end, page_size, lane);
  const int page = window.page_of(min(kb + int(lane), end - 1));
  if (kb + int(lane) < end) {
    at.page[lane] = page;
  }
}

// Float pages: the paged prefill's located rows and staging.
template <typename T, int D, int BK>
struct CascadeFloatPages {
  using Located = PagedKeyRows<BK>;
  const device T* k;
  const device T* v;

  inline void locate(constant AttentionParams& p, const device int* table_row, int page_size, int kv_head, int kb,
                     int kv_end, uint lane, threadgroup Located& at) const {
    locate_paged_keys<BK>(p, table_row, page_size, kv_head, kb, kv_end, lane, at);
  }
  template <int THREADS>
  inline void stage(constant AttentionParams& p, threadgroup Located& at, int, int, int kb, int kv_end, uint tid,
                    threadgroup KeyValueTiles<T, D, BK>& tiles) const {
    stage_paged_key_block<T, D, BK, THREADS>(p, k, v, at, kb, kv_end, p.vector_loads != 0, tid, tiles);
  }
};

// Quantized pages: each key's page located, its runs dequantized as the
// quantized prefill stages them (stage_quantized_run), the page as the batch entry.
template <typename T, int D, int BK, int BITS>
struct CascadeQuantizedPages {
  using Located = PagedKeyPages<BK>;
  QuantizedKV<T, D, BITS> kv;

  inline void locate(constant AttentionParams&, const device int* table_row, int page_size, int, int kb, int kv_end,
                     uint lane, threadgroup Located& at) const {
    locate_key_pages<BK>(table_row, page_size, kb, kv_end, lane, at);
  }
  template <int THREADS>
  inline void stage(constant AttentionParams& p, threadgroup Located& at, int kv_head, int page_size, int kb,
                    int kv_end, uint tid, threadgroup KeyValueTiles<T, D, BK>& tiles) const {
    constexpr int LD = KeyValueTiles<T, D, BK>::LD;
    constexpr int RUN = MLX_ATTN_QUANTIZED_STAGE_RUN;
    constexpr int ROW_RUNS = D / RUN;
    constexpr int TILE_RUNS = BK * ROW_RUNS;
    for (int u = int(tid); u < 2 * TILE_RUNS; u += THREADS) {
      const bool value = u >= TILE_RUNS;
      const int run = value ? u - TILE_RUNS : u;
      const int j = run / ROW_RUNS;
      const int col = (run % ROW_RUNS) * RUN;
      threadgroup T* row = (value ? tiles.v : tiles.k) + j * LD + col;
      if (kb + j >= kv_end) {
        for (int e = 0; e < RUN; ++e) {
          row[e] = T(0);
        }
        continue;
      }
      QuantizedKV<T, D, BITS> on_page = kv;
      on_page.select_head(p, at.page[j], kv_head);
      stage_quantized_run<T, D, BITS>(on_page, (kb + j) % page_size, value, col, row);
    }
  }
};

// The prefix pass of one (prefix split, KV head x tile, group): the tile's
// rows over the split's prefix keys, partials into each row's sequence.
template <typename T, int D, int BK, typename Pages>
inline void cascade_prefix_tile(
    thread const Pages& pages, const device T* q, const device int* prefix_table, constant PagedSequence* sequences,
    constant CascadeGroup* cascade_groups, const device CascadeRow* cascade_rows, device float* partial_out,
    device float* partial_stats, threadgroup KeyValueTiles<T, D, BK>& tiles, threadgroup typename Pages::Located& located,
    threadgroup int* tile_positions, uint3 group_id, uint3 groups, uint tid, uint sg, uint lane) {
  constexpr int NSG = MLX_ATTN_CASCADE_SIMDGROUPS;
  constant CascadeGroup& g = cascade_groups[group_id.z];
  constant AttentionParams& p = g.attn;  // kv_len: the prefix; q_len: the tile rows per KV head
  const int max_tiles = int(groups.y) / p.kv_heads;
  const int kv_head = int(group_id.y) / max_tiles;
  const int tile = int(group_id.y) % max_tiles;
  const int split = int(group_id.x);
  if (split >= g.splits || tile >= g.tiles) {
    return;  // the whole threadgroup: past this group's splits or rows
  }

  // this lane's row: member row qi / group, query head kv_head * group + qi % group
  const TileLane at = tile_lane(lane);
  QueryRows rows;
  rows.b = 0;
  rows.kv_head = kv_head;
  rows.q0 = tile * CascadeTile::ROWS;
  rows.r = at.row;
  rows.c = at.col;
  rows.qi = rows.q0 + int(sg) * 8 + at.row;
  const bool real = rows.qi < p.q_len;
  const device CascadeRow& member = cascade_rows[g.row_start + (real ? rows.qi / p.group : 0)];
  constant PagedSequence& seq = sequences[member.sequence];
  const int head_in_group = real ? rows.qi % p.group : 0;
  rows.h = kv_head * p.group + head_in_group;
  // its key position in the whole sequence: the prefix, then its own keys
  rows.pos = p.kv_len + query_position(seq.attn, member.query);
  int first_pos = simd_min(real ? rows.pos : INT_MAX);
  int last_pos = simd_max(real ? rows.pos : INT_MIN);
  const bool simdgroup_has_rows = simd_any(real);
  if (!simdgroup_has_rows) {
    first_pos = last_pos = 0;  // no row in this simdgroup: every key is hidden from it (edge tests)
  }
  rows.sg_first_pos = first_pos;
  rows.sg_last_pos = last_pos;
  rows.sg_rows_past_end = rows.q0 + int(sg) * 8 + 8 > p.q_len;
  if (lane == 0) {
    tile_positions[sg] = simdgroup_has_rows ? first_pos : INT_MAX;
    tile_positions[NSG + sg] = simdgroup_has_rows ? last_pos : INT_MIN;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int tile_first = INT_MAX, tile_last = INT_MIN;
  for (int s = 0; s < NSG; ++s) {
    tile_first = min(tile_first, tile_positions[s]);
    tile_last = max(tile_last, tile_positions[NSG + s]);
  }
  rows.keys = block_key_range(p, tile_first, tile_last);

  simdgroup_float8x8 q_tiles[D / 8];
  simdgroup_float8x8 o_tiles[D / 8];
  const long q_row = (seq.q_start + member.query) * p.q_strides[2] + rows.h * p.q_strides[1];
  prefill_load_queries<T, D>(p, q, q_row, rows, p.vector_loads != 0, q_tiles, o_tiles);
  float m_row = MLX_ATTN_MASKED_LOGIT;
  float l_row = 0.0f;

  // the split's keys some row of the tile sees, in blocks from the split's
  // start (a split holds whole blocks, so a block never reaches the next split)
  const int split_begin = split * g.keys_per_split;
  const int split_end = min(p.kv_len, split_begin + g.keys_per_split);
  const int begin = max(split_begin, rows.keys.begin);
  const int end = min(split_end, rows.keys.end);
  const device int* table_row = prefix_table + g.table_start;
  for (int kb = split_begin + max(0, begin - split_begin) / BK * BK; kb < end; kb += BK) {
    if (sg == 0) {
      pages.locate(p, table_row, g.page_size, kv_head, kb, end, lane, located);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    pages.template stage<CascadeTile::THREADS>(p, located, kv_head, g.page_size, kb, end, tid, tiles);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefill_attend_block<T, D, BK, MLX_ATTN_MASK_NONE>(p, (const device uchar*)q, tiles, rows, kb, q_tiles, o_tiles,
                                                       m_row, l_row);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  // the partial: after the sequence's own splits, in its [Hkv, splits +
  // prefix_splits, rows] partial rows (row: head in group x q_len + query)
  if (!real) {
    return;
  }
  const int partials = seq.splits + seq.prefix_splits;
  const int seq_rows = seq.attn.group * seq.attn.q_len;
  const long base = seq.partial_start + (long(kv_head) * partials + seq.splits + split) * seq_rows +
      head_in_group * seq.attn.q_len + member.query;
  for (int d = 0; d < D / 8; ++d) {
    for (int t = 0; t < 2; ++t) {
      partial_out[base * D + d * 8 + rows.c + t] = o_tiles[d].thread_elements()[t];
    }
  }
  if (rows.c == 0) {
    partial_stats[base * 2] = m_row;
    partial_stats[base * 2 + 1] = l_row;
  }
}

template <typename T, int D, int BK>
[[kernel, max_total_threads_per_threadgroup(CascadeTile::THREADS)]] void attention_paged_cascade_prefix(
    const device T* q [[buffer(0)]],               // [total_q, Hq, D]
    const device T* k_pages [[buffer(1)]],         // [num_pages, Hkv, page_size, D]
    const device T* v_pages [[buffer(2)]],
    const device int* prefix_table [[buffer(3)]],  // [groups, max_prefix_pages]
    constant PagedSequence* sequences [[buffer(4)]],
    constant CascadeGroup* cascade_groups [[buffer(5)]],
    const device CascadeRow* cascade_rows [[buffer(6)]],
    device float* partial_out [[buffer(7)]],
    device float* partial_stats [[buffer(8)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup KeyValueTiles<T, D, BK> tiles;
  threadgroup PagedKeyRows<BK> located;
  threadgroup int tile_positions[2 * MLX_ATTN_CASCADE_SIMDGROUPS];
  CascadeFloatPages<T, D, BK> pages;
  pages.k = k_pages;
  pages.v = v_pages;
  cascade_prefix_tile<T, D, BK>(pages, q, prefix_table, sequences, cascade_groups, cascade_rows, partial_out,
                                partial_stats, tiles, located, tile_positions, group_id, groups, tid, sg, lane);
}

template <typename T, int D, int BITS, int BK>
[[kernel, max_total_threads_per_threadgroup(CascadeTile::THREADS)]] void attention_paged_cascade_quantized_prefix(
    const device T* q [[buffer(0)]],
    const device uint* k_pages [[buffer(1)]],  // packed [num_pages, Hkv, page_size, D * BITS / 32]
    const device T* k_scales [[buffer(2)]],
    const device T* k_biases [[buffer(3)]],
    const device uint* v_pages [[buffer(4)]],
    const device T* v_scales [[buffer(5)]],
    const device T* v_biases [[buffer(6)]],
    const device int* prefix_table [[buffer(7)]],
    constant PagedSequence* sequences [[buffer(8)]],
    constant QuantizedAttentionParams& qp [[buffer(9)]],
    constant CascadeGroup* cascade_groups [[buffer(10)]],
    const device CascadeRow* cascade_rows [[buffer(11)]],
    device float* partial_out [[buffer(12)]],
    device float* partial_stats [[buffer(13)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup KeyValueTiles<T, D, BK> tiles;
  threadgroup PagedKeyPages<BK> located;
  threadgroup int tile_positions[2 * MLX_ATTN_CASCADE_SIMDGROUPS];
  CascadeQuantizedPages<T, D, BK, BITS> pages;
  pages.kv = quantized_kv<T, D, BITS>(k_pages, k_scales, k_biases, v_pages, v_scales, v_biases, qp);
  cascade_prefix_tile<T, D, BK>(pages, q, prefix_table, sequences, cascade_groups, cascade_rows, partial_out,
                                partial_stats, tiles, located, tile_positions, group_id, groups, tid, sg, lane);
}
