// Shared between kernels and (hypothetical) host code, like
// metal/attention_params.h: Metal sees `uint`, the host sees uint32_t.
#pragma once

#ifdef __METAL_VERSION__
typedef uint emu_u32;
#else
#include <cstdint>
typedef uint32_t emu_u32;
#endif

struct SoftmaxParams {
  emu_u32 rows;
  emu_u32 columns;
  float scale;
};
