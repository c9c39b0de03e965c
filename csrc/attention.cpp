#include "csrc/attention.h"

#include <sstream>
#include <stdexcept>

#include "csrc/cpu/kernels.h"
#include "mlx/backend/cpu/encoder.h"

#ifdef MLX_ATTN_METAL
#include "csrc/metal/attention_metal.h"
#endif

namespace mlx_attn {

std::vector<mx::array> fused_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    throw std::invalid_argument("[mlx_attn] q, k and v must be rank 4");
  }
  options.has_mask = mask.has_value();
  options.has_sinks = sinks.has_value();
  if (options.window_size > 0) options.causal = true;
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) inputs.push_back(*mask);
  if (sinks) inputs.push_back(*sinks);
  auto stream = mx::to_stream(s);
  auto primitive = std::make_shared<FusedAttention>(stream, options);
  mx::Shape out_shape = {q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  if (options.output_lse) {
    return mx::array::make_arrays(
        {out_shape, mx::Shape{q.shape(0), q.shape(1), q.shape(2)}},
        {q.dtype(), mx::float32},
        primitive,
        inputs);
  }
  return {mx::array(out_shape, q.dtype(), primitive, inputs)};
}

namespace {

cpu::ElemType elem_type(mx::Dtype t) {
  if (t == mx::float32) return cpu::ElemType::float32;
  if (t == mx::float16) return cpu::ElemType::float16;
  if (t == mx::bfloat16) return cpu::ElemType::bfloat16;
  std::ostringstream msg;
  msg << "[mlx_attn] fused attention supports float32, float16 and bfloat16, got "
      << t;
  throw std::invalid_argument(msg.str());
}

void copy_strides(const mx::array& a, int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = a.strides()[i];
}

}  // namespace

void FusedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  float* lse = nullptr;
  if (options_.output_lse) {
    outputs[1].set_data(mx::allocator::malloc(outputs[1].nbytes()));
    lse = outputs[1].data<float>();
  }

  cpu::AttentionProblem p{};
  p.batch = q.shape(0);
  p.q_heads = q.shape(1);
  p.q_len = q.shape(2);
  p.head_dim = q.shape(3);
  p.kv_heads = k.shape(1);
  p.kv_len = k.shape(2);
  p.value_dim = v.shape(3);
  p.dtype = elem_type(q.dtype());
  p.q = q.data<void>();
  p.k = k.data<void>();
  p.v = v.data<void>();
  p.out = out.data<void>();
  copy_strides(q, p.q_strides);
  copy_strides(k, p.k_strides);
  copy_strides(v, p.v_strides);
  p.scale = options_.scale;
  p.causal = options_.causal;
  p.window_size = options_.window_size;
  p.mask_kind = cpu::ArrayMask::none;
  int next = 3;
  if (options_.has_mask) {
    const auto& mask = inputs[next++];
    p.mask_kind = mask.dtype() == mx::bool_ ? cpu::ArrayMask::boolean
                                            : cpu::ArrayMask::additive;
    p.mask = mask.data<void>();
    copy_strides(mask, p.mask_strides);
  }
  if (options_.has_sinks) {
    const auto& sinks = inputs[next++];
    p.sinks = sinks.data<void>();
    p.sinks_stride = sinks.strides()[0];
  }
  p.lse = lse;
  cpu::plan_work(p);

  // Tile scratch comes from MLX's allocator so it shows in MLX's memory
  // statistics; it is O(threads x tile), never O(Tq x Tkv).
  mx::array scratch({int(cpu::scratch_size(p))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& o : outputs) encoder.set_output_array(o);
  encoder.dispatch([p, buffer = scratch.data<float>()]() {
    cpu::run_attention(p, buffer);
  });
  encoder.add_temporary(std::move(scratch));
}

void FusedAttention::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
#ifdef MLX_ATTN_METAL
  metal::eval_attention(stream(), options_, inputs, outputs);
#else
  throw std::runtime_error(
      "[mlx_attn] this build of mlx_attn has no GPU kernels (MLX without Metal)");
#endif
}

std::vector<mx::array> FusedAttention::vjp(
    const std::vector<mx::array>&,
    const std::vector<mx::array>&,
    const std::vector<int>&,
    const std::vector<mx::array>&) {
  // mlx_attn.scaled_dot_product_attention wraps the primitive in a
  // custom_function whose vjp differentiates the reference path.
  throw std::runtime_error(
      "[mlx_attn] differentiate mlx_attn.scaled_dot_product_attention, not the "
      "raw _ext primitive");
}

std::vector<mx::Shape> FusedAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  const auto& q = inputs[0];
  mx::Shape out = {q.shape(0), q.shape(1), q.shape(2), inputs[2].shape(3)};
  if (options_.output_lse) {
    return {out, mx::Shape{q.shape(0), q.shape(1), q.shape(2)}};
  }
  return {out};
}

bool FusedAttention::is_equivalent(const mx::Primitive& other) const {
  return options_ == static_cast<const FusedAttention&>(other).options_;
}

}  // namespace mlx_attn
