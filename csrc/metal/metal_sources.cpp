#include "csrc/metal/metal_sources.h"

#include <stdexcept>
#include <string>

namespace mlx_attn::metal {

const EmbeddedSource& source_for_kernel(std::string_view kernel) {
  const EmbeddedSource* best = nullptr;
  for (const auto& source : embedded_sources()) {
    const bool names_it = kernel == source.name ||
        (kernel.starts_with(source.name) && kernel[source.name.size()] == '_');
    if (names_it && (!best || source.name.size() > best->name.size())) best = &source;
  }
  if (!best) {
    std::string known;
    for (const auto& source : embedded_sources()) {
      known += (known.empty() ? "" : ", ") + std::string(source.name);
    }
    throw std::invalid_argument(
        "[mlx_attn] no Metal source defines kernel '" + std::string(kernel) +
        "' (a kernel name starts with its source's name; sources: " + known + ")");
  }
  return *best;
}

}  // namespace mlx_attn::metal
