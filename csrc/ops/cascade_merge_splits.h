// The merge step of cascade attention, row by row (csrc/ops/cascade_merge.cpp
// runs it as its own primitive, csrc/ops/cascade_attention.cpp after the passes).
#pragma once

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "csrc/ops/attention.h"

namespace mlx_attn::cascade {

// One pass's partials as the merge reads them: element strides, so a view is read in place.
struct Partials {
  const void* out = nullptr;
  const float* lse = nullptr;
  int64_t out_strides[3] = {0, 0, 0};
  int64_t lse_strides[2] = {0, 0};
};

inline Partials partials_of(const mx::array& out, const mx::array& lse) {
  Partials p;
  if (out.size() == 0) return p;
  p.out = out.data<void>();
  p.lse = lse.data<float>();
  for (int i = 0; i < 3; ++i) p.out_strides[i] = out.strides()[i];
  for (int i = 0; i < 2; ++i) p.lse_strides[i] = lse.strides()[i];
  return p;
}

template <typename T>
struct MergeCall {
  Partials suffix, prefix, direct;
  const int32_t* suffix_index;
  const int32_t* prefix_index;  // [splits, rows]
  const int32_t* direct_index;
  const float* sinks;
  int64_t index_strides[4];  // suffix, prefix split, prefix row, direct
  int64_t sinks_stride;
  int64_t rows, heads, value_dim, splits;
  T* out;
  float* lse;
};

// Rows of half floats to and from float32. The merge reads and writes every
// value of every partial once; MLX's scalar half conversion (bit arithmetic
// per element) made it a tenth of a cascade decode step, so on x86 CPUs with
// F16C the rows convert 8 at a time.
#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx,f16c"))) inline void f16c_to_float(const uint16_t* in, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j))));
  }
  for (; j < n; ++j) out[j] = _cvtsh_ss(in[j]);
}

__attribute__((target("avx,f16c"))) inline void f16c_from_float(const float* in, uint16_t* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; j < n; ++j) out[j] = _cvtss_sh(in[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

// n values of T at `in` (element stride `stride`) as float32.
template <typename T>
inline void load_floats(const T* in, int64_t stride, float* out, int64_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  if constexpr (std::is_same_v<T, mx::float16_t>) {
    if (stride == 1 && has_f16c()) return f16c_to_float(reinterpret_cast<const uint16_t*>(in), out, n);
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = float(in[j * stride]);
}

template <typename T>
inline void store_floats(const float* in, T* out, int64_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  if constexpr (std::is_same_v<T, mx::float16_t>) {
    if (has_f16c()) return f16c_from_float(in, reinterpret_cast<uint16_t*>(out), n);
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = T(in[j]);
}

// The log-sum-exp merge of one row's partials (the split-K merge, n-way): the
// largest lse (or sink) as the shift, each partial weighted by exp(lse - top),
// the sink adding exp(sink - top) to the total and nothing to the output.
template <typename T>
void merge_splits(const MergeCall<T>& c) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kMaxParts = 64;
  const Partials* from[kMaxParts];
  int64_t at[kMaxParts];
  float weight[kMaxParts];
  std::vector<float> acc(c.value_dim), part(c.value_dim);
  for (int64_t t = 0; t < c.rows; ++t) {
    const int32_t d = c.direct_index[t * c.index_strides[3]];
    for (int64_t h = 0; h < c.heads; ++h) {
      T* out = c.out + (t * c.heads + h) * c.value_dim;
      float* lse = c.lse + t * c.heads + h;
      if (d >= 0) {  // a direct row: its pass already holds its whole result, in T
        const Partials& p = c.direct;
        const T* from_row = static_cast<const T*>(p.out) + d * p.out_strides[0] + h * p.out_strides[1];
        for (int64_t j = 0; j < c.value_dim; ++j) out[j] = from_row[j * p.out_strides[2]];
        *lse = p.lse[d * p.lse_strides[0] + h * p.lse_strides[1]];
        continue;
      }
      int parts = 0;
      auto add = [&](const Partials& p, int32_t row) {
        if (row < 0) return;
        from[parts] = &p;
        at[parts] = row;
        weight[parts] = p.lse[row * p.lse_strides[0] + h * p.lse_strides[1]];
        ++parts;
      };
      add(c.suffix, c.suffix_index[t * c.index_strides[0]]);
      for (int64_t s = 0; s < c.splits; ++s) {
        add(c.prefix, c.prefix_index[s * c.index_strides[1] + t * c.index_strides[2]]);
      }
      const float sink = c.sinks[h * c.sinks_stride];
      float top = sink;
      for (int i = 0; i < parts; ++i) top = std::fmax(top, weight[i]);
      if (top == kNegInf) top = 0.0f;  // no key and no sink: any finite shift
      float total = std::exp(sink - top);
      for (int i = 0; i < parts; ++i) {
        weight[i] = std::exp(weight[i] - top);
        total += weight[i];
      }
      const float inv = total == 0.0f ? 0.0f : 1.0f / total;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int i = 0; i < parts; ++i) {  // partials in order, as the scalar sum added them
        const Partials& p = *from[i];
        load_floats(static_cast<const T*>(p.out) + at[i] * p.out_strides[0] + h * p.out_strides[1],
                    p.out_strides[2], part.data(), c.value_dim);
        for (int64_t j = 0; j < c.value_dim; ++j) acc[j] += weight[i] * part[j];
      }
      for (int64_t j = 0; j < c.value_dim; ++j) acc[j] *= inv;
      store_floats(acc.data(), out, c.value_dim);
      *lse = total == 0.0f ? kNegInf : top + std::log(total);
    }
  }
}

}  // namespace mlx_attn::cascade
