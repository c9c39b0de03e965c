// The fused CPU attention kernel compiled for arm64 NEON with FEAT_BF16 and
// FEAT_FHM (Apple M2+, Neoverse V1/N2+): native score products for both
// reduced types, bfloat16 through BFDOT and float16 through FMLAL/FMLAL2,
// float32 accumulation; see kernel_impl.h and micro_kernel.h. Built on
// aarch64 only, with the flags of CMakeLists.txt.
#define MLX_ATTN_ISA neonbf16
#define MLX_ATTN_NATIVE_BF16 1
#define MLX_ATTN_NATIVE_FP16 1
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/kernel_impl.h"
