// The Mac-only part: encode a launch plan (csrc/metal/launch_plan.cpp, tested on
// Linux) with MLX's Metal command encoder. The plan decides every kernel,
// grid and binding (placeholders and scratch access included); this loop
// only looks each binding's memory up. The kernels' library comes from
// csrc/metal/metal_library.cpp (compiled at run time by default).
#include "csrc/metal/attention_metal.h"

#include <dlfcn.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>

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

GpuTarget gpu_target(mx::Stream stream) {
  return gpu_target_from_architecture(mx::metal::device(stream.device).get_architecture());
}

void encode_launch_plan(
    mx::Stream stream,
    const LaunchPlan& plan,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  if (!plan.supported) {
    throw std::runtime_error("[mlx_attn] Metal kernels: " + plan.reason);
  }
  std::vector<mx::array> scratch;
  for (const auto& buffer : plan.scratch) {
    scratch.emplace_back(mx::Shape{int(buffer.elements)}, mx::float32, nullptr, std::vector<mx::array>{});
    scratch.back().set_data(mx::allocator::malloc(scratch.back().nbytes()));
  }
  // a paged plan's per-sequence parameters (and a cascade's groups and
  // rows): buffers (setBytes stops at 4 KB)
  const auto bytes_buffer = [](const std::vector<uint8_t>& bytes) {
    mx::array buffer(mx::Shape{int(bytes.size())}, mx::uint8, nullptr, std::vector<mx::array>{});
    if (!bytes.empty()) {
      buffer.set_data(mx::allocator::malloc(buffer.nbytes()));
      std::memcpy(buffer.data<uint8_t>(), bytes.data(), bytes.size());
    }
    return buffer;
  };
  mx::array sequences = bytes_buffer(plan.sequences);
  mx::array cascade_groups = bytes_buffer(plan.cascade_groups);
  mx::array cascade_rows = bytes_buffer(plan.cascade_rows);

  auto& device = mx::metal::device(stream.device);
  auto& encoder = mx::metal::get_command_encoder(stream);
  for (const auto& dispatch : plan.dispatches) {
    encoder.set_compute_pipeline_state(
        device.get_kernel(dispatch.id.name(), kernel_library(device, dispatch.id.name())));
    for (const auto& b : dispatch.bindings) {
      switch (b.source) {
        case Source::input: encoder.set_input_array(inputs[b.source_index], b.index); break;
        case Source::output: encoder.set_output_array(outputs[b.source_index], b.index); break;
        case Source::scratch:
          if (b.access == Access::write) encoder.set_output_array(scratch[b.source_index], b.index);
          else encoder.set_input_array(scratch[b.source_index], b.index);
          break;
        case Source::params: encoder.set_bytes(plan.params, b.index); break;
        case Source::splits: encoder.set_bytes(plan.splits, b.index); break;
        case Source::quantized_params:
          encoder.set_bytes(plan.quantized_params.data(), int(plan.quantized_params.size()), b.index);
          break;
        case Source::sequences: encoder.set_input_array(sequences, b.index); break;
        case Source::cascade_groups: encoder.set_input_array(cascade_groups, b.index); break;
        case Source::cascade_rows: encoder.set_input_array(cascade_rows, b.index); break;
      }
    }
    encoder.dispatch_threadgroups(
        MTL::Size(dispatch.grid[0], dispatch.grid[1], dispatch.grid[2]),
        MTL::Size(dispatch.threadgroup[0], dispatch.threadgroup[1], dispatch.threadgroup[2]));
  }
  for (auto& buffer : scratch) encoder.add_temporary(std::move(buffer));
  if (!plan.sequences.empty()) encoder.add_temporary(std::move(sequences));
  if (!plan.cascade_groups.empty()) encoder.add_temporary(std::move(cascade_groups));
  if (!plan.cascade_rows.empty()) encoder.add_temporary(std::move(cascade_rows));
}

}  // namespace mlx_attn::metal
