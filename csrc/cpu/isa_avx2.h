// AVX2 + FMA + F16C: 32-byte vectors, the micro-kernel's default 6 x 2
// register tile (12 of 16 ymm). Included by kernel_avx2.cpp and
// backward_avx2.cpp after MLX_ATTN_ISA, before the kernel source.
#pragma once

#define MLX_ATTN_VEC_BYTES 32
// The forward's panels (kernel_impl.h): S^T rows 16 floats longer than the
// padded row count, and Q^T stored one register tile of columns at a time.
// With 128 rows both panels' rows are 512 bytes apart, so the 64 keys or
// features a product steps through fall into 8 of the L1's 64 sets and
// evict each other (Zen 2, 32 KiB 8-way): P.V ran at ~70 % and the score
// product at ~85 % of the FMA rate of the same product on conflict-free
// panels (single-thread micro-benchmark, T = 4096, D = 64 / 128).
#define MLX_ATTN_SCORE_ROW_PAD 16
#define MLX_ATTN_QUERY_PANEL_TILES 1
