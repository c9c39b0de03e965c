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
};

#ifndef __METAL_VERSION__
static_assert(sizeof(PagedSequence) == sizeof(AttentionParams) + 3 * 8 + 4 * 4, "PagedSequence layout");
#endif
