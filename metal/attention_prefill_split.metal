// Fused attention forward for prefill at large or unequal head dims: the
// instantiations of the D-split kernel template in
// metal/attention_prefill_split.h (see there for the register budget).
#include "metal/attention_prefill_split.h"

#define MLX_ATTN_PREFILL_SPLIT_MASK(mname, mask, tname, type, d, dv, bk)                                  \
  template [[host_name("attention_prefill_split_" #tname "_d" #d "_dv" #dv "_bk" #bk mname)]] [[kernel]] \
  decltype(attention_prefill_split<type, d, dv, bk, mask>) attention_prefill_split<type, d, dv, bk, mask>;
#define MLX_ATTN_PREFILL_SPLIT(tname, type, d, dv, bk) \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_PREFILL_SPLIT_MASK, tname, type, d, dv, bk)

// (D, DV) pairs: csrc/metal/launch_plan.h kSplitPrefillHeadDims; BK: the family
// table's D = 256 column (csrc/metal/launch_plan.cpp, docs/metal_kernels.md).
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PREFILL_SPLIT_BFLOAT16(d, dv, bk) MLX_ATTN_PREFILL_SPLIT(bfloat16, bfloat, d, dv, bk)
#else
#define MLX_ATTN_PREFILL_SPLIT_BFLOAT16(d, dv, bk)
#endif
#define MLX_ATTN_PREFILL_SPLIT_2BYTE_TYPES(d, dv, bk) \
  MLX_ATTN_PREFILL_SPLIT(float16, half, d, dv, bk)    \
  MLX_ATTN_PREFILL_SPLIT_BFLOAT16(d, dv, bk)
#define MLX_ATTN_PREFILL_SPLIT_TYPES(d, dv, bk)     \
  MLX_ATTN_PREFILL_SPLIT(float32, float, d, dv, bk) \
  MLX_ATTN_PREFILL_SPLIT_2BYTE_TYPES(d, dv, bk)

// every family, every dtype
MLX_ATTN_PREFILL_SPLIT_TYPES(192, 128, 8)
MLX_ATTN_PREFILL_SPLIT_TYPES(256, 256, 8)
MLX_ATTN_PREFILL_SPLIT_TYPES(512, 512, 8)
MLX_ATTN_PREFILL_SPLIT_TYPES(576, 512, 8)
// apple9, 2-byte dtypes: twice the keys per block
MLX_ATTN_PREFILL_SPLIT_2BYTE_TYPES(192, 128, 16)
MLX_ATTN_PREFILL_SPLIT_2BYTE_TYPES(256, 256, 16)
MLX_ATTN_PREFILL_SPLIT_2BYTE_TYPES(512, 512, 16)
MLX_ATTN_PREFILL_SPLIT_2BYTE_TYPES(576, 512, 16)
