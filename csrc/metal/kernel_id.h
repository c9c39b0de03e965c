// A kernel's identity as a typed value: the one place a host name is built
// (KernelId::name) and read back (parse_kernel_id). A host name is
//   attention_<family>_<dtype>{_<tag><value>}[_mask_bool | _mask_additive]
// with the family's fields in order (_d<D>, _dv<DV>, _bk<BK>, _b<BITS>,
// _r<R>, _sg<NSG>) and the mask suffix on families instantiated per mask kind.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "csrc/core/attention_problem.h"

namespace mlx_attn {

enum class KernelFamily : int32_t {
  prefill, prefill_split, decode_partial, decode_merge,
  quantized_prefill, quantized_decode_partial,
  paged_prefill, paged_decode_partial, paged_quantized_decode_partial, paged_decode_merge,
  backward_delta, backward_dkdv, backward_dq, backward_sinks, backward_split_dkdv, backward_split_dq,
  // cascade attention's prefix pass (metal/attention_paged_cascade.h)
  paged_cascade_prefix, paged_cascade_quantized_prefix,
};
inline constexpr int kKernelFamilyCount = int(KernelFamily::paged_cascade_quantized_prefix) + 1;

// What a self-check vouches for: the step of attention a family computes.
enum class KernelPhase : int32_t { prefill, decode, backward };

// "prefill_split" (the host name prefixes it with "attention_").
const char* family_name(KernelFamily family);
KernelPhase family_phase(KernelFamily family);
bool family_per_mask_kind(KernelFamily family);
const char* phase_name(KernelPhase phase);

struct KernelId {
  KernelFamily family = KernelFamily::prefill;
  ElemType dtype = ElemType::float32;
  std::vector<std::pair<std::string, int>> fields;  // in name order
  MaskKind mask = MaskKind::none;

  // The value of a field ("d", "bk", ...), or -1 when the id has none.
  int field(std::string_view tag) const;
  KernelId& with(std::string tag, int value) {
    fields.emplace_back(std::move(tag), value);
    return *this;
  }
  std::string name() const;
};

// Whether the id has exactly its family's fields (tags in order) and a mask
// only where the family is instantiated per mask kind.
bool spells_family(const KernelId& id);

// The id of a problem's kernel of `family`: its dtype and head dim (_d<D>),
// and its mask kind where the family is instantiated per mask kind.
KernelId kernel_id(KernelFamily family, const AttentionProblem& problem);

// "", "_mask_bool" or "_mask_additive": a per-mask family's host-name suffix.
std::string_view mask_suffix(MaskKind mask);

// The id a host name spells, or nothing for a name that spells none.
std::optional<KernelId> parse_kernel_id(std::string_view name);

}  // namespace mlx_attn
