// The integer-dot quantized matrix-vector product compiled for the avx2
// instruction set; see int8_matvec_impl.h.
#define MLX_ATTN_ISA avx2
#include "csrc/cpu/isa_avx2.h"
#include "csrc/cpu/int8_matvec_impl.h"
