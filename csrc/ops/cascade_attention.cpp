#include "csrc/ops/cascade_attention.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "csrc/core/argument_checks.h"
#include "csrc/cpu/paged_host.h"
#include "csrc/cpu/host.h"
#include "csrc/ops/cascade_merge_splits.h"
#include "csrc/ops/paged_attention.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_attn {
namespace {

using namespace cascade;

constexpr const char* kOp = "cascade_paged_attention";
constexpr int kPasses = 3;  // prefix, suffix, direct

int kv_count(const AttentionOptions& options) {
  return options.quantization.bits == 0 ? 2 : 6;
}

// The options of pass p: the prefix pass sees every prefix key (rows at or
// after its end), the suffix pass has no sinks (the merge counts them once).
AttentionOptions pass_options(AttentionOptions options, int pass) {
  options.output_lse = true;
  options.has_mask = false;
  options.lse_for_backward = false;
  if (pass == 0) {
    options.causal = false;
    options.window_size = 0;
  }
  if (pass != 2) options.has_sinks = false;
  return options;
}

// The paged primitive's inputs of pass p, over `q_rows` (its gathered rows).
std::vector<mx::array> pass_inputs(const std::vector<mx::array>& inputs, const AttentionOptions& options, int pass,
                                   const mx::array& q_rows) {
  const int kv = kv_count(options);
  std::vector<mx::array> in = {q_rows};
  in.insert(in.end(), inputs.begin() + 1, inputs.begin() + 1 + kv);
  const int base = 1 + kv + 4 * pass;
  in.insert(in.end(), inputs.begin() + base, inputs.begin() + base + 3);
  if (pass == 2 && options.has_sinks) in.push_back(inputs.back());
  return in;
}

// One pass as the dispatch runs it: the kernel call over buffers made when the primitive runs.
struct PassRun {
  cpu::KernelCall call{};
  const int32_t* rows = nullptr;
  int64_t row_count = 0;
  void* q_rows = nullptr;
};

}  // namespace

std::vector<mx::array> cascade_paged_attention(
    const mx::array& q, const std::vector<mx::array>& k_parts, const std::vector<mx::array>& v_parts,
    const std::vector<mx::array>& passes, const mx::array& suffix_index, const mx::array& prefix_index,
    const mx::array& direct_index, const mx::array& merge_sinks, const std::optional<mx::array>& sinks,
    AttentionOptions options, mx::StreamOrDevice s) {
  const size_t parts = options.quantization.bits == 0 ? 1 : 3;
  if (k_parts.size() != parts || v_parts.size() != parts) throw_invalid(kOp, "k_parts / v_parts: wrong count");
  if (passes.size() != 4 * kPasses) throw_invalid(kOp, "passes must be 12 arrays: 3 x (table, kv_lens, q_lens, rows)");
  if (q.ndim() != 3) throw_invalid(kOp, "q must be [total_q, q_heads, head_dim], got " + shape_string(q));
  options.has_mask = false;
  options.has_sinks = sinks.has_value();
  options.lse_for_backward = false;
  auto stream = mx::to_stream(s);
  if (stream.device.type != mx::Device::cpu) throw_invalid(kOp, "runs on the CPU only");
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), k_parts.begin(), k_parts.end());
  inputs.insert(inputs.end(), v_parts.begin(), v_parts.end());
  inputs.insert(inputs.end(), passes.begin(), passes.end());
  inputs.insert(inputs.end(), {suffix_index, prefix_index, direct_index, merge_sinks});
  if (sinks) inputs.push_back(*sinks);
  for (int pass = 0; pass < kPasses; ++pass) {  // each pass is a valid paged call over its rows
    const mx::array& rows = passes[4 * pass + 3];
    if (rows.ndim() != 1 || rows.dtype() != mx::int32) throw_invalid(kOp, "a pass's rows must be int32 [n]");
    if (rows.shape(0) == 0) continue;  // a pass without rows is not run
    mx::array q_rows({rows.shape(0), q.shape(1), q.shape(2)}, q.dtype(), nullptr, {});
    const auto description = describe_paged_attention(pass_inputs(inputs, options, pass, q_rows),
                                                      pass_options(options, pass));
    if (std::string reason = paged_unsupported_reason(description, mx::Device::cpu); !reason.empty()) {
      throw_invalid(kOp, reason);
    }
  }
  if (suffix_index.ndim() != 1 || suffix_index.shape(0) != q.shape(0) || direct_index.ndim() != 1 ||
      direct_index.shape(0) != q.shape(0) || prefix_index.ndim() != 2 || prefix_index.shape(1) != q.shape(0) ||
      prefix_index.shape(0) > 62 || merge_sinks.ndim() != 1 || merge_sinks.shape(0) != q.shape(1) ||
      merge_sinks.dtype() != mx::float32) {
    throw_invalid(kOp, "the merge's indices must be int32 [total_q] ([splits <= 62, total_q] for the prefix) and "
                       "merge_sinks float32 [q_heads]");
  }
  auto primitive = std::make_shared<CascadePagedAttention>(stream, options);
  auto shapes = primitive->output_shapes(inputs);
  return mx::array::make_arrays(std::move(shapes), {q.dtype(), mx::float32}, primitive, inputs);
}

std::vector<mx::Shape> CascadePagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& q = inputs[0];
  const int kv = kv_count(options_);
  const mx::array& v = inputs[1 + kv / 2];
  const int value_dim = options_.quantization.bits == 0 ? v.shape(3) : v.shape(3) * (32 / options_.quantization.bits);
  return {{q.shape(0), q.shape(1), value_dim}, {q.shape(0), q.shape(1)}};
}

// The message of mlx_attn.paged's inference-only wrapper (_INFERENCE_ONLY), which the tests match.
constexpr const char* kInferenceOnly =
    "paged_attention is inference only: it has no gradient (use mlx_attn.scaled_dot_product_attention "
    "on contiguous K/V to train)";

std::vector<mx::array> CascadePagedAttention::vjp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                                                  const std::vector<int>&, const std::vector<mx::array>&) {
  throw std::invalid_argument(kInferenceOnly);
}

std::vector<mx::array> CascadePagedAttention::jvp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                                                  const std::vector<int>&) {
  throw std::invalid_argument(kInferenceOnly);
}

std::pair<std::vector<mx::array>, std::vector<int>> CascadePagedAttention::vmap(const std::vector<mx::array>&,
                                                                                const std::vector<int>&) {
  throw std::invalid_argument(std::string("[") + kOp + "] has no vmap: call it once per batch of tables");
}

bool CascadePagedAttention::is_equivalent(const mx::Primitive& other) const {
  return options_ == static_cast<const CascadePagedAttention&>(other).options_;
}

namespace {

// Pass `pass`'s buffers (its gathered q rows, out, lse: temporaries of the
// evaluation) and its kernel call; raises the scratch size to the pass's.
PassRun prepare_pass(const std::vector<mx::array>& inputs, const AttentionOptions& base_options, int pass,
                     int value_dim, mx::cpu::CommandEncoder& encoder, Partials& partials, int64_t& scratch_floats) {
  const mx::array& q = inputs[0];
  const int kv = kv_count(base_options);
  const mx::array& rows = inputs[1 + kv + 4 * pass + 3];
  const int n = rows.shape(0);
  PassRun run;
  if (n == 0) return run;
  mx::array q_rows({n, q.shape(1), q.shape(2)}, q.dtype(), nullptr, {});
  mx::array out({n, q.shape(1), value_dim}, q.dtype(), nullptr, {});
  mx::array lse({n, q.shape(1)}, mx::float32, nullptr, {});
  for (auto* a : {&q_rows, &out, &lse}) a->set_data(mx::allocator::malloc(a->nbytes()));
  const auto in = pass_inputs(inputs, base_options, pass, q_rows);
  const AttentionOptions options = pass_options(base_options, pass);
  const PagedDescription d = describe_paged_attention(in, options);
  cpu::KernelCall& call = run.call;
  call.problem = d.problem;
  call.quantized = d.quantized;
  call.paged = d.paged;
  call.q = q_rows.data<void>();
  call.k = in[1].data<void>();
  call.v = in[1 + kv / 2].data<void>();
  if (options.quantization.bits != 0) {
    call.quantized.k_scales = in[2].data<void>();
    call.quantized.k_biases = in[3].data<void>();
    call.quantized.v_scales = in[5].data<void>();
    call.quantized.v_biases = in[6].data<void>();
  }
  call.paged.block_table = in[1 + kv].data<int32_t>();
  call.paged.kv_lens = in[2 + kv].data<int32_t>();
  call.paged.q_lens = in[3 + kv].data<int32_t>();
  if (options.has_sinks) call.sinks = in.back().data<void>();
  call.out = out.data<void>();
  call.lse = lse.data<float>();
  cpu::plan_paged_work(call);
  scratch_floats = std::max(scratch_floats, cpu::scratch_size(call));
  run.rows = rows.data<int32_t>();
  run.row_count = n;
  run.q_rows = q_rows.data<void>();
  partials = partials_of(out, lse);
  for (auto* a : {&q_rows, &out, &lse}) encoder.add_temporary(*a);
  return run;
}

// q as the gather reads it: bytes, element strides.
struct QView {
  const char* data;
  int64_t element, strides[3];
  int heads, head_dim;
};

// The pass's rows of q, packed [n, Hq, D].
void gather_rows(const PassRun& r, const QView& q) {
  char* dst = static_cast<char*>(r.q_rows);
  for (int64_t i = 0; i < r.row_count; ++i) {
    const int64_t row = r.rows[i];
    for (int h = 0; h < q.heads; ++h) {
      const char* src = q.data + (row * q.strides[0] + h * q.strides[1]) * q.element;
      char* to = dst + ((i * q.heads + h) * q.head_dim) * q.element;
      if (q.strides[2] == 1) {
        std::memcpy(to, src, q.head_dim * q.element);
      } else {
        for (int j = 0; j < q.head_dim; ++j) {
          std::memcpy(to + j * q.element, src + j * q.strides[2] * q.element, q.element);
        }
      }
    }
  }
}

}  // namespace

void CascadePagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& o : outputs) encoder.set_output_array(o);
  const mx::array& q = inputs[0];
  const int value_dim = outputs[0].shape(2);
  PassRun runs[kPasses];
  Partials partials[kPasses];
  int64_t scratch_floats = 0;
  for (int pass = 0; pass < kPasses; ++pass) {
    runs[pass] = prepare_pass(inputs, options_, pass, value_dim, encoder, partials[pass], scratch_floats);
  }
  mx::array scratch({int(std::max<int64_t>(scratch_floats, 1))}, mx::float32, nullptr, {});
  scratch.set_data(mx::allocator::malloc(scratch.nbytes()));
  float* scratch_data = scratch.data<float>();
  encoder.add_temporary(std::move(scratch));
  const QView view{static_cast<const char*>(q.data<void>()), int64_t(q.itemsize()),
                   {q.strides()[0], q.strides()[1], q.strides()[2]}, q.shape(1), q.shape(2)};

  const int base = 1 + kv_count(options_) + 4 * kPasses;
  auto run = [&](auto typed) {
    using T = decltype(typed);
    MergeCall<T> c{};
    c.prefix = partials[0];
    c.suffix = partials[1];
    c.direct = partials[2];
    c.suffix_index = inputs[base].data<int32_t>();
    c.prefix_index = inputs[base + 1].data<int32_t>();
    c.direct_index = inputs[base + 2].data<int32_t>();
    c.sinks = inputs[base + 3].data<float>();
    c.index_strides[0] = inputs[base].strides()[0];
    c.index_strides[1] = inputs[base + 1].strides()[0];
    c.index_strides[2] = inputs[base + 1].strides()[1];
    c.index_strides[3] = inputs[base + 2].strides()[0];
    c.sinks_stride = inputs[base + 3].strides()[0];
    c.rows = outputs[0].shape(0);
    c.heads = q.shape(1);
    c.value_dim = value_dim;
    c.splits = inputs[base + 1].shape(0);
    c.out = outputs[0].data<T>();
    c.lse = outputs[1].data<float>();
    encoder.dispatch([=]() {
      // The passes as one pool run, heaviest items first (a prefix item is a
      // tile of the group's rows over a key split, a direct row reads its
      // whole table, a suffix row only its own pages): no barrier between the
      // passes, so a thread that ends its prefix item early takes suffix rows.
      cpu::KernelCall calls[kPasses];
      std::vector<cpu::PagedItem> items[kPasses];
      int count = 0;
      for (int pass : {0, 2, 1}) {
        const PassRun& r = runs[pass];
        if (r.row_count == 0) continue;
        gather_rows(r, view);
        calls[count] = r.call;
        items[count] = cpu::plan_paged_items(calls[count]);
        ++count;
      }
      cpu::run_attention_calls(calls, count, scratch_data);
      merge_splits(c);
    });
  };
  switch (q.dtype()) {
    case mx::float32: run(float{}); break;
    case mx::float16: run(mx::float16_t{}); break;
    case mx::bfloat16: run(mx::bfloat16_t{}); break;
    default: throw std::invalid_argument("[cascade_paged_attention] q must be float32, float16 or bfloat16");
  }
}

void CascadePagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_attn.cascade_paged_attention] runs on the CPU only");
}

}  // namespace mlx_attn
