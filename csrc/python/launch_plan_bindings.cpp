// Exposes the launch plan to Python (tests, the emulator runner).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "csrc/metal/backward_launch_plan.h"
#include "csrc/metal/launch_plan.h"
#include "csrc/ops/quantized_attention.h"
#include "csrc/metal/quantized_launch_plan.h"
#include "csrc/python/options.h"
#include "metal/attention_quantized_params.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_attn {

namespace {

// A kernel id's fields as Python sees them: tag -> value, in name order.
nb::dict kernel_fields(const KernelId& id) {
  nb::dict fields;
  for (const auto& [tag, value] : id.fields) fields[tag.c_str()] = value;
  return fields;
}

nb::bytes as_bytes(const void* data, size_t size) {
  return nb::bytes(reinterpret_cast<const char*>(data), size);
}

// A kernel's identity: what Python reads instead of a name.
void bind_kernel_id(nb::module_& m) {
  nb::class_<KernelId>(m, "KernelId", "A kernel's identity (csrc/metal/kernel_id.h).")
      .def_prop_ro("family", [](const KernelId& id) { return std::string(family_name(id.family)); })
      .def_prop_ro("phase", [](const KernelId& id) { return std::string(phase_name(family_phase(id.family))); })
      .def_prop_ro("dtype", [](const KernelId& id) { return std::string(elem_type_name(id.dtype)); })
      .def_prop_ro("fields", &kernel_fields, "tag -> value, in name order (d, bk, ...)")
      .def_prop_ro("mask", [](const KernelId& id) { return int(id.mask); })
      .def_prop_ro("name", &KernelId::name, "its host name in mlx_attn.metallib")
      .def("__eq__", [](const KernelId& a, const KernelId& b) { return a.name() == b.name(); })
      .def("__hash__", [](const KernelId& id) { return nb::hash(nb::str(id.name().c_str())); })
      .def("__repr__", [](const KernelId& id) { return "KernelId(" + id.name() + ")"; });
}

// A plan as Python sees it (tests, the emulator runner, the benchmarks):
// typed, read-only views of the C++ structs.
void bind_plan_types(nb::module_& m) {
  bind_kernel_id(m);
  nb::class_<Binding>(m, "Binding", "One buffer binding of a dispatch.")
      .def_ro("index", &Binding::index)
      .def_prop_ro("role", [](const Binding& b) { return std::string(role_name(b.role)); })
      .def_prop_ro("access", [](const Binding& b) { return std::string(b.access == Access::write ? "write" : "read"); })
      .def_prop_ro("source", [](const Binding& b) { return std::string(source_name(b.source)); })
      .def_ro("source_index", &Binding::source_index);
  nb::class_<KernelDispatch>(m, "KernelDispatch", "One kernel launch of a plan.")
      .def_ro("id", &KernelDispatch::id)
      .def_prop_ro("kernel", [](const KernelDispatch& d) { return d.id.name(); }, "the kernel's host name")
      .def_ro("grid", &KernelDispatch::grid)
      .def_ro("threadgroup", &KernelDispatch::threadgroup)
      .def_ro("bindings", &KernelDispatch::bindings)
      .def_ro("threadgroup_memory_bytes", &KernelDispatch::threadgroup_memory_bytes);
  nb::class_<ScratchBuffer>(m, "ScratchBuffer", "A float32 buffer a plan allocates for one call.")
      .def_prop_ro("role", [](const ScratchBuffer& b) { return std::string(role_name(b.role)); })
      .def_ro("elements", &ScratchBuffer::elements)
      .def_ro("producer", &ScratchBuffer::producer)
      .def_ro("consumer", &ScratchBuffer::consumer)
      .def_ro("writers", &ScratchBuffer::writers);
  nb::class_<LaunchPlan>(m, "LaunchPlan", "How the Metal kernels run a problem (csrc/metal/launch_plan.h).")
      .def_ro("supported", &LaunchPlan::supported)
      .def_ro("reason", &LaunchPlan::reason)
      .def_ro("problem", &LaunchPlan::problem)
      .def_prop_ro("gpu_family", [](const LaunchPlan& p) { return std::string(gpu_family_name(p.target.family)); })
      .def_prop_ro("gpu_cores", [](const LaunchPlan& p) { return p.target.gpu_cores; })
      .def_prop_ro("params", [](const LaunchPlan& p) { return as_bytes(&p.params, sizeof(AttentionParams)); },
                   "the AttentionParams bytes")
      .def_prop_ro("vector_loads", [](const LaunchPlan& p) { return p.params.vector_loads != 0; })
      .def_ro("dispatches", &LaunchPlan::dispatches)
      .def_ro("splits", &LaunchPlan::splits)
      .def_ro("scratch", &LaunchPlan::scratch)
      .def_prop_ro("quantized_params",
                   [](const LaunchPlan& p) { return as_bytes(p.quantized_params.data(), p.quantized_params.size()); })
      .def_prop_ro("sequences", [](const LaunchPlan& p) { return as_bytes(p.sequences.data(), p.sequences.size()); })
      .def_prop_ro("cascade_groups",
                   [](const LaunchPlan& p) { return as_bytes(p.cascade_groups.data(), p.cascade_groups.size()); })
      .def_prop_ro("cascade_rows",
                   [](const LaunchPlan& p) { return as_bytes(p.cascade_rows.data(), p.cascade_rows.size()); })
      .def_ro("keys_per_split", &LaunchPlan::keys_per_split);
}

// The GPU a plan is for, from the bindings' gpu_family / gpu_cores arguments.
GpuTarget gpu_target_argument(const std::string& gpu_family, int gpu_cores) {
  GpuTarget target;
  if (!gpu_family_from_name(gpu_family, target.family)) {
    throw nb::value_error(("gpu_family must be one of apple7, apple8, apple9, apple10, unknown; got '" + gpu_family + "'").c_str());
  }
  if (gpu_cores < 0) {
    throw nb::value_error(("gpu_cores must be >= 0 (0: the family's base part), got " + std::to_string(gpu_cores)).c_str());
  }
  target.gpu_cores = gpu_cores;
  return target;
}

}  // namespace

DecodeShapeChoice decode_shape_choice(const std::string& name) {
  if (name == "auto") return DecodeShapeChoice::automatic;
  if (name == "group") return DecodeShapeChoice::group;
  if (name == "row") return DecodeShapeChoice::row;
  throw nb::value_error(("decode_shape must be 'auto', 'group' or 'row'; got '" + name + "'").c_str());
}

namespace {

// The GPU targets a plan can be made for and the per-target rules it reads.
void bind_gpu_targets(nb::module_& m) {
  m.def(
      "gpu_target_from_architecture",
      [](const std::string& architecture) {
        const GpuTarget target = gpu_target_from_architecture(architecture);
        nb::dict out;
        out["gpu_family"] = gpu_family_name(target.family);
        out["gpu_cores"] = target.gpu_cores;
        return out;
      },
      "architecture"_a,
      "The plan's GPU target for an MLX Metal architecture name (mx.metal.device_info()['architecture'], "
      "e.g. 'applegpu_g14g'): family and the tier's smallest core count (0: not known).");
  m.def(
      "gpu_family_table",
      [] {
        nb::list rows;
        for (GpuFamily family : {GpuFamily::unknown, GpuFamily::apple7, GpuFamily::apple8, GpuFamily::apple9,
                                  GpuFamily::apple10}) {
          const GpuTuning& row = gpu_tuning(family);
          nb::dict entry;
          entry["gpu_family"] = row.name;
          entry["base_cores"] = row.base_cores;
          entry["prefill_simdgroups"] = row.prefill_simdgroups;
          nb::dict blocks;
          for (int i = 0; i < int(kHeadDims.size()); ++i) {
            blocks[nb::int_(kHeadDims[i])] = nb::make_tuple(row.prefill_key_block_16[i], row.prefill_key_block_32[i]);
          }
          entry["prefill_key_block"] = blocks;  // D -> (2-byte dtypes, float32)
          entry["decode_threadgroups_per_core"] = row.decode_threadgroups_per_core;
          rows.append(entry);
        }
        return rows;
      },
      "The launch plan's per-GPU-family table (docs/metal_kernels.md).");
  m.def(
      "metal_decode_shapes",
      [](int batch, int kv_heads, int rows, int kv_len, int head_dim, const std::string& gpu_family, int gpu_cores,
         bool dequantized) {
        const GpuTarget target = gpu_target_argument(gpu_family, gpu_cores);
        const DecodeKeys keys = dequantized ? DecodeKeys::dequantized : DecodeKeys::plain;
        const DecodeShape chosen =
            decode_shape(batch, kv_heads, rows, kv_len, head_dim, target, DecodeShapeChoice::automatic, {}, keys);
        nb::dict out;
        for (auto [name, shape] : {std::pair{"group", decode_group_shape(head_dim)},
                                   std::pair{"row", decode_row_shape(head_dim)}}) {
          nb::dict entry;
          entry["rows"] = shape.rows;
          entry["simdgroups"] = shape.simdgroups;
          entry["splits"] = shape.rows > 0 ? decode_splits(batch, kv_heads, rows, kv_len, shape, target, keys) : 0;
          entry["chosen"] = shape.rows > 0 && shape.rows == chosen.rows && shape.simdgroups == chosen.simdgroups;
          out[name] = entry;
        }
        return out;
      },
      "batch"_a, "kv_heads"_a, "rows"_a, "kv_len"_a, "head_dim"_a, "gpu_family"_a = "unknown", "gpu_cores"_a = 0,
      "dequantized"_a = false,
      "The dense decode's two threadgroup shapes for a problem (rows = query heads per KV head x query "
      "positions): per shape its rows, simdgroups and split count (decode_splits), and which one the plan "
      "chooses (decode_shape; dequantized: the quantized decodes' splits and choice, which takes the row shape "
      "at one row). The paged decodes choose alike, each shape's splits capped by its page window.");
}

}  // namespace

void bind_launch_plan(nb::module_& m) {
  bind_plan_types(m);
  bind_gpu_targets(m);
  m.def(
      "parse_kernel_id",
      [](const std::string& name) { return parse_kernel_id(name); },
      "name"_a,
      "The identity (family, phase, dtype, fields, mask) a kernel host name spells, as a plan's dispatch "
      "'id'; None for a name that spells none (csrc/metal/kernel_id.h: the one reader of names).");
  m.def(
      "metal_launch_plan",
      [](const AttentionProblem& problem, const std::string& gpu_family, int gpu_cores,
         const std::string& decode_shape) {
        return plan_attention(problem, gpu_target_argument(gpu_family, gpu_cores), decode_shape_choice(decode_shape));
      },
      "problem"_a, "gpu_family"_a = "unknown", "gpu_cores"_a = 0, "decode_shape"_a = "auto",
      "The Metal launch plan for a problem (_ext.describe_attention) on a GPU family (apple7, apple8, "
      "apple9, apple10, unknown = the conservative default) with gpu_cores cores (0: the family's base part); "
      "decode_shape: the dense decode's threadgroup shape, 'auto' (the plan's rule), 'group' or 'row'. A "
      "LaunchPlan: its dispatches (kernel id, grid, threadgroup, bindings: index, role, access, source, "
      "source_index), params bytes and scratch, exactly as the Mac host encodes them.");
  m.def(
      "quantized_metal_launch_plan",
      [](const mx::array& q, const std::vector<mx::array>& k_quant, const std::vector<mx::array>& v_quant,
         std::optional<mx::array> mask, std::optional<mx::array> sinks, const std::string& gpu_family,
         int gpu_cores, const std::string& decode_shape, const nb::kwargs& kwargs) {
        const GpuTarget target = gpu_target_argument(gpu_family, gpu_cores);
        const DecodeShapeChoice choice = decode_shape_choice(decode_shape);
        if (k_quant.size() != 3 || v_quant.size() != 3) {
          throw std::invalid_argument("k_quant and v_quant must be (packed, scales, biases) triples");
        }
        AttentionOptions options = options_from(kwargs, {.quantization = {8, 64}});
        options.causal = options.causal || options.window_size > 0;
        options.has_mask = mask.has_value();
        options.has_sinks = sinks.has_value();
        std::vector<mx::array> inputs = {q};
        inputs.insert(inputs.end(), k_quant.begin(), k_quant.end());
        inputs.insert(inputs.end(), v_quant.begin(), v_quant.end());
        if (mask) inputs.push_back(*mask);
        if (sinks) inputs.push_back(*sinks);
        const auto [problem, kv] = describe_quantized_attention(inputs, options);
        return plan_quantized_attention(problem, kv, target, choice);
      },
      "q"_a, "k_quant"_a, "v_quant"_a, nb::kw_only(), "mask"_a = nb::none(), "sinks"_a = nb::none(),
      "gpu_family"_a = "unknown", "gpu_cores"_a = 0, "decode_shape"_a = "auto", "options"_a,
      "The Metal launch plan over quantized K/V for these arrays (their current strides; scales and biases in "
      "q's dtype), as metal_launch_plan (for the gpu_family's tiles and decode_shape), with its quantized_params "
      "bytes and the problem it was made for.");
  m.attr("QUANTIZED_ATTENTION_PARAMS_BYTES") = int(sizeof(QuantizedAttentionParams));
  m.def(
      "metal_backward_launch_plan",
      [](const AttentionProblem& problem) { return plan_attention_backward(problem); },
      "problem"_a,
      "The Metal backward's launch plan for a forward problem (_ext.describe_attention), a "
      "LaunchPlan as metal_launch_plan's; bindings index the backward primitive's inputs (q, k, v, [mask], "
      "[sinks], out, lse, d_out, d_lse) and outputs (dq, dk, dv, [d_sinks]).");
  m.def(
      "buffer_role_names",
      [] {
        std::vector<std::string> names;
        for (int i = 0; i < kBufferRoleCount; ++i) names.push_back(role_name(BufferRole(i)));
        return names;
      },
      "Every BufferRole of the launch plans, in declaration order (docs/architecture.md lists them).");
  m.attr("MASK_NONE") = MLX_ATTN_MASK_NONE;
  m.attr("MASK_BOOL") = MLX_ATTN_MASK_BOOL;
  m.attr("MASK_ADDITIVE") = MLX_ATTN_MASK_ADDITIVE;
  m.attr("ATTENTION_PARAMS_BYTES") = int(sizeof(AttentionParams));
}

}  // namespace mlx_attn
