// Paged, ragged attention over float pages: the instantiations of the kernel
// templates in metal/attention_paged.h (see there).
#include "metal/attention_paged.h"

#define MLX_ATTN_PAGED(tname, type, d)                                                                           \
  template [[host_name("attention_paged_decode_partial_" #tname "_d" #d)]] [[kernel]] decltype(                \
      attention_paged_decode_partial<type, d>) attention_paged_decode_partial<type, d>;                        \
  template [[host_name("attention_paged_decode_merge_" #tname "_d" #d)]] [[kernel]] decltype(                  \
      attention_paged_decode_merge<type, d>) attention_paged_decode_merge<type, d>;

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PAGED_BFLOAT16(d) MLX_ATTN_PAGED(bfloat16, bfloat, d)
#else
#define MLX_ATTN_PAGED_BFLOAT16(d)
#endif
#define MLX_ATTN_PAGED_TYPES(d)       \
  MLX_ATTN_PAGED(float32, float, d)   \
  MLX_ATTN_PAGED(float16, half, d)    \
  MLX_ATTN_PAGED_BFLOAT16(d)

MLX_ATTN_PAGED_TYPES(64)
MLX_ATTN_PAGED_TYPES(96)
MLX_ATTN_PAGED_TYPES(128)
MLX_ATTN_PAGED_TYPES(256)
