// The integer-dot quantized matrix-vector product compiled for baseline arm64
// NEON (widening multiplies, int8 and int16 activations); see
// int8_matvec_impl.h. Built on aarch64 only.
#define MLX_ATTN_ISA neon
#define MLX_ATTN_INT8_NEON 1
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/int8_matvec_impl.h"
