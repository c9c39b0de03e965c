// The fused CPU attention kernel compiled for the avx2 instruction set
// (32-byte vectors); see kernel_impl.h.
#define MLX_ATTN_ISA avx2
#define MLX_ATTN_VEC_BYTES 32
#include "csrc/cpu/kernel_impl.h"
