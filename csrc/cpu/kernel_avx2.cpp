// The fused CPU attention kernel compiled for the avx2 instruction set;
// see kernel_impl.h.
#define MLX_ATTN_ISA avx2
#include "csrc/cpu/isa_avx2.h"
#include "csrc/cpu/kernel_impl.h"
