// Exposes the launch plan to Python (tests, the emulator runner).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
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

// A kernel's identity as Python sees it: what it reads instead of a name.
nb::dict kernel_id_dict(const KernelId& id) {
  nb::dict out;
  out["family"] = family_name(id.family);
  out["phase"] = phase_name(family_phase(id.family));
  out["dtype"] = elem_type_name(id.dtype);
  nb::dict fields;
  for (const auto& [tag, value] : id.fields) fields[tag.c_str()] = value;
  out["fields"] = fields;
  out["mask"] = int(id.mask);
  return out;
}

// A plan as Python sees it (tests, the emulator runner).
nb::dict plan_dict(const LaunchPlan& plan) {
  nb::dict out;
  out["supported"] = plan.supported;
  out["reason"] = plan.reason;
  out["params"] = nb::bytes(reinterpret_cast<const char*>(&plan.params), sizeof(AttentionParams));
  out["vector_loads"] = plan.params.vector_loads != 0;
  nb::list dispatches;
  for (const auto& d : plan.dispatches) {
    nb::dict entry;
    entry["kernel"] = d.id.name();
    entry["id"] = kernel_id_dict(d.id);
    entry["grid"] = d.grid;
    entry["threadgroup"] = d.threadgroup;
    nb::list bindings;
    for (const auto& b : d.bindings) {
      nb::dict binding;
      binding["index"] = b.index;
      binding["role"] = role_name(b.role);
      binding["access"] = b.access == Access::write ? "write" : "read";
      binding["source"] = source_name(b.source);
      binding["source_index"] = b.source_index;
      bindings.append(binding);
    }
    entry["bindings"] = bindings;
    entry["threadgroup_memory_bytes"] = d.threadgroup_memory_bytes;
    dispatches.append(entry);
  }
  out["dispatches"] = dispatches;
  out["splits"] = plan.splits;
  nb::list scratch;
  for (const auto& buffer : plan.scratch) {
    nb::dict entry;
    entry["role"] = role_name(buffer.role);
    entry["elements"] = buffer.elements;
    entry["producer"] = buffer.producer;
    entry["consumer"] = buffer.consumer;
    scratch.append(entry);
  }
  out["scratch"] = scratch;
  out["quantized_params"] = nb::bytes(reinterpret_cast<const char*>(plan.quantized_params.data()),
                                    plan.quantized_params.size());
  out["sequences"] = nb::bytes(reinterpret_cast<const char*>(plan.sequences.data()), plan.sequences.size());
  return out;
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

nb::dict launch_plan_dict(const LaunchPlan& plan) { return plan_dict(plan); }

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
  bind_gpu_targets(m);
  m.def(
      "parse_kernel_id",
      [](const std::string& name) -> std::optional<nb::dict> {
        const auto id = parse_kernel_id(name);
        if (!id) return std::nullopt;
        return kernel_id_dict(*id);
      },
      "name"_a,
      "The identity (family, phase, dtype, fields, mask) a kernel host name spells, as a plan's dispatch "
      "'id'; None for a name that spells none (csrc/metal/kernel_id.h: the one reader of names).");
  m.def(
      "metal_launch_plan",
      [](const AttentionProblem& problem, const std::string& gpu_family, int gpu_cores,
         const std::string& decode_shape) {
        const LaunchPlan plan = plan_attention(problem, gpu_target_argument(gpu_family, gpu_cores),
                                               decode_shape_choice(decode_shape));
        nb::dict out = plan_dict(plan);
        out["gpu_family"] = gpu_family_name(plan.target.family);
        out["gpu_cores"] = plan.target.gpu_cores;
        return out;
      },
      "problem"_a, "gpu_family"_a = "unknown", "gpu_cores"_a = 0, "decode_shape"_a = "auto",
      "The Metal launch plan for a problem (_ext.describe_attention) on a GPU family (apple7, apple8, "
      "apple9, apple10, unknown = the conservative default) with gpu_cores cores (0: the family's base part); "
      "decode_shape: the dense decode's threadgroup shape, 'auto' (the plan's rule), 'group' or 'row': "
      "kernels, grids, threadgroups, params bytes, and per dispatch its bindings (index, role, access, "
      "source, source_index) exactly as the Mac host encodes them.");
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
        nb::dict out = plan_dict(plan_quantized_attention(problem, kv, target, choice));
        out["problem"] = nb::cast(problem);
        return out;
      },
      "q"_a, "k_quant"_a, "v_quant"_a, nb::kw_only(), "mask"_a = nb::none(), "sinks"_a = nb::none(),
      "gpu_family"_a = "unknown", "gpu_cores"_a = 0, "decode_shape"_a = "auto", "options"_a,
      "The Metal launch plan over quantized K/V for these arrays (their current strides; scales and biases in "
      "q's dtype), as metal_launch_plan (for the gpu_family's tiles and decode_shape), plus 'quantized_params' "
      "bytes and the 'problem'.");
  m.attr("QUANTIZED_ATTENTION_PARAMS_BYTES") = int(sizeof(QuantizedAttentionParams));
  m.def(
      "metal_backward_launch_plan",
      [](const AttentionProblem& problem) { return plan_dict(plan_attention_backward(problem)); },
      "problem"_a,
      "The Metal backward's launch plan for a forward problem (_ext.describe_attention), in "
      "metal_launch_plan's format; bindings index the backward primitive's inputs (q, k, v, [mask], "
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
