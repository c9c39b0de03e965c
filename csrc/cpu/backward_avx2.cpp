// The fused CPU attention backward compiled for the avx2 instruction set;
// see backward_impl.h.
#define MLX_ATTN_ISA avx2_backward
#include "csrc/cpu/isa_avx2.h"
#include "csrc/cpu/backward_impl.h"
