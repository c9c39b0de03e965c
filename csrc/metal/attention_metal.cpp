// The Mac-only part: translate a launch plan (csrc/launch_plan.cpp, tested on
// Linux) into MLX Metal command-encoder calls. The kernels' library comes
// from csrc/metal/metal_library.cpp (compiled at run time by default).
#include "csrc/metal/attention_metal.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "csrc/launch_plan.h"
#include "csrc/metal/metal_library.h"
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

namespace {
std::string dtype_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  if (t == mx::bfloat16) return "bfloat16";
  throw std::invalid_argument("[mlx_attn] unsupported dtype for the Metal kernels");
}
void copy_strides(const mx::array& a, std::array<int64_t, 4>& out) {
  for (int i = 0; i < 4; ++i) out[i] = a.strides()[i];
}
}  // namespace

void eval_attention(
    mx::Stream stream,
    const AttentionOptions& options,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  if (options.output_lse) {
    throw std::runtime_error("[mlx_attn] the Metal kernels do not return the log-sum-exp");
  }
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  AttentionShape shape;
  shape.batch = q.shape(0);
  shape.q_heads = q.shape(1);
  shape.q_len = q.shape(2);
  shape.head_dim = q.shape(3);
  shape.kv_heads = k.shape(1);
  shape.kv_len = k.shape(2);
  shape.value_dim = v.shape(3);
  shape.dtype = dtype_name(q.dtype());
  copy_strides(q, shape.q_strides);
  copy_strides(k, shape.k_strides);
  copy_strides(v, shape.v_strides);
  const mx::array* mask = options.has_mask ? &inputs[3] : nullptr;
  if (mask) {
    copy_strides(*mask, shape.mask_strides);
    shape.mask_kind = mask->dtype() == mx::bool_ ? MLX_ATTN_MASK_BOOL : MLX_ATTN_MASK_ADDITIVE;
  }
  shape.causal = options.causal;
  shape.window_size = options.window_size;
  shape.has_sinks = options.has_sinks;
  shape.scale = options.scale;
  const LaunchPlan plan = plan_attention(shape);
  if (!plan.supported) {
    throw std::runtime_error("[mlx_attn] Metal kernels: " + plan.reason);
  }

  auto& device = mx::metal::device(stream.device);
  auto& encoder = mx::metal::get_command_encoder(stream);
  std::vector<std::pair<std::string, mx::array>> scratch;
  for (const auto& buffer : plan.scratch) {
    mx::array temporary({int(buffer.elements)}, mx::float32, nullptr, {});
    temporary.set_data(mx::allocator::malloc(temporary.nbytes()));
    scratch.emplace_back(buffer.name, temporary);
  }
  auto scratch_array = [&](const std::string& name) -> mx::array* {
    for (auto& [key, array] : scratch) {
      if (key == name) return &array;
    }
    return nullptr;
  };
  for (const auto& dispatch : plan.dispatches) {
    encoder.set_compute_pipeline_state(
        device.get_kernel(dispatch.kernel, kernel_library(device, dispatch.kernel)));
    for (int i = 0; i < int(dispatch.buffers.size()); ++i) {
      const std::string& name = dispatch.buffers[i];
      if (name == "q") encoder.set_input_array(q, i);
      else if (name == "k") encoder.set_input_array(k, i);
      else if (name == "v") encoder.set_input_array(v, i);
      else if (name == "out") encoder.set_output_array(out, i);
      else if (name == "params") encoder.set_bytes(plan.params, i);
      else if (name == "mask") encoder.set_input_array(mask ? *mask : q, i);  // q: an unread placeholder
      else if (name == "sinks") encoder.set_input_array(options.has_sinks ? inputs.back() : q, i);
      else if (name == "splits") encoder.set_bytes(plan.splits, i);
      else if (mx::array* buffer = scratch_array(name)) {
        // written by the first dispatch, read by the second
        if (&dispatch == &plan.dispatches.front()) encoder.set_output_array(*buffer, i);
        else encoder.set_input_array(*buffer, i);
      }
      else throw std::logic_error("[mlx_attn] unknown buffer " + name + " in a launch plan");
    }
    encoder.dispatch_threadgroups(
        MTL::Size(dispatch.grid[0], dispatch.grid[1], dispatch.grid[2]),
        MTL::Size(dispatch.threadgroup[0], dispatch.threadgroup[1], dispatch.threadgroup[2]));
  }
  for (auto& [name, array] : scratch) encoder.add_temporary(std::move(array));
}

}  // namespace mlx_attn::metal
