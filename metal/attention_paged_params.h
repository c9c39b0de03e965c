// Parameters of the paged attention kernels (metal/attention_paged.metal),
// shared with their launch plan (csrc/metal/paged_launch_plan.cpp) so the layout
// cannot drift. One PagedSequence per sequence of the batch, in a constant
// buffer: its own AttentionParams (q_len / kv_len are the sequence's, so
// every rule of metal/attention_rules.h applies unchanged) and where its rows,
// block-table row, split partials and prefill query blocks are.
#pragma once

#include "metal/attention_params.h"

// Block-table entries a lane of the decode kernel holds (PageWindow), per
// threadgroup shape: a split covers at most 32 x this - 1 whole pages (its
// first key may sit mid-page), csrc/metal/paged_launch_plan.h
// paged_max_pages_per_split. The row shape's splits are long (1024 keys and
// more: 4 entries fit pages of 16 keys with room) and its registers are
// free; the group shape's are short (64 keys and up) and its registers near
// the budget: one entry.
#define MLX_ATTN_PAGED_ROW_WINDOW_ROUNDS 4
#define MLX_ATTN_PAGED_GROUP_WINDOW_ROUNDS 1

struct PagedSequence {
  // batch 1; q strides of the packed rows [total_q, Hq, D] ([0] unused);
  // k/v strides of the pages [num_pages, Hkv, page_size, D]: [0] is the page
  // stride, so a loader policy reads a page as it reads a batch entry
  AttentionParams attn;
  attn_int64 q_start;        // first row of packed q, of the output and of the log-sum-exp
  attn_int64 table_start;    // its block-table row, in int32 elements
  attn_int64 partial_start;  // its first partial row: [Hkv, splits, rows] of them
  attn_int32 splits;         // decode threadgroups along its keys (each at most paged_max_pages_per_split pages); 0: none
  attn_int32 page_size;
  // the paged prefill kernel's query blocks of this sequence: blocks
  // [query_block_start, + query_blocks) of its grid (0 blocks: the decode
  // kernel serves its rows; csrc/metal/paged_launch_plan.h paged_rows_take_prefill)
  attn_int32 query_block_start;
  attn_int32 query_blocks;
  // cascade (metal/attention_paged_cascade.h): its group's prefix partials,
  // merged after its own splits' (its partial rows are [Hkv, splits +
  // prefix_splits, rows]); 0 outside a cascade group
  attn_int32 prefix_splits;
  attn_int32 prefix_group;  // its cascade group, -1: none
};

// Simdgroups of a cascade prefix tile (metal/attention_paged_cascade.h), 8
// rows each: a tile holds 64 rows (16 decode rows x a GQA group of 4 read
// the prefix once).
#define MLX_ATTN_CASCADE_SIMDGROUPS 8

// Cascade attention's shared level, one per group of sequences whose keys
// begin with the same pages: the prefix pass (attention_paged_cascade_prefix)
// reads the group's prefix pages once per tile of its query rows.
struct CascadeGroup {
  // kv_len: the prefix keys; q_len: the group's tile rows per KV head (its
  // member rows x GQA group); the rest as every sequence's
  AttentionParams attn;
  attn_int64 table_start;  // its prefix_table row, in int32 elements
  attn_int32 row_start;    // its first CascadeRow
  attn_int32 rows;         // its member rows (one per (sequence, query position))
  attn_int32 splits;       // prefix key splits (threadgroups along the prefix)
  attn_int32 keys_per_split;  // a multiple of the prefix kernel's key block
  attn_int32 page_size;
  attn_int32 tiles;        // tiles of tile rows per KV head
};

// One member row of a cascade group: sequence `sequence`'s query `query`.
struct CascadeRow {
  attn_int32 sequence;
  attn_int32 query;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(PagedSequence) == sizeof(AttentionParams) + 3 * 8 + 6 * 4, "PagedSequence layout");
static_assert(sizeof(CascadeGroup) == sizeof(AttentionParams) + 8 + 6 * 4, "CascadeGroup layout");
#endif
