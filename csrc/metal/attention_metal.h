// Mac-only host code of the fused attention (compiled when MLX has Metal).
#pragma once

#include <string>
#include <vector>

#include "csrc/ops/attention.h"
#include "csrc/metal/launch_plan.h"

namespace mlx_attn::metal {

// Directory of the loaded _ext binary; mlx_attn.metallib is installed there.
const std::string& binary_dir();

// The launch plan's GPU target (family, cores) for the stream's device.
GpuTarget gpu_target(mx::Stream stream);

// Encodes every dispatch of `plan` (forward, quantized or backward attention) on a GPU
// stream: inputs are the primitive's, outputs already allocated. Throws for
// an unsupported plan.
void encode_launch_plan(
    mx::Stream stream,
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

}  // namespace mlx_attn::metal
