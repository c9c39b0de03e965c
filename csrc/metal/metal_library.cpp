#include "csrc/metal/metal_library.h"

#include <string>

#include "csrc/metal/attention_metal.h"
#include "csrc/metal/metal_sources.h"

#ifdef MLX_ATTN_PREBUILT_METALLIB
#include <filesystem>
#endif

namespace mlx_attn::metal {

namespace mx = mlx::core;

MTL::Library* kernel_library(mx::metal::Device& device, const std::string& kernel) {
#ifdef MLX_ATTN_PREBUILT_METALLIB
  static const bool prebuilt_installed =
      std::filesystem::exists(std::filesystem::path(binary_dir()) / "mlx_attn.metallib");
  if (prebuilt_installed) return device.get_library("mlx_attn", binary_dir());
#endif
  const EmbeddedSource& source = source_for_kernel(kernel);
  // One variant alone where its family has the rule (prefill: ~0.1x the
  // whole file's compile by proxy, benchmarks/bench_metal_compile.py),
  // cached by MLX under the kernel's own name; else the whole family.
  std::string variant = variant_source(kernel);
  // Safe math, as the prebuilt metallib (-fno-fast-math); the kernels use
  // finite sentinels, so they are also correct under fast math. The softmax
  // exps call fast::exp2 explicitly (as MLX's steel): under Safe math a bare
  // exp2 would be the precise, slower sequence.
  mx::CompileOptions options;
  options.math_mode = mx::MathMode::Safe;
  if (!variant.empty()) {
    return device.get_library("mlx_attn_" + kernel, options, [&variant] { return variant; });
  }
  return device.get_library(
      "mlx_attn_" + std::string(source.name), options, [&source] { return std::string(source.text); });
}

}  // namespace mlx_attn::metal
