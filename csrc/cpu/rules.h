// The attention rules (metal/attention_rules.h: logit saturation, key
// visibility, the key and query ranges of a block, edge blocks, the mask read
// and the masked sentinel) for one per-ISA copy of the CPU kernels. Included
// inside the copy's anonymous namespace, so the rules' inline functions get
// internal linkage like everything else compiled for a wide instruction set
// (none can be picked by the linker for code that runs on an older CPU).
#pragma once

#include "csrc/cpu/kernels.h"  // AttentionParams, outside the namespace

#if !defined(MLX_ATTN_ISA)
#error "define MLX_ATTN_ISA before including rules.h"
#endif
#ifdef ATTN_PARAMS
#error "metal/attention_rules.h was included outside a copy's namespace first"
#endif

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {
#include "metal/attention_rules.h"
}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
