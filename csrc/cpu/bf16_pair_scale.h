// The exactness guard of the bf16 pair products (vdpbf16ps, BFDOT, AMX
// TDPBF16PS) on the score product: the forward (kernel_impl.h) and the AMX
// backward (backward_impl.h) apply the same rule to their packed bf16 Q.
#pragma once

#include <math.h>
#include <stdint.h>

#include "csrc/cpu/elements.h"

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

// The bf16 pair product (vdpbf16ps, BFDOT) flushes products below float32's
// normal range (2^-126) to zero and reads subnormal inputs as zero; with a
// huge scale those lost products are whole logits (scale near float32's
// maximum, q.k near 1 / scale: logits of order one, products all flushed).
// Two moves keep it exact enough, else the item scores in float32:
//  - a power of two 2^e of the scale moves into the packed bf16 Q panel
//    (exact: bf16 has float32's exponents), as much as keeps every |q| below
//    2^-(1 + ceil(log2 D)) (|k| < 2^128, so no q.k of D terms can pass 2^127
//    and overflow where it did not before) and the rest of the scale >= 1;
//    normal-range products are scaled exactly, so no other logit changes;
//  - the pair product is used only where no q is subnormal after the move
//    and |scale'| * max(1, max |q'|) <= 2^64 (kPairScaleLimit). A lost term
//    (a product below 2^-126, or one with a subnormal k) is below
//    2^-126 * max(1, |q'|), so each logit is then off by under D * 2^-62.
// Typical scales (|scale| < 2) move nothing and keep the pair product.
struct PairScale {
  float scale;   // what the pair product's sums are multiplied by
  bool exact;    // whether the pair product may score this item
  int moved = 0; // e: the power of two moved into the panel
};
inline constexpr float kPairScaleLimit = 18446744073709551616.0f;  // 2^64

// The rule from the panel's largest |q| and smallest nonzero |q| (a NaN
// largest for NaN q, an infinite smallest when every q is 0).
inline PairScale bf16_pair_scale_of(float largest, float smallest, float scale, int head_dim) {
  int e = 0;
  if (largest > 0.0f && largest < INFINITY && fabsf(scale) >= 2.0f) {
    int log2_dim = 0;  // ceil(log2 D)
    while ((1 << log2_dim) < head_dim) ++log2_dim;
    const int room = -2 - log2_dim - ilogbf(largest);  // largest * 2^room < 2^-(1 + log2_dim)
    e = room < ilogbf(scale) ? room : ilogbf(scale);
    e = e > 0 ? e : 0;
  }
  const float rest = ldexpf(scale, -e);
  const float q_largest = ldexpf(largest, e);  // NaN q gives NaN logits with either product
  const bool no_subnormal_q = !(ldexpf(smallest, e) < 0x1p-126f);
  return {rest, no_subnormal_q && fabsf(rest) * (q_largest > 1.0f ? q_largest : 1.0f) <= kPairScaleLimit, e};
}

// Moves 2^moved into the panel (exact for normal q).
inline void bf16_pair_scale_move(uint16_t* panel, int64_t count, int moved) {
  if (moved <= 0) return;
  for (int64_t i = 0; i < count; ++i) panel[i] = float_to_bfloat(ldexpf(bfloat_to_float(panel[i]), moved));
}

inline PairScale bf16_pair_scale(uint16_t* panel, int64_t count, float scale, int head_dim) {
  // Of |q|: the largest (NaN if any q is) and the smallest nonzero, on the
  // magnitude bits, whose integer order is the float order (NaN above inf):
  // an integer min / max the compiler vectorizes.
  // magnitude - 1 wraps 0 to 0xffff, out of the smallest's way.
  uint16_t largest_bits = 0, smallest_less_one = 0xffff;
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t magnitude = panel[i] & 0x7fff;
    const uint16_t less_one = uint16_t(magnitude - 1);
    largest_bits = magnitude > largest_bits ? magnitude : largest_bits;
    smallest_less_one = less_one < smallest_less_one ? less_one : smallest_less_one;
  }
  const float largest = bfloat_to_float(largest_bits);
  const float smallest = smallest_less_one >= 0x7f80 ? INFINITY : bfloat_to_float(uint16_t(smallest_less_one + 1));
  const PairScale pair = bf16_pair_scale_of(largest, smallest, scale, head_dim);
  bf16_pair_scale_move(panel, count, pair.moved);
  return pair;
}

}  // namespace
}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
