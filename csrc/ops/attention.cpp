#include "csrc/ops/attention.h"
#include "csrc/core/argument_checks.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "csrc/metal/backward_launch_plan.h"
#include "csrc/cpu/backward_host.h"
#include "csrc/cpu/host.h"
#include "csrc/ops/reference_graph.h"
#include "csrc/metal/backend.h"
#include "csrc/metal/launch_plan.h"
#include "mlx/backend/cpu/encoder.h"


namespace mlx_attn {

namespace {

[[noreturn]] void invalid(const std::string& message) {
  throw_invalid("mlx_attn.fused_attention", message);
}

// An invariant the kernels rely on: a terse statement of it, not a message
// for users (mlx_attn.ops.AttentionCall validates the public contract and
// words its errors; these guard direct callers of _ext).
void require(bool holds, const std::string& invariant, const std::string& detail = "") {
  if (holds) return;
  invalid("internal check failed: " + invariant + (detail.empty() ? "" : " (" + detail + ")") +
          "; mlx_attn.scaled_dot_product_attention validates its arguments");
}

ElemType elem_type(mx::Dtype t) {
  const std::optional<ElemType> type = float_elem_type(t);
  require(type.has_value(), "q.dtype in {float32, float16, bfloat16}", dtype_string(t));
  return *type;
}

void copy_strides(const mx::array& a, int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = a.strides()[i];
}

// The mask's strides as a [B, Hq, Tq, Tkv] view: missing leading dims and
// size-1 dims read with stride 0.
void broadcast_strides(const mx::array& mask, const int (&target)[4], int64_t* out) {
  const int lead = 4 - mask.ndim();
  for (int i = 0; i < 4; ++i) {
    const int axis = i - lead;
    if (axis < 0 || mask.shape(axis) == 1) {
      out[i] = 0;
    } else if (mask.shape(axis) == target[i]) {
      out[i] = mask.strides()[axis];
    } else {
      require(false, "mask broadcasts to [B, Hq, Tq, Tkv]",
              shape_string(mask) + " against [" + std::to_string(target[0]) + ", " + std::to_string(target[1]) +
                  ", " + std::to_string(target[2]) + ", " + std::to_string(target[3]) + "]");
    }
  }
}

}  // namespace

AttentionProblem describe_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options) {
  const size_t expected = 3 + options.has_mask + options.has_sinks;
  require(inputs.size() == expected, "inputs are q, k, v, [mask], [sinks]",
          std::to_string(inputs.size()) + " given, " + std::to_string(expected) + " expected");
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const char* names[] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    require(inputs[i].ndim() == 4, std::string(names[i]) + ".ndim == 4", shape_string(inputs[i]));
  }
  AttentionProblem p{};
  p.dtype = elem_type(q.dtype());
  require(k.dtype() == q.dtype() && v.dtype() == q.dtype(), "k.dtype == v.dtype == q.dtype");
  p.batch = q.shape(0);
  p.q_heads = q.shape(1);
  p.q_len = q.shape(2);
  p.head_dim = q.shape(3);
  p.kv_heads = k.shape(1);
  p.kv_len = k.shape(2);
  p.value_dim = v.shape(3);
  const std::string shapes = "q " + shape_string(q) + ", k " + shape_string(k) + ", v " + shape_string(v);
  require(k.shape(0) == p.batch && v.shape(0) == p.batch, "one batch size for q, k, v", shapes);
  require(v.shape(1) == p.kv_heads && v.shape(2) == p.kv_len, "k and v: same heads and length", shapes);
  require(k.shape(3) == p.head_dim, "q and k: same head dim", shapes);
  require(p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0, "q heads a multiple of k/v heads", shapes);
  p.group = p.q_heads / p.kv_heads;
  // "a window implies causal" is normalised once, by the caller (Python's AttentionCall)
  if (const char* broken = set_option_params(p, options)) require(false, broken);
  copy_strides(q, p.q_strides);
  copy_strides(k, p.k_strides);
  copy_strides(v, p.v_strides);
  p.q_offset = q.offset() / int64_t(q.itemsize());
  p.k_offset = k.offset() / int64_t(k.itemsize());
  p.v_offset = v.offset() / int64_t(v.itemsize());
  p.mask_kind = MaskKind::none;
  size_t next = 3;
  if (options.has_mask) {
    const auto& mask = inputs[next++];
    require(mask.ndim() <= 4, "mask.ndim <= 4", shape_string(mask));
    require(mask.dtype() == mx::bool_ || mask.dtype() == q.dtype(), "mask.dtype is bool or q.dtype");
    p.mask_kind = mask.dtype() == mx::bool_ ? MaskKind::boolean : MaskKind::additive;
    broadcast_strides(mask, {p.batch, p.q_heads, p.q_len, p.kv_len}, p.mask_strides);
  }
  if (options.has_sinks) {
    const auto& sinks = inputs[next++];
    require(sinks.ndim() == 1 && sinks.shape(0) == p.q_heads, "sinks.shape == [q_heads]",
            shape_string(sinks) + " for " + std::to_string(p.q_heads) + " q heads");
    require(sinks.dtype() == q.dtype(), "sinks.dtype == q.dtype");
    p.has_sinks = 1;
    p.sinks_stride = sinks.strides()[0];
  }
  return p;
}

std::string unsupported_reason(const AttentionProblem& problem, mx::Device::DeviceType device) {
  if (device == mx::Device::gpu) {
    return metal::available() ? plan_attention(problem).reason : metal::kNoMetalReason;
  }
  return cpu::unsupported_reason(problem);
}

namespace {

// The primitive's inputs (q, k, v, then the mask and sinks when given) and
// the options that say which are there.
std::vector<mx::array> primitive_inputs(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions& options) {
  options.has_mask = mask.has_value();
  options.has_sinks = sinks.has_value();
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) inputs.push_back(*mask);
  if (sinks) inputs.push_back(*sinks);
  return inputs;
}

// Whether FusedAttentionBackward runs `problem` on `device`: always on the
// CPU, on the GPU where the Metal backward's launch plan takes it.
bool fused_backward_supported(const AttentionProblem& problem, mx::Device device) {
  return device == mx::Device::cpu || plan_attention_backward(problem).supported;
}

// Every output of the primitive (out, and lse when options.output_lse) for
// inputs `problem` describes (built once per call, by the caller).
std::vector<mx::array> make_fused_outputs(
    const std::vector<mx::array>& inputs,
    const AttentionOptions& options,
    const AttentionProblem& problem,
    mx::Stream stream) {
  if (std::string reason = unsupported_reason(problem, stream.device.type); !reason.empty()) {
    invalid(reason);
  }
  auto primitive = std::make_shared<FusedAttention>(stream, options);
  auto shapes = primitive->output_shapes(inputs);
  std::vector<mx::Dtype> dtypes = {inputs[0].dtype()};
  if (options.output_lse) dtypes.push_back(mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

std::vector<mx::array> fused_attention_outputs(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::Stream stream) {
  const std::vector<mx::array> inputs = primitive_inputs(q, k, v, mask, sinks, options);
  return make_fused_outputs(inputs, options, describe_attention(inputs, options), stream);
}

}  // namespace

std::vector<mx::array> fused_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  options.lse_for_backward = false;
  const std::vector<mx::array> inputs = primitive_inputs(q, k, v, mask, sinks, options);
  AttentionProblem problem = describe_attention(inputs, options);  // once per call
  // Inputs are tracers only inside a transformation (grad, vjp, compile,
  // vmap): only then may a backward need the lse. MLX does not export its
  // own "in grad tracing" test, so compiled inference keeps it too (one
  // float per query row).
  const bool traced = q.is_tracer() || k.is_tracer() || v.is_tracer() ||
      (sinks && sinks->is_tracer());
  if (!options.output_lse && traced && fused_backward_supported(problem, stream.device)) {
    options.output_lse = options.lse_for_backward = true;
    problem.output_lse = true;
  }
  auto outputs = make_fused_outputs(inputs, options, problem, stream);
  if (options.lse_for_backward) outputs.pop_back();
  return outputs;
}

void FusedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  cpu::KernelCall call{};
  call.problem = describe_attention(inputs, options_);
  if (outputs[0].size() == 0) return;  // B, Hq or Tq is 0: nothing to compute
  call.q = inputs[0].data<void>();
  call.k = inputs[1].data<void>();
  call.v = inputs[2].data<void>();
  size_t next = 3;
  if (options_.has_mask) call.mask = inputs[next++].data<void>();
  if (options_.has_sinks) call.sinks = inputs[next++].data<void>();
  call.out = outputs[0].data<void>();
  call.lse = options_.output_lse ? outputs[1].data<float>() : nullptr;
  run_cpu_kernel(call, inputs, outputs, stream());
}

void run_cpu_kernel(
    cpu::KernelCall call,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    mx::Stream stream) {
  cpu::plan_work(call);

  // Tile scratch comes from MLX's allocator so it shows in MLX's memory
  // statistics; it is O(threads x tile), never O(Tq x Tkv).
  mx::array scratch({int(cpu::scratch_size(call))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& o : outputs) encoder.set_output_array(o);
  encoder.dispatch([call, buffer = scratch.data<float>()]() {
    cpu::run_attention(call, buffer);
  });
  encoder.add_temporary(std::move(scratch));
}

std::vector<mx::Shape> AttentionPrimitive::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto& q = inputs[0];
  mx::Shape out = {q.shape(0), q.shape(1), q.shape(2), value_dim(inputs)};
  if (options_.output_lse) {
    return {out, mx::Shape{q.shape(0), q.shape(1), q.shape(2)}};
  }
  return {out};
}

bool AttentionPrimitive::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AttentionPrimitive&>(other);
  return options_ == o.options_;
}

LaunchPlan FusedAttention::launch_plan(const std::vector<mx::array>& inputs, const GpuTarget& target) const {
  return plan_attention(describe_attention(inputs, options_), target);
}

namespace {

// Whether the vjp runs FusedAttentionBackward: its plan takes the problem
// and, on the GPU only, the Metal backward's variant is trusted (the caller's
// answer, AttentionOptions::metal_backward_trusted).
bool use_fused_backward(const AttentionProblem& problem, const AttentionOptions& options, mx::Device device) {
  if (!fused_backward_supported(problem, device)) return false;
  return device == mx::Device::cpu || options.metal_backward_trusted;
}

// Whether an additive mask is among the differentiated inputs: the fused
// backward has no output for its gradient (the score gradient dS reduced
// over the mask's broadcast dimensions), the reference path's autodiff has.
bool wants_mask_gradient(
    const std::vector<mx::array>& primals, const std::vector<int>& argnums, const AttentionOptions& options) {
  if (!options.has_mask || primals[3].dtype() == mx::bool_) return false;
  for (int i : argnums) {
    if (i == 3) return true;
  }
  return false;
}

}  // namespace

// The fused backward runs when the forward kept its lse (on the GPU: when the
// Metal backward's plan takes the problem and its variant passed the
// self-check) and no additive mask is differentiated; the cotangent of the
// lse (zeros unless the caller asked for the lse) joins delta. A boolean
// mask is a constant: its gradient is zero.
std::vector<mx::array> FusedAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  const auto s = stream();
  if (!options_.output_lse || wants_mask_gradient(primals, argnums, options_) ||
      !use_fused_backward(describe_attention(primals, options_), options_, s.device)) {
    if (!options_.lse_for_backward) return reference_derivatives(false, primals, cotangents, argnums, options_, s);
    // The hidden lse's cotangent is zero: differentiating it anyway would
    // put log(0)'s NaN derivative into the rows that see no key.
    AttentionOptions without_lse = options_;
    without_lse.output_lse = without_lse.lse_for_backward = false;
    return reference_derivatives(false, primals, {cotangents[0]}, argnums, without_lse, s);
  }
  const auto& q = primals[0];
  std::vector<mx::array> inputs = primals;
  inputs.push_back(outputs[0]);
  inputs.push_back(outputs[1]);
  inputs.push_back(mx::astype(cotangents[0], q.dtype(), s));
  inputs.push_back(mx::astype(cotangents[1], mx::float32, s));
  if (s.device != mx::Device::cpu) {  // the Metal backward reads these row-contiguous
    for (size_t i = primals.size(); i < inputs.size(); ++i) inputs[i] = mx::contiguous(inputs[i], false, s);
  }
  auto backward = std::make_shared<FusedAttentionBackward>(s, options_);
  auto shapes = backward->output_shapes(inputs);
  const std::vector<mx::Dtype> dtypes(shapes.size(), q.dtype());
  auto grads = mx::array::make_arrays(std::move(shapes), dtypes, backward, inputs);
  const int mask_index = options_.has_mask ? 3 : -1;
  std::vector<mx::array> result;
  for (int i : argnums) {
    if (i < 3) {
      result.push_back(grads[i]);
    } else if (i == mask_index) {
      result.push_back(mx::zeros_like(primals[i], s));
    } else {
      result.push_back(mx::astype(grads[3], primals[i].dtype(), s));
    }
  }
  return result;
}

std::vector<mx::array> FusedAttention::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  if (!options_.lse_for_backward) {
    return reference_derivatives(true, primals, tangents, argnums, options_, stream());
  }
  // The hidden lse is read by the fused backward only, never differentiated
  // forward: its tangent is a placeholder of the right shape.
  AttentionOptions without_lse = options_;
  without_lse.output_lse = without_lse.lse_for_backward = false;
  auto out_tangent = reference_derivatives(true, primals, tangents, argnums, without_lse, stream());
  const auto& q = primals[0];
  out_tangent.push_back(mx::zeros({q.shape(0), q.shape(1), q.shape(2)}, mx::float32, stream()));
  return out_tangent;
}

// vmap folds the mapped axis into the head axis: q [B, V, Hq, ...] becomes
// [B, V*Hq, ...] (likewise k, v, the mask and sinks [V*Hq]), so query head
// v*Hq + h still maps to key/value head v*Hkv + h/G. Unmapped inputs are
// repeated along V where they are not broadcast already.
std::pair<std::vector<mx::array>, std::vector<int>> FusedAttention::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  const auto s = stream();
  int mapped = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) mapped = inputs[i].shape(axes[i]);
  }
  // x with the mapped axis at `at` (inserted with size `mapped` if unmapped).
  auto mapped_at = [&](size_t i, int at) {
    const auto& x = inputs[i];
    if (axes[i] >= 0) return mx::moveaxis(x, axes[i], at, s);
    auto shape = x.shape();
    shape.insert(shape.begin() + at, mapped);
    return mx::broadcast_to(mx::expand_dims(x, at, s), shape, s);
  };
  auto fold_heads = [&](const mx::array& x5) {  // [B, V, H, ...] -> [B, V*H, ...]
    auto shape = x5.shape();
    shape[1] *= shape[2];
    shape.erase(shape.begin() + 2);
    return mx::reshape(x5, shape, s);
  };
  std::vector<mx::array> folded;
  for (size_t i = 0; i < 3; ++i) folded.push_back(fold_heads(mapped_at(i, 1)));
  const int q_heads = folded[0].shape(1) / mapped;
  size_t next = 3;
  std::optional<mx::array> mask, sinks;
  if (options_.has_mask) {
    const size_t i = next++;
    const auto& m = inputs[i];
    if (axes[i] < 0 && (m.ndim() < 3 || m.shape(m.ndim() - 3) == 1)) {
      mask = m;  // broadcast over every head already
    } else {
      auto m5 = mapped_at(i, 0);  // [V, ...rank dims]
      while (m5.ndim() < 5) m5 = mx::expand_dims(m5, 1, s);
      m5 = mx::moveaxis(m5, 0, 1, s);  // [b, V, h, tq, tkv]
      auto shape = m5.shape();
      shape[2] = q_heads;
      mask = fold_heads(mx::broadcast_to(m5, shape, s));
    }
  }
  if (options_.has_sinks) {
    const size_t i = next++;
    sinks = mx::flatten(mapped_at(i, 0), s);  // [V*Hq]
  }
  auto outs = fused_attention_outputs(folded[0], folded[1], folded[2], mask, sinks, options_, s);
  std::vector<int> out_axes;
  for (auto& o : outs) {
    auto shape = o.shape();
    shape[1] = mapped;
    shape.insert(shape.begin() + 2, q_heads);
    o = mx::reshape(o, shape, s);
    out_axes.push_back(1);
  }
  return {outs, out_axes};
}

void FusedAttentionBackward::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const size_t forward_inputs = 3 + options_.has_mask + options_.has_sinks;
  const std::vector<mx::array> primals(inputs.begin(), inputs.begin() + forward_inputs);
  const auto& out = inputs[forward_inputs];
  const auto& lse = inputs[forward_inputs + 1];
  const auto& d_out = inputs[forward_inputs + 2];
  const auto& d_lse = inputs[forward_inputs + 3];
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));

  cpu::BackwardCall call{};
  call.problem = describe_attention(primals, options_);
  const AttentionProblem& p = call.problem;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& o : outputs) encoder.set_output_array(o);
  if (int64_t(p.batch) * p.q_heads * p.q_len * p.kv_len == 0) {  // nothing attended
    std::vector<std::pair<void*, size_t>> buffers;
    for (auto& o : outputs) buffers.emplace_back(o.data<void>(), o.nbytes());
    encoder.dispatch([buffers]() {
      for (auto [data, bytes] : buffers) std::memset(data, 0, bytes);
    });
    return;
  }
  call.q = primals[0].data<void>();
  call.k = primals[1].data<void>();
  call.v = primals[2].data<void>();
  size_t next = 3;
  if (options_.has_mask) call.mask = primals[next++].data<void>();
  if (options_.has_sinks) call.sinks = primals[next++].data<void>();
  call.out = out.data<void>();
  copy_strides(out, call.out_strides);
  call.lse = lse.data<float>();
  call.d_out = d_out.data<void>();
  copy_strides(d_out, call.d_out_strides);
  call.d_lse = d_lse.data<float>();
  for (int i = 0; i < 3; ++i) call.d_lse_strides[i] = d_lse.strides()[i];
  call.dq = outputs[0].data<void>();
  call.dk = outputs[1].data<void>();
  call.dv = outputs[2].data<void>();
  call.d_sinks = options_.has_sinks ? outputs[3].data<void>() : nullptr;
  cpu::plan_backward(call);

  // Scratch from MLX's allocator (it shows in MLX's memory statistics): delta
  // per query row and per-thread tiles, never O(Tq x Tkv).
  mx::array scratch({int(cpu::backward_scratch_size(call))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  encoder.dispatch([call, buffer = scratch.data<float>()]() {
    cpu::run_backward(call, buffer);
  });
  encoder.add_temporary(std::move(scratch));
}

// The gradients have the shapes of q, k, v and sinks (a [Hq] view).
std::vector<mx::Shape> FusedAttentionBackward::output_shapes(
    const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes = {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
  if (options_.has_sinks) shapes.push_back({inputs[0].shape(1)});
  return shapes;
}

bool FusedAttentionBackward::is_equivalent(const mx::Primitive& other) const {
  return options_ == static_cast<const FusedAttentionBackward&>(other).options_;
}

}  // namespace mlx_attn
