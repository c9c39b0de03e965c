// The fused CPU attention kernel compiled for arm64 NEON (16-byte vectors,
// 32 q registers); see kernel_impl.h. Built on aarch64 only.
#define MLX_ATTN_ISA neon
#define MLX_ATTN_VEC_BYTES 16
// 32 vector registers: a 6 x 4 accumulator tile (24 registers), 4 B vectors
// and one broadcast A value.
#define MLX_ATTN_TILE_ROWS 6
#define MLX_ATTN_TILE_VECTORS 4
#include "csrc/cpu/kernel_impl.h"
