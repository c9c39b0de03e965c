// AVX-512: 64-byte vectors and 32 zmm registers, so a 6 x 4 accumulator tile
// (24 registers), 4 B vectors and one broadcast A value. Included by the
// avx512 copies (kernel_avx512*.cpp, backward_avx512.cpp) after
// MLX_ATTN_ISA, before the kernel source.
#pragma once

#define MLX_ATTN_VEC_BYTES 64
#define MLX_ATTN_TILE_ROWS 6
#define MLX_ATTN_TILE_VECTORS 4
