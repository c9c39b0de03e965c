// Mac-only host code of the fused attention (compiled when MLX has Metal).
#pragma once

#include <string>
#include <vector>

#include "csrc/attention.h"

namespace mlx_attn::metal {

// Directory of the loaded _ext binary; mlx_attn.metallib is installed there.
const std::string& binary_dir();

// Runs the fused attention on a GPU stream.
void eval_attention(
    mx::Stream stream,
    const AttentionProblem& problem,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

}  // namespace mlx_attn::metal
