// Launch plan of the paged, ragged attention kernels (metal/attention_paged.h,
// metal/attention_paged_prefill.h, mlx_attn.paged_attention): one
// PagedSequence (metal/attention_paged_params.h) per sequence with its own
// lengths; the decode kernel's split-K partial dispatch sized for the largest
// sequence it serves and the paged merge, and the paged prefill kernel's
// dispatch over the query blocks of the sequences it serves
// (paged_rows_take_prefill). Same plan types as csrc/metal/launch_plan.h:
// the Mac host encodes it with the same loop (the sequences as one more
// buffer) and the emulator tests launch it unchanged.
#pragma once

#include <cstdint>
#include <vector>

#include "csrc/cpu/quantized_kv.h"
#include "csrc/metal/launch_plan.h"
#include "metal/attention_paged_params.h"

namespace mlx_attn {

// A paged call as the kernels see it. `attention` holds what all sequences
// share: q [total_q, Hq, D] seen as [1, Hq, total_q, D] (q_strides[1] head,
// [2] row, [3] dim), k/v pages [num_pages, Hkv, page_size, D] with strides
// [page, head, slot, dim] (quantized: packed uint32 words), heads, dims,
// dtype, scale, causal / window, sinks, lse; its batch, q_len and kv_len are
// unused (each sequence has its own). Lengths are host values, checked by
// the caller (mlx_attn/paged.py): q_lens[b] <= kv_lens[b], block-table
// entries in range.
struct PagedProblem {
  AttentionProblem attention{};
  std::vector<int32_t> q_lens;
  std::vector<int32_t> kv_lens;
  int page_size = 0;
  int64_t table_stride = 0;  // elements between block-table rows
  cpu::QuantizedKV quantized;  // bits 0: float pages; else strides of scales / biases [page, head, slot, group]
};

// Most pages one decode split on threadgroups of `shape` covers, plus one
// partial page: a simdgroup's lanes hold the split's block-table entries,
// MLX_ATTN_PAGED_ROW_WINDOW_ROUNDS each on the row shape (127 pages),
// MLX_ATTN_PAGED_GROUP_WINDOW_ROUNDS on the group shape (31 pages)
// (PageWindow, metal/attention_paged.h).
int paged_max_pages_per_split(const DecodeShape& shape);

// The decode kernel's threadgroup shape (csrc/metal/launch_plan.h DecodeShape),
// float and quantized pages alike: the dense decode's rule (decode_shape
// over the sequences the decode kernel serves, as a batch of the longest,
// each shape's splits capped by its page window) or the shape `choice`
// names. For a problem the plan supports.
DecodeShape paged_decode_shape(const PagedProblem& problem, const GpuTarget& target = {},
                               DecodeShapeChoice choice = DecodeShapeChoice::automatic);

// Keys per decode split for pages of `page_size` on threadgroups of `shape`:
// enough threadgroups for the target (decode_splits on the longest
// sequence), at most paged_max_pages_per_split(shape) pages, whole pages.
int paged_keys_per_split(const PagedProblem& problem, const DecodeShape& shape, const GpuTarget& target = {});

// Which kernel serves a sequence's query rows, the one routing rule: the paged
// prefill kernel (MMA tiles over blocks of BQ query rows) for a chunk longer
// than the decode kernel serves well, by the dense plan's decode limits (more
// than kDecodeMaxQueries positions or kDecodeMaxRows rows = GQA group x
// positions), on float pages of a head dim it is instantiated for (64, 96,
// 128); the decode kernel (split-K over pages, the GQA group sharing each page
// read) otherwise: decode rows, short chunks, quantized pages, D = 256.
bool paged_rows_take_prefill(const PagedProblem& problem, int q_len);

// Inputs are bound in the paged primitive's order: q, k, v (quantized: q,
// k packed, k scales, k biases, v packed, v scales, v biases), block_table,
// then sinks when present; outputs out [total_q, Hq, D], then lse
// [total_q, Hq] when asked. LaunchPlan::sequences holds the PagedSequence
// array. Dispatches: the decode partial and merge when some sequence's rows
// take the decode kernel, then the prefill when some take it.
LaunchPlan plan_paged_attention(const PagedProblem& problem, const GpuTarget& target = {},
                                DecodeShapeChoice decode_choice = DecodeShapeChoice::automatic);

// Cascade (shared-prefix) attention (metal/attention_paged_cascade.h): `own`
// is the paged problem of every sequence's own keys (kv_lens: the keys after
// its group's prefix; block_table: its own pages; outside a group, all its
// keys); group g's prefix is prefix_lens[g] keys on row g of the prefix table
// (page_size keys a page, prefix_table_stride elements between rows).
struct CascadeProblem {
  PagedProblem own;
  std::vector<int32_t> prefix_lens;    // per group
  std::vector<int32_t> prefix_groups;  // per sequence: its group, -1 none
  int64_t prefix_table_stride = 0;
};

// The prefix pass's tile: MLX_ATTN_CASCADE_SIMDGROUPS simdgroups of 8 rows.
inline constexpr int kCascadeSimdgroups = MLX_ATTN_CASCADE_SIMDGROUPS;
inline constexpr int kCascadeTileRows = 8 * kCascadeSimdgroups;
// A prefix split holds at least this many keys (unless the prefix is shorter).
inline constexpr int kCascadeMinSplitKeys = 512;

// Inputs: the paged plan's (q, pages, block_table = the own pages, [sinks]),
// then prefix_table int32 [groups, max_prefix_pages]; outputs out, [lse].
// Dispatches: the paged decode partial over the own keys (dispatch 0), the
// prefix pass (1: attention_paged_cascade_prefix, or _quantized_prefix),
// both writing partials, and the paged merge (2), which merges each member's
// own and prefix partials and joins the sinks once. Decode rows only (a
// chunk the paged prefill kernel would take makes the plan unsupported).
LaunchPlan plan_cascade_paged_attention(const CascadeProblem& problem, const GpuTarget& target = {});

}  // namespace mlx_attn
