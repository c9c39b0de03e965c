// The generic copies' vector width (SSE2 on x86-64, baseline NEON on arm64):
// 16-byte vectors, the micro-kernel's default 6 x 2 register tile (sized to
// 16 vector registers). Included by kernel_generic.cpp and
// backward_generic.cpp after MLX_ATTN_ISA, before the kernel source.
#pragma once

#define MLX_ATTN_VEC_BYTES 16
