// The Mac-only part: translate a launch plan (csrc/launch_plan.cpp, tested on
// Linux) into MLX Metal command-encoder calls. mlx_attn.metallib is loaded
// from next to the extension binary, as in MLX's extension example.
#include "csrc/metal/attention_metal.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "csrc/launch_plan.h"
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
    const AttentionProblem& problem,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  const mx::array* mask = problem.mask_kind != MaskKind::none ? &inputs[3] : nullptr;
  const LaunchPlan plan = plan_attention(problem);
  if (!plan.supported) {
    throw std::runtime_error("[mlx_attn] Metal kernels: " + plan.reason);
  }

  auto& device = mx::metal::device(stream.device);
  auto* library = device.get_library("mlx_attn", binary_dir());
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
    encoder.set_compute_pipeline_state(device.get_kernel(dispatch.kernel, library));
    for (int i = 0; i < int(dispatch.buffers.size()); ++i) {
      const std::string& name = dispatch.buffers[i];
      if (name == "q") encoder.set_input_array(q, i);
      else if (name == "k") encoder.set_input_array(k, i);
      else if (name == "v") encoder.set_input_array(v, i);
      else if (name == "out") encoder.set_output_array(out, i);
      else if (name == "params") encoder.set_bytes(plan.params, i);
      else if (name == "mask") encoder.set_input_array(mask ? *mask : q, i);  // q: an unread placeholder
      else if (name == "sinks") encoder.set_input_array(problem.has_sinks ? inputs.back() : q, i);
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
