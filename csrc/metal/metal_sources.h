// The Metal kernel sources carried inside the extension (every platform), so
// a Mac compiles them at run time and tests can read the very text it would
// compile. The text is each metal/<name>.metal with the project headers it
// includes inlined (rule: csrc/metal/embed_metal_sources.cmake).
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace mlx_attn::metal {

struct EmbeddedSource {
  std::string_view name;  // file stem: "attention_prefill" for metal/attention_prefill.metal
  std::string_view text;
};

// All embedded sources (generated at build time).
std::span<const EmbeddedSource> embedded_sources();

// The source that defines a kernel. Naming rule: a kernel's host name begins
// with the stem of its file ("attention_decode_merge_float16_d64" lives in
// attention_decode.metal); the longest matching stem wins. A bare stem also
// names its source. Throws std::invalid_argument for a name no source has.
const EmbeddedSource& source_for_kernel(std::string_view kernel);

// The source of one prefill variant, for compiling that kernel alone on first
// use: its family's embedded text with the top-level instantiation lines
// (`MLX_ATTN_<NAME>(args)` alone on a line) dropped and the one instantiation
// of `kernel` appended. Empty for a kernel of another family or a name the
// prefill naming rule (attention_prefill_<dtype>_d<D>_bk<BK>[_mask_bool |
// _mask_additive]) does not produce: the caller compiles the whole family.
std::string variant_source(std::string_view kernel);

}  // namespace mlx_attn::metal
