// Fused attention for decoding: the instantiations of the kernel templates in
// metal/attention_decode.h (contiguous K/V; see there for the algorithm).
#include "metal/attention_decode.h"

#define MLX_ATTN_DECODE_PARTIAL(mname, mask, tname, type, d, r, sg)                                        \
  template [[host_name("attention_decode_partial_" #tname "_d" #d "_r" #r "_sg" #sg mname)]] [[kernel]] \
  decltype(attention_decode_partial<type, d, mask, r, sg>) attention_decode_partial<type, d, mask, r, sg>;
#define MLX_ATTN_DECODE_MERGE(tname, type, d)                                            \
  template [[host_name("attention_decode_merge_" #tname "_d" #d)]] [[kernel]] decltype(  \
      attention_decode_merge<type, d>) attention_decode_merge<type, d>;
// Per kernel: MLX_ATTN_DECODE_PARTIAL(mask suffix, mask kind, ..., rows,
// simdgroups) and MLX_ATTN_DECODE_MERGE (a first-use compile builds one,
// csrc/metal/metal_sources.cpp). Each head dim has two threadgroup shapes
// (decode_split): the group shape (`group_rows` rows, 4 simdgroups) and the
// row shape (1 row, `row_simdgroups` simdgroups); csrc/metal/launch_plan.cpp
// (kDecodeShapes) names the same numbers.
#define MLX_ATTN_DECODE(tname, type, d, group_rows, row_simdgroups)                       \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_DECODE_PARTIAL, tname, type, d, group_rows, 4)          \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_DECODE_PARTIAL, tname, type, d, 1, row_simdgroups)      \
  MLX_ATTN_DECODE_MERGE(tname, type, d)

static_assert(MLX_ATTN_DECODE_SIMDGROUPS == 4, "the group shape's simdgroups, named in its kernels' host names");

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_DECODE_BFLOAT16(...) MLX_ATTN_DECODE(bfloat16, bfloat, __VA_ARGS__)
#else
#define MLX_ATTN_DECODE_BFLOAT16(...)
#endif
#define MLX_ATTN_DECODE_TYPES(...)             \
  MLX_ATTN_DECODE(float32, float, __VA_ARGS__) \
  MLX_ATTN_DECODE(float16, half, __VA_ARGS__)  \
  MLX_ATTN_DECODE_BFLOAT16(__VA_ARGS__)

// head dim, the group shape's rows (DecodeGroupRows<D>), the row shape's
// simdgroups (as many as a core's registers hold, up to 32)
MLX_ATTN_DECODE_TYPES(64, 8, 32)
MLX_ATTN_DECODE_TYPES(96, 8, 32)
MLX_ATTN_DECODE_TYPES(128, 8, 32)
MLX_ATTN_DECODE_TYPES(256, 4, 16)
MLX_ATTN_DECODE_TYPES(512, 2, 16)
