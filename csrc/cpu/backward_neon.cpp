// The fused CPU attention backward compiled for baseline arm64 NEON (float32
// throughout, so the neonfhm and neonbf16 forward copies share it); see
// backward_impl.h. Built on aarch64 only.
#define MLX_ATTN_ISA neon_backward
#include "csrc/cpu/isa_neon.h"
#include "csrc/cpu/backward_impl.h"
