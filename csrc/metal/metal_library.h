// Mac only: the MTL::Library that holds a kernel.
#pragma once

#include <string>

#include "mlx/backend/metal/device.h"

namespace mlx_attn::metal {

// The library defining `kernel` (a host name from the launch plan).
// Default: the embedded source of the kernel's family (one .metal file, see
// csrc/metal/metal_sources.h) compiled at run time through MLX on first use,
// then cached by MLX under "mlx_attn_<family>". Builds configured with
// MLX_ATTN_PREBUILT_METALLIB use mlx_attn.metallib next to the extension
// when it is there.
MTL::Library* kernel_library(mlx::core::metal::Device& device, const std::string& kernel);

}  // namespace mlx_attn::metal
