// The fused CPU attention kernel compiled for arm64 NEON with FEAT_FHM
// (ARMv8.2 FP16 multiply-accumulate into float32: FMLAL/FMLAL2; Apple M1+):
// the neon copy plus a native float16 score product; see kernel_impl.h and
// micro_kernel.h. Built on aarch64 only, with the flags of CMakeLists.txt.
#define MLX_ATTN_ISA neonfhm
#define MLX_ATTN_NATIVE_FP16 1
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/kernel_impl.h"
