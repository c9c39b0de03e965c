// Paged, ragged attention over float pages: the instantiations of the kernel
// templates in metal/attention_paged.h (see there).
#include "metal/attention_paged.h"

#define MLX_ATTN_PAGED_PARTIAL(tname, type, d, r, sg)                                                       \
  template [[host_name("attention_paged_decode_partial_" #tname "_d" #d "_r" #r "_sg" #sg)]] [[kernel]]      \
  decltype(attention_paged_decode_partial<type, d, r, sg>) attention_paged_decode_partial<type, d, r, sg>;
// Per head dim: the partial kernel in the dense decode's two shapes (the
// group shape: `group_rows` rows on 4 simdgroups; the row shape: 1 row on
// `row_simdgroups`, metal/attention_decode.metal's numbers) and the merge.
#define MLX_ATTN_PAGED(tname, type, d, group_rows, row_simdgroups)                                    \
  MLX_ATTN_PAGED_PARTIAL(tname, type, d, group_rows, 4)                                               \
  MLX_ATTN_PAGED_PARTIAL(tname, type, d, 1, row_simdgroups)                                           \
  template [[host_name("attention_paged_decode_merge_" #tname "_d" #d)]] [[kernel]] decltype(        \
      attention_paged_decode_merge<type, d>) attention_paged_decode_merge<type, d>;

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_PAGED_BFLOAT16(...) MLX_ATTN_PAGED(bfloat16, bfloat, __VA_ARGS__)
#else
#define MLX_ATTN_PAGED_BFLOAT16(...)
#endif
#define MLX_ATTN_PAGED_TYPES(...)             \
  MLX_ATTN_PAGED(float32, float, __VA_ARGS__) \
  MLX_ATTN_PAGED(float16, half, __VA_ARGS__)  \
  MLX_ATTN_PAGED_BFLOAT16(__VA_ARGS__)

// head dim, the group shape's rows, the row shape's simdgroups
// (csrc/metal/launch_plan.cpp decode_group_shape / decode_row_shape)
MLX_ATTN_PAGED_TYPES(64, 8, 32)
MLX_ATTN_PAGED_TYPES(96, 8, 32)
MLX_ATTN_PAGED_TYPES(128, 8, 32)
MLX_ATTN_PAGED_TYPES(256, 4, 16)
