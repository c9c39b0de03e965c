// The fused CPU attention kernel compiled for AVX-512 with AVX512_BF16
// (64-byte vectors): the avx512 copy plus a native bf16 score product
// (vdpbf16ps, float32 accumulation) for bfloat16 inputs; see kernel_impl.h.
#define MLX_ATTN_ISA avx512bf16
#define MLX_ATTN_VEC_BYTES 64
// 32 vector registers: a 6 x 4 accumulator tile (24 registers), 4 B vectors
// and one broadcast A value.
#define MLX_ATTN_TILE_ROWS 6
#define MLX_ATTN_TILE_VECTORS 4
#include "csrc/cpu/kernel_impl.h"
