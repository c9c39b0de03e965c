// The fused CPU attention kernel compiled for AVX-512 with AVX512_BF16 and
// AMX-BF16: the avx512bf16 copy with the bf16 score product on AMX tiles
// (amx_tiles.h) where D is a multiple of 32; see kernel_impl.h.
#define MLX_ATTN_ISA avx512amx
#define MLX_ATTN_NATIVE_BF16 1
#define MLX_ATTN_AMX_BF16 1
#include "csrc/cpu/isa_avx512.h"
#include "csrc/cpu/kernel_impl.h"
