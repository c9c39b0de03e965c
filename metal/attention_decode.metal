// Fused attention for decoding (few queries, long key/value length).
//
// attention_decode_partial: the key/value length is split across
// threadgroups (grid.x = splits); each threadgroup of 4 simdgroups stages a
// block of BK keys and values of one KV head in threadgroup memory, shared by
// all rows = (query head of the GQA group) x (query position): row r is
// handled by simdgroup r % 4. Lanes split the head dim (D / 32 each): a score
// is a simd_sum of lane partial dot products, and each lane accumulates its
// slice of the output. Every (row, split) writes a partial (max, sum, output).
// attention_decode_merge combines the splits: the same online-softmax
// rescale, then sinks and normalize.
// Same step names and finite sentinels as attention_prefill.metal.
#include <metal_stdlib>

#include "metal/attention_params.h"

using namespace metal;

constant float kDecodeMasked = MLX_ATTN_MASKED_LOGIT;

inline float decode_saturate_logit(float x) {
  return clamp(x, -MLX_ATTN_LOGIT_LIMIT, MLX_ATTN_LOGIT_LIMIT);
}

template <typename T, int D, int BK>
[[kernel]] void attention_decode_partial(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    constant AttentionParams& p [[buffer(3)]],
    const device uchar* mask [[buffer(4)]],
    device float* partial_out [[buffer(5)]],    // [B, Hkv, splits, rows, D]
    device float* partial_stats [[buffer(6)]],  // [B, Hkv, splits, rows, 2]: max, sum
    uint3 group_id [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = 4;
  constexpr int THREADS = 32 * NSG;
  constexpr int SLICE = D / 32;      // head-dim elements per lane
  constexpr int MAX_ROWS_PER_SG = 8;  // rows <= 32 (checked by the launch plan)
  threadgroup float k_tile[BK * D];
  threadgroup float v_tile[BK * D];

  const int split = int(group_id.x);
  const int splits = int(groups.x);
  const int kv_head = int(group_id.y);
  const int b = int(group_id.z);
  const int rows = p.group * p.q_len;
  const int offset = p.kv_len - p.q_len;
  const int chunk = (p.kv_len + splits - 1) / splits;
  const int kv_begin = split * chunk;
  const int kv_end = min(p.kv_len, kv_begin + chunk);

  float q_part[MAX_ROWS_PER_SG][SLICE];
  float o_part[MAX_ROWS_PER_SG][SLICE];
  float m_row[MAX_ROWS_PER_SG];
  float l_row[MAX_ROWS_PER_SG];
  for (int i = 0; i < MAX_ROWS_PER_SG; ++i) {
    const int r = int(sg) + NSG * i;
    const int h = kv_head * p.group + (r < rows ? r / p.q_len : 0);
    const int qi = r < rows ? r % p.q_len : 0;
    for (int e = 0; e < SLICE; ++e) {
      const int col = int(lane) * SLICE + e;
      q_part[i][e] = r < rows
          ? float(q[b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2] + col * p.q_strides[3]])
          : 0.0f;
      o_part[i][e] = 0.0f;
    }
    m_row[i] = kDecodeMasked;
    l_row[i] = 0.0f;
  }

  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    for (int e = int(tid); e < BK * D; e += THREADS) {
      const int key = kb + e / D;
      const int col = e % D;
      const bool inside = key < kv_end;
      k_tile[e] = inside
          ? float(k[b * p.k_strides[0] + kv_head * p.k_strides[1] + key * p.k_strides[2] + col * p.k_strides[3]])
          : 0.0f;
      v_tile[e] = inside
          ? float(v[b * p.v_strides[0] + kv_head * p.v_strides[1] + key * p.v_strides[2] + col * p.v_strides[3]])
          : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int i = 0; i < MAX_ROWS_PER_SG; ++i) {
      const int r = int(sg) + NSG * i;
      if (r >= rows) {
        break;  // uniform across the simdgroup
      }
      const int h = kv_head * p.group + r / p.q_len;
      const int qi = r % p.q_len;
      const int pos = qi + offset;
      for (int j = 0; j < BK; ++j) {
        const int key = kb + j;
        // score
        float dot = 0.0f;
        for (int e = 0; e < SLICE; ++e) {
          dot += q_part[i][e] * k_tile[j * D + int(lane) * SLICE + e];
        }
        float s = decode_saturate_logit(simd_sum(dot) * p.scale);  // scale
        // mask
        bool visible = key < kv_end;
        if (p.causal != 0) {
          visible = visible && key <= pos && (p.window_size <= 0 || key > pos - p.window_size);
        }
        if (visible && p.mask_kind != MLX_ATTN_MASK_NONE) {
          const long at = b * p.mask_strides[0] + h * p.mask_strides[1] + qi * p.mask_strides[2] +
              key * p.mask_strides[3];
          if (p.mask_kind == MLX_ATTN_MASK_BOOL) {
            visible = mask[at] != 0;
          } else {
            // values at or below the sentinel (-inf included) mask the key;
            // max() turns -inf into a finite value before any arithmetic
            const float added = max(float(((const device T*)mask)[at]), kDecodeMasked);
            visible = added > kDecodeMasked;
            s = decode_saturate_logit(s + added);
          }
        }
        if (!visible) {
          continue;  // same decision on every lane
        }
        // online max / rescale, accumulate
        const float m_new = max(m_row[i], s);
        const float alpha = exp2((m_row[i] - m_new) * MLX_ATTN_LOG2E);
        const float prob = exp2((s - m_new) * MLX_ATTN_LOG2E);
        l_row[i] = l_row[i] * alpha + prob;
        m_row[i] = m_new;
        for (int e = 0; e < SLICE; ++e) {
          o_part[i][e] = o_part[i][e] * alpha + prob * v_tile[j * D + int(lane) * SLICE + e];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  for (int i = 0; i < MAX_ROWS_PER_SG; ++i) {
    const int r = int(sg) + NSG * i;
    if (r >= rows) {
      break;
    }
    const long base = ((long(b) * p.kv_heads + kv_head) * splits + split) * rows + r;
    for (int e = 0; e < SLICE; ++e) {
      partial_out[base * D + int(lane) * SLICE + e] = o_part[i][e];
    }
    if (lane == 0) {
      partial_stats[base * 2] = m_row[i];
      partial_stats[base * 2 + 1] = l_row[i];
    }
  }
}

// One simdgroup per (row, KV head, batch): merge the splits' partials.
template <typename T, int D>
[[kernel]] void attention_decode_merge(
    const device float* partial_out [[buffer(0)]],
    const device float* partial_stats [[buffer(1)]],
    const device T* sinks [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    constant int& splits [[buffer(5)]],
    uint3 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int SLICE = D / 32;
  const int r = int(group_id.x);
  const int kv_head = int(group_id.y);
  const int b = int(group_id.z);
  const int rows = p.group * p.q_len;
  const int h = kv_head * p.group + r / p.q_len;
  const int qi = r % p.q_len;

  float m = kDecodeMasked;
  for (int s = 0; s < splits; ++s) {
    const long base = ((long(b) * p.kv_heads + kv_head) * splits + s) * rows + r;
    m = max(m, partial_stats[base * 2]);
  }
  float l = 0.0f;
  float o[SLICE];
  for (int e = 0; e < SLICE; ++e) {
    o[e] = 0.0f;
  }
  for (int s = 0; s < splits; ++s) {
    const long base = ((long(b) * p.kv_heads + kv_head) * splits + s) * rows + r;
    const float weight = exp2((partial_stats[base * 2] - m) * MLX_ATTN_LOG2E);  // rescale to the common max
    l += partial_stats[base * 2 + 1] * weight;
    for (int e = 0; e < SLICE; ++e) {
      o[e] += partial_out[base * D + int(lane) * SLICE + e] * weight;
    }
  }
  // normalize: sinks join the sum; rows that saw nothing give zeros
  float correction = 1.0f;
  if (p.has_sinks != 0) {
    const float sink = decode_saturate_logit(float(sinks[h * p.sinks_stride]));
    const float m_final = max(m, sink);
    correction = exp2((m - m_final) * MLX_ATTN_LOG2E);
    l = l * correction + exp2((sink - m_final) * MLX_ATTN_LOG2E);
  }
  const float factor = l > 0.0f ? correction / l : 0.0f;
  for (int e = 0; e < SLICE; ++e) {
    out[((long(b) * p.q_heads + h) * p.q_len + qi) * D + int(lane) * SLICE + e] = T(o[e] * factor);
  }
}

#define MLX_ATTN_DECODE(tname, type, d, bk)                                                      \
  template [[host_name("attention_decode_partial_" #tname "_d" #d)]] [[kernel]] decltype(     \
      attention_decode_partial<type, d, bk>) attention_decode_partial<type, d, bk>;            \
  template [[host_name("attention_decode_merge_" #tname "_d" #d)]] [[kernel]] decltype(       \
      attention_decode_merge<type, d>) attention_decode_merge<type, d>;

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_DECODE_BFLOAT16(d, bk) MLX_ATTN_DECODE(bfloat16, bfloat, d, bk)
#else
#define MLX_ATTN_DECODE_BFLOAT16(d, bk)
#endif
#define MLX_ATTN_DECODE_TYPES(d, bk)       \
  MLX_ATTN_DECODE(float32, float, d, bk)   \
  MLX_ATTN_DECODE(float16, half, d, bk)    \
  MLX_ATTN_DECODE_BFLOAT16(d, bk)

MLX_ATTN_DECODE_TYPES(64, 32)
MLX_ATTN_DECODE_TYPES(96, 16)
MLX_ATTN_DECODE_TYPES(128, 16)
MLX_ATTN_DECODE_TYPES(256, 8)
