// Paged, ragged attention for chunked prefill: the instantiations of the
// kernel template in metal/attention_paged_prefill.h (see there).
#include "metal/attention_paged_prefill.h"

#define MLX_ATTN_PAGED_PREFILL(tname, type, d, bk)                                                       \
  template [[host_name("attention_paged_prefill_" #tname "_d" #d "_bk" #bk)]] [[kernel]] decltype(      \
      attention_paged_prefill<type, d, bk>) attention_paged_prefill<type, d, bk>;

// BK: the dense prefill kernel's keys per block, from the launch plan's
// per-family table (csrc/metal/launch_plan.cpp prefill_key_block); the head dims
// both the paged decode and the register-resident prefill kernels serve.
// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PAGED_PREFILL_BFLOAT16(d, bk) MLX_ATTN_PAGED_PREFILL(bfloat16, bfloat, d, bk)
#else
#define MLX_ATTN_PAGED_PREFILL_BFLOAT16(d, bk)
#endif
#define MLX_ATTN_PAGED_PREFILL_2BYTE_TYPES(d, bk) \
  MLX_ATTN_PAGED_PREFILL(float16, half, d, bk)    \
  MLX_ATTN_PAGED_PREFILL_BFLOAT16(d, bk)
#define MLX_ATTN_PAGED_PREFILL_TYPES(d, bk)        \
  MLX_ATTN_PAGED_PREFILL(float32, float, d, bk)    \
  MLX_ATTN_PAGED_PREFILL_2BYTE_TYPES(d, bk)

MLX_ATTN_PAGED_PREFILL_TYPES(64, 32)
MLX_ATTN_PAGED_PREFILL_TYPES(96, 16)
MLX_ATTN_PAGED_PREFILL_TYPES(128, 16)
// apple9, 2-byte dtypes: twice the keys per block
MLX_ATTN_PAGED_PREFILL_2BYTE_TYPES(96, 32)
MLX_ATTN_PAGED_PREFILL_2BYTE_TYPES(128, 32)
