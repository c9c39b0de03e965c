// The host side of the fused CPU attention backward: work split, scratch
// size and the run over the kernel's thread pool (backward_kernels.h).
#pragma once

#include "csrc/cpu/backward_kernels.h"

namespace mlx_attn::cpu {

// Sets call.query_block: as many query rows per tile as fit kMaxRows.
void plan_backward(BackwardCall& call);
// Floats run_backward needs: delta per query row plus tile buffers for every
// pool thread. O(B x Hq x Tq + threads x tile), never O(Tq x Tkv).
int64_t backward_scratch_size(const BackwardCall& call);
// Runs the three passes with the instruction set the forward uses; `scratch`
// holds backward_scratch_size(call) floats. Sets call.delta.
void run_backward(BackwardCall call, float* scratch);

}  // namespace mlx_attn::cpu
