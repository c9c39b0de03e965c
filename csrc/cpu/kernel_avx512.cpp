// The fused CPU attention kernel compiled for the avx512 instruction set;
// see kernel_impl.h.
#define MLX_ATTN_ISA avx512
#include "csrc/cpu/isa_avx512.h"
#include "csrc/cpu/kernel_impl.h"
