// arm64 NEON: 16-byte vectors and 32 q registers, so a 6 x 4 accumulator tile
// (24 registers), 4 B vectors and one broadcast A value. Included by the
// NEON copies (kernel_neon*.cpp, backward_neon.cpp) after MLX_ATTN_ISA,
// before the kernel source.
#pragma once

#define MLX_ATTN_VEC_BYTES 16
#define MLX_ATTN_TILE_ROWS 6
#define MLX_ATTN_TILE_VECTORS 4
