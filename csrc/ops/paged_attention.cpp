#include "csrc/ops/paged_attention.h"
#include "csrc/core/argument_checks.h"

#include <cmath>
#include <stdexcept>

#include "csrc/cpu/host.h"
#include "csrc/cpu/paged_host.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_attn {

namespace {

[[noreturn]] void invalid(const std::string& message) {
  throw_invalid("mlx_attn.paged_attention", message);
}

void require_rank(const char* name, const mx::array& a, int rank, const char* meaning) {
  if (int(a.ndim()) != rank) {
    invalid(std::string(name) + " must have rank " + std::to_string(rank) + " " + meaning + ", got shape " +
            shape_string(a));
  }
}

void require_dtype(const char* name, const mx::array& a, mx::Dtype dtype) {
  if (a.dtype() != dtype) {
    invalid(std::string(name) + " must be " + dtype_string(dtype) + ", got " + dtype_string(a.dtype()));
  }
}

// Features per row of one page array (float pages, or a quantized triple at
// `t`), checked: rank 4, dtypes, scales and biases matching the packed words.
int page_features(const char* name, const mx::array* t, mx::Dtype dtype, const Quantization& qz) {
  require_rank(name, t[0], 4, "[num_pages, kv_heads, page_size, features]");
  if (qz.bits == 0) {
    require_dtype(name, t[0], dtype);
    return t[0].shape(3);
  }
  require_dtype(name, t[0], mx::uint32);
  for (int i = 1; i < 3; ++i) {
    const std::string part = std::string(name) + (i == 1 ? " scales" : " biases");
    require_rank(part.c_str(), t[i], 4, "[num_pages, kv_heads, page_size, groups]");
    require_dtype(part.c_str(), t[i], dtype);
  }
  const int features = t[0].shape(3) * (32 / qz.bits);
  for (int i = 1; i < 3; ++i) {
    for (int axis = 0; axis < 3; ++axis) {
      if (t[i].shape(axis) != t[0].shape(axis)) {
        invalid(std::string(name) + " packed " + shape_string(t[0]) + " and its scales/biases " +
                shape_string(t[i]) + " disagree on [num_pages, kv_heads, page_size]");
      }
    }
    if (features == 0 || features % qz.group_size != 0 || t[i].shape(3) != features / qz.group_size) {
      invalid(std::string(name) + " packed " + shape_string(t[0]) + " and scales " + shape_string(t[i]) +
              " do not match bits=" + std::to_string(qz.bits) + ", group_size=" + std::to_string(qz.group_size));
    }
  }
  return features;
}

int kv_arrays(const Quantization& qz) {
  return qz.bits == 0 ? 2 : 6;
}

}  // namespace

namespace {

void check_quantization(const Quantization& qz) {
  if (qz.bits != 0 && qz.bits != 4 && qz.bits != 8) invalid("bits must be 4 or 8, got " + std::to_string(qz.bits));
  if (qz.bits != 0 && qz.group_size != 32 && qz.group_size != 64 && qz.group_size != 128) {
    invalid("group_size must be 32, 64 or 128, got " + std::to_string(qz.group_size));
  }
}

// The primitive's inputs by name (k and v: the first array of their parts),
// checked for rank, dtype and agreeing sizes.
struct PagedArrays {
  const mx::array& q;
  const mx::array* k;
  const mx::array* v;
  const mx::array& table;
  const mx::array& kv_lens;
  const mx::array& q_lens;
  int head_dim, value_dim;
};

PagedArrays paged_arrays(const std::vector<mx::array>& inputs, const AttentionOptions& options) {
  const Quantization& qz = options.quantization;
  const int kv_count = kv_arrays(qz);
  const size_t expected = 1 + kv_count + 3 + options.has_sinks;
  if (inputs.size() != expected) {
    invalid("expected " + std::to_string(expected) + " inputs, got " + std::to_string(inputs.size()));
  }
  const mx::array& q = inputs[0];
  require_rank("q", q, 3, "[total_q, q_heads, head_dim]");
  if (q.dtype() != mx::float32 && q.dtype() != mx::float16 && q.dtype() != mx::bfloat16) {
    invalid("q must be float16, bfloat16 or float32, got " + dtype_string(q.dtype()));
  }
  const mx::array* k = &inputs[1];
  const mx::array* v = &inputs[1 + kv_count / 2];
  PagedArrays a{q, k, v, inputs[1 + kv_count], inputs[2 + kv_count], inputs[3 + kv_count],
                page_features("k_pages", k, q.dtype(), qz), page_features("v_pages", v, q.dtype(), qz)};
  require_rank("block_table", a.table, 2, "[batch, max_pages]");
  require_dtype("block_table", a.table, mx::int32);
  require_rank("kv_lens", a.kv_lens, 1, "[batch]");
  require_dtype("kv_lens", a.kv_lens, mx::int32);
  require_rank("q_lens", a.q_lens, 1, "[batch]");
  require_dtype("q_lens", a.q_lens, mx::int32);
  const int batch = a.table.shape(0);
  if (a.kv_lens.shape(0) != batch || a.q_lens.shape(0) != batch) {
    invalid("kv_lens " + shape_string(a.kv_lens) + " and q_lens " + shape_string(a.q_lens) + " must be [batch] = [" +
            std::to_string(batch) + "] (block_table's rows)");
  }
  for (int axis = 0; axis < 3; ++axis) {
    if (k[0].shape(axis) != v[0].shape(axis)) {
      invalid("k_pages " + shape_string(k[0]) + " and v_pages " + shape_string(v[0]) +
              " must agree on [num_pages, kv_heads, page_size]");
    }
  }
  if (a.head_dim != q.shape(2)) {
    invalid("q " + shape_string(q) + " and k_pages need one head dim, got " + std::to_string(a.head_dim));
  }
  if (k[0].shape(2) < 1) invalid("k_pages must have page_size >= 1, got shape " + shape_string(k[0]));
  return a;
}

// The problem's sizes and strides: q [total_q, Hq, D] seen as [1, Hq, total_q, D].
AttentionProblem paged_problem_shape(const PagedArrays& a) {
  AttentionProblem p{};
  const mx::Dtype dtype = a.q.dtype();
  p.dtype = dtype == mx::float32 ? ElemType::float32 : (dtype == mx::float16 ? ElemType::float16 : ElemType::bfloat16);
  p.batch = a.table.shape(0);
  p.q_heads = a.q.shape(1);
  p.kv_heads = a.k[0].shape(1);
  if (p.kv_heads < 1 || p.q_heads % p.kv_heads != 0) {
    invalid("q heads (" + std::to_string(p.q_heads) + ") must be a multiple of k_pages' kv heads (" +
            std::to_string(p.kv_heads) + ")");
  }
  p.group = p.q_heads / p.kv_heads;
  p.q_len = a.q.shape(0);
  p.kv_len = int(std::min<int64_t>(int64_t(a.table.shape(1)) * a.k[0].shape(2), INT32_MAX));
  p.head_dim = a.head_dim;
  p.value_dim = a.value_dim;
  p.q_strides[0] = 0;
  p.q_strides[1] = a.q.strides()[1];
  p.q_strides[2] = a.q.strides()[0];
  p.q_strides[3] = a.q.strides()[2];
  for (int i = 0; i < 4; ++i) {
    p.k_strides[i] = a.k[0].strides()[i];
    p.v_strides[i] = a.v[0].strides()[i];
  }
  return p;
}

// The options' part of the problem (scale, softcap, causal / window, lse) and the sinks.
void apply_paged_options(AttentionProblem& p, const AttentionOptions& options, const std::vector<mx::array>& inputs) {
  if (const char* broken = set_option_params(p, options)) invalid(std::string("expected ") + broken);
  p.mask_kind = MaskKind::none;
  if (options.has_sinks) {
    const mx::array& sinks = inputs.back();
    if (sinks.ndim() != 1 || sinks.shape(0) != p.q_heads) {
      invalid("sinks must have shape [q_heads] = [" + std::to_string(p.q_heads) + "], got " + shape_string(sinks));
    }
    require_dtype("sinks", sinks, inputs[0].dtype());
    p.has_sinks = 1;
    p.sinks_stride = sinks.strides()[0];
  }
}

}  // namespace

PagedDescription describe_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options) {
  const Quantization& qz = options.quantization;
  check_quantization(qz);
  const PagedArrays a = paged_arrays(inputs, options);
  PagedDescription d{};
  d.problem = paged_problem_shape(a);
  apply_paged_options(d.problem, options, inputs);
  if (qz.bits != 0) {
    d.quantized.bits = qz.bits;
    d.quantized.group_size = qz.group_size;
    for (int i = 0; i < 4; ++i) {
      d.quantized.k_scale_strides[i] = a.k[1].strides()[i];
      d.quantized.k_bias_strides[i] = a.k[2].strides()[i];
      d.quantized.v_scale_strides[i] = a.v[1].strides()[i];
      d.quantized.v_bias_strides[i] = a.v[2].strides()[i];
    }
  }
  d.paged.table_strides[0] = a.table.strides()[0];
  d.paged.table_strides[1] = a.table.strides()[1];
  d.paged.max_pages = a.table.shape(1);
  d.paged.page_size = a.k[0].shape(2);
  d.paged.num_pages = a.k[0].shape(0);
  d.paged.kv_len_stride = a.kv_lens.strides()[0];
  d.paged.q_len_stride = a.q_lens.strides()[0];
  d.paged.total_q = a.q.shape(0);
  return d;
}

std::string paged_unsupported_reason(const PagedDescription& description, mx::Device::DeviceType device) {
  if (device == mx::Device::gpu) return "no fused Metal paged attention kernel in this build";
  return cpu::unsupported_reason(description.problem);
}

std::vector<mx::array> paged_attention(
    const mx::array& q,
    const std::vector<mx::array>& k_parts,
    const std::vector<mx::array>& v_parts,
    const mx::array& block_table,
    const mx::array& kv_lens,
    const mx::array& q_lens,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s) {
  const size_t parts = options.quantization.bits == 0 ? 1 : 3;
  if (k_parts.size() != parts || v_parts.size() != parts) {
    invalid(options.quantization.bits == 0 ? "k_pages and v_pages must be one array each"
                                   : "k_pages and v_pages must be (packed, scales, biases) triples");
  }
  options.has_mask = false;
  options.has_sinks = sinks.has_value();
  options.lse_for_backward = false;
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), k_parts.begin(), k_parts.end());
  inputs.insert(inputs.end(), v_parts.begin(), v_parts.end());
  inputs.insert(inputs.end(), {block_table, kv_lens, q_lens});
  if (sinks) inputs.push_back(*sinks);
  const PagedDescription description = describe_paged_attention(inputs, options);
  auto stream = mx::to_stream(s);
  if (std::string reason = paged_unsupported_reason(description, stream.device.type); !reason.empty()) {
    invalid(reason);
  }
  auto primitive = std::make_shared<PagedAttention>(stream, options);
  auto shapes = primitive->output_shapes(inputs);
  std::vector<mx::Dtype> dtypes = {q.dtype()};
  if (options.output_lse) dtypes.push_back(mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

int PagedAttention::value_dim(const std::vector<mx::array>& inputs) const {
  if (options_.quantization.bits == 0) return inputs[2].shape(3);
  return inputs[4].shape(3) * (32 / options_.quantization.bits);
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& q = inputs[0];
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), value_dim(inputs)}};
  if (options_.output_lse) shapes.push_back({q.shape(0), q.shape(1)});
  return shapes;
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return options_ == o.options_;
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  const PagedDescription d = describe_paged_attention(inputs, options_);
  cpu::KernelCall call{};
  call.problem = d.problem;
  call.quantized = d.quantized;
  call.paged = d.paged;
  if (outputs[0].size() == 0) return;  // no rows, or no heads
  const int kv_count = kv_arrays(options_.quantization);
  call.q = inputs[0].data<void>();
  call.k = inputs[1].data<void>();
  call.v = inputs[1 + kv_count / 2].data<void>();
  if (options_.quantization.bits != 0) {
    call.quantized.k_scales = inputs[2].data<void>();
    call.quantized.k_biases = inputs[3].data<void>();
    call.quantized.v_scales = inputs[5].data<void>();
    call.quantized.v_biases = inputs[6].data<void>();
  }
  call.paged.block_table = inputs[1 + kv_count].data<int32_t>();
  call.paged.kv_lens = inputs[2 + kv_count].data<int32_t>();
  call.paged.q_lens = inputs[3 + kv_count].data<int32_t>();
  if (options_.has_sinks) call.sinks = inputs.back().data<void>();
  call.out = outputs[0].data<void>();
  call.lse = options_.output_lse ? outputs[1].data<float>() : nullptr;
  cpu::plan_paged_work(call);

  // Tile scratch only (O(threads x rows x D)), from MLX's allocator so it
  // shows in MLX's memory statistics; the work list is O(query blocks).
  mx::array scratch({int(cpu::scratch_size(call))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& o : outputs) encoder.set_output_array(o);
  encoder.dispatch([call, buffer = scratch.data<float>()]() { cpu::run_paged_attention(call, buffer); });
  encoder.add_temporary(std::move(scratch));
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.paged_attention] no fused Metal paged attention kernel in this build");
}

}  // namespace mlx_attn
