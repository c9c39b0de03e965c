// The fused CPU attention backward compiled for AVX-512 with AVX512_BF16 and
// AMX-BF16: the avx512 copy with the five bf16 products on AMX tiles
// (amx_tiles.h) where D and Dv are multiples of 32; see backward_impl.h.
#define MLX_ATTN_ISA avx512amx_backward
#define MLX_ATTN_AMX_BF16 1
#include "csrc/cpu/isa_avx512.h"
#include "csrc/cpu/backward_impl.h"
