// The attention rules (metal/attention_rules.h: logit saturation, the
// softcap, key visibility, the key and query ranges of a block, edge blocks,
// the mask read and the masked sentinel) for one per-ISA copy of the CPU
// kernels. Included inside the copy's anonymous namespace, so the rules'
// inline functions get internal linkage like everything else compiled for a
// wide instruction set (none can be picked by the linker for code that runs
// on an older CPU).
#pragma once

#include "csrc/cpu/kernels.h"  // AttentionParams, outside the namespace
#include "csrc/cpu/simd.h"     // vfloat, tanh_vec

#if !defined(MLX_ATTN_ISA)
#error "define MLX_ATTN_ISA before including rules.h"
#endif
#ifdef ATTN_PARAMS
#error "metal/attention_rules.h was included outside a copy's namespace first"
#endif

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {
// The tanh softcap_logit applies to a vector of logits (declared before the
// rules: the template finds it by ordinary lookup, vectors have no ADL).
inline vfloat attn_tanh(vfloat x) {
  return tanh_vec(x);
}
#include "metal/attention_rules.h"

// Sets the logits s[j * stride] of keys kb + j (j < n) that the query at
// `pos` cannot see (causal / window) to the masked sentinel. The keys a
// query sees are one range (block_key_range of that single query), so an
// edge block costs two short stores per row, no test per key.
inline void mask_hidden_keys(const AttentionParams& p, int pos, int kb, int n, float* s, int64_t stride) {
  const KeyRange seen = block_key_range(p, pos, pos);
  const int begin = seen.begin - kb < 0 ? 0 : (seen.begin - kb < n ? seen.begin - kb : n);
  const int end = seen.end - kb < begin ? begin : (seen.end - kb < n ? seen.end - kb : n);
  for (int j = 0; j < begin; ++j) s[j * stride] = MLX_ATTN_MASKED_LOGIT;
  for (int j = end; j < n; ++j) s[j * stride] = MLX_ATTN_MASKED_LOGIT;
}
}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
