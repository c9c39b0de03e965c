// The Python module mlx_attn._ext: the fused attention op, the problem
// description and the support rules it is built on (Python asks them), and
// the CPU instruction-set controls. Every entry validates its input in C++
// (std::invalid_argument becomes ValueError).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "csrc/metal/backend.h"
#include "csrc/metal/backward_launch_plan.h"
#include "csrc/ops/attention.h"
#include "csrc/cpu/host.h"
#include "csrc/ops/quantized_attention.h"
#include "csrc/ops/quantized_matvec.h"
#include "csrc/python/options.h"
#include "mlx/compile_impl.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace mlx_attn {
void bind_launch_plan(nb::module_& m);  // csrc/python/launch_plan_bindings.cpp
void bind_metal_sources(nb::module_& m);  // csrc/python/metal_source_bindings.cpp
void bind_paged_metal(nb::module_& m);  // csrc/python/paged_metal_bindings.cpp
void bind_paged(nb::module_& m);  // csrc/python/paged_bindings.cpp
void bind_decode_attention(nb::module_& m);  // csrc/python/decode_bindings.cpp

namespace {

// mx.quantize's defaults, as the quantized entries always had.
constexpr AttentionOptions kQuantizedDefaults{.quantization = {8, 64}};

std::vector<int64_t> strides_of(const int64_t (&s)[4]) {
  return {s[0], s[1], s[2], s[3]};
}

// describe_attention over a call's arrays and keyword options.
AttentionProblem describe_call(const mx::array& q, const mx::array& k, const mx::array& v,
                               const std::optional<mx::array>& mask, const std::optional<mx::array>& sinks,
                               const nb::kwargs& kwargs) {
  AttentionOptions options = options_from(kwargs);
  options.has_mask = mask.has_value();
  options.has_sinks = sinks.has_value();
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) inputs.push_back(*mask);
  if (sinks) inputs.push_back(*sinks);
  return describe_attention(inputs, options);
}

void bind_problem_class(nb::module_& m) {
  nb::class_<AttentionProblem>(m, "AttentionProblem",
                               "The one description of an attention problem (csrc/core/attention_problem.h).")
      .def_ro("batch", &AttentionProblem::batch)
      .def_ro("q_heads", &AttentionProblem::q_heads)
      .def_ro("kv_heads", &AttentionProblem::kv_heads)
      .def_ro("q_len", &AttentionProblem::q_len)
      .def_ro("kv_len", &AttentionProblem::kv_len)
      .def_ro("head_dim", &AttentionProblem::head_dim)
      .def_ro("value_dim", &AttentionProblem::value_dim)
      .def_prop_ro("dtype", [](const AttentionProblem& p) { return std::string(elem_type_name(p.dtype)); })
      .def_prop_ro("q_strides", [](const AttentionProblem& p) { return strides_of(p.q_strides); })
      .def_prop_ro("k_strides", [](const AttentionProblem& p) { return strides_of(p.k_strides); })
      .def_prop_ro("v_strides", [](const AttentionProblem& p) { return strides_of(p.v_strides); })
      .def_ro("q_offset", &AttentionProblem::q_offset)
      .def_ro("k_offset", &AttentionProblem::k_offset)
      .def_ro("v_offset", &AttentionProblem::v_offset)
      .def_prop_ro("mask_strides", [](const AttentionProblem& p) { return strides_of(p.mask_strides); })
      .def_prop_ro("mask_kind", [](const AttentionProblem& p) { return int(p.mask_kind); })
      .def_ro("causal", &AttentionProblem::causal)
      .def_ro("window_size", &AttentionProblem::window_size)
      .def_ro("has_sinks", &AttentionProblem::has_sinks)
      .def_ro("sinks_stride", &AttentionProblem::sinks_stride)
      .def_ro("scale", &AttentionProblem::scale)
      .def_ro("softcap", &AttentionProblem::softcap)
      .def_ro("output_lse", &AttentionProblem::output_lse);
}

void bind_problem(nb::module_& m) {
  bind_problem_class(m);
  m.def(
      "describe_attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, std::optional<mx::array> mask,
         std::optional<mx::array> sinks, const nb::kwargs& kwargs) {
        return describe_call(q, k, v, mask, sinks, kwargs);
      },
      "q"_a, "k"_a, "v"_a, nb::kw_only(), "mask"_a = nb::none(), "sinks"_a = nb::none(), "options"_a,
      "The problem description the primitive builds from these arrays (their current strides); "
      "**options: AttentionOptions' fields.");

  m.def(
      "unsupported_reason",
      [](const AttentionProblem& problem, mx::Device::DeviceType device) -> std::optional<std::string> {
        std::string reason = unsupported_reason(problem, device);
        if (reason.empty()) return std::nullopt;
        return reason;
      },
      "problem"_a, nb::kw_only(), "device"_a,
      "None when the fused kernels of `device` (mx.cpu or mx.gpu) handle the problem, else why not.");
}

void bind_attention_support(nb::module_& m) {
  m.def(
      "attention_support",
      [](const mx::array& q, const mx::array& k, const mx::array& v, std::optional<mx::array> mask,
         std::optional<mx::array> sinks, mx::Device::DeviceType device, const nb::kwargs& kwargs) {
        const AttentionProblem problem = describe_call(q, k, v, mask, sinks, kwargs);
        nb::dict out;
        out["problem"] = problem;
        const std::string reason = unsupported_reason(problem, device);
        out["reason"] = reason.empty() ? nb::none() : nb::cast(reason);
        out["phase"] = nb::none();
        out["backward_supported"] = nb::none();
        if (reason.empty() && device == mx::Device::gpu) {  // what the self-checks vouch for
          const LaunchPlan plan = plan_attention(problem);
          out["phase"] = plan.dispatches.empty() ? "prefill" : phase_name(family_phase(plan.dispatches.front().id.family));
          out["backward_supported"] = plan_attention_backward(problem).supported;
        }
        return out;
      },
      "q"_a, "k"_a, "v"_a, nb::kw_only(), "mask"_a = nb::none(), "sinks"_a = nb::none(), "device"_a, "options"_a,
      "One question for the path choice of a call: its 'problem' (describe_attention), the 'reason' the fused "
      "kernels of `device` do not run it (None: they do) and, when the Metal kernels do, the forward kernel's "
      "'phase' and whether the Metal backward's plan takes it ('backward_supported').");
}

// The CPU quantized products of the models' linear layers (not attention).
void bind_quantized_matvecs(nb::module_& m) {
  m.def("quantized_matvec", &quantized_matvec, "x"_a, "codes"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ dequantize(codes, scales, biases).T on the CPU for a few float32 rows x [rows, k] and a 4- "
        "or 8-bit MLX affine weight: float32 [rows, n], each weight read once for all rows.");
  m.def("quantized_matvec_int8", &quantized_matvec_int8, "x"_a, "codes"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "activation_bits"_a = 8, nb::kw_only(), "stream"_a = nb::none(),
        "As quantized_matvec through integer dot products: x's rows quantized to int8 (or int16: "
        "activation_bits=16) per 32 columns, multiplied with the 4- or 8-bit codes as integers "
        "(AVX512-VNNI, AVX-VNNI, AVX2, arm64 NEON / SDOT / USMMLA or plain C++).");
  m.def("int8_matvec_copy", &int8_matvec_copy_name,
        "The integer product's copy for the active CPU kernel ISA: avx512vnni, avxvnni, avx2, neoni8mm, "
        "neondot, neon or generic.");
  m.def("quantized_matvec_int8_many", &quantized_matvec_int8_many, "x"_a, "codes"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "activation_bits"_a = 8, nb::kw_only(),
        "norm_weight"_a = nb::none(), "norm_eps"_a = 1e-5f, "gate"_a = nb::none(), "residual"_a = nb::none(),
        "stream"_a = nb::none(),
        "quantized_matvec_int8 of x against several weights of one bit width and group size (lists of "
        "codes, scales and biases): x quantized once, all products in one pass over the threads; a list "
        "of float32 [rows, n_i]. norm_weight (float32 [k]): the products take RMSNorm(x, norm_weight, "
        "norm_eps) instead of x, normalized in the same pass. gate (float32, x's shape; not with "
        "norm_weight): they take silu(gate) * x. residual (float32, the output's shape; one weight "
        "only): added to the output.");
  m.def("dequantize_affine", &dequantize_affine, "codes"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "The float32 weight [n, k] of an MLX affine-quantized one (2, 3, 4, 5, 6 or 8 bits), "
        "fma(scale, code, bias) per weight, on the CPU, in one pass that writes only the output.");
}

}  // namespace
}  // namespace mlx_attn

NB_MODULE(_ext, m) {
  m.doc() = "mlx_attn native extension: the fused attention primitive.";

  m.def(
      "fused_attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, std::optional<mx::array> mask,
         std::optional<mx::array> sinks, mx::StreamOrDevice s, const nb::kwargs& options) {
        return mlx_attn::fused_attention(q, k, v, mask, sinks, mlx_attn::options_from(options), s);
      },
      "q"_a, "k"_a, "v"_a, nb::kw_only(), "mask"_a = nb::none(), "sinks"_a = nb::none(), "stream"_a = nb::none(),
      "options"_a,
      "Fused attention; returns [out] or [out, lse]. Raises ValueError on any invalid input. **options: "
      "AttentionOptions' fields (scale, causal, window_size, output_lse, softcap, and metal_backward_trusted: "
      "whether a vjp on the GPU may run the Metal backward, its self-check passed).");

  m.def(
      "quantized_attention",
      [](const mx::array& q, const std::vector<mx::array>& k_quant, const std::vector<mx::array>& v_quant,
         std::optional<mx::array> mask, std::optional<mx::array> sinks, mx::StreamOrDevice s,
         const nb::kwargs& options) {
        return mlx_attn::quantized_attention(
            q, k_quant, v_quant, mask, sinks, mlx_attn::options_from(options, mlx_attn::kQuantizedDefaults), s)[0];
      },
      "q"_a, "k_quant"_a, "v_quant"_a, nb::kw_only(), "mask"_a = nb::none(), "sinks"_a = nb::none(),
      "stream"_a = nb::none(), "options"_a,
      "Fused attention over mx.quantize triples (bits 8, group_size 64 unless given). Raises ValueError on "
      "any invalid input.");

  m.attr("built_with_mlx") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);

  m.def("cpu_isa", [] { return std::string(mlx_attn::cpu::current_isa()); },
        "Instruction set the fused CPU kernel uses.");
  m.def("cpu_backward_copy", [] { return std::string(mlx_attn::cpu::current_backward_copy()); },
        "The fused CPU backward's kernel copy, the one that serves cpu_isa().");
  m.def("set_cpu_isa", [](const std::string& name) {
        mlx_attn::cpu::set_isa(name.c_str());
      }, "name"_a, "Use another compiled kernel copy (for tests).");
  m.def("supported_cpu_isas", [] {
        int n = 0;
        const char* const* names = mlx_attn::cpu::supported_isas(&n);
        return std::vector<std::string>(names, names + n);
      }, "Kernel instruction sets this CPU can run, widest first.");
  m.def("has_metal", &mlx_attn::metal::available, "Whether this build contains the Metal kernels.");

  m.def("forget_thread_compile_cache", [] {
        mx::detail::compile_clear_cache(mx::detail::compile_cache());
      },
      "Empty MLX's compile cache of the calling thread. Its entries hold Python "
      "objects; left to the thread's exit they are freed from a C++ thread-local "
      "destructor that takes the GIL, which aborts the process if the interpreter "
      "is already finalizing. A worker thread that ran compiled functions calls "
      "this as its last MLX step.");

  m.attr("LOG2E") = mlx_attn::kLog2e;
  m.attr("LOGIT_LIMIT") = mlx_attn::kLogitLimit;
  m.attr("MASKED_LOGIT") = mlx_attn::kMaskedLogit;
  mlx_attn::bind_options(m);
  mlx_attn::bind_problem(m);
  mlx_attn::bind_attention_support(m);
  mlx_attn::bind_launch_plan(m);
  mlx_attn::bind_metal_sources(m);
  mlx_attn::bind_paged_metal(m);
  mlx_attn::bind_paged(m);
  mlx_attn::bind_quantized_matvecs(m);
  mlx_attn::bind_decode_attention(m);
}
