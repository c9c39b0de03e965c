#include "csrc/metal/metal_sources.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>

namespace mlx_attn::metal {

const EmbeddedSource& source_for_kernel(std::string_view kernel) {
  const EmbeddedSource* best = nullptr;
  for (const auto& source : embedded_sources()) {
    const bool names_it = kernel == source.name ||
        (kernel.starts_with(source.name) && kernel[source.name.size()] == '_');
    if (names_it && (!best || source.name.size() > best->name.size())) best = &source;
  }
  if (!best) {
    std::string known;
    for (const auto& source : embedded_sources()) {
      known += (known.empty() ? "" : ", ") + std::string(source.name);
    }
    throw std::invalid_argument(
        "[mlx_attn] no Metal source defines kernel '" + std::string(kernel) +
        "' (a kernel name starts with its source's name; sources: " + known + ")");
  }
  return *best;
}

namespace {
// "float16" -> "half": the MSL element type of a kernel name's dtype.
std::string_view msl_type(std::string_view dtype) {
  if (dtype == "float32") return "float";
  if (dtype == "float16") return "half";
  if (dtype == "bfloat16") return "bfloat";
  return {};
}

bool all_digits(std::string_view text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
}

// A line that is only `MLX_ATTN_<NAME>(args)`: a top-level instantiation.
bool instantiation_line(std::string_view line) {
  while (!line.empty() && (line.back() == ' ' || line.back() == '\t' || line.back() == '\r')) line.remove_suffix(1);
  if (!line.starts_with("MLX_ATTN_") || line.empty() || line.back() != ')') return false;
  const size_t open = line.find('(');
  if (open == std::string_view::npos) return false;
  for (char c : line.substr(0, open)) {
    if (!((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  const std::string_view args = line.substr(open + 1, line.size() - open - 2);
  return args.find_first_of("()") == std::string_view::npos;
}
}  // namespace

// The families whose kernels compile one at a time: a kernel name is the
// prefix, then <dtype>, then the family's fields in order (`_<tag><digits>`
// each: _d<D>, _dv<DV>, _bk<BK>, _b<BITS>, _r<R>, _sg<NSG>), then, for a family instantiated
// per mask kind, the mask suffix; `macro` is the family's per-kernel
// instantiation macro in its .metal file, called with ("<mask suffix>",
// <mask kind>,) <dtype>, <MSL type>, <fields...> (its host name is the kernel
// name again). Longer prefixes first.
struct VariantFamily {
  std::string_view prefix, macro;
  std::array<std::string_view, 4> fields;  // tags, "" past the last
  bool masked;                             // instantiated per mask kind
};
constexpr VariantFamily kVariantFamilies[] = {
    {"attention_prefill_split_", "MLX_ATTN_PREFILL_SPLIT_MASK", {"d", "dv", "bk", ""}, true},
    {"attention_prefill_", "MLX_ATTN_PREFILL_MASK", {"d", "bk", "", ""}, true},
    {"attention_decode_partial_", "MLX_ATTN_DECODE_PARTIAL", {"d", "r", "sg", ""}, true},
    {"attention_decode_merge_", "MLX_ATTN_DECODE_MERGE", {"d", "", "", ""}, false},
    {"attention_quantized_decode_partial_", "MLX_ATTN_QUANTIZED_DECODE_MASK", {"d", "b", "r", "sg"}, true},
    {"attention_quantized_prefill_", "MLX_ATTN_QUANTIZED_PREFILL_MASK", {"d", "b", "bk", ""}, true},
    // the D-split backward (its _bk: rows per streamed block)
    {"attention_backward_split_dkdv_", "MLX_ATTN_BACKWARD_SPLIT_DKDV_MASK", {"d", "dv", "bk", ""}, true},
    {"attention_backward_split_dq_", "MLX_ATTN_BACKWARD_SPLIT_DQ_MASK", {"d", "dv", "bk", ""}, true},
    {"attention_paged_prefill_", "MLX_ATTN_PAGED_PREFILL", {"d", "bk", "", ""}, false},
};

std::string variant_source(std::string_view kernel) {
  const VariantFamily* family = nullptr;
  for (const auto& candidate : kVariantFamilies) {
    if (kernel.starts_with(candidate.prefix)) {
      family = &candidate;
      break;
    }
  }
  if (!family) return {};
  std::string_view rest = kernel.substr(family->prefix.size());
  // the mask suffix, then <dtype>_<tag><digits>...
  std::string_view mask_suffix, mask = "MLX_ATTN_MASK_NONE";
  if (family->masked) {
    for (auto [suffix, kind] : {std::pair<std::string_view, std::string_view>{"_mask_bool", "MLX_ATTN_MASK_BOOL"},
                                {"_mask_additive", "MLX_ATTN_MASK_ADDITIVE"}}) {
      if (rest.ends_with(suffix)) {
        mask_suffix = suffix;
        mask = kind;
        rest.remove_suffix(suffix.size());
      }
    }
  }
  const size_t dtype_end = rest.find('_');
  if (dtype_end == std::string_view::npos) return {};
  const std::string_view dtype = rest.substr(0, dtype_end);
  if (msl_type(dtype).empty()) return {};
  rest.remove_prefix(dtype_end);
  std::string arguments;
  for (std::string_view tag : family->fields) {
    if (tag.empty()) break;
    // "_<tag><digits>", up to the next '_'
    if (!rest.starts_with('_') || !rest.substr(1).starts_with(tag)) return {};
    rest.remove_prefix(1 + tag.size());
    const size_t end = std::min(rest.find('_'), rest.size());
    const std::string_view value = rest.substr(0, end);
    if (!all_digits(value)) return {};
    arguments += ", " + std::string(value);
    rest.remove_prefix(end);
  }
  if (!rest.empty()) return {};

  const std::string_view text = source_for_kernel(kernel).text;
  std::string out;
  out.reserve(text.size() + 128);
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    end = end == std::string_view::npos ? text.size() : end + 1;
    const std::string_view line = text.substr(at, end - at);
    if (!instantiation_line(line.substr(0, line.ends_with('\n') ? line.size() - 1 : line.size()))) out += line;
    at = end;
  }
  if (!out.empty() && out.back() != '\n') out += '\n';
  // The family's own per-kernel macro: the host name it builds is `kernel` again.
  out += std::string(family->macro) + "(";
  if (family->masked) out += "\"" + std::string(mask_suffix) + "\", " + std::string(mask) + ", ";
  out += std::string(dtype) + ", " + std::string(msl_type(dtype)) + arguments + ")\n";
  return out;
}

}  // namespace mlx_attn::metal
