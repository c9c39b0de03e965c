// Parameters of the fused Metal attention kernels, shared by the .metal
// sources and the C++ host (csrc/launch_plan.cpp) so the layout cannot drift.
// 64-bit members first: both sides then lay the struct out without padding.
#pragma once

#ifdef __METAL_VERSION__
typedef long attn_int64;
typedef int attn_int32;
#else
#include <cstdint>
typedef int64_t attn_int64;
typedef int32_t attn_int32;
#endif

// Array mask kinds (AttentionParams::mask_kind).
#define MLX_ATTN_MASK_NONE 0
#define MLX_ATTN_MASK_BOOL 1
#define MLX_ATTN_MASK_ADDITIVE 2

struct AttentionParams {
  attn_int64 q_strides[4];     // in elements, [batch, head, position, dim]
  attn_int64 k_strides[4];
  attn_int64 v_strides[4];
  attn_int64 mask_strides[4];  // broadcast dims have stride 0
  attn_int32 batch;
  attn_int32 q_heads;
  attn_int32 kv_heads;
  attn_int32 group;            // q_heads / kv_heads
  attn_int32 q_len;
  attn_int32 kv_len;
  attn_int32 causal;           // lower-right aligned
  attn_int32 window_size;      // > 0: sliding window (with causal)
  attn_int32 mask_kind;
  attn_int32 has_sinks;
  float scale_log2;            // scale * log2(e): scores live in exp2 space
  attn_int32 reserved;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(AttentionParams) == 4 * 4 * 8 + 12 * 4, "AttentionParams layout");
#endif
