// The integer-dot quantized matrix-vector product compiled for the generic
// instruction set; see int8_matvec_impl.h.
#define MLX_ATTN_ISA generic
#include "csrc/cpu/isa_generic.h"
#include "csrc/cpu/int8_matvec_impl.h"
