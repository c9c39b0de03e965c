#include "csrc/ops/decode_attention.h"
#include "csrc/core/argument_checks.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <typeinfo>

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

RowView row_view(const mx::array& a, int axis) {
  return RowView{a.data<void>(), *float_elem_type(a.dtype()), int64_t(a.strides()[axis])};
}

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

// The step's rotation: pairs (2i, 2i + 1) when traditional, else (i, i + pairs); none when pairs is 0.
// row_stride: elements between two tokens' angles (cos / sin [T, pairs]); 0 when every token shares them.
struct Rotation {
  RowView cos, sin;
  int pairs = 0;
  bool traditional = false;
  int64_t cos_row_stride = 0, sin_row_stride = 0;
};

// One head's row of `dim` features (`first`: its first feature's element in
// `in`), the first 2 * pairs rotated by (cos, sin) as mlx_attn.rope.RoPE does
// in float32, stored at out[out_first, out_first + dim) in `type`.
// `token`: the row of the rotation's angles (0 when the tokens share them).
void write_row(const RowView& in, int64_t first, int dim, const Rotation& rotation, void* out, ElemType type,
               int64_t out_first, int64_t token = 0) {
  const int64_t cos_first = token * rotation.cos_row_stride, sin_first = token * rotation.sin_row_stride;
  for (int i = 0; i < rotation.pairs; ++i) {
    const int64_t at_a = rotation.traditional ? 2 * i : i;
    const int64_t at_b = rotation.traditional ? 2 * i + 1 : i + rotation.pairs;
    const float a = in.at(first, at_a), b = in.at(first, at_b);
    const float c = rotation.cos.at(cos_first, i), s = rotation.sin.at(sin_first, i);
    store(out, type, out_first + at_a, a * c - b * s);
    store(out, type, out_first + at_b, b * c + a * s);
  }
  for (int i = 2 * rotation.pairs; i < dim; ++i) store(out, type, out_first + i, in.at(first, i));
}

// dst (row-contiguous [B, H, S, D]) = src read through its element strides.
void copy_cache(const void* src, const mx::Strides& strides, void* dst, const mx::Shape& shape, int64_t item_bytes) {
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

void check_cache(const char* name, const mx::array& cache) {
  if (cache.ndim() != 4) invalid(std::string(name) + " must be [batch, kv_heads, slots, dim], got " + shape_string(cache));
  if (!float_elem_type(cache.dtype())) {
    invalid(std::string(name) + " must be float32, float16 or bfloat16, got " + dtype_string(cache.dtype()));
  }
  if (cache.size() == 0) invalid(std::string(name) + " needs at least one slot, head and feature, got " + shape_string(cache));
}

// The rows of the new token, [B, 1, width] in a float dtype.
void check_rows(const char* name, const mx::array& rows, int batch, int64_t width, const std::string& expected) {
  if (rows.ndim() != 3 || rows.shape(0) != batch || rows.shape(1) != 1 || (width >= 0 && rows.shape(2) != width)) {
    invalid(std::string(name) + " must be [" + std::to_string(batch) + ", 1, " + expected +
            "] (one new token per sequence, heads side by side), got " + shape_string(rows));
  }
  if (!float_elem_type(rows.dtype())) {
    invalid(std::string(name) + " must be float32, float16 or bfloat16, got " + dtype_string(rows.dtype()));
  }
}

// A buffer no other array holds becomes `out` as it is (true: the step writes
// its rows, not a copy of the buffer); otherwise `out` gets fresh memory.
bool donate_or_allocate(const mx::array& buffer, mx::array& out) {
  const bool donated = buffer.is_donatable() && buffer.flags().row_contiguous;
  if (donated) {
    out.copy_shared_buffer(buffer);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  return donated;
}

}  // namespace

// ---------------------------------------------------------------- the cache write
std::vector<mx::Shape> RowsWrite::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool RowsWrite::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const RowsWrite*>(&other);
  return o != nullptr && typeid(*o) == typeid(*this) && o->rotate_ == rotate_ && o->traditional_ == traditional_;
}

void RowsWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string("[") + op_ + "] runs on the CPU only");
}

mx::array decode_cache_write(const mx::array& cache, const mx::array& rows, const mx::array& position,
                             const std::optional<mx::array>& cos, const std::optional<mx::array>& sin,
                             bool traditional, mx::Stream stream) {
  std::vector<mx::array> inputs = {cache, rows, position};
  if (cos) inputs.insert(inputs.end(), {*cos, *sin});
  return mx::array(cache.shape(), cache.dtype(), std::make_shared<DecodeCacheWrite>(stream, cos.has_value(), traditional),
                   std::move(inputs));
}

void DecodeCacheWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &cache = inputs[0], &rows = inputs[1];
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  const bool donated = donate_or_allocate(cache, out);
  encoder.set_output_array(out);
  Rotation rotation;
  if (rotate_) rotation = {row_view(inputs[3], 0), row_view(inputs[4], 0), inputs[3].shape(0), traditional_};
  encoder.dispatch([source = donated ? nullptr : cache.data<void>(), strides = cache.strides(), shape = cache.shape(),
                    item_bytes = int64_t(cache.itemsize()), type = *float_elem_type(cache.dtype()),
                    target = out.data<void>(), in = row_view(rows, 2), batch_stride = int64_t(rows.strides()[0]),
                    position = inputs[2].data<void>(), position_type = inputs[2].dtype(), rotation]() {
    if (source != nullptr) copy_cache(source, strides, target, shape, item_bytes);
    const int64_t at = read_position(position, position_type);
    if (at < 0 || at >= shape[2]) return;  // the attention reports it (NaN)
    const int heads = shape[1], dim = shape[3];
    const int64_t slots = shape[2];
    for (int b = 0; b < shape[0]; ++b) {
      for (int h = 0; h < heads; ++h) {
        write_row(in, b * batch_stride + int64_t(h) * dim * in.stride, dim, rotation, target, type,
                  ((int64_t(b) * heads + h) * slots + at) * dim);
      }
    }
  });
}


// ---------------------------------------------------------------- the attention
std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& key_cache, const mx::array& value_cache,
                                        const mx::array& position, const mx::array& cos, const mx::array& sin,
                                        float scale, int window_size, bool traditional, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) {
    invalid("runs on the CPU only (on the GPU the decode step runs MLX's operations)");
  }
  check_cache("key_cache", key_cache);
  check_cache("value_cache", value_cache);
  if (value_cache.dtype() != key_cache.dtype()) {
    invalid("value_cache must have key_cache's dtype, got " + dtype_string(value_cache.dtype()) + " and " +
            dtype_string(key_cache.dtype()));
  }
  const int batch = key_cache.shape(0), kv_heads = key_cache.shape(1);
  const int head_dim = key_cache.shape(3), value_dim = value_cache.shape(3);
  if (value_cache.shape(0) != batch || value_cache.shape(1) != kv_heads || value_cache.shape(2) != key_cache.shape(2)) {
    invalid("value_cache " + shape_string(value_cache) + " must match key_cache " + shape_string(key_cache) +
            " but for the last axis");
  }
  check_rows("q", q, batch, -1, "q_heads * " + std::to_string(head_dim));
  check_rows("k", k, batch, int64_t(kv_heads) * head_dim, std::to_string(int64_t(kv_heads) * head_dim));
  check_rows("v", v, batch, int64_t(kv_heads) * value_dim, std::to_string(int64_t(kv_heads) * value_dim));
  if (q.shape(2) % head_dim != 0 || (q.shape(2) / head_dim) % kv_heads != 0 || q.shape(2) == 0) {
    invalid("q " + shape_string(q) + " must hold a positive multiple of " + std::to_string(kv_heads) +
            " heads (the caches' kv_heads) of " + std::to_string(head_dim) + " features");
  }
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
  problem.q_heads = q.shape(2) / head_dim;
  problem.kv_heads = kv_heads;
  problem.group = problem.q_heads / kv_heads;
  problem.q_len = 1;
  problem.kv_len = key_cache.shape(2);
  problem.head_dim = head_dim;
  problem.value_dim = value_dim;
  if (const std::string reason = cpu::unsupported_reason(problem); !reason.empty()) invalid(reason);

  // Three single-output nodes, not one with three outputs: MLX gives each
  // output of a node its own copy of the inputs, so a cache buffer read by a
  // three-output node could never be donated (updated in place).
  mx::array keys = decode_cache_write(key_cache, k, position, cos, sin, traditional, stream);
  mx::array values = decode_cache_write(value_cache, v, position, std::nullopt, std::nullopt, false, stream);
  mx::array out(mx::Shape{batch, 1, problem.q_heads * value_dim}, key_cache.dtype(),
                std::make_shared<DecodeAttention>(stream, scale, window_size, traditional),
                {q, keys, values, position, cos, sin});
  return {out, keys, values};
}

std::vector<mx::Shape> DecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& q = inputs[0];
  return {mx::Shape{q.shape(0), 1, q.shape(2) / inputs[1].shape(3) * inputs[2].shape(3)}};
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &q = inputs[0], &keys = inputs[1], &values = inputs[2];
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  if (out.size() == 0) return;

  cpu::KernelCall call{};
  AttentionProblem& p = call.problem;
  p.dtype = *float_elem_type(keys.dtype());
  p.batch = keys.shape(0);
  p.kv_heads = keys.shape(1);
  p.head_dim = keys.shape(3);
  p.value_dim = values.shape(3);
  p.q_heads = q.shape(2) / p.head_dim;
  p.group = p.q_heads / p.kv_heads;
  p.q_len = 1;
  p.kv_len = keys.shape(2);  // the largest it becomes: the task sets the filled length
  AttentionOptions options;
  options.scale = scale_;
  options.window_size = window_size_;
  options.causal = window_size_ > 0;  // one query row: causal alone changes nothing
  if (const char* broken = set_option_params(p, options)) invalid(broken);
  for (int i = 0; i < 4; ++i) {
    p.k_strides[i] = keys.strides()[i];
    p.v_strides[i] = values.strides()[i];
  }
  const int64_t q_strides[4] = {int64_t(p.q_heads) * p.head_dim, p.head_dim, p.head_dim, 1};
  for (int i = 0; i < 4; ++i) p.q_strides[i] = q_strides[i];

  // the rotated q in the caches' dtype, [B, Hq, 1, D]: the kernel's q
  mx::array rotated_q({p.batch * p.q_heads * p.head_dim}, keys.dtype(), nullptr, {});
  rotated_q.set_data(mx::allocator::malloc(rotated_q.nbytes()));
  call.q = rotated_q.data<void>();
  call.k = keys.data<void>();
  call.v = values.data<void>();
  call.out = out.data<void>();
  cpu::plan_work(call);
  mx::array scratch({int(cpu::scratch_size(call))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  const Rotation rotation{row_view(inputs[4], 0), row_view(inputs[5], 0), inputs[4].shape(0), traditional_};
  encoder.dispatch([call, rotation, in = row_view(q, 2), batch_stride = int64_t(q.strides()[0]),
                    position = inputs[3].data<void>(), position_type = inputs[3].dtype(),
                    buffer = scratch.data<float>()]() mutable {
    const AttentionProblem& p = call.problem;
    const int64_t at = read_position(position, position_type);
    if (at < 0 || at >= p.kv_len) {  // the caller broke the contract: say so in the output
      const int64_t outputs = int64_t(p.batch) * p.q_heads * p.value_dim;
      for (int64_t i = 0; i < outputs; ++i) store(call.out, p.dtype, i, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    for (int b = 0; b < p.batch; ++b) {
      for (int h = 0; h < p.q_heads; ++h) {
        write_row(in, b * batch_stride + int64_t(h) * p.head_dim * in.stride, p.head_dim, rotation,
                  const_cast<void*>(call.q), p.dtype, (int64_t(b) * p.q_heads + h) * p.head_dim);
      }
    }
    call.problem.kv_len = int(at + 1);  // the filled slots only: no mask, no reads past them
    cpu::run_attention(call, buffer);
  });
  encoder.add_temporary(std::move(rotated_q));
  encoder.add_temporary(std::move(scratch));
}

void DecodeAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.decode_attention] runs on the CPU only");
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const DecodeAttention*>(&other);
  return o != nullptr && o->scale_ == scale_ && o->window_size_ == window_size_ && o->traditional_ == traditional_;
}

// ---------------------------------------------------------------- paged rows (the serving engine's decode step)
namespace {

constexpr const char* kPagedOp = "mlx_attn.paged_rows";

[[noreturn]] void invalid_paged(const std::string& message) {
  throw_invalid(kPagedOp, message);
}

// Tokens' rows [T, width] or [1, T, width]: feature i of token t at view.at(t * token_stride, i).
struct TokenRows {
  RowView view;
  int64_t token_stride = 0;
};

TokenRows token_rows(const mx::array& rows) {
  const int axis = int(rows.ndim()) - 1;
  return {row_view(rows, axis), int64_t(rows.strides()[axis - 1])};
}

int check_token_rows(const char* name, const mx::array& rows) {
  if (!(rows.ndim() == 2 || (rows.ndim() == 3 && rows.shape(0) == 1))) {
    invalid_paged(std::string(name) + " must be [T, heads * dim] or [1, T, heads * dim], got " + shape_string(rows));
  }
  if (!float_elem_type(rows.dtype())) {
    invalid_paged(std::string(name) + " must be float32, float16 or bfloat16, got " + dtype_string(rows.dtype()));
  }
  return rows.shape(-2);
}

void check_token_angles(const mx::array& cos, const mx::array& sin, int tokens, int dim) {
  for (const auto& [name, a] : {std::pair<const char*, const mx::array&>{"cos", cos}, {"sin", sin}}) {
    if (a.ndim() != 2 || a.shape(0) != tokens || a.dtype() != mx::float32 || a.shape(1) < 1 ||
        2 * int64_t(a.shape(1)) > dim) {
      invalid_paged(std::string(name) + " must be float32 [" + std::to_string(tokens) +
                    ", rotated_dims / 2] with 0 < rotated_dims <= " + std::to_string(dim) + ", got " +
                    shape_string(a) + " " + dtype_string(a.dtype()));
    }
  }
  if (sin.shape(1) != cos.shape(1)) invalid_paged("sin " + shape_string(sin) + " must match cos " + shape_string(cos));
}

Rotation token_rotation(const mx::array& cos, const mx::array& sin, bool traditional) {
  return Rotation{row_view(cos, 1), row_view(sin, 1), cos.shape(1), traditional, int64_t(cos.strides()[0]),
                  int64_t(sin.strides()[0])};
}

}  // namespace

mx::array paged_rows_write(const mx::array& pages, const mx::array& rows, const mx::array& write_pages,
                           const mx::array& write_slots, const std::optional<mx::array>& cos,
                           const std::optional<mx::array>& sin, bool traditional, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) invalid_paged("runs on the CPU only");
  if (pages.ndim() != 4 || pages.size() == 0) {
    invalid_paged("pages must be [num_pages, kv_heads, page_size, dim], none empty, got " + shape_string(pages));
  }
  if (!float_elem_type(pages.dtype())) {
    invalid_paged("pages must be float32, float16 or bfloat16, got " + dtype_string(pages.dtype()));
  }
  const int tokens = check_token_rows("rows", rows);
  if (rows.shape(-1) != int64_t(pages.shape(1)) * pages.shape(3)) {
    invalid_paged("rows " + shape_string(rows) + " must hold kv_heads * dim = " +
                  std::to_string(int64_t(pages.shape(1)) * pages.shape(3)) + " features per token (pages " +
                  shape_string(pages) + ")");
  }
  for (const auto& [name, a] :
       {std::pair<const char*, const mx::array&>{"write_pages", write_pages}, {"write_slots", write_slots}}) {
    if (a.ndim() != 1 || a.shape(0) != tokens || a.dtype() != mx::int32) {
      invalid_paged(std::string(name) + " must be int32 [" + std::to_string(tokens) + "] (one per row), got " +
                    shape_string(a) + " " + dtype_string(a.dtype()));
    }
  }
  if (cos.has_value() != sin.has_value()) invalid_paged("cos and sin come together");
  std::vector<mx::array> inputs = {pages, rows, write_pages, write_slots};
  if (cos) {
    check_token_angles(*cos, *sin, tokens, pages.shape(3));
    inputs.insert(inputs.end(), {*cos, *sin});
  }
  return mx::array(pages.shape(), pages.dtype(), std::make_shared<PagedRowsWrite>(stream, cos.has_value(), traditional),
                   std::move(inputs));
}

void PagedRowsWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& pages = inputs[0];
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  const bool donated = donate_or_allocate(pages, out);
  encoder.set_output_array(out);
  Rotation rotation;
  if (rotate_) rotation = token_rotation(inputs[4], inputs[5], traditional_);
  encoder.dispatch([source = donated ? nullptr : pages.data<void>(), strides = pages.strides(), shape = pages.shape(),
                    item_bytes = int64_t(pages.itemsize()), type = *float_elem_type(pages.dtype()),
                    target = out.data<void>(), in = token_rows(inputs[1]), tokens = inputs[1].shape(-2),
                    page_of = inputs[2].data<int32_t>(), slot_of = inputs[3].data<int32_t>(), rotation]() {
    if (source != nullptr) copy_cache(source, strides, target, shape, item_bytes);
    const int heads = shape[1], page_size = shape[2], dim = shape[3];
    for (int t = 0; t < tokens; ++t) {
      const int64_t page = page_of[t], slot = slot_of[t];
      if (page < 0 || page >= shape[0] || slot < 0 || slot >= page_size) continue;  // outside the pool: not written
      for (int h = 0; h < heads; ++h) {
        write_row(in.view, t * in.token_stride + int64_t(h) * dim * in.view.stride, dim, rotation, target, type,
                  ((page * heads + h) * page_size + slot) * dim, t);
      }
    }
  });
}


mx::array rotated_rows(const mx::array& rows, const mx::array& cos, const mx::array& sin, int heads, bool traditional,
                       mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) invalid_paged("runs on the CPU only");
  const int tokens = check_token_rows("rows", rows);
  if (heads < 1 || rows.shape(-1) % heads != 0 || rows.shape(-1) == 0) {
    invalid_paged("rows " + shape_string(rows) + " must hold heads = " + std::to_string(heads) +
                  " (>= 1) heads of equal width");
  }
  const int dim = rows.shape(-1) / heads;
  check_token_angles(cos, sin, tokens, dim);
  return mx::array(mx::Shape{tokens, heads, dim}, rows.dtype(), std::make_shared<RotatedRows>(stream, heads, traditional),
                   {rows, cos, sin});
}

void RotatedRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  encoder.dispatch([in = token_rows(inputs[0]), rotation = token_rotation(inputs[1], inputs[2], traditional_),
                    tokens = out.shape(0), heads = heads_, dim = out.shape(2), type = *float_elem_type(out.dtype()),
                    target = out.data<void>()]() {
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        write_row(in.view, t * in.token_stride + int64_t(h) * dim * in.view.stride, dim, rotation, target, type,
                  (int64_t(t) * heads + h) * dim, t);
      }
    }
  });
}

std::vector<mx::Shape> RotatedRows::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& rows = inputs[0];
  return {mx::Shape{rows.shape(-2), heads_, rows.shape(-1) / heads_}};
}

bool RotatedRows::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const RotatedRows*>(&other);
  return o != nullptr && o->heads_ == heads_ && o->traditional_ == traditional_;
}

void RotatedRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.rotated_rows] runs on the CPU only");
}

}  // namespace mlx_attn
