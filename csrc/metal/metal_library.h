// Mac only: the MTL::Library that holds a kernel.
#pragma once

#include <string>

#include "mlx/backend/metal/device.h"

namespace mlx_attn::metal {

// The library defining `kernel` (a host name from the launch plan).
// Default: compiled at run time through MLX on first use, then cached by MLX:
// a prefill kernel alone (variant_source, cached as "mlx_attn_<kernel>"),
// any other kernel with its family's whole embedded source (one .metal file,
// see csrc/metal/metal_sources.h; "mlx_attn_<family>"). Builds with the
// prebuilt metallib (MLX_ATTN_PREBUILT_METALLIB, AUTO: when Xcode's Metal
// toolchain is found) use mlx_attn.metallib next to the extension.
MTL::Library* kernel_library(mlx::core::metal::Device& device, const std::string& kernel);

}  // namespace mlx_attn::metal
