// Paged, ragged attention (mlx_attn.paged_attention): the kernel templates;
// metal/attention_paged.metal and metal/attention_paged_quantized.metal
// instantiate them.
//
// The K/V layout is an axis, not a kernel: PagedKV<KV> wraps any decode
// loader policy (ContiguousKV, metal/attention_decode.h; QuantizedKV,
// metal/attention_quantized.h) and reads key j of a sequence as slot
// j % page_size of its page block_table[j / page_size], the page taking the
// place of the batch entry (PagedSequence::attn k/v strides[0] = page
// stride). The attention loop is decode_split, written once: split-K over
// the sequence's keys (grid.x), a threadgroup serving R rows = (query head of
// the GQA group) x (query position) of one KV head, so each page is read once
// for the whole group (grid.y = KV heads x row chunks), one sequence per
// grid.z, each with its own AttentionParams (its lengths: the causal, window
// and key-range rules apply as written). Float and quantized pages have the
// dense decode's two threadgroup shapes (R rows on 4 simdgroups, or 1 row on
// NSG). The plan (csrc/metal/paged_launch_plan.cpp) picks the shape and sizes the
// grid for the largest sequence; threadgroups past a sequence's splits or
// rows return at once.
//
// Block-table reads: each split covers at most 32 x ROUNDS - 1 pages plus a
// partial one (the plan's keys per split, paged_max_pages_per_split), so
// lane l of every simdgroup reads the split's pages l, l + 32, ... once
// (ROUNDS of them: MLX_ATTN_PAGED_ROW_WINDOW_ROUNDS for the row shape,
// MLX_ATTN_PAGED_GROUP_WINDOW_ROUNDS for the group shape) and a key's page
// is a simd_shuffle: 4 bytes per page, not per key and lane.
#pragma once

#include <metal_stdlib>

#include "metal/attention_decode.h"
#include "metal/attention_paged_params.h"

using namespace metal;

// The pages of one split (decode) or key block (prefill), ROUNDS per lane:
// lane l holds pages first_page + l + 32 i of the sequence, i < ROUNDS (only
// the pages of keys before key_end are read).
template <int ROUNDS>
struct PageWindow {
  int page[ROUNDS];
  int first_page;
  int page_size;

  inline void select(const device int* table_row, int first_key, int key_end, int size, uint lane) {
    page_size = size;
    first_page = first_key / size;
    const int pages = (key_end + size - 1) / size;
    for (int i = 0; i < ROUNDS; ++i) {
      const int mine = first_page + 32 * i + int(lane);
      page[i] = mine < pages ? table_row[mine] : 0;
    }
  }
  // the page of `key` (uniform across the simdgroup): its round's entry
  // picked by compare and select (a register array indexed at run time
  // would live in memory), then the lane that holds it
  inline int page_of(int key) const {
    const int index = key / page_size - first_page;
    int entry = page[0];
    for (int i = 1; i < ROUNDS; ++i) {
      entry = index >= 32 * i ? page[i] : entry;
    }
    return simd_shuffle(entry, ushort(index % 32));
  }
};

// The page window's entries a lane holds on threadgroups of R rows.
template <int R>
struct PagedWindowRounds {
  static constexpr int value = R == 1 ? MLX_ATTN_PAGED_ROW_WINDOW_ROUNDS : MLX_ATTN_PAGED_GROUP_WINDOW_ROUNDS;
};

// Any decode loader policy over pages: the page is its batch entry.
template <typename KV, int ROUNDS>
struct PagedKV {
  static constexpr int SLICE = KV::SLICE;
  static constexpr int VEC = KV::VEC;
  // the page window's entries a lane holds, beyond the page loader's own
  static constexpr int REGISTERS = KV::REGISTERS + ROUNDS;
  static inline int dim(uint lane, int e) { return KV::dim(lane, e); }

  KV rows;  // the policy reading one page's slots
  PageWindow<ROUNDS> pages;
  constant AttentionParams* p;
  int kv_head;

  inline void select_head(constant AttentionParams& params, int, int head) {
    p = &params;
    kv_head = head;
  }
  inline void load(int key, uint lane, thread float* k_slice, thread float* v_slice) const {
    KV at = rows;
    at.select_head(*p, pages.page_of(key), kv_head);
    at.load(key % pages.page_size, lane, k_slice, v_slice);
  }
};

// The partial kernel's body for one (split, KV head x row chunk, sequence):
// the sequence's split of keys through decode_split. A sequence of one split
// writes its packed output rows [total_q, Hq, D] (and lse [total_q, Hq])
// itself (decode_launch_outputs); the merge passes over it.
template <typename T, int D, typename KV, int ROUNDS, int NSG, int R>
inline void paged_decode_partial(
    thread PagedKV<KV, ROUNDS>& kv, const device T* q, const device int* block_table, constant PagedSequence* sequences,
    device float* partial_out, device float* partial_stats, const device T* sinks, device T* out, device float* lse,
    threadgroup DecodeStates<D, NSG, R>& states, uint3 group_id, uint3 groups, uint sg, uint lane) {
  constant PagedSequence& seq = sequences[group_id.z];
  constant AttentionParams& p = seq.attn;
  const int rows = p.group * p.q_len;
  const int chunks = (rows + R - 1) / R;
  const int max_chunks = int(groups.y) / p.kv_heads;
  const int kv_head = int(group_id.y) / max_chunks;
  const int chunk = int(group_id.y) % max_chunks;
  const int split = int(group_id.x);
  if (split >= seq.splits || chunk >= chunks) {
    return;  // the whole threadgroup: past this sequence's keys or rows
  }
  const int keys_per_split = (p.kv_len + seq.splits - 1) / seq.splits;  // decode_split's split
  kv.pages.select(block_table + seq.table_start, split * keys_per_split, p.kv_len, seq.page_size, lane);
  const uint3 sequence_groups = uint3(uint(seq.splits), 1u, 1u);
  const long first_row = seq.q_start * p.q_heads;
  DecodeOutputs<T> outputs = decode_launch_outputs(partial_out + seq.partial_start * D,
                                                   partial_stats + seq.partial_start * 2, sinks, out + first_row * D,
                                                   lse + first_row, p, sequence_groups);
  outputs.head_rows = 1;  // packed rows: position-major
  outputs.position_rows = p.q_heads;
  // a cascade member's partials are followed by its prefix's: it never writes its rows itself
  outputs.partial_splits = seq.splits + seq.prefix_splits;
  outputs.direct = outputs.partial_splits == 1;
  decode_split<T, D, MLX_ATTN_MASK_NONE>(kv, q + seq.q_start * p.q_strides[2], p, (const device uchar*)q, outputs,
                                         states, uint3(uint(split), uint(kv_head * chunks + chunk), 0u),
                                         sequence_groups, sg, lane);
}

// R rows and NSG simdgroups per threadgroup (decode_split's shape); the
// attribute makes the compiler fit 32 x NSG threads in a core's registers.
template <typename T, int D, int R, int NSG>
[[kernel, max_total_threads_per_threadgroup(32 * NSG)]] void attention_paged_decode_partial(
    const device T* q [[buffer(0)]],              // [total_q, Hq, D]
    const device T* k_pages [[buffer(1)]],        // [num_pages, Hkv, page_size, D]
    const device T* v_pages [[buffer(2)]],
    const device int* block_table [[buffer(3)]],  // [B, max_pages]
    constant PagedSequence* sequences [[buffer(4)]],
    device float* partial_out [[buffer(5)]],      // per sequence [Hkv, splits, rows, D]
    device float* partial_stats [[buffer(6)]],    // per sequence [Hkv, splits, rows, 2]: max, sum
    const device T* sinks [[buffer(7)]],
    device T* out [[buffer(8)]],                  // [total_q, Hq, D]: sequences of one split
    device float* lse [[buffer(9)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup DecodeStates<D, NSG, R> states;
  PagedKV<ContiguousKV<T, D>, PagedWindowRounds<R>::value> kv;
  kv.rows.k = k_pages;
  kv.rows.v = v_pages;
  paged_decode_partial<T, D>(kv, q, block_table, sequences, partial_out, partial_stats, sinks, out, lse, states,
                             group_id, groups, sg, lane);
}

// One threadgroup of MLX_ATTN_DECODE_MERGE_SIMDGROUPS simdgroups per (row, KV
// head, sequence): merge the sequence's splits (and, in a cascade, its
// group's prefix splits: the log-sum-exp merge is merge_splits either way)
// into its packed output row [total_q, Hq, D] (and log-sum-exp [total_q, Hq]);
// the sinks join once, here.
template <typename T, int D>
[[kernel]] void attention_paged_decode_merge(
    const device float* partial_out [[buffer(0)]],
    const device float* partial_stats [[buffer(1)]],
    const device T* sinks [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant PagedSequence* sequences [[buffer(4)]],
    device float* lse [[buffer(5)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup MergeStates<D> states;
  constant PagedSequence& seq = sequences[group_id.z];
  constant AttentionParams& p = seq.attn;
  const int rows = p.group * p.q_len;
  const int r = int(group_id.x);
  const int partials = seq.splits + seq.prefix_splits;  // its own splits', then its cascade prefix's
  if (r >= rows || partials <= 1) {
    return;  // (the whole threadgroup) past its rows, the paged prefill kernel serves them, or one split wrote them
  }
  const int kv_head = int(group_id.y);
  const int h = kv_head * p.group + r / p.q_len;
  const long row = (seq.q_start + r % p.q_len) * p.q_heads + h;
  merge_splits<T, D>(partial_out, partial_stats, seq.partial_start + long(kv_head) * partials * rows + r, rows,
                     partials, sinks, p, h, out + row * D, p.output_lse != 0 ? lse + row : nullptr, states, sg,
                     lane);
}
