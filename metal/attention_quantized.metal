// Fused attention over quantized keys and values: the instantiations of the
// kernel template in metal/attention_quantized.h (see there).
#include "metal/attention_quantized.h"

#define MLX_ATTN_QUANTIZED_DECODE_MASK(mname, mask, tname, type, d, bits, r, sg)                                   \
  template [[host_name("attention_quantized_decode_partial_" #tname "_d" #d "_b" #bits "_r" #r "_sg" #sg mname)]] \
  [[kernel]] decltype(attention_quantized_decode_partial<type, d, bits, mask, r, sg>)                            \
      attention_quantized_decode_partial<type, d, bits, mask, r, sg>;
// Per kernel: MLX_ATTN_QUANTIZED_DECODE_MASK (a first-use compile builds
// one, csrc/metal/metal_sources.cpp). Each head dim has the float decode's
// two threadgroup shapes (metal/attention_decode.metal): the group shape
// (`group_rows` rows, 4 simdgroups) and the row shape (1 row,
// `row_simdgroups` simdgroups).
#define MLX_ATTN_QUANTIZED_DECODE(tname, type, d, bits, group_rows, row_simdgroups)                     \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_QUANTIZED_DECODE_MASK, tname, type, d, bits, group_rows, 4)          \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_QUANTIZED_DECODE_MASK, tname, type, d, bits, 1, row_simdgroups)

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(...) MLX_ATTN_QUANTIZED_DECODE(bfloat16, bfloat, __VA_ARGS__)
#else
#define MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(...)
#endif
#define MLX_ATTN_QUANTIZED_DECODE_TYPES(...)             \
  MLX_ATTN_QUANTIZED_DECODE(float32, float, __VA_ARGS__) \
  MLX_ATTN_QUANTIZED_DECODE(float16, half, __VA_ARGS__)  \
  MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(__VA_ARGS__)
#define MLX_ATTN_QUANTIZED_DECODE_BITS(d, group_rows, row_simdgroups) \
  MLX_ATTN_QUANTIZED_DECODE_TYPES(d, 4, group_rows, row_simdgroups)   \
  MLX_ATTN_QUANTIZED_DECODE_TYPES(d, 8, group_rows, row_simdgroups)

// Head dims of the float decode merge (attention_decode.metal) whose lane
// slice (D / 32 features) divides every group size: not 96; with the float
// decode's shape numbers (head dim, group rows, row simdgroups).
MLX_ATTN_QUANTIZED_DECODE_BITS(64, 8, 32)
MLX_ATTN_QUANTIZED_DECODE_BITS(128, 8, 32)
MLX_ATTN_QUANTIZED_DECODE_BITS(256, 4, 16)
MLX_ATTN_QUANTIZED_DECODE_BITS(512, 2, 16)
