// The fused CPU attention backward compiled for the generic instruction set
// (16-byte vectors); see backward_impl.h.
#define MLX_ATTN_ISA generic_backward
#define MLX_ATTN_VEC_BYTES 16
#include "csrc/cpu/backward_impl.h"
