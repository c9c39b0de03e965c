#include "csrc/metal/metal_sources.h"

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
// prefix, then <dtype>_d<D>[_dv<DV>]_bk<BK>[mask suffix]; `macro` is the
// family's per-kernel instantiation macro in its .metal file (its host name
// is the kernel name again). Longer prefixes first.
struct VariantFamily {
  std::string_view prefix, macro;
  bool value_dim;   // the name carries _dv<DV>
  bool mask_kinds;  // instantiated per mask kind: the macro takes (suffix, kind, ...) first
};
constexpr VariantFamily kVariantFamilies[] = {
    {"attention_prefill_split_", "MLX_ATTN_PREFILL_SPLIT_MASK", true, true},
    {"attention_prefill_", "MLX_ATTN_PREFILL_MASK", false, true},
    {"attention_paged_prefill_", "MLX_ATTN_PAGED_PREFILL", false, false},
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
  // the mask suffix, then <dtype>_d<D>[_dv<DV>]_bk<BK>
  std::string_view mask_suffix, mask = "MLX_ATTN_MASK_NONE";
  for (auto [suffix, kind] : {std::pair<std::string_view, std::string_view>{"_mask_bool", "MLX_ATTN_MASK_BOOL"},
                              {"_mask_additive", "MLX_ATTN_MASK_ADDITIVE"}}) {
    if (rest.ends_with(suffix)) {
      if (!family->mask_kinds) return {};
      mask_suffix = suffix;
      mask = kind;
      rest.remove_suffix(suffix.size());
    }
  }
  const size_t d_at = rest.find("_d");
  const size_t bk_at = rest.find("_bk");
  if (d_at == std::string_view::npos || bk_at == std::string_view::npos || bk_at < d_at) return {};
  const std::string_view dtype = rest.substr(0, d_at);
  std::string_view d = rest.substr(d_at + 2, bk_at - d_at - 2), dv;
  if (family->value_dim) {
    const size_t dv_at = d.find("_dv");
    if (dv_at == std::string_view::npos) return {};
    dv = d.substr(dv_at + 3);
    d = d.substr(0, dv_at);
    if (!all_digits(dv)) return {};
  }
  const std::string_view bk = rest.substr(bk_at + 3);
  if (msl_type(dtype).empty() || !all_digits(d) || !all_digits(bk)) return {};

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
  out += std::string(family->macro) + "(" +
      (family->mask_kinds ? "\"" + std::string(mask_suffix) + "\", " + std::string(mask) + ", " : std::string()) +
      std::string(dtype) + ", " + std::string(msl_type(dtype)) + ", " + std::string(d) + ", " +
      (family->value_dim ? std::string(dv) + ", " : std::string()) + std::string(bk) + ")\n";
  return out;
}

}  // namespace mlx_attn::metal
