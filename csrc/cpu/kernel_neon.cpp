// The fused CPU attention kernel compiled for baseline arm64 NEON; see
// kernel_impl.h. Built on aarch64 only.
#define MLX_ATTN_ISA neon
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/kernel_impl.h"
