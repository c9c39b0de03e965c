// Keys and values in pages addressed through a block table (paged, ragged
// attention), as the fused CPU kernel reads them. Plain C++ (no STL, no MLX):
// the per-ISA kernels include it.
#pragma once

#include <stdint.h>

namespace mlx_attn::cpu {

// One planned work item of a paged call, before the kv head is chosen: a
// block of query rows of one sequence (csrc/cpu/paged_dispatch.cpp plans them,
// heaviest first).
struct PagedItem {
  int32_t sequence;  // b
  int32_t q_begin;   // the sequence's first row in the packed q (and out)
  int32_t q_start;   // first query row of the block, within the sequence
  int32_t q_len, kv_len;  // of the sequence (checked against the buffers)
};

// Paged K/V: KernelCall::k / ::v (and the quantized scales and biases) hold
// [num_pages, Hkv, page_size, D] pages read through AttentionProblem::k_strides
// / v_strides; key t of sequence b is slot t % page_size of page
// block_table[b, t / page_size]. q is [total_q, Hq, D], seen by the problem as
// [1, Hq, total_q, D] (q_strides[0] = 0); out is row-contiguous
// [total_q, Hq, Dv], lse [total_q, Hq].
struct PagedKV {
  const int32_t* block_table = nullptr;  // null: K/V are dense [B, Hkv, T, D]
  int64_t table_strides[2] = {};         // in elements, [sequence, column]
  int max_pages = 0;
  int page_size = 0;
  int num_pages = 0;
  const int32_t* kv_lens = nullptr;  // [B], read through len_strides
  const int32_t* q_lens = nullptr;   // [B]
  int64_t kv_len_stride = 0, q_len_stride = 0;
  int total_q = 0;
  // Filled by the planner: work item i is (items[i / kv_heads], kv head i % kv_heads).
  const PagedItem* items = nullptr;
  int64_t item_count = 0;

  bool active() const { return block_table != nullptr; }
  // The page holding key t of sequence b (planned sequences only: the
  // planner checked every entry they read).
  int32_t page_of(int b, int t) const {
    return block_table[b * table_strides[0] + int64_t(t / page_size) * table_strides[1]];
  }
};

}  // namespace mlx_attn::cpu
