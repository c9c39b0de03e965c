// The fused CPU attention backward compiled for the generic instruction set;
// see backward_impl.h.
#define MLX_ATTN_ISA generic_backward
#include "csrc/cpu/isa_generic.h"
#include "csrc/cpu/backward_impl.h"
