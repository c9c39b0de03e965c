// The fused CPU attention kernel compiled for the generic instruction set
// (16-byte vectors); see kernel_impl.h.
#define MLX_ATTN_ISA generic
#define MLX_ATTN_VEC_BYTES 16
#include "csrc/cpu/kernel_impl.h"
