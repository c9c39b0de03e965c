// Cascade (shared-prefix) paged attention: the instantiations of the prefix
// pass's kernel templates in metal/attention_paged_cascade.h (see there); the
// suffix pass and the merge are attention_paged.metal's and
// attention_paged_quantized.metal's.
#include "metal/attention_paged_cascade.h"

#define MLX_ATTN_PAGED_CASCADE_PREFIX(tname, type, d, bk)                                                 \
  template [[host_name("attention_paged_cascade_prefix_" #tname "_d" #d "_bk" #bk)]] [[kernel]] decltype( \
      attention_paged_cascade_prefix<type, d, bk>) attention_paged_cascade_prefix<type, d, bk>;
#define MLX_ATTN_PAGED_CASCADE_QUANTIZED_PREFIX(tname, type, d, bits, bk)                                   \
  template [[host_name("attention_paged_cascade_quantized_prefix_" #tname "_d" #d "_b" #bits "_bk" #bk)]] \
  [[kernel]] decltype(attention_paged_cascade_quantized_prefix<type, d, bits, bk>)                          \
      attention_paged_cascade_quantized_prefix<type, d, bits, bk>;

// BK: the paged prefill's keys per block (csrc/metal/launch_plan.cpp
// prefill_key_block), for the head dims it serves; 4- and 8-bit pages where
// the quantized paged decode serves them too (D 64, 128).
#define MLX_ATTN_PAGED_CASCADE_ALL_PAGES(tname, type, d, bk)     \
  MLX_ATTN_PAGED_CASCADE_PREFIX(tname, type, d, bk)              \
  MLX_ATTN_PAGED_CASCADE_QUANTIZED_PREFIX(tname, type, d, 4, bk) \
  MLX_ATTN_PAGED_CASCADE_QUANTIZED_PREFIX(tname, type, d, 8, bk)
// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PAGED_CASCADE_BFLOAT16(PAGES, d, bk) PAGES(bfloat16, bfloat, d, bk)
#else
#define MLX_ATTN_PAGED_CASCADE_BFLOAT16(PAGES, d, bk)
#endif
#define MLX_ATTN_PAGED_CASCADE_2BYTE_TYPES(PAGES, d, bk) \
  PAGES(float16, half, d, bk)                            \
  MLX_ATTN_PAGED_CASCADE_BFLOAT16(PAGES, d, bk)
#define MLX_ATTN_PAGED_CASCADE_TYPES(PAGES, d, bk) \
  PAGES(float32, float, d, bk)                     \
  MLX_ATTN_PAGED_CASCADE_2BYTE_TYPES(PAGES, d, bk)

MLX_ATTN_PAGED_CASCADE_TYPES(MLX_ATTN_PAGED_CASCADE_ALL_PAGES, 64, 32)
MLX_ATTN_PAGED_CASCADE_TYPES(MLX_ATTN_PAGED_CASCADE_PREFIX, 96, 16)
MLX_ATTN_PAGED_CASCADE_TYPES(MLX_ATTN_PAGED_CASCADE_ALL_PAGES, 128, 16)
// apple9, 2-byte dtypes: twice the keys per block
MLX_ATTN_PAGED_CASCADE_2BYTE_TYPES(MLX_ATTN_PAGED_CASCADE_PREFIX, 96, 32)
MLX_ATTN_PAGED_CASCADE_2BYTE_TYPES(MLX_ATTN_PAGED_CASCADE_ALL_PAGES, 128, 32)
