// Fused attention for decoding: the instantiations of the kernel templates in
// metal/attention_decode.h (contiguous K/V; see there for the algorithm).
#include "metal/attention_decode.h"

#define MLX_ATTN_DECODE_PARTIAL(mname, mask, tname, type, d)                                      \
  template [[host_name("attention_decode_partial_" #tname "_d" #d mname)]] [[kernel]] decltype(  \
      attention_decode_partial<type, d, mask>) attention_decode_partial<type, d, mask>;
#define MLX_ATTN_DECODE_MERGE(tname, type, d)                                            \
  template [[host_name("attention_decode_merge_" #tname "_d" #d)]] [[kernel]] decltype(  \
      attention_decode_merge<type, d>) attention_decode_merge<type, d>;
// Per kernel: MLX_ATTN_DECODE_PARTIAL(mask suffix, mask kind, ...) and
// MLX_ATTN_DECODE_MERGE (a first-use compile builds one, csrc/metal/metal_sources.cpp).
#define MLX_ATTN_DECODE(tname, type, d)                           \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_DECODE_PARTIAL, tname, type, d) \
  MLX_ATTN_DECODE_MERGE(tname, type, d)

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_DECODE_BFLOAT16(d) MLX_ATTN_DECODE(bfloat16, bfloat, d)
#else
#define MLX_ATTN_DECODE_BFLOAT16(d)
#endif
#define MLX_ATTN_DECODE_TYPES(d)       \
  MLX_ATTN_DECODE(float32, float, d)   \
  MLX_ATTN_DECODE(float16, half, d)    \
  MLX_ATTN_DECODE_BFLOAT16(d)

MLX_ATTN_DECODE_TYPES(64)
MLX_ATTN_DECODE_TYPES(96)
MLX_ATTN_DECODE_TYPES(128)
MLX_ATTN_DECODE_TYPES(256)
MLX_ATTN_DECODE_TYPES(512)
