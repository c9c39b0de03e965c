// Fused attention backward at large or unequal head dims: the instantiations
// of the D-split kernel templates in metal/attention_backward_split.h (see
// there for the register budget). The delta and sinks dispatches are the
// register-resident family's (metal/attention_backward.metal).
#include "metal/attention_backward_split.h"

// One kernel each, named <pass>_<dtype>_d<D>_dv<DV>_bk<rows per streamed
// block>[mask suffix] (the per-variant compile rule of
// csrc/metal/metal_sources.cpp kVariantFamilies); C = 64 columns per chunk.
#define MLX_ATTN_BACKWARD_SPLIT_DKDV_MASK(mname, mask, tname, type, d, dv, bq)                                 \
  template [[host_name("attention_backward_split_dkdv_" #tname "_d" #d "_dv" #dv "_bk" #bq mname)]] [[kernel]] \
  decltype(attention_backward_split_dkdv<type, d, dv, 64, bq, mask>)                                           \
      attention_backward_split_dkdv<type, d, dv, 64, bq, mask>;
#define MLX_ATTN_BACKWARD_SPLIT_DQ_MASK(mname, mask, tname, type, d, dv, bk)                                 \
  template [[host_name("attention_backward_split_dq_" #tname "_d" #d "_dv" #dv "_bk" #bk mname)]] [[kernel]] \
  decltype(attention_backward_split_dq<type, d, dv, 64, bk, mask>) attention_backward_split_dq<type, d, dv, 64, bk, mask>;
#define MLX_ATTN_BACKWARD_SPLIT_DKDV(tname, type, d, dv) \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_BACKWARD_SPLIT_DKDV_MASK, tname, type, d, dv, 32)
#define MLX_ATTN_BACKWARD_SPLIT(tname, type, d, dv)    \
  MLX_ATTN_BACKWARD_SPLIT_DKDV(tname, type, d, dv)     \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_BACKWARD_SPLIT_DQ_MASK, tname, type, d, dv, 32)

// C = 64 columns per chunk, BQ = BK = 32 rows per streamed block: the plan's
// kBackwardChunk and kSplitStreamRows (csrc/metal/backward_launch_plan.cpp).
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_BACKWARD_SPLIT_BFLOAT16(d, dv) MLX_ATTN_BACKWARD_SPLIT(bfloat16, bfloat, d, dv)
#define MLX_ATTN_BACKWARD_SPLIT_DKDV_BFLOAT16(d, dv) MLX_ATTN_BACKWARD_SPLIT_DKDV(bfloat16, bfloat, d, dv)
#else
#define MLX_ATTN_BACKWARD_SPLIT_BFLOAT16(d, dv)
#define MLX_ATTN_BACKWARD_SPLIT_DKDV_BFLOAT16(d, dv)
#endif
#define MLX_ATTN_BACKWARD_SPLIT_TYPES(d, dv)     \
  MLX_ATTN_BACKWARD_SPLIT(float32, float, d, dv) \
  MLX_ATTN_BACKWARD_SPLIT(float16, half, d, dv)  \
  MLX_ATTN_BACKWARD_SPLIT_BFLOAT16(d, dv)
#define MLX_ATTN_BACKWARD_SPLIT_DKDV_TYPES(d, dv)     \
  MLX_ATTN_BACKWARD_SPLIT_DKDV(float32, float, d, dv) \
  MLX_ATTN_BACKWARD_SPLIT_DKDV(float16, half, d, dv)  \
  MLX_ATTN_BACKWARD_SPLIT_DKDV_BFLOAT16(d, dv)

// (D, DV): csrc/metal/backward_launch_plan.cpp backward_splits_head_dims; at D = 128
// only the dK/dV pass (its dQ pass stays register-resident: 96 floats a lane)
MLX_ATTN_BACKWARD_SPLIT_DKDV_TYPES(128, 128)
MLX_ATTN_BACKWARD_SPLIT_TYPES(192, 128)
MLX_ATTN_BACKWARD_SPLIT_TYPES(256, 256)
MLX_ATTN_BACKWARD_SPLIT_TYPES(512, 512)
MLX_ATTN_BACKWARD_SPLIT_TYPES(576, 512)
