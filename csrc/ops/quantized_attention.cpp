#include "csrc/ops/quantized_attention.h"
#include "csrc/core/argument_checks.h"

#include <stdexcept>
#include <string>

#include "csrc/metal/backend.h"
#include "csrc/metal/quantized_launch_plan.h"

namespace mlx_attn {

namespace {

[[noreturn]] void invalid(const std::string& message) {
  throw_invalid("mlx_attn.quantized_attention", message);
}

// The features one (packed, scales, biases) triple holds, after checking it.
int check_triple(const char* name, const mx::array* t, mx::Dtype dtype, const Quantization& qz) {
  const char* parts[] = {"packed", "scales", "biases"};
  for (int i = 0; i < 3; ++i) {
    if (t[i].ndim() != 4) {
      invalid(std::string(name) + " " + parts[i] + " must have rank 4, got shape " + shape_string(t[i]));
    }
  }
  if (t[0].dtype() != mx::uint32) invalid(std::string(name) + " packed must be uint32");
  if (t[1].dtype() != dtype || t[2].dtype() != dtype) {
    invalid(std::string(name) + " scales and biases must have q's dtype");
  }
  if (t[1].shape() != t[2].shape()) invalid(std::string(name) + " scales and biases need one shape");
  const int features = t[0].shape(3) * (32 / qz.bits);
  for (int axis = 0; axis < 3; ++axis) {
    if (t[1].shape(axis) != t[0].shape(axis)) {
      invalid(std::string(name) + " packed " + shape_string(t[0]) + " and scales " + shape_string(t[1]) +
              " disagree on [batch, heads, length]");
    }
  }
  if (features == 0 || features % qz.group_size != 0 || t[1].shape(3) != features / qz.group_size) {
    invalid(std::string(name) + " packed " + shape_string(t[0]) + " and scales " + shape_string(t[1]) +
            " do not match bits=" + std::to_string(qz.bits) + ", group_size=" + std::to_string(qz.group_size));
  }
  return features;
}

}  // namespace

std::pair<AttentionProblem, cpu::QuantizedKV> describe_quantized_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options) {
  const Quantization& qz = options.quantization;
  const size_t expected = 7 + options.has_mask + options.has_sinks;
  if (inputs.size() != expected) {
    invalid("expected " + std::to_string(expected) + " inputs, got " + std::to_string(inputs.size()));
  }
  if (qz.bits != 4 && qz.bits != 8) invalid("bits must be 4 or 8, got " + std::to_string(qz.bits));
  if (qz.group_size != 32 && qz.group_size != 64 && qz.group_size != 128) {
    invalid("group_size must be 32, 64 or 128, got " + std::to_string(qz.group_size));
  }
  const mx::array& q = inputs[0];
  const int head_dim = check_triple("k_quant", &inputs[1], q.dtype(), qz);
  const int value_dim = check_triple("v_quant", &inputs[4], q.dtype(), qz);
  // The float problem these triples stand for: shapes only, never evaluated.
  auto stand_in = [&](const mx::array& packed, int features) {
    return mx::array({packed.shape(0), packed.shape(1), packed.shape(2), features}, q.dtype(), nullptr, {});
  };
  std::vector<mx::array> described = {q, stand_in(inputs[1], head_dim), stand_in(inputs[4], value_dim)};
  described.insert(described.end(), inputs.begin() + 7, inputs.end());
  AttentionProblem problem = describe_attention(described, options);
  cpu::QuantizedKV kv;
  kv.bits = qz.bits;
  kv.group_size = qz.group_size;
  for (int i = 0; i < 4; ++i) {
    problem.k_strides[i] = inputs[1].strides()[i];
    problem.v_strides[i] = inputs[4].strides()[i];
    kv.k_scale_strides[i] = inputs[2].strides()[i];
    kv.k_bias_strides[i] = inputs[3].strides()[i];
    kv.v_scale_strides[i] = inputs[5].strides()[i];
    kv.v_bias_strides[i] = inputs[6].strides()[i];
  }
  return {problem, kv};
}

std::string quantized_unsupported_reason(
    const AttentionProblem& problem, const cpu::QuantizedKV& quantized, mx::Device::DeviceType device) {
  if (device == mx::Device::gpu) {
    return metal::available() ? plan_quantized_attention(problem, quantized).reason : metal::kNoMetalReason;
  }
  return unsupported_reason(problem, mx::Device::cpu);
}

std::vector<mx::array> quantized_attention(
    const mx::array& q,
    const std::vector<mx::array>& k_quant,
    const std::vector<mx::array>& v_quant,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s) {
  if (k_quant.size() != 3 || v_quant.size() != 3) {
    invalid("k_quant and v_quant must be (packed, scales, biases) triples");
  }
  if (options.output_lse) invalid("the log-sum-exp output is not offered over quantized K/V");
  options.has_mask = mask.has_value();
  options.has_sinks = sinks.has_value();
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), k_quant.begin(), k_quant.end());
  inputs.insert(inputs.end(), v_quant.begin(), v_quant.end());
  if (mask) inputs.push_back(*mask);
  if (sinks) inputs.push_back(*sinks);
  const auto [problem, kv] = describe_quantized_attention(inputs, options);
  auto stream = mx::to_stream(s);
  if (std::string reason = quantized_unsupported_reason(problem, kv, stream.device.type); !reason.empty()) {
    invalid(reason);
  }
  auto primitive = std::make_shared<QuantizedAttention>(stream, options);
  auto shapes = primitive->output_shapes(inputs);
  return mx::array::make_arrays(std::move(shapes), {q.dtype()}, primitive, inputs);
}

void QuantizedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  cpu::KernelCall call{};
  std::tie(call.problem, call.quantized) = describe_quantized_attention(inputs, options_);
  if (outputs[0].size() == 0) return;
  call.q = inputs[0].data<void>();
  call.k = inputs[1].data<void>();
  call.quantized.k_scales = inputs[2].data<void>();
  call.quantized.k_biases = inputs[3].data<void>();
  call.v = inputs[4].data<void>();
  call.quantized.v_scales = inputs[5].data<void>();
  call.quantized.v_biases = inputs[6].data<void>();
  size_t next = 7;
  if (options_.has_mask) call.mask = inputs[next++].data<void>();
  if (options_.has_sinks) call.sinks = inputs[next++].data<void>();
  call.out = outputs[0].data<void>();
  run_cpu_kernel(call, inputs, outputs, stream());
}

LaunchPlan QuantizedAttention::launch_plan(const std::vector<mx::array>& inputs, const GpuTarget& target) const {
  const auto [problem, kv] = describe_quantized_attention(inputs, options_);
  return plan_quantized_attention(problem, kv, target);
}

}  // namespace mlx_attn
