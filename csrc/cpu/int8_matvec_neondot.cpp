// The integer-dot quantized matrix-vector product compiled for arm64 NEON
// with FEAT_DotProd (ARMv8.2 SDOT; Apple M1+): int8 activations by SDOT,
// int16 ones as the neon copy; see int8_matvec_impl.h. Built on aarch64 only,
// with the flags of CMakeLists.txt.
#define MLX_ATTN_ISA neondot
#define MLX_ATTN_INT8_NEON 1
#define MLX_ATTN_INT8_DOTPROD 1
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/int8_matvec_impl.h"
