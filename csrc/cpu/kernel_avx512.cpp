// The fused CPU attention kernel compiled for the avx512 instruction set
// (64-byte vectors); see kernel_impl.h.
#define MLX_ATTN_ISA avx512
#define MLX_ATTN_VEC_BYTES 64
// 32 vector registers: a 6 x 4 accumulator tile (24 registers), 4 B vectors
// and one broadcast A value.
#define MLX_ATTN_TILE_ROWS 6
#define MLX_ATTN_TILE_VECTORS 4
#include "csrc/cpu/kernel_impl.h"
