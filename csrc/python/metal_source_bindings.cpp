// Python access to the embedded Metal sources (every platform), for tests and
// diagnostics: the exact text a Mac compiles at run time.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "csrc/metal/metal_sources.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

void bind_metal_sources(nb::module_& m) {
  m.def("metal_source_names", [] {
        std::vector<std::string> names;
        for (const auto& source : metal::embedded_sources()) names.emplace_back(source.name);
        return names;
      }, "Names (file stems) of the Metal sources embedded in the extension.");
  m.def("metal_kernel_source", [](const std::string& name) {
        return std::string(metal::source_for_kernel(name).text);
      }, "name"_a,
      "The Metal source text a Mac compiles at run time for a kernel host name "
      "(or a source name), project headers inlined. Raises ValueError for an unknown name.");
  m.def("metal_variant_source", [](const std::string& kernel) { return metal::variant_source(kernel); }, "kernel"_a,
      "The Metal source a Mac compiles on first use for this one kernel (its family's text with one "
      "instantiation), or '' when the whole family's source is compiled instead.");
}

}  // namespace mlx_attn
