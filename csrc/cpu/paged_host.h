// The host side of the fused CPU kernel over paged K/V (paged_dispatch.cpp).
#pragma once

#include <vector>

#include "csrc/cpu/kernels.h"

namespace mlx_attn::cpu {

// Sets call.query_block for a paged call (call.paged filled but not planned):
// as many query rows per item as fit kMaxRows.
void plan_paged_work(KernelCall& call);
// Plans the items from the lengths and the block table (sequences whose
// lengths or entries fall outside the buffers get NaN rows instead of being
// read) and runs them on the thread pool; `scratch` holds scratch_size(call)
// floats.
void run_paged_attention(KernelCall call, float* scratch);
// The planning half of run_paged_attention: poisons the rows of unreadable
// sequences and sets call.paged.items to the returned items (keep them alive
// while the call runs), for run_attention_calls.
std::vector<PagedItem> plan_paged_items(KernelCall& call);

}  // namespace mlx_attn::cpu
