// Fused attention forward for prefill: the instantiations of the kernel
// template in metal/attention_prefill.h (see there for the algorithm).
#include "metal/attention_prefill.h"

#define MLX_ATTN_PREFILL_MASK(mname, mask, tname, type, d, bk)                                    \
  template [[host_name("attention_prefill_" #tname "_d" #d "_bk" #bk mname)]] [[kernel]] decltype( \
      attention_prefill<type, d, bk, mask>) attention_prefill<type, d, bk, mask>;
#define MLX_ATTN_PREFILL(tname, type, d, bk) MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_PREFILL_MASK, tname, type, d, bk)

// BK: keys per block, chosen per GPU family, head dim and element size by
// the launch plan's table (csrc/metal/launch_plan.cpp, docs/metal_kernels.md).
// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PREFILL_BFLOAT16(d, bk) MLX_ATTN_PREFILL(bfloat16, bfloat, d, bk)
#else
#define MLX_ATTN_PREFILL_BFLOAT16(d, bk)
#endif
#define MLX_ATTN_PREFILL_2BYTE_TYPES(d, bk) \
  MLX_ATTN_PREFILL(float16, half, d, bk)    \
  MLX_ATTN_PREFILL_BFLOAT16(d, bk)
#define MLX_ATTN_PREFILL_TYPES(d, bk)        \
  MLX_ATTN_PREFILL(float32, float, d, bk)    \
  MLX_ATTN_PREFILL_2BYTE_TYPES(d, bk)

// every family, every dtype (MLX steel_attention's BK); past D = 128 the
// D-split kernel serves (metal/attention_prefill_split.metal)
MLX_ATTN_PREFILL_TYPES(64, 32)
MLX_ATTN_PREFILL_TYPES(80, 16)
MLX_ATTN_PREFILL_TYPES(96, 16)
MLX_ATTN_PREFILL_TYPES(128, 16)
// apple9, 2-byte dtypes: twice the keys per block
MLX_ATTN_PREFILL_2BYTE_TYPES(80, 32)
MLX_ATTN_PREFILL_2BYTE_TYPES(96, 32)
MLX_ATTN_PREFILL_2BYTE_TYPES(128, 32)
