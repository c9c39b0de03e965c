// The fused CPU attention backward compiled for the avx512 instruction set
// (64-byte vectors); see backward_impl.h. Register tile as the forward's
// (kernel_avx512.cpp): 6 x 4 accumulators of 32 vector registers.
#define MLX_ATTN_ISA avx512_backward
#define MLX_ATTN_VEC_BYTES 64
#define MLX_ATTN_TILE_ROWS 6
#define MLX_ATTN_TILE_VECTORS 4
#include "csrc/cpu/backward_impl.h"
