// The fused CPU attention backward compiled for the avx2 instruction set
// (32-byte vectors); see backward_impl.h.
#define MLX_ATTN_ISA avx2_backward
#define MLX_ATTN_VEC_BYTES 32
#include "csrc/cpu/backward_impl.h"
