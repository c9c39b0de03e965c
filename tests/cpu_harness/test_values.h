// Test values and the bfloat16 conversions the standalone drivers share.
#pragma once

#include <stdint.h>
#include <string.h>

// The next of a linear congruential stream: multiples of 1/64 in [-2, 2),
// exact in bf16 (and in every product of two of them in float32).
inline float next_value(uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return float(int((state >> 8) % 256) - 128) / 64.0f;
}

// Round to nearest even (exact for the values above).
inline uint16_t to_bfloat(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

inline float from_bfloat(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
