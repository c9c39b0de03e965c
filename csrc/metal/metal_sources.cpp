#include "csrc/metal/metal_sources.h"
#include "csrc/metal/kernel_id.h"

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

namespace {

// The families whose kernels compile one at a time: `macro` is the family's
// per-kernel instantiation macro in its .metal file, called with ("<mask
// suffix>", <mask kind>,) <dtype>, <MSL type>, <the id's field values> (its
// host name is the kernel's again).
struct VariantFamily {
  KernelFamily family;
  std::string_view macro;
};
constexpr VariantFamily kVariantFamilies[] = {
    {KernelFamily::prefill_split, "MLX_ATTN_PREFILL_SPLIT_MASK"},
    {KernelFamily::prefill, "MLX_ATTN_PREFILL_MASK"},
    {KernelFamily::decode_partial, "MLX_ATTN_DECODE_PARTIAL"},
    {KernelFamily::decode_merge, "MLX_ATTN_DECODE_MERGE"},
    {KernelFamily::quantized_decode_partial, "MLX_ATTN_QUANTIZED_DECODE_MASK"},
    {KernelFamily::quantized_prefill, "MLX_ATTN_QUANTIZED_PREFILL_MASK"},
    // the D-split backward (its _bk: rows per streamed block)
    {KernelFamily::backward_split_dkdv, "MLX_ATTN_BACKWARD_SPLIT_DKDV_MASK"},
    {KernelFamily::backward_split_dq, "MLX_ATTN_BACKWARD_SPLIT_DQ_MASK"},
    {KernelFamily::paged_prefill, "MLX_ATTN_PAGED_PREFILL"},
    {KernelFamily::paged_cascade_prefix, "MLX_ATTN_PAGED_CASCADE_PREFIX"},
    {KernelFamily::paged_cascade_quantized_prefix, "MLX_ATTN_PAGED_CASCADE_QUANTIZED_PREFIX"},
};

const char* mask_macro(MaskKind mask) {
  switch (mask) {
    case MaskKind::none: return "MLX_ATTN_MASK_NONE";
    case MaskKind::boolean: return "MLX_ATTN_MASK_BOOL";
    case MaskKind::additive: return "MLX_ATTN_MASK_ADDITIVE";
  }
  return "MLX_ATTN_MASK_NONE";
}

const VariantFamily* variant_family(KernelFamily family) {
  for (const auto& row : kVariantFamilies) {
    if (row.family == family) return &row;
  }
  return nullptr;
}

}  // namespace

std::string variant_source(std::string_view kernel) {
  const std::optional<KernelId> id = parse_kernel_id(kernel);
  const VariantFamily* family = id ? variant_family(id->family) : nullptr;
  if (!family) return {};
  const std::string_view dtype = elem_type_name(id->dtype);
  std::string arguments;
  for (const auto& [tag, value] : id->fields) arguments += ", " + std::to_string(value);

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
  if (family_per_mask_kind(id->family)) out += "\"" + std::string(mask_suffix(id->mask)) + "\", " + std::string(mask_macro(id->mask)) + ", ";
  out += std::string(dtype) + ", " + std::string(msl_type(dtype)) + arguments + ")\n";
  return out;
}

}  // namespace mlx_attn::metal
