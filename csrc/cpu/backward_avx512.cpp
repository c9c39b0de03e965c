// The fused CPU attention backward compiled for the avx512 instruction set;
// see backward_impl.h.
#define MLX_ATTN_ISA avx512_backward
#include "csrc/cpu/isa_avx512.h"
#include "csrc/cpu/backward_impl.h"
