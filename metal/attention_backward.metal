// Fused attention backward: the instantiations of the kernel templates in
// metal/attention_backward.h (see there for the algorithm).
#include "metal/attention_backward.h"

#define MLX_ATTN_BACKWARD_DKDV_MASK(mname, mask, tname, type, d, bq)                                 \
  template [[host_name("attention_backward_dkdv_" #tname "_d" #d mname)]] [[kernel]] decltype(      \
      attention_backward_dkdv<type, d, bq, mask>) attention_backward_dkdv<type, d, bq, mask>;
#define MLX_ATTN_BACKWARD_DQ_MASK(mname, mask, tname, type, d, bk)                                   \
  template [[host_name("attention_backward_dq_" #tname "_d" #d mname)]] [[kernel]] decltype(        \
      attention_backward_dq<type, d, bk, mask>) attention_backward_dq<type, d, bk, mask>;
// delta's d: the value head dim (the row length of out and dO)
#define MLX_ATTN_BACKWARD_DELTA(tname, type, d)                                                      \
  template [[host_name("attention_backward_delta_" #tname "_d" #d)]] [[kernel]] decltype(          \
      attention_backward_delta<type, d>) attention_backward_delta<type, d>;
// without dK/dV: the D-split family's at that head dim (metal/attention_backward_split.metal)
#define MLX_ATTN_BACKWARD_DQ(tname, type, d, bk) \
  MLX_ATTN_BACKWARD_DELTA(tname, type, d)       \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_BACKWARD_DQ_MASK, tname, type, d, bk)
#define MLX_ATTN_BACKWARD(tname, type, d, bq, bk) \
  MLX_ATTN_BACKWARD_DQ(tname, type, d, bk)       \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_BACKWARD_DKDV_MASK, tname, type, d, bq)
#define MLX_ATTN_BACKWARD_SINKS(tname, type)                                                         \
  template [[host_name("attention_backward_sinks_" #tname)]] [[kernel]] decltype(                  \
      attention_backward_sinks<type>) attention_backward_sinks<type>;

// BQ: query rows per staged block of dkdv (backward_query_block); BK: keys per
// staged block of dq (prefill_key_block), both in csrc/metal/backward_launch_plan.cpp.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_BACKWARD_BFLOAT16(d, bq, bk) MLX_ATTN_BACKWARD(bfloat16, bfloat, d, bq, bk)
#define MLX_ATTN_BACKWARD_DQ_BFLOAT16(d, bk) MLX_ATTN_BACKWARD_DQ(bfloat16, bfloat, d, bk)
#define MLX_ATTN_BACKWARD_DELTA_BFLOAT16(d) MLX_ATTN_BACKWARD_DELTA(bfloat16, bfloat, d)
#define MLX_ATTN_BACKWARD_SINKS_BFLOAT16 MLX_ATTN_BACKWARD_SINKS(bfloat16, bfloat)
#else
#define MLX_ATTN_BACKWARD_BFLOAT16(d, bq, bk)
#define MLX_ATTN_BACKWARD_DQ_BFLOAT16(d, bk)
#define MLX_ATTN_BACKWARD_DELTA_BFLOAT16(d)
#define MLX_ATTN_BACKWARD_SINKS_BFLOAT16
#endif
#define MLX_ATTN_BACKWARD_TYPES(d, bq, bk)     \
  MLX_ATTN_BACKWARD(float32, float, d, bq, bk) \
  MLX_ATTN_BACKWARD(float16, half, d, bq, bk)  \
  MLX_ATTN_BACKWARD_BFLOAT16(d, bq, bk)

MLX_ATTN_BACKWARD_TYPES(64, 32, 32)
MLX_ATTN_BACKWARD_TYPES(80, 16, 16)
MLX_ATTN_BACKWARD_TYPES(96, 16, 16)
#define MLX_ATTN_BACKWARD_DQ_TYPES(d, bk)     \
  MLX_ATTN_BACKWARD_DQ(float32, float, d, bk) \
  MLX_ATTN_BACKWARD_DQ(float16, half, d, bk)  \
  MLX_ATTN_BACKWARD_DQ_BFLOAT16(d, bk)
// D = 128: delta and dQ (96 floats a lane); its dK/dV pass (128 floats
// register-resident) is the D-split family's
MLX_ATTN_BACKWARD_DQ_TYPES(128, 16)
// delta alone for the value dims of the D-split family (metal/attention_backward_split.metal)
#define MLX_ATTN_BACKWARD_DELTA_TYPES(d)     \
  MLX_ATTN_BACKWARD_DELTA(float32, float, d) \
  MLX_ATTN_BACKWARD_DELTA(float16, half, d)  \
  MLX_ATTN_BACKWARD_DELTA_BFLOAT16(d)
MLX_ATTN_BACKWARD_DELTA_TYPES(256)
MLX_ATTN_BACKWARD_DELTA_TYPES(512)
MLX_ATTN_BACKWARD_SINKS(float32, float)
MLX_ATTN_BACKWARD_SINKS(float16, half)
MLX_ATTN_BACKWARD_SINKS_BFLOAT16
