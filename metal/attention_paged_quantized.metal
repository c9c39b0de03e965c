// Paged, ragged attention over quantized pages: the instantiations of the
// kernel template in metal/attention_paged_quantized.h (see there); the
// merge is attention_paged.metal's.
#include "metal/attention_paged_quantized.h"

#define MLX_ATTN_PAGED_QUANTIZED(tname, type, d, bits)                                                              \
  template [[host_name("attention_paged_quantized_decode_partial_" #tname "_d" #d "_b" #bits)]] [[kernel]] decltype( \
      attention_paged_quantized_decode_partial<type, d, bits>) attention_paged_quantized_decode_partial<type, d, bits>;

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PAGED_QUANTIZED_BFLOAT16(d, bits) MLX_ATTN_PAGED_QUANTIZED(bfloat16, bfloat, d, bits)
#else
#define MLX_ATTN_PAGED_QUANTIZED_BFLOAT16(d, bits)
#endif
#define MLX_ATTN_PAGED_QUANTIZED_TYPES(d, bits)    \
  MLX_ATTN_PAGED_QUANTIZED(float32, float, d, bits) \
  MLX_ATTN_PAGED_QUANTIZED(float16, half, d, bits)  \
  MLX_ATTN_PAGED_QUANTIZED_BFLOAT16(d, bits)
#define MLX_ATTN_PAGED_QUANTIZED_BITS(d) \
  MLX_ATTN_PAGED_QUANTIZED_TYPES(d, 4)   \
  MLX_ATTN_PAGED_QUANTIZED_TYPES(d, 8)

// The head dims of the quantized decode (attention_quantized.metal): a lane's
// slice divides every group size.
MLX_ATTN_PAGED_QUANTIZED_BITS(64)
MLX_ATTN_PAGED_QUANTIZED_BITS(128)
MLX_ATTN_PAGED_QUANTIZED_BITS(256)
