#include "csrc/ops/metal_paged_attention.h"

#include <stdexcept>
#include <string>


namespace mlx_attn {

namespace {

[[noreturn]] void invalid(const std::string& message) {
  throw std::invalid_argument("[mlx_attn.paged_attention] internal check failed: " + message +
                              "; mlx_attn.paged_attention validates its arguments");
}

ElemType paged_elem_type(mx::Dtype t) {
  if (t == mx::float32) return ElemType::float32;
  if (t == mx::float16) return ElemType::float16;
  if (t == mx::bfloat16) return ElemType::bfloat16;
  invalid("q.dtype in {float32, float16, bfloat16}");
}

}  // namespace

PagedProblem describe_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& kv_lens) {
  const Quantization& qz = options.quantization;
  const bool quantized = qz.bits != 0;
  const size_t pages_end = quantized ? 7 : 3;
  if (inputs.size() != pages_end + 1 + options.has_sinks) invalid("the number of inputs");
  const mx::array& q = inputs[0];
  const mx::array& k = inputs[1];
  const mx::array& v = inputs[quantized ? 4 : 2];
  const mx::array& table = inputs[pages_end];
  if (q.ndim() != 3 || k.ndim() != 4 || v.ndim() != 4 || table.ndim() != 2) invalid("input ranks");
  if (table.dtype() != mx::int32) invalid("block_table int32");
  for (size_t i = 1; i < pages_end; ++i) {
    const bool packed = quantized && (i == 1 || i == 4);
    if (inputs[i].ndim() != 4 || inputs[i].dtype() != (packed ? mx::uint32 : q.dtype())) {
      invalid("pages of rank 4 in q's dtype (quantized: uint32 words, scales and biases in q's dtype)");
    }
  }
  if (int(q_lens.size()) != table.shape(0) || kv_lens.size() != q_lens.size()) invalid("one length per sequence");
  int64_t total_q = 0;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    if (q_lens[b] < 0 || q_lens[b] > kv_lens[b]) invalid("0 <= q_lens[b] <= kv_lens[b]");
    const int64_t pages = (int64_t(kv_lens[b]) + k.shape(2) - 1) / k.shape(2);
    if (pages > table.shape(1)) invalid("kv_lens within the block table");
    total_q += q_lens[b];
  }
  if (total_q != q.shape(0)) invalid("q rows == sum of q_lens");

  PagedProblem s;
  AttentionProblem& a = s.attention;
  a.dtype = paged_elem_type(q.dtype());
  a.batch = int(q_lens.size());
  a.q_heads = q.shape(1);
  a.kv_heads = k.shape(1);
  if (a.kv_heads < 1 || a.q_heads % a.kv_heads != 0) invalid("q heads a multiple of k/v heads");
  a.group = a.q_heads / a.kv_heads;
  a.q_len = q.shape(0);
  a.head_dim = q.shape(2);
  const int words_to_features = quantized ? 32 / qz.bits : 1;
  a.value_dim = v.shape(3) * words_to_features;
  if (k.shape(3) * words_to_features != a.head_dim) invalid("q and k: same head dim");
  a.q_strides[0] = 0;
  a.q_strides[1] = q.strides()[1];
  a.q_strides[2] = q.strides()[0];
  a.q_strides[3] = q.strides()[2];
  for (int i = 0; i < 4; ++i) {
    a.k_strides[i] = k.strides()[i];
    a.v_strides[i] = v.strides()[i];
  }
  a.q_offset = q.offset() / int64_t(q.itemsize());
  a.k_offset = k.offset() / int64_t(k.itemsize());
  a.v_offset = v.offset() / int64_t(v.itemsize());
  AttentionOptions causal_options = options;  // a window implies causal here (the caller's contract)
  causal_options.causal = options.causal || options.window_size > 0;
  if (const char* broken = set_option_params(a, causal_options)) invalid(broken);
  a.mask_kind = MaskKind::none;
  if (options.has_sinks) {
    const mx::array& sinks = inputs.back();
    if (sinks.ndim() != 1 || sinks.shape(0) != a.q_heads || sinks.dtype() != q.dtype()) invalid("sinks [Hq], q's dtype");
    a.has_sinks = 1;
    a.sinks_stride = sinks.strides()[0];
  }
  s.q_lens = q_lens;
  s.kv_lens = kv_lens;
  s.page_size = k.shape(2);
  s.table_stride = table.strides()[0];
  if (quantized) {
    s.quantized.bits = qz.bits;
    s.quantized.group_size = qz.group_size;
    for (int i = 0; i < 4; ++i) {
      s.quantized.k_scale_strides[i] = inputs[2].strides()[i];
      s.quantized.k_bias_strides[i] = inputs[3].strides()[i];
      s.quantized.v_scale_strides[i] = inputs[5].strides()[i];
      s.quantized.v_bias_strides[i] = inputs[6].strides()[i];
    }
  }
  return s;
}

void MetalPagedAttention::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn] MetalPagedAttention runs on a GPU stream only");
}

bool MetalPagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MetalPagedAttention&>(other);
  return options_ == o.options_ && q_lens_ == o.q_lens_ && kv_lens_ == o.kv_lens_;
}

CascadeProblem describe_cascade_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& own_kv_lens, const std::vector<int32_t>& prefix_lens,
    const std::vector<int32_t>& prefix_groups) {
  if (inputs.size() < 2) invalid("the number of inputs");
  const mx::array& prefix_table = inputs.back();
  if (prefix_table.ndim() != 2 || prefix_table.dtype() != mx::int32) invalid("prefix_table int32 [groups, pages]");
  if (int(prefix_lens.size()) != prefix_table.shape(0) || prefix_groups.size() != q_lens.size()) {
    invalid("one prefix length per group, one group per sequence");
  }
  CascadeProblem c;
  c.own = describe_paged_attention({inputs.begin(), inputs.end() - 1}, options, q_lens, own_kv_lens);
  for (size_t g = 0; g < prefix_lens.size(); ++g) {
    const int64_t pages = (int64_t(prefix_lens[g]) + c.own.page_size - 1) / c.own.page_size;
    if (prefix_lens[g] < 0 || pages > prefix_table.shape(1)) invalid("prefix_lens within the prefix table");
  }
  c.prefix_lens = prefix_lens;
  c.prefix_groups = prefix_groups;
  c.prefix_table_stride = prefix_table.strides()[0];
  return c;
}

void MetalCascadePagedAttention::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn] MetalCascadePagedAttention runs on a GPU stream only");
}

bool MetalCascadePagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MetalCascadePagedAttention&>(other);
  return options_ == o.options_ && lengths_ == o.lengths_;
}

std::vector<mx::array> metal_cascade_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& own_kv_lens, const std::vector<int32_t>& prefix_lens,
    const std::vector<int32_t>& prefix_groups, mx::StreamOrDevice s) {
  const CascadeProblem problem =
      describe_cascade_paged_attention(inputs, options, q_lens, own_kv_lens, prefix_lens, prefix_groups);
  if (const std::string reason = plan_cascade_paged_attention(problem).reason; !reason.empty()) {
    throw std::invalid_argument("[mlx_attn.cascade_paged_attention] " + reason);
  }
  const mx::array& q = inputs[0];
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), problem.own.attention.value_dim}};
  std::vector<mx::Dtype> dtypes = {q.dtype()};
  if (options.output_lse) {
    shapes.push_back({q.shape(0), q.shape(1)});
    dtypes.push_back(mx::float32);
  }
  auto primitive = std::make_shared<MetalCascadePagedAttention>(
      mx::to_stream(s), options, std::vector<std::vector<int32_t>>{q_lens, own_kv_lens, prefix_lens, prefix_groups});
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), primitive, inputs);
}

std::vector<mx::array> metal_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options, const std::vector<int32_t>& q_lens,
    const std::vector<int32_t>& kv_lens, mx::StreamOrDevice s) {
  const PagedProblem problem = describe_paged_attention(inputs, options, q_lens, kv_lens);
  if (const std::string reason = plan_paged_attention(problem).reason; !reason.empty()) {
    throw std::invalid_argument("[mlx_attn.paged_attention] " + reason);
  }
  const mx::array& q = inputs[0];
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), problem.attention.value_dim}};
  std::vector<mx::Dtype> dtypes = {q.dtype()};
  if (options.output_lse) {
    shapes.push_back({q.shape(0), q.shape(1)});
    dtypes.push_back(mx::float32);
  }
  auto primitive = std::make_shared<MetalPagedAttention>(mx::to_stream(s), options, q_lens, kv_lens);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), primitive, inputs);
}

}  // namespace mlx_attn
