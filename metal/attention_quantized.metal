// Fused attention over quantized keys and values: the instantiations of the
// kernel template in metal/attention_quantized.h (see there).
#include "metal/attention_quantized.h"

#define MLX_ATTN_QUANTIZED_DECODE_MASK(mname, mask, tname, type, d, bits)                                     \
  template [[host_name("attention_quantized_decode_partial_" #tname "_d" #d "_b" #bits mname)]] [[kernel]] \
  decltype(attention_quantized_decode_partial<type, d, bits, mask>)                                          \
      attention_quantized_decode_partial<type, d, bits, mask>;
#define MLX_ATTN_QUANTIZED_DECODE(tname, type, d, bits) \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_QUANTIZED_DECODE_MASK, tname, type, d, bits)

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(d, bits) MLX_ATTN_QUANTIZED_DECODE(bfloat16, bfloat, d, bits)
#else
#define MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(d, bits)
#endif
#define MLX_ATTN_QUANTIZED_DECODE_TYPES(d, bits)   \
  MLX_ATTN_QUANTIZED_DECODE(float32, float, d, bits) \
  MLX_ATTN_QUANTIZED_DECODE(float16, half, d, bits)  \
  MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(d, bits)
#define MLX_ATTN_QUANTIZED_DECODE_BITS(d) \
  MLX_ATTN_QUANTIZED_DECODE_TYPES(d, 4)   \
  MLX_ATTN_QUANTIZED_DECODE_TYPES(d, 8)

// Head dims of the float decode merge (attention_decode.metal) whose lane
// slice (D / 32 features) divides every group size: not 96.
MLX_ATTN_QUANTIZED_DECODE_BITS(64)
MLX_ATTN_QUANTIZED_DECODE_BITS(128)
MLX_ATTN_QUANTIZED_DECODE_BITS(256)
MLX_ATTN_QUANTIZED_DECODE_BITS(512)
