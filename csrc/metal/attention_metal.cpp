// Loads mlx_attn.metallib from next to the extension binary, the way MLX's
// extension example does. The attention kernels themselves come with the
// Metal-kernel work (metal/*.metal); until they exist, Python never routes a
// GPU call here (mlx_attn/metal_support.py reports them unavailable).
#include "csrc/metal/attention_metal.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "mlx/backend/metal/device.h"

namespace mlx_attn::metal {

const std::string& binary_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&binary_dir), &info)) {
      throw std::runtime_error("[mlx_attn] cannot locate the _ext binary");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

void eval_attention(
    mx::Stream stream,
    const AttentionOptions&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  auto& device = mx::metal::device(stream.device);
  device.get_library("mlx_attn", binary_dir());  // fails clearly if not installed
  throw std::runtime_error(
      "[mlx_attn] this version has no fused Metal attention kernels yet; "
      "use backend='auto' or 'reference' on the GPU");
}

}  // namespace mlx_attn::metal
