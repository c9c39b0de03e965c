// The fused CPU attention kernel compiled for AVX-512 with AVX512_BF16: the
// avx512 copy plus a native bf16 score product (vdpbf16ps, float32
// accumulation) for bfloat16 inputs; see kernel_impl.h and micro_kernel.h.
#define MLX_ATTN_ISA avx512bf16
#define MLX_ATTN_NATIVE_BF16 1
#include "csrc/cpu/isa_avx512.h"
#include "csrc/cpu/kernel_impl.h"
