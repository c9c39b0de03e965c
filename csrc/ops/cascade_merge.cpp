#include "csrc/ops/cascade_merge.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "csrc/core/argument_checks.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_attn {
namespace {

constexpr const char* kOp = "cascade_merge";

// One pass's partials as the merge reads them: element strides, so a view is read in place.
struct Partials {
  const void* out = nullptr;
  const float* lse = nullptr;
  int64_t out_strides[3] = {0, 0, 0};
  int64_t lse_strides[2] = {0, 0};
};

Partials partials_of(const mx::array& out, const mx::array& lse) {
  Partials p;
  if (out.size() == 0) return p;
  p.out = out.data<void>();
  p.lse = lse.data<float>();
  for (int i = 0; i < 3; ++i) p.out_strides[i] = out.strides()[i];
  for (int i = 0; i < 2; ++i) p.lse_strides[i] = lse.strides()[i];
  return p;
}

template <typename T>
float value_at(const void* p, int64_t i) {
  return float(static_cast<const T*>(p)[i]);
}

template <typename T>
struct MergeCall {
  Partials suffix, prefix, direct;
  const int32_t* suffix_index;
  const int32_t* prefix_index;  // [splits, rows]
  const int32_t* direct_index;
  const float* sinks;
  int64_t index_strides[4];  // suffix, prefix split, prefix row, direct
  int64_t sinks_stride;
  int64_t rows, heads, value_dim, splits;
  T* out;
  float* lse;
};

// The log-sum-exp merge of one row's partials (the split-K merge, n-way): the
// largest lse (or sink) as the shift, each partial weighted by exp(lse - top),
// the sink adding exp(sink - top) to the total and nothing to the output.
template <typename T>
void merge_rows(const MergeCall<T>& c) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kMaxParts = 64;
  const Partials* from[kMaxParts];
  int64_t at[kMaxParts];
  float weight[kMaxParts];
  for (int64_t t = 0; t < c.rows; ++t) {
    const int32_t d = c.direct_index[t * c.index_strides[3]];
    for (int64_t h = 0; h < c.heads; ++h) {
      T* out = c.out + (t * c.heads + h) * c.value_dim;
      float* lse = c.lse + t * c.heads + h;
      if (d >= 0) {  // a direct row: its pass already holds its whole result
        const Partials& p = c.direct;
        const int64_t base = d * p.out_strides[0] + h * p.out_strides[1];
        for (int64_t j = 0; j < c.value_dim; ++j) out[j] = T(value_at<T>(p.out, base + j * p.out_strides[2]));
        *lse = p.lse[d * p.lse_strides[0] + h * p.lse_strides[1]];
        continue;
      }
      int parts = 0;
      auto add = [&](const Partials& p, int32_t row) {
        if (row < 0) return;
        from[parts] = &p;
        at[parts] = row;
        weight[parts] = p.lse[row * p.lse_strides[0] + h * p.lse_strides[1]];
        ++parts;
      };
      add(c.suffix, c.suffix_index[t * c.index_strides[0]]);
      for (int64_t s = 0; s < c.splits; ++s) {
        add(c.prefix, c.prefix_index[s * c.index_strides[1] + t * c.index_strides[2]]);
      }
      const float sink = c.sinks[h * c.sinks_stride];
      float top = sink;
      for (int i = 0; i < parts; ++i) top = std::fmax(top, weight[i]);
      if (top == kNegInf) top = 0.0f;  // no key and no sink: any finite shift
      float total = std::exp(sink - top);
      for (int i = 0; i < parts; ++i) {
        weight[i] = std::exp(weight[i] - top);
        total += weight[i];
      }
      const float inv = total == 0.0f ? 0.0f : 1.0f / total;
      for (int64_t j = 0; j < c.value_dim; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < parts; ++i) {
          const Partials& p = *from[i];
          acc += weight[i] * value_at<T>(p.out, at[i] * p.out_strides[0] + h * p.out_strides[1] + j * p.out_strides[2]);
        }
        out[j] = T(acc * inv);
      }
      *lse = total == 0.0f ? kNegInf : top + std::log(total);
    }
  }
}

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
    encoder.dispatch([c]() { merge_rows(c); });
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
