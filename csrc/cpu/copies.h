// The kernel copies compiled into this build, widest first, each with the
// CPU feature it needs and the backward copy that serves it: the one table
// the dispatchers (dispatch.cpp, backward_dispatch.cpp) and the standalone
// harness (tests/cpu_harness) read. No STL.
#pragma once

#include "csrc/cpu/backward_kernels.h"
#include "csrc/cpu/cpu_features.h"
#include "csrc/cpu/kernels.h"

namespace mlx_attn::cpu {

inline bool always_available() {
  return true;
}

struct BackwardCopy {
  const char* name;
  int (*lanes)();
  int64_t (*panel_floats)(const BackwardCall&);
  void (*rows)(const BackwardCall&, int64_t);
  void (*group)(const BackwardCall&, int64_t, float*);
  void (*key_block)(const BackwardCall&, int64_t, float*);
  void (*query_block)(const BackwardCall&, int64_t, float*);
  bool (*available)();
};

#define MLX_ATTN_BACKWARD_COPY(isa, available)                                 \
  BackwardCopy {                                                               \
    #isa, isa::backward_vector_lanes, isa::backward_panel_floats, isa::backward_rows, isa::backward_group, \
        isa::backward_key_block, isa::backward_query_block, available          \
  }
#ifdef MLX_ATTN_X86_KERNELS
inline constexpr BackwardCopy kAvx512AmxBackward = MLX_ATTN_BACKWARD_COPY(avx512amx_backward, features::amx_bf16);
inline constexpr BackwardCopy kAvx512Backward = MLX_ATTN_BACKWARD_COPY(avx512_backward, features::avx512);
inline constexpr BackwardCopy kAvx2Backward = MLX_ATTN_BACKWARD_COPY(avx2_backward, features::avx2);
#endif
#ifdef MLX_ATTN_ARM64_KERNELS
inline constexpr BackwardCopy kNeonBackward = MLX_ATTN_BACKWARD_COPY(neon_backward, always_available);
#endif
inline constexpr BackwardCopy kGenericBackward = MLX_ATTN_BACKWARD_COPY(generic_backward, always_available);
#undef MLX_ATTN_BACKWARD_COPY

inline constexpr const BackwardCopy* kBackwardCopies[] = {
#ifdef MLX_ATTN_X86_KERNELS
    &kAvx512AmxBackward,
    &kAvx512Backward,
    &kAvx2Backward,
#endif
#ifdef MLX_ATTN_ARM64_KERNELS
    &kNeonBackward,
#endif
    &kGenericBackward,
};

struct ForwardCopy {
  const char* name;
  int (*lanes)();
  void (*process)(const KernelCall&, int64_t, float*);
  bool (*available)();
  const BackwardCopy* backward;
};

#define MLX_ATTN_FORWARD_COPY(isa, available, backward)                    \
  ForwardCopy {                                                            \
    #isa, isa::vector_lanes, isa::process_work_item, available, &backward \
  }
// Widest first. The backward computes in float32: forward copies that differ
// only in a native reduced-precision score product share one backward copy,
// except avx512amx, whose backward runs bf16 products on AMX tiles too.
inline constexpr ForwardCopy kForwardCopies[] = {
#ifdef MLX_ATTN_X86_KERNELS
    MLX_ATTN_FORWARD_COPY(avx512amx, features::amx_bf16, kAvx512AmxBackward),
    MLX_ATTN_FORWARD_COPY(avx512bf16, features::avx512bf16, kAvx512Backward),
    MLX_ATTN_FORWARD_COPY(avx512, features::avx512, kAvx512Backward),
    MLX_ATTN_FORWARD_COPY(avx2, features::avx2, kAvx2Backward),
#endif
#ifdef MLX_ATTN_ARM64_KERNELS
    MLX_ATTN_FORWARD_COPY(neonbf16, features::neon_bf16_and_fhm, kNeonBackward),
    MLX_ATTN_FORWARD_COPY(neonfhm, features::neon_fhm, kNeonBackward),
    MLX_ATTN_FORWARD_COPY(neon, always_available, kNeonBackward),  // baseline on arm64
#endif
    MLX_ATTN_FORWARD_COPY(generic, always_available, kGenericBackward),
};
#undef MLX_ATTN_FORWARD_COPY

}  // namespace mlx_attn::cpu
