// The fused CPU attention kernel compiled for the avx512 instruction set
// (64-byte vectors); see kernel_impl.h.
#define MLX_ATTN_ISA avx512
#define MLX_ATTN_VEC_BYTES 64
#include "csrc/cpu/kernel_impl.h"
