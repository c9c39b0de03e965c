// AVX2 + FMA + F16C: 32-byte vectors, the micro-kernel's default 6 x 2
// register tile (12 of 16 ymm). Included by kernel_avx2.cpp and
// backward_avx2.cpp after MLX_ATTN_ISA, before the kernel source.
#pragma once

#define MLX_ATTN_VEC_BYTES 32
