// The launch plan of the fused Metal attention backward
// (metal/attention_backward.metal), in the forward's plan types: the Mac
// host encodes it like the forward's, and the MSL emulator tests launch it
// unchanged. The backward primitive (FusedAttentionBackward) has inputs
// q, k, v, [mask], [sinks], out, lse, d_out, d_lse and outputs dq, dk, dv,
// [d_sinks]; out, lse, d_out and d_lse must be row-contiguous (the vjp makes
// them so on the GPU). The one scratch buffer, delta, is written by the first
// dispatch and read by every later one: its ScratchBuffer::consumer is the
// last reader.
#pragma once

#include "csrc/metal/launch_plan.h"

namespace mlx_attn {

// Query rows per staged block of the register-resident dK/dV kernel for a
// head dim (0: not instantiated; from D = 128 on the D-split kernel serves
// dK/dV): its float32 Q and dO tiles, 2 * BQ * (D + 4) * 4 bytes, stay
// under 18 KB.
int backward_query_block(int head_dim);
// Keys per staged K/V block of the dQ kernel for a head dim (0: unsupported).
int backward_key_block(int head_dim);

// Whether the dK/dV pass takes the D-split kernel
// (metal/attention_backward_split.h): the forward's D-split head dims
// (kSplitPrefillHeadDims), and D = 128, where the register-resident kernel
// holds 128 floats a lane (K, V, dK, dV rows) against the split's 52.
bool backward_splits_key_gradients(int head_dim, int value_dim);
// Whether the dQ pass does: the forward's D-split head dims (register-resident
// it holds 3 * D / 4 floats a lane: 96 at D = 128, within the budget).
bool backward_splits_query_gradients(int head_dim, int value_dim);

// Dispatches in order: delta, dK/dV, dQ, then (with sinks) the sinks'
// gradient. Unsupported (with a reason) where the forward's Metal plan is,
// for head dims neither family is instantiated for, and for empty problems.
LaunchPlan plan_attention_backward(const AttentionProblem& problem);

}  // namespace mlx_attn
