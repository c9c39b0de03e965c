// Mac-only host code of the fused attention (compiled when MLX has Metal).
#pragma once

#include <string>
#include <vector>

#include "csrc/attention.h"
#include "csrc/launch_plan.h"

namespace mlx_attn::metal {

// Directory of the loaded _ext binary; mlx_attn.metallib is installed there.
const std::string& binary_dir();

// Runs the fused attention on a GPU stream.
void eval_attention(
    mx::Stream stream,
    const AttentionProblem& problem,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

// Encodes every dispatch of a supported plan on the stream's command encoder:
// each binding's memory from `inputs`, `outputs` (allocated by the caller),
// the plan's scratch (allocated here) or bytes.
void encode_launch_plan(
    mx::Stream stream,
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

// Runs the fused attention backward (FusedAttentionBackward) on a GPU stream.
void eval_attention_backward(
    mx::Stream stream,
    const AttentionProblem& problem,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

}  // namespace mlx_attn::metal
