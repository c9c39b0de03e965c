// Paged, ragged attention over quantized pages: the instantiations of the
// kernel template in metal/attention_paged_quantized.h (see there); the
// merge is attention_paged.metal's.
#include "metal/attention_paged_quantized.h"

#define MLX_ATTN_PAGED_QUANTIZED_SHAPE(tname, type, d, bits, r, sg)                                          \
  template [[host_name("attention_paged_quantized_decode_partial_" #tname "_d" #d "_b" #bits "_r" #r "_sg" #sg)]] \
  [[kernel]] decltype(attention_paged_quantized_decode_partial<type, d, bits, r, sg>)                          \
      attention_paged_quantized_decode_partial<type, d, bits, r, sg>;
// The float paged decode's two threadgroup shapes (metal/attention_paged.metal).
#define MLX_ATTN_PAGED_QUANTIZED(tname, type, d, bits, group_rows, row_simdgroups) \
  MLX_ATTN_PAGED_QUANTIZED_SHAPE(tname, type, d, bits, group_rows, 4)               \
  MLX_ATTN_PAGED_QUANTIZED_SHAPE(tname, type, d, bits, 1, row_simdgroups)

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PAGED_QUANTIZED_BFLOAT16(...) MLX_ATTN_PAGED_QUANTIZED(bfloat16, bfloat, __VA_ARGS__)
#else
#define MLX_ATTN_PAGED_QUANTIZED_BFLOAT16(...)
#endif
#define MLX_ATTN_PAGED_QUANTIZED_TYPES(...)             \
  MLX_ATTN_PAGED_QUANTIZED(float32, float, __VA_ARGS__) \
  MLX_ATTN_PAGED_QUANTIZED(float16, half, __VA_ARGS__)  \
  MLX_ATTN_PAGED_QUANTIZED_BFLOAT16(__VA_ARGS__)
#define MLX_ATTN_PAGED_QUANTIZED_BITS(d, group_rows, row_simdgroups) \
  MLX_ATTN_PAGED_QUANTIZED_TYPES(d, 4, group_rows, row_simdgroups)   \
  MLX_ATTN_PAGED_QUANTIZED_TYPES(d, 8, group_rows, row_simdgroups)

// The head dims of the quantized decode (attention_quantized.metal): a lane's
// slice divides every group size; with the float decode's shape numbers.
MLX_ATTN_PAGED_QUANTIZED_BITS(64, 8, 32)
MLX_ATTN_PAGED_QUANTIZED_BITS(128, 8, 32)
MLX_ATTN_PAGED_QUANTIZED_BITS(256, 4, 16)
