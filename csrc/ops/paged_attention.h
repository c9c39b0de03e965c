// Paged, ragged attention (mlx_attn.paged_attention): packed query rows of a
// batch of sequences over K/V pages addressed through a block table, float or
// quantized (mx.quantize triples per page). One primitive; on the CPU the
// fused kernel's tile loop with the paged K/V layout (csrc/cpu/kernel_impl.h,
// PagedLayout; planning in csrc/cpu/paged_dispatch.cpp). Inference only.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "csrc/ops/attention.h"

namespace mlx_attn {

// The problem of the primitive's inputs, in this order:
//   q [total_q, Hq, D]; K/V pages: k_pages [N, Hkv, P, D], v_pages [N, Hkv, P, Dv]
//   (float) or the six arrays k_packed, k_scales, k_biases, v_packed,
//   v_scales, v_biases (quantized); block_table int32 [B, max_pages];
//   kv_lens, q_lens int32 [B]; then sinks [Hq] when options.has_sinks.
// The AttentionProblem sees q as [1, Hq, total_q, D] (batch = B sequences,
// q_len = total_q, kv_len = max_pages * P: per-sequence lengths are read
// when the call runs) and K/V through the pages' strides. Buffer pointers
// are left null. Throws std::invalid_argument naming the argument.
struct PagedDescription {
  AttentionProblem problem;
  cpu::QuantizedKV quantized;
  cpu::PagedKV paged;
};
PagedDescription describe_paged_attention(
    const std::vector<mx::array>& inputs, const AttentionOptions& options);

// Empty when the fused paged kernels of `device` handle the problem, else
// why not. The one home of the paged support rule (Python asks it).
std::string paged_unsupported_reason(const PagedDescription& description, mx::Device::DeviceType device);

// Returns [out] or [out, lse] (options.output_lse); out [total_q, Hq, Dv] in
// q's dtype, lse float32 [total_q, Hq]. k_parts / v_parts: one float array
// each, or the (packed, scales, biases) triples.
std::vector<mx::array> paged_attention(
    const mx::array& q,
    const std::vector<mx::array>& k_parts,
    const std::vector<mx::array>& v_parts,
    const mx::array& block_table,
    const mx::array& kv_lens,
    const mx::array& q_lens,
    const std::optional<mx::array>& sinks,
    AttentionOptions options,
    mx::StreamOrDevice s = {});

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, AttentionOptions options) : mx::Primitive(stream), options_(options) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  // The Metal paged kernels slot in here (today: no GPU kernel).
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "PagedAttention";
  }

 private:
  int value_dim(const std::vector<mx::array>& inputs) const;
  AttentionOptions options_;
};

}  // namespace mlx_attn
