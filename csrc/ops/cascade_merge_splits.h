// The merge step of cascade attention, row by row (csrc/ops/cascade_merge.cpp
// runs it as its own primitive, csrc/ops/cascade_attention.cpp after the passes).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

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
inline float value_at(const void* p, int64_t i) {
  return float(static_cast<const T*>(p)[i]);
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
  for (int64_t t = 0; t < c.rows; ++t) {
    const int32_t d = c.direct_index[t * c.index_strides[3]];
    for (int64_t h = 0; h < c.heads; ++h) {
      T* out = c.out + (t * c.heads + h) * c.value_dim;
      float* lse = c.lse + t * c.heads + h;
      if (d >= 0) {  // a direct row: its pass already holds its whole result
        const Partials& p = c.direct;
        const int64_t base = d * p.out_strides[0] + h * p.out_strides[1];
        for (int64_t j = 0; j < c.value_dim; ++j) out[j] = T(value_at<T>(p.out, base + j * p.out_strides[2]));
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
      for (int64_t j = 0; j < c.value_dim; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < parts; ++i) {
          const Partials& p = *from[i];
          acc += weight[i] * value_at<T>(p.out, at[i] * p.out_strides[0] + h * p.out_strides[1] + j * p.out_strides[2]);
        }
        out[j] = T(acc * inv);
      }
      *lse = total == 0.0f ? kNegInf : top + std::log(total);
    }
  }
}

}  // namespace mlx_attn::cascade
