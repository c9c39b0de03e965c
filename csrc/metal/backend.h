// Whether this build carries the Metal host: MLX built with Metal compiles
// csrc/metal/eval_gpu.cpp, every other build csrc/metal/no_metal.cpp (as
// MLX's own no_metal backend does). The eval_gpu bodies of the primitives
// (csrc/ops/) live in the same two files; nothing else tests for Metal.
#pragma once

namespace mlx_attn::metal {

inline constexpr const char* kNoMetalReason = "this build of mlx_attn has no Metal kernels (MLX without Metal)";

bool available();

}  // namespace mlx_attn::metal
