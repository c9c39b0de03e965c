// The integer-dot quantized matrix-vector product compiled for arm64 NEON
// with FEAT_I8MM (USMMLA: two rows times two outputs an instruction; Apple
// M2+, Neoverse V1/N2/V2, Cortex-A510/A710/X2 and later): int8 activations by
// USMMLA, int16 ones as the neon copy; see int8_matvec_impl.h. Built on
// aarch64 only, with the flags of CMakeLists.txt.
#define MLX_ATTN_ISA neoni8mm
#define MLX_ATTN_INT8_NEON 1
#define MLX_ATTN_INT8_I8MM 1
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/int8_matvec_impl.h"
