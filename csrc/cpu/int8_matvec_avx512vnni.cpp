// The integer-dot quantized matrix-vector product compiled for the avx512vnni
// instruction set; see int8_matvec_impl.h.
#define MLX_ATTN_ISA avx512vnni
#include "csrc/cpu/isa_avx512.h"
#include "csrc/cpu/int8_matvec_impl.h"
