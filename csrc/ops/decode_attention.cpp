#include "csrc/ops/decode_attention.h"
#include "csrc/core/argument_checks.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>

#include "csrc/core/attention_options.h"
#include "csrc/cpu/host.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_attn {
namespace {

constexpr const char* kOp = "mlx_attn.decode_attention";

[[noreturn]] void invalid(const std::string& message) {
  throw_invalid(kOp, message);
}

float load(const void* base, ElemType type, int64_t at) {
  switch (type) {
    case ElemType::float16: return float(static_cast<const mx::float16_t*>(base)[at]);
    case ElemType::bfloat16: return float(static_cast<const mx::bfloat16_t*>(base)[at]);
    default: return static_cast<const float*>(base)[at];
  }
}

void store(void* base, ElemType type, int64_t at, float value) {
  switch (type) {
    case ElemType::float16: static_cast<mx::float16_t*>(base)[at] = mx::float16_t(value); break;
    case ElemType::bfloat16: static_cast<mx::bfloat16_t*>(base)[at] = mx::bfloat16_t(value); break;
    default: static_cast<float*>(base)[at] = value;
  }
}

// Features along one axis of an input as MLX hands it over (any layout):
// feature i after element `base` at data[base + i * stride].
struct RowView {
  const void* data = nullptr;
  ElemType type = ElemType::float32;
  int64_t stride = 1;
  float at(int64_t base, int64_t i) const { return load(data, type, base + i * stride); }
};

// Everything the evaluation needs besides the kernel call.
struct StepRows {
  RowView q, k, v, cos, sin;    // q, k, v: batch b's row starts at element b * *_batch_stride
  int64_t q_batch_stride, k_batch_stride, v_batch_stride;
  const void* position;
  mx::Dtype position_type = mx::int32;
  int rotated_pairs;            // R / 2
  bool traditional;
  void* q_rotated;              // [B, Hq, D] in the caches' dtype: the kernel's q
  // the caches' source when the outputs are copies (else null), with its strides
  const void* key_source;
  const void* value_source;
  int64_t key_source_strides[4], value_source_strides[4];
  int64_t slots;                // S
  int64_t item_bytes;
};

int64_t read_position(const void* p, mx::Dtype type) {
  switch (type) {
    case mx::int64: return *static_cast<const int64_t*>(p);
    case mx::uint32: return *static_cast<const uint32_t*>(p);
    case mx::uint64: {
      const uint64_t value = *static_cast<const uint64_t*>(p);
      return value > uint64_t(std::numeric_limits<int64_t>::max()) ? -1 : int64_t(value);
    }
    case mx::int16: return *static_cast<const int16_t*>(p);
    case mx::uint16: return *static_cast<const uint16_t*>(p);
    case mx::int8: return *static_cast<const int8_t*>(p);
    case mx::uint8: return *static_cast<const uint8_t*>(p);
    default: return *static_cast<const int32_t*>(p);
  }
}

// dst (row-contiguous [B, H, S, D]) = src read through its element strides.
void copy_cache(const void* src, const int64_t (&strides)[4], void* dst, const int (&shape)[4], int64_t item_bytes) {
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  for (int b = 0; b < shape[0]; ++b) {
    for (int h = 0; h < shape[1]; ++h) {
      for (int s = 0; s < shape[2]; ++s) {
        const int64_t row = b * strides[0] + h * strides[1] + s * strides[2];
        if (strides[3] == 1) {
          std::memcpy(to, from + row * item_bytes, shape[3] * item_bytes);
          to += shape[3] * item_bytes;
          continue;
        }
        for (int d = 0; d < shape[3]; ++d, to += item_bytes) {
          std::memcpy(to, from + (row + d * strides[3]) * item_bytes, item_bytes);
        }
      }
    }
  }
}

// One head's row of `dim` features, the first 2 * pairs rotated by (cos, sin)
// as mlx_attn.rope.RoPE does in float32, stored at out[0, dim) in `type`.
// `first`: the row's first feature, head h of batch b at b * batch stride + h * dim * stride.
void rotate_row(const RowView& in, int64_t first, int dim, const StepRows& step, void* out, ElemType type,
                int64_t out_first) {
  const int pairs = step.rotated_pairs;
  for (int i = 0; i < pairs; ++i) {
    const int64_t at_a = step.traditional ? 2 * i : i;
    const int64_t at_b = step.traditional ? 2 * i + 1 : i + pairs;
    const float a = in.at(first, at_a), b = in.at(first, at_b);
    const float c = step.cos.at(0, i), s = step.sin.at(0, i);
    store(out, type, out_first + at_a, a * c - b * s);
    store(out, type, out_first + at_b, b * c + a * s);
  }
  for (int i = 2 * pairs; i < dim; ++i) store(out, type, out_first + i, in.at(first, i));
}

void copy_row(const RowView& in, int64_t first, int dim, void* out, ElemType type, int64_t out_first) {
  for (int i = 0; i < dim; ++i) store(out, type, out_first + i, in.at(first, i));
}

void run_step(cpu::KernelCall call, const StepRows& step, void* key_cache, void* value_cache, float* scratch) {
  const AttentionProblem& p = call.problem;
  const int key_shape[4] = {p.batch, p.kv_heads, int(step.slots), p.head_dim};
  const int value_shape[4] = {p.batch, p.kv_heads, int(step.slots), p.value_dim};
  if (step.key_source) copy_cache(step.key_source, step.key_source_strides, key_cache, key_shape, step.item_bytes);
  if (step.value_source) {
    copy_cache(step.value_source, step.value_source_strides, value_cache, value_shape, step.item_bytes);
  }
  const int64_t position = read_position(step.position, step.position_type);
  if (position < 0 || position >= step.slots) {  // the caller broke the contract: say so in the output
    const int64_t outputs = int64_t(p.batch) * p.q_heads * p.value_dim;
    for (int64_t i = 0; i < outputs; ++i) store(call.out, p.dtype, i, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.kv_heads; ++h) {
      const int64_t key_slot = b * p.k_strides[0] + h * p.k_strides[1] + position * p.k_strides[2];
      const int64_t value_slot = b * p.v_strides[0] + h * p.v_strides[1] + position * p.v_strides[2];
      rotate_row(step.k, b * step.k_batch_stride + int64_t(h) * p.head_dim * step.k.stride, p.head_dim, step,
                 key_cache, p.dtype, key_slot);
      copy_row(step.v, b * step.v_batch_stride + int64_t(h) * p.value_dim * step.v.stride, p.value_dim,
               value_cache, p.dtype, value_slot);
    }
    for (int h = 0; h < p.q_heads; ++h) {
      rotate_row(step.q, b * step.q_batch_stride + int64_t(h) * p.head_dim * step.q.stride, p.head_dim, step,
                 step.q_rotated, p.dtype, (int64_t(b) * p.q_heads + h) * p.head_dim);
    }
  }
  call.problem.kv_len = int(position + 1);  // the filled slots only: no mask, no reads past them
  cpu::run_attention(call, scratch);
}

RowView row_view(const mx::array& a, int axis) {
  return RowView{a.data<void>(), *float_elem_type(a.dtype()), int64_t(a.strides()[axis])};
}

}  // namespace

std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& key_cache, const mx::array& value_cache,
                                        const mx::array& position, const mx::array& cos, const mx::array& sin,
                                        float scale, int window_size, bool traditional, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) {
    invalid("runs on the CPU only (on the GPU the decode step runs MLX's operations)");
  }
  for (const auto& [name, cache] : {std::pair<const char*, const mx::array&>{"key_cache", key_cache},
                                    {"value_cache", value_cache}}) {
    if (cache.ndim() != 4) invalid(std::string(name) + " must be [batch, kv_heads, slots, dim], got " + shape_string(cache));
    if (!float_elem_type(cache.dtype())) {
      invalid(std::string(name) + " must be float32, float16 or bfloat16, got " + dtype_string(cache.dtype()));
    }
  }
  if (value_cache.dtype() != key_cache.dtype()) {
    invalid("value_cache must have key_cache's dtype, got " + dtype_string(value_cache.dtype()) + " and " +
            dtype_string(key_cache.dtype()));
  }
  const int batch = key_cache.shape(0), kv_heads = key_cache.shape(1), slots = key_cache.shape(2);
  const int head_dim = key_cache.shape(3), value_dim = value_cache.shape(3);
  if (value_cache.shape(0) != batch || value_cache.shape(1) != kv_heads || value_cache.shape(2) != slots) {
    invalid("value_cache " + shape_string(value_cache) + " must match key_cache " + shape_string(key_cache) +
            " but for the last axis");
  }
  if (slots < 1 || kv_heads < 1 || head_dim < 1 || value_dim < 1) {
    invalid("key_cache and value_cache need at least one slot, head and feature, got " + shape_string(key_cache) +
            " and " + shape_string(value_cache));
  }
  for (const auto& [name, row, width] :
       {std::tuple<const char*, const mx::array&, int64_t>{"q", q, -1}, {"k", k, int64_t(kv_heads) * head_dim},
        {"v", v, int64_t(kv_heads) * value_dim}}) {
    if (row.ndim() != 3 || row.shape(0) != batch || row.shape(1) != 1 || (width >= 0 && row.shape(2) != width)) {
      invalid(std::string(name) + " must be [" + std::to_string(batch) + ", 1, " +
              (width >= 0 ? std::to_string(width) : std::string("q_heads * ") + std::to_string(head_dim)) +
              "] (one new token per sequence, heads side by side), got " + shape_string(row));
    }
    if (!float_elem_type(row.dtype())) {
      invalid(std::string(name) + " must be float32, float16 or bfloat16, got " + dtype_string(row.dtype()));
    }
  }
  if (q.shape(2) % head_dim != 0 || (q.shape(2) / head_dim) % kv_heads != 0 || q.shape(2) == 0) {
    invalid("q " + shape_string(q) + " must hold a positive multiple of " + std::to_string(kv_heads) +
            " heads (the caches' kv_heads) of " + std::to_string(head_dim) + " features");
  }
  const int q_heads = q.shape(2) / head_dim;
  if (position.size() != 1 || position.ndim() > 1 || !mx::issubdtype(position.dtype(), mx::integer)) {
    invalid("position must be an integer scalar array (or [1]), got " + shape_string(position) + " " +
            dtype_string(position.dtype()));
  }
  for (const auto& [name, a] : {std::pair<const char*, const mx::array&>{"cos", cos}, {"sin", sin}}) {
    if (a.ndim() != 1 || a.dtype() != mx::float32 || a.shape(0) < 1 || 2 * int64_t(a.shape(0)) > head_dim) {
      invalid(std::string(name) + " must be float32 [rotated_dims / 2] with 0 < rotated_dims <= head_dim (" +
              std::to_string(head_dim) + "), got " + shape_string(a) + " " + dtype_string(a.dtype()));
    }
  }
  if (sin.shape(0) != cos.shape(0)) invalid("sin " + shape_string(sin) + " must match cos " + shape_string(cos));
  if (!std::isfinite(scale)) invalid("scale must be finite in float32, got " + std::to_string(scale));
  if (window_size < 0) invalid("window_size must be >= 0 (0: no window), got " + std::to_string(window_size));

  AttentionProblem problem{};
  problem.dtype = *float_elem_type(key_cache.dtype());
  problem.batch = batch;
  problem.q_heads = q_heads;
  problem.kv_heads = kv_heads;
  problem.group = q_heads / kv_heads;
  problem.q_len = 1;
  problem.kv_len = slots;
  problem.head_dim = head_dim;
  problem.value_dim = value_dim;
  if (const std::string reason = cpu::unsupported_reason(problem); !reason.empty()) invalid(reason);

  auto primitive = std::make_shared<DecodeAttention>(stream, scale, window_size, traditional);
  std::vector<mx::array> inputs = {q, k, v, key_cache, value_cache, position, cos, sin};
  auto shapes = primitive->output_shapes(inputs);
  const mx::Dtype dtype = key_cache.dtype();
  return mx::array::make_arrays(std::move(shapes), {dtype, dtype, dtype}, primitive, std::move(inputs));
}

std::vector<mx::Shape> DecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& q = inputs[0];
  const int q_heads = q.shape(2) / inputs[3].shape(3);
  return {mx::Shape{q.shape(0), 1, q_heads * inputs[4].shape(3)}, inputs[3].shape(), inputs[4].shape()};
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
  const mx::array &key_in = inputs[3], &value_in = inputs[4];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);

  StepRows step{};
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  // A cache no other array holds becomes the output as it is: the step writes one row, not a copy of the buffer.
  const void* sources[2] = {nullptr, nullptr};
  for (int c = 0; c < 2; ++c) {
    const mx::array& in = inputs[3 + c];
    mx::array& out = outputs[1 + c];
    if (in.is_donatable() && in.flags().row_contiguous) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      sources[c] = in.data<void>();
      int64_t* strides = c == 0 ? step.key_source_strides : step.value_source_strides;
      for (int i = 0; i < 4; ++i) strides[i] = in.strides()[i];
    }
  }
  for (auto& o : outputs) encoder.set_output_array(o);
  step.key_source = sources[0];
  step.value_source = sources[1];

  cpu::KernelCall call{};
  AttentionProblem& p = call.problem;
  p.dtype = *float_elem_type(key_in.dtype());
  p.batch = key_in.shape(0);
  p.kv_heads = key_in.shape(1);
  p.head_dim = key_in.shape(3);
  p.value_dim = value_in.shape(3);
  p.q_heads = q.shape(2) / p.head_dim;
  p.group = p.q_heads / p.kv_heads;
  p.q_len = 1;
  p.kv_len = key_in.shape(2);  // the largest it becomes (run_step sets the filled length)
  AttentionOptions options;
  options.scale = scale_;
  options.window_size = window_size_;
  options.causal = window_size_ > 0;  // one query row: causal alone changes nothing
  if (const char* broken = set_option_params(p, options)) throw std::invalid_argument(std::string("[") + kOp + "] " + broken);
  const int64_t slots = key_in.shape(2);
  const int64_t key_strides[4] = {int64_t(p.kv_heads) * slots * p.head_dim, slots * p.head_dim, p.head_dim, 1};
  const int64_t value_strides[4] = {int64_t(p.kv_heads) * slots * p.value_dim, slots * p.value_dim, p.value_dim, 1};
  const int64_t q_strides[4] = {int64_t(p.q_heads) * p.head_dim, p.head_dim, p.head_dim, 1};
  for (int i = 0; i < 4; ++i) {
    p.k_strides[i] = key_strides[i];
    p.v_strides[i] = value_strides[i];
    p.q_strides[i] = q_strides[i];
  }
  if (outputs[0].size() == 0) return;

  mx::array q_rotated({p.batch * p.q_heads * p.head_dim}, key_in.dtype(), nullptr, {});
  q_rotated.set_data(mx::allocator::malloc(q_rotated.nbytes()));
  call.q = q_rotated.data<void>();
  call.k = outputs[1].data<void>();
  call.v = outputs[2].data<void>();
  call.out = outputs[0].data<void>();
  cpu::plan_work(call);
  mx::array scratch({int(cpu::scratch_size(call))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));

  step.q = row_view(q, 2);
  step.k = row_view(k, 2);
  step.v = row_view(v, 2);
  step.q_batch_stride = q.strides()[0];
  step.k_batch_stride = k.strides()[0];
  step.v_batch_stride = v.strides()[0];
  step.cos = row_view(inputs[6], 0);
  step.sin = row_view(inputs[7], 0);
  step.position = inputs[5].data<void>();
  step.position_type = inputs[5].dtype();
  step.rotated_pairs = inputs[6].shape(0);
  step.traditional = traditional_;
  step.q_rotated = q_rotated.data<void>();
  step.slots = slots;
  step.item_bytes = key_in.itemsize();
  encoder.dispatch([call, step, key = outputs[1].data<void>(), value = outputs[2].data<void>(),
                    buffer = scratch.data<float>()]() { run_step(call, step, key, value, buffer); });
  encoder.add_temporary(std::move(q_rotated));
  encoder.add_temporary(std::move(scratch));
}

void DecodeAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.decode_attention] runs on the CPU only");
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const DecodeAttention*>(&other);
  return o != nullptr && o->scale_ == scale_ && o->window_size_ == window_size_ && o->traditional_ == traditional_;
}

}  // namespace mlx_attn
