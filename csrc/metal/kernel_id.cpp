#include "csrc/metal/kernel_id.h"

#include <algorithm>
#include <array>

namespace mlx_attn {

namespace {

// The naming rule of each family: its fields' tags, in order, and whether it
// is instantiated per mask kind (a mask suffix).
struct FamilyRow {
  KernelFamily family;
  const char* name;
  KernelPhase phase;
  std::array<std::string_view, 4> fields;  // "" past the last
  bool per_mask_kind;
};

constexpr std::array<FamilyRow, kKernelFamilyCount> kFamilies = {{
    {KernelFamily::prefill, "prefill", KernelPhase::prefill, {"d", "bk"}, true},
    {KernelFamily::prefill_split, "prefill_split", KernelPhase::prefill, {"d", "dv", "bk"}, true},
    {KernelFamily::decode_partial, "decode_partial", KernelPhase::decode, {"d", "r", "sg"}, true},
    {KernelFamily::decode_merge, "decode_merge", KernelPhase::decode, {"d"}, false},
    {KernelFamily::quantized_prefill, "quantized_prefill", KernelPhase::prefill, {"d", "b", "bk"}, true},
    {KernelFamily::quantized_decode_partial, "quantized_decode_partial", KernelPhase::decode, {"d", "b", "r", "sg"}, true},
    {KernelFamily::paged_prefill, "paged_prefill", KernelPhase::prefill, {"d", "bk"}, false},
    {KernelFamily::paged_decode_partial, "paged_decode_partial", KernelPhase::decode, {"d", "r", "sg"}, false},
    {KernelFamily::paged_quantized_decode_partial, "paged_quantized_decode_partial", KernelPhase::decode, {"d", "b", "r", "sg"}, false},
    {KernelFamily::paged_decode_merge, "paged_decode_merge", KernelPhase::decode, {"d"}, false},
    {KernelFamily::backward_delta, "backward_delta", KernelPhase::backward, {"d"}, false},
    {KernelFamily::backward_dkdv, "backward_dkdv", KernelPhase::backward, {"d"}, true},
    {KernelFamily::backward_dq, "backward_dq", KernelPhase::backward, {"d"}, true},
    {KernelFamily::backward_sinks, "backward_sinks", KernelPhase::backward, {}, false},
    {KernelFamily::backward_split_dkdv, "backward_split_dkdv", KernelPhase::backward, {"d", "dv", "bk"}, true},
    {KernelFamily::backward_split_dq, "backward_split_dq", KernelPhase::backward, {"d", "dv", "bk"}, true},
    {KernelFamily::paged_cascade_prefix, "paged_cascade_prefix", KernelPhase::decode, {"d", "bk"}, false},
    {KernelFamily::paged_cascade_quantized_prefix, "paged_cascade_quantized_prefix", KernelPhase::decode, {"d", "b", "bk"}, false},
}};

constexpr std::string_view kPrefix = "attention_";

constexpr std::array<std::pair<std::string_view, MaskKind>, 2> kMaskSuffixes = {{
    {"_mask_bool", MaskKind::boolean},
    {"_mask_additive", MaskKind::additive},
}};

std::optional<ElemType> dtype_named(std::string_view name) {
  for (ElemType t : {ElemType::float32, ElemType::float16, ElemType::bfloat16}) {
    if (name == elem_type_name(t)) return t;
  }
  return std::nullopt;
}

// "_<tag><digits>" fields up to the end of `rest`; nothing when it holds other text.
std::optional<std::vector<std::pair<std::string, int>>> parse_fields(std::string_view rest) {
  std::vector<std::pair<std::string, int>> fields;
  while (!rest.empty()) {
    if (rest.front() != '_') return std::nullopt;
    rest.remove_prefix(1);
    const size_t end = std::min(rest.find('_'), rest.size());
    const std::string_view token = rest.substr(0, end);
    const size_t digits = token.find_first_of("0123456789");
    if (digits == 0 || digits == std::string_view::npos || token.size() - digits > 9 ||
        !std::all_of(token.begin() + digits, token.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return std::nullopt;
    }
    fields.emplace_back(std::string(token.substr(0, digits)), std::stoi(std::string(token.substr(digits))));
    rest.remove_prefix(end);
  }
  return fields;
}

}  // namespace

const char* family_name(KernelFamily family) {
  return kFamilies[int(family)].name;
}

KernelPhase family_phase(KernelFamily family) {
  return kFamilies[int(family)].phase;
}

bool family_per_mask_kind(KernelFamily family) {
  return kFamilies[int(family)].per_mask_kind;
}

bool spells_family(const KernelId& id) {
  const FamilyRow& row = kFamilies[int(id.family)];
  if (id.mask != MaskKind::none && !row.per_mask_kind) return false;
  for (size_t i = 0; i < row.fields.size(); ++i) {
    const bool expected = !row.fields[i].empty();
    if (expected != (i < id.fields.size()) || (expected && id.fields[i].first != row.fields[i])) return false;
  }
  return id.fields.size() <= row.fields.size();
}

const char* phase_name(KernelPhase phase) {
  switch (phase) {
    case KernelPhase::prefill: return "prefill";
    case KernelPhase::decode: return "decode";
    case KernelPhase::backward: return "backward";
  }
  return "prefill";
}

std::string_view mask_suffix(MaskKind mask) {
  for (const auto& [suffix, kind] : kMaskSuffixes) {
    if (mask == kind) return suffix;
  }
  return "";
}

int KernelId::field(std::string_view tag) const {
  for (const auto& [name, value] : fields) {
    if (name == tag) return value;
  }
  return -1;
}

std::string KernelId::name() const {
  std::string out = std::string(kPrefix) + family_name(family) + "_" + elem_type_name(dtype);
  for (const auto& [tag, value] : fields) out += "_" + tag + std::to_string(value);
  return out + std::string(mask_suffix(mask));
}

KernelId kernel_id(KernelFamily family, const AttentionProblem& problem) {
  return {family, problem.dtype, {{"d", problem.head_dim}},
          family_per_mask_kind(family) ? problem.mask_kind : MaskKind::none};
}

std::optional<KernelId> parse_kernel_id(std::string_view name) {
  if (!name.starts_with(kPrefix)) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  KernelId id;
  for (const auto& [suffix, kind] : kMaskSuffixes) {
    if (name.ends_with(suffix)) {
      id.mask = kind;
      name.remove_suffix(suffix.size());
    }
  }
  // The family whose name, then "_<dtype>", begins the rest (a family's name
  // may begin another's: prefill, prefill_split).
  for (const FamilyRow& row : kFamilies) {
    const std::string_view family = row.name;
    if (!name.starts_with(family) || name.size() <= family.size() || name[family.size()] != '_') continue;
    std::string_view rest = name.substr(family.size() + 1);
    const size_t dtype_end = std::min(rest.find('_'), rest.size());
    const auto dtype = dtype_named(rest.substr(0, dtype_end));
    if (!dtype) continue;
    auto fields = parse_fields(rest.substr(dtype_end));
    if (!fields) return std::nullopt;
    id.family = row.family;
    id.dtype = *dtype;
    id.fields = std::move(*fields);
    if (!spells_family(id)) continue;
    return id;
  }
  return std::nullopt;
}

}  // namespace mlx_attn
