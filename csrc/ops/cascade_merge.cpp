#include "csrc/ops/cascade_merge.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "csrc/core/argument_checks.h"
#include "csrc/ops/cascade_merge_splits.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_attn {
namespace {

using namespace cascade;

constexpr const char* kOp = "cascade_merge";

void check_pass(const char* name, const mx::array& out, const mx::array& lse, mx::Dtype dtype, int heads,
                int value_dim) {
  if (out.ndim() != 3 || out.shape(1) != heads || out.shape(2) != value_dim || out.dtype() != dtype) {
    throw_invalid(kOp, std::string(name) + " out must be [rows, " + std::to_string(heads) + ", " +
                           std::to_string(value_dim) + "] of " + dtype_string(dtype) + ", got " + shape_string(out) +
                           " " + dtype_string(out.dtype()));
  }
  if (lse.ndim() != 2 || lse.shape(0) != out.shape(0) || lse.shape(1) != heads || lse.dtype() != mx::float32) {
    throw_invalid(kOp, std::string(name) + " lse must be float32 [" + std::to_string(out.shape(0)) + ", " +
                           std::to_string(heads) + "], got " + shape_string(lse));
  }
}

}  // namespace

std::vector<mx::array> cascade_merge(
    const mx::array& suffix_out, const mx::array& suffix_lse,
    const mx::array& prefix_out, const mx::array& prefix_lse,
    const mx::array& direct_out, const mx::array& direct_lse,
    const mx::array& suffix_index, const mx::array& prefix_index, const mx::array& direct_index,
    const mx::array& sinks, mx::Dtype dtype, mx::StreamOrDevice s) {
  if (!float_elem_type(dtype)) throw_invalid(kOp, "dtype must be float32, float16 or bfloat16");
  if (sinks.ndim() != 1 || sinks.dtype() != mx::float32) throw_invalid(kOp, "sinks must be float32 [heads]");
  const int heads = sinks.shape(0);
  const int value_dim = suffix_out.ndim() == 3 ? suffix_out.shape(2) : -1;
  check_pass("suffix", suffix_out, suffix_lse, dtype, heads, value_dim);
  check_pass("prefix", prefix_out, prefix_lse, dtype, heads, value_dim);
  check_pass("direct", direct_out, direct_lse, dtype, heads, value_dim);
  if (suffix_index.ndim() != 1 || suffix_index.dtype() != mx::int32) {
    throw_invalid(kOp, "suffix_index must be int32 [rows]");
  }
  const int rows = suffix_index.shape(0);
  if (direct_index.ndim() != 1 || direct_index.shape(0) != rows || direct_index.dtype() != mx::int32) {
    throw_invalid(kOp, "direct_index must be int32 [" + std::to_string(rows) + "]");
  }
  if (prefix_index.ndim() != 2 || prefix_index.shape(1) != rows || prefix_index.dtype() != mx::int32 ||
      prefix_index.shape(0) > 62) {
    throw_invalid(kOp, "prefix_index must be int32 [splits <= 62, " + std::to_string(rows) + "]");
  }
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) throw_invalid(kOp, "runs on the CPU only");
  std::vector<mx::array> inputs = {suffix_out, suffix_lse, prefix_out,   prefix_lse,   direct_out, direct_lse,
                                   suffix_index, prefix_index, direct_index, sinks};
  auto primitive = std::make_shared<CascadeMerge>(stream);
  auto shapes = primitive->output_shapes(inputs);
  return mx::array::make_arrays(std::move(shapes), {dtype, mx::float32}, primitive, inputs);
}

std::vector<mx::Shape> CascadeMerge::output_shapes(const std::vector<mx::array>& inputs) {
  const int rows = inputs[6].shape(0), heads = inputs[9].shape(0), value_dim = inputs[0].shape(2);
  return {{rows, heads, value_dim}, {rows, heads}};
}

void CascadeMerge::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& o : outputs) encoder.set_output_array(o);
  auto fill = [&](auto typed) {
    using T = decltype(typed);
    MergeCall<T> c{};
    c.suffix = partials_of(inputs[0], inputs[1]);
    c.prefix = partials_of(inputs[2], inputs[3]);
    c.direct = partials_of(inputs[4], inputs[5]);
    c.suffix_index = inputs[6].data<int32_t>();
    c.prefix_index = inputs[7].data<int32_t>();
    c.direct_index = inputs[8].data<int32_t>();
    c.sinks = inputs[9].data<float>();
    c.index_strides[0] = inputs[6].strides()[0];
    c.index_strides[1] = inputs[7].strides()[0];
    c.index_strides[2] = inputs[7].strides()[1];
    c.index_strides[3] = inputs[8].strides()[0];
    c.sinks_stride = inputs[9].strides()[0];
    c.rows = outputs[0].shape(0);
    c.heads = outputs[0].shape(1);
    c.value_dim = outputs[0].shape(2);
    c.splits = inputs[7].shape(0);
    c.out = outputs[0].data<T>();
    c.lse = outputs[1].data<float>();
    encoder.dispatch([c]() { merge_splits(c); });
  };
  switch (outputs[0].dtype()) {
    case mx::float32: fill(float{}); break;
    case mx::float16: fill(mx::float16_t{}); break;
    case mx::bfloat16: fill(mx::bfloat16_t{}); break;
    default: throw std::invalid_argument("[cascade_merge] dtype must be float32, float16 or bfloat16");
  }
}

void CascadeMerge::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.cascade_merge] runs on the CPU only");
}

}  // namespace mlx_attn
