// The fused CPU attention kernel compiled for the generic instruction set;
// see kernel_impl.h.
#define MLX_ATTN_ISA generic
#include "csrc/cpu/isa_generic.h"
#include "csrc/cpu/kernel_impl.h"
