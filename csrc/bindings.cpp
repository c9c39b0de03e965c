// The Python module mlx_attn._ext. Public API and input validation live in
// mlx_attn/ops.py; these bindings are thin.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/attention.h"
#include "csrc/cpu/kernels.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {
void bind_launch_plan(nb::module_& m);  // csrc/launch_plan_bindings.cpp
void bind_metal_sources(nb::module_& m);  // csrc/metal/metal_source_bindings.cpp
}

NB_MODULE(_ext, m) {
  m.doc() = "mlx_attn native extension: the fused attention primitive.";

  m.def(
      "fused_attention",
      [](const mlx::core::array& q,
         const mlx::core::array& k,
         const mlx::core::array& v,
         float scale,
         bool causal,
         int window_size,
         std::optional<mlx::core::array> mask,
         std::optional<mlx::core::array> sinks,
         bool output_lse,
         mlx::core::StreamOrDevice s) {
        mlx_attn::AttentionOptions options;
        options.scale = scale;
        options.causal = causal;
        options.window_size = window_size;
        options.output_lse = output_lse;
        return mlx_attn::fused_attention(q, k, v, mask, sinks, options, s);
      },
      "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a, "causal"_a = false,
      "window_size"_a = 0, "mask"_a = nb::none(), "sinks"_a = nb::none(),
      "output_lse"_a = false, "stream"_a = nb::none(),
      "Fused attention on validated inputs; returns [out] or [out, lse].");

  m.attr("built_with_mlx") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);

  m.def("cpu_isa", [] { return std::string(mlx_attn::cpu::current_isa()); },
        "Instruction set the fused CPU kernel uses.");
  m.def("set_cpu_isa", [](const std::string& name) {
        mlx_attn::cpu::set_isa(name.c_str());
      }, "name"_a, "Use another compiled kernel copy (for tests).");
  m.def("supported_cpu_isas", [] {
        int n = 0;
        const char* const* names = mlx_attn::cpu::supported_isas(&n);
        return std::vector<std::string>(names, names + n);
      }, "Kernel instruction sets this CPU can run, widest first.");
  m.def("has_metal", [] {
#ifdef MLX_ATTN_METAL
        return true;
#else
        return false;
#endif
      }, "Whether this build contains the Metal kernels.");

  mlx_attn::bind_launch_plan(m);
  mlx_attn::bind_metal_sources(m);
}
