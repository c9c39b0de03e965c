// Fused prefill attention over quantized K/V: the instantiations of the
// kernel template in metal/attention_quantized_prefill.h (see there).
#include "metal/attention_quantized_prefill.h"

#define MLX_ATTN_QUANTIZED_PREFILL_MASK(mname, mask, tname, type, d, bits, bk)                                  \
  template [[host_name("attention_quantized_prefill_" #tname "_d" #d "_b" #bits "_bk" #bk mname)]] [[kernel]] \
  decltype(attention_quantized_prefill<type, d, bk, bits, mask>) attention_quantized_prefill<type, d, bk, bits, mask>;
#define MLX_ATTN_QUANTIZED_PREFILL(tname, type, d, bits, bk) \
  MLX_ATTN_FOR_EACH_MASK(MLX_ATTN_QUANTIZED_PREFILL_MASK, tname, type, d, bits, bk)

// BK: the dense prefill kernel's keys per block, from the launch plan's
// per-family table (csrc/metal/launch_plan.cpp prefill_key_block); the head dims
// both the quantized decode and the register-resident prefill kernels serve
// (64, 128: D = 256 prefill stays on the decode structure, see
// csrc/metal/quantized_launch_plan.h quantized_rows_take_prefill).
// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_QUANTIZED_PREFILL_BFLOAT16(d, bits, bk) MLX_ATTN_QUANTIZED_PREFILL(bfloat16, bfloat, d, bits, bk)
#else
#define MLX_ATTN_QUANTIZED_PREFILL_BFLOAT16(d, bits, bk)
#endif
#define MLX_ATTN_QUANTIZED_PREFILL_2BYTE_TYPES(d, bits, bk) \
  MLX_ATTN_QUANTIZED_PREFILL(float16, half, d, bits, bk)    \
  MLX_ATTN_QUANTIZED_PREFILL_BFLOAT16(d, bits, bk)
#define MLX_ATTN_QUANTIZED_PREFILL_TYPES(d, bits, bk)   \
  MLX_ATTN_QUANTIZED_PREFILL(float32, float, d, bits, bk) \
  MLX_ATTN_QUANTIZED_PREFILL_2BYTE_TYPES(d, bits, bk)

MLX_ATTN_QUANTIZED_PREFILL_TYPES(64, 4, 32)
MLX_ATTN_QUANTIZED_PREFILL_TYPES(64, 8, 32)
MLX_ATTN_QUANTIZED_PREFILL_TYPES(128, 4, 16)
MLX_ATTN_QUANTIZED_PREFILL_TYPES(128, 8, 16)
// apple9, 2-byte dtypes: twice the keys per block
MLX_ATTN_QUANTIZED_PREFILL_2BYTE_TYPES(128, 4, 32)
MLX_ATTN_QUANTIZED_PREFILL_2BYTE_TYPES(128, 8, 32)
