// Fused attention for decoding (few queries, long key/value length).
//
// attention_decode_partial: the key/value length is split across
// threadgroups (grid.x = splits). A threadgroup serves up to R rows =
// (query head of the GQA group) x (query position) of one KV head, so K/V are
// read once for the whole group (grid.y = KV heads x row chunks; one chunk
// unless rows > R). Its simdgroups take the split's keys in turn (key j:
// simdgroup j % NSG) and read them straight from device memory into
// registers: lane l holds D/32 dims of the key, the value, every row's query
// and output (DecodeLayout::dim: chunk c of VEC consecutive dims at
// c * 32 * VEC + l * VEC, so consecutive lanes read consecutive vectors), and
// a score is a simd_sum of lane partial dot products; no K/V staging. With
// params.vector_loads each chunk is one VEC-wide device load. Register
// budget: R x D/32 floats of q and of the output per lane
// (MLX_ATTN_DECODE_ROW_FLOATS each).
// The simdgroups' online-softmax states are combined once into one partial
// (max, sum, output) per (row, split): simdgroups 1.. hand their live rows
// (not the register budget's unused ones) to simdgroup 0 through threadgroup
// memory, and simdgroup 0 adds them to its own registers (lane g reads the max
// and sum of simdgroup g + 1 once; the other lanes get its weight by shuffle).
// attention_decode_merge combines the splits: the same rescale, then sinks,
// normalize and the row log-sum-exp.
// Same step names and finite sentinels as attention_prefill.metal.
#include <metal_stdlib>

#include "metal/attention_params.h"

using namespace metal;

constant float kDecodeMasked = MLX_ATTN_MASKED_LOGIT;

inline float decode_saturate_logit(float x) {
  return clamp(x, -MLX_ATTN_LOGIT_LIMIT, MLX_ATTN_LOGIT_LIMIT);
}

// Dims per device load in decode: the largest of 4, 2, 1 that divides a lane's D/32.
template <int D>
struct DecodeLayout {
  static constexpr int SLICE = D / 32;
  static constexpr int VEC = SLICE % 4 == 0 ? 4 : (SLICE % 2 == 0 ? 2 : 1);
  // the head dim of element e of `lane`'s slice
  static inline int dim(uint lane, int e) { return e / VEC * 32 * VEC + int(lane) * VEC + e % VEC; }
};

template <typename T, int D>
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
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = MLX_ATTN_DECODE_SIMDGROUPS;
  constexpr int SLICE = D / 32;                              // head-dim elements per lane
  constexpr int VEC = DecodeLayout<D>::VEC;
  constexpr int R = MLX_ATTN_DECODE_ROW_FLOATS / SLICE;      // rows per threadgroup
  // the states of simdgroups 1.., combined at the end; element e of a lane's
  // slice sits at e * 32 + lane so that the 32 lanes hit 32 different banks
  threadgroup float sg_out[(NSG - 1) * R * D];
  threadgroup float sg_max[(NSG - 1) * R];
  threadgroup float sg_sum[(NSG - 1) * R];

  const int split = int(group_id.x);
  const int splits = int(groups.x);
  const int rows = p.group * p.q_len;
  const int row_chunks = (rows + R - 1) / R;
  const int kv_head = int(group_id.y) / row_chunks;
  const int r0 = (int(group_id.y) % row_chunks) * R;
  const int b = int(group_id.z);
  const int offset = p.kv_len - p.q_len;
  const int chunk = (p.kv_len + splits - 1) / splits;
  int kv_begin = split * chunk;
  const int kv_end = min(p.kv_len, kv_begin + chunk);
  if (p.causal != 0 && p.window_size > 0) {
    // keys before the first query's window are outside every row's window
    kv_begin = max(kv_begin, offset - p.window_size + 1);
  }

  const bool vector_loads = p.vector_loads != 0;
  float q_part[R][SLICE];
  float o_part[R][SLICE];
  float m_row[R];
  float l_row[R];
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    const int h = kv_head * p.group + (r < rows ? r / p.q_len : 0);
    const int qi = r < rows ? r % p.q_len : 0;
    const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
    for (int e = 0; e < SLICE; e += VEC) {
      if (r < rows) {
        const long at = q_row + DecodeLayout<D>::dim(lane, e) * p.q_strides[3];
        RowLoad<T, VEC>::read(q, at, p.q_strides[3], vector_loads, &q_part[i][e]);
      }
    }
    for (int e = 0; e < SLICE; ++e) {
      q_part[i][e] = r < rows ? q_part[i][e] : 0.0f;  // rows past the group: not read above
      o_part[i][e] = 0.0f;
    }
    m_row[i] = kDecodeMasked;
    l_row[i] = 0.0f;
  }

  const long k_head = b * p.k_strides[0] + kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + kv_head * p.v_strides[1];
  for (int key = kv_begin + int(sg); key < kv_end; key += NSG) {
    // the simdgroup reads one key row in VEC-element chunks, lane l the
    // l-th chunk of each 32: coalesced
    float k_slice[SLICE];
    float v_slice[SLICE];
    const long k_at = k_head + key * p.k_strides[2];
    const long v_at = v_head + key * p.v_strides[2];
    for (int e = 0; e < SLICE; e += VEC) {
      const int d = DecodeLayout<D>::dim(lane, e);
      RowLoad<T, VEC>::read(k, k_at + d * p.k_strides[3], p.k_strides[3], vector_loads, &k_slice[e]);
      RowLoad<T, VEC>::read(v, v_at + d * p.v_strides[3], p.v_strides[3], vector_loads, &v_slice[e]);
    }
    for (int i = 0; i < R; ++i) {
      const int r = r0 + i;
      if (r >= rows) {
        break;  // uniform across the simdgroup
      }
      const int h = kv_head * p.group + r / p.q_len;
      const int qi = r % p.q_len;
      const int pos = qi + offset;
      // score
      float dot = 0.0f;
      for (int e = 0; e < SLICE; ++e) {
        dot += q_part[i][e] * k_slice[e];
      }
      float s = decode_saturate_logit(simd_sum(dot) * p.scale);  // scale
      // mask
      bool visible = true;
      if (p.causal != 0) {
        visible = key <= pos && (p.window_size <= 0 || key > pos - p.window_size);
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
        o_part[i][e] = o_part[i][e] * alpha + prob * v_slice[e];
      }
    }
  }

  // combine the simdgroups' states into this split's partial, live rows only
  const int live_rows = min(R, rows - r0);
  if (sg != 0) {
    const int at = (int(sg) - 1) * R;
    for (int i = 0; i < live_rows; ++i) {
      for (int e = 0; e < SLICE; ++e) {
        sg_out[(at + i) * D + e * 32 + int(lane)] = o_part[i][e];
      }
      if (lane == 0) {
        sg_max[at + i] = m_row[i];
        sg_sum[at + i] = l_row[i];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg != 0) {
    return;  // after the last barrier
  }
  const bool reads_stats = lane < uint(NSG - 1);  // lane g: simdgroup g + 1's max and sum
  for (int i = 0; i < live_rows; ++i) {
    const float their_max = reads_stats ? sg_max[int(lane) * R + i] : kDecodeMasked;
    const float their_sum = reads_stats ? sg_sum[int(lane) * R + i] : 0.0f;
    const float m = max(m_row[i], simd_max(their_max));
    // rescale to the common max: lane g's weight is simdgroup g + 1's
    const float own = exp2((m_row[i] - m) * MLX_ATTN_LOG2E);
    const float their_weight = exp2((their_max - m) * MLX_ATTN_LOG2E);
    const float l = l_row[i] * own + simd_sum(their_sum * their_weight);
    float o[SLICE];
    for (int e = 0; e < SLICE; ++e) {
      o[e] = o_part[i][e] * own;
    }
    for (int g = 0; g < NSG - 1; ++g) {
      const float weight = simd_shuffle(their_weight, ushort(g));
      for (int e = 0; e < SLICE; ++e) {
        o[e] += sg_out[(g * R + i) * D + e * 32 + int(lane)] * weight;
      }
    }
    const long base = ((long(b) * p.kv_heads + kv_head) * splits + split) * rows + r0 + i;
    for (int e = 0; e < SLICE; ++e) {
      partial_out[base * D + DecodeLayout<D>::dim(lane, e)] = o[e];
    }
    if (lane == 0) {
      partial_stats[base * 2] = m;
      partial_stats[base * 2 + 1] = l;
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
    device float* lse [[buffer(6)]],  // [B, Hq, Tq] when p.output_lse
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
      o[e] += partial_out[base * D + DecodeLayout<D>::dim(lane, e)] * weight;
    }
  }
  // normalize: sinks join the sum; rows that saw nothing give zeros
  float correction = 1.0f;
  if (p.has_sinks != 0) {
    const float sink = decode_saturate_logit(float(sinks[h * p.sinks_stride]));
    const float m_final = max(m, sink);
    correction = exp2((m - m_final) * MLX_ATTN_LOG2E);
    l = l * correction + exp2((sink - m_final) * MLX_ATTN_LOG2E);
    m = m_final;
  }
  const float factor = l > 0.0f ? correction / l : 0.0f;
  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;
  for (int e = 0; e < SLICE; ++e) {
    out[row * D + DecodeLayout<D>::dim(lane, e)] = T(o[e] * factor);
  }
  if (p.output_lse != 0 && lane == 0) {
    // a row that saw nothing: -inf, written as bits (fast math has no infinities)
    lse[row] = l > 0.0f ? m + log(l) : as_type<float>(0xff800000u);
  }
}

#define MLX_ATTN_DECODE(tname, type, d)                                                          \
  template [[host_name("attention_decode_partial_" #tname "_d" #d)]] [[kernel]] decltype(     \
      attention_decode_partial<type, d>) attention_decode_partial<type, d>;                    \
  template [[host_name("attention_decode_merge_" #tname "_d" #d)]] [[kernel]] decltype(       \
      attention_decode_merge<type, d>) attention_decode_merge<type, d>;

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_DECODE_BFLOAT16(d) MLX_ATTN_DECODE(bfloat16, bfloat, d)
#else
#define MLX_ATTN_DECODE_BFLOAT16(d)
#endif
#define MLX_ATTN_DECODE_TYPES(d)       \
  MLX_ATTN_DECODE(float32, float, d)   \
  MLX_ATTN_DECODE(float16, half, d)    \
  MLX_ATTN_DECODE_BFLOAT16(d)

MLX_ATTN_DECODE_TYPES(64)
MLX_ATTN_DECODE_TYPES(96)
MLX_ATTN_DECODE_TYPES(128)
MLX_ATTN_DECODE_TYPES(256)
