// Fused attention over keys and values quantized by mx.quantize: uint32
// words of 32 / BITS codes (code i of a word at bit (i % (32 / BITS)) * BITS),
// per-group scales and biases in the query dtype, feature = scale * code + bias.
//
// attention_quantized_decode_partial has the structure of the float decode
// kernel (metal/attention_decode.metal, same step names): the key/value
// length split across threadgroups (grid.x), a threadgroup serving R rows =
// (query head of the GQA group) x (query position) of one KV head, so K/V
// are read once for the whole group, its simdgroups taking keys in turn.
// Lane l owns features [l * SLICE, (l + 1) * SLICE), SLICE = D / 32: per key
// it reads only the packed words holding them (a simdgroup reads the row's
// D * BITS / 8 bytes, coalesced) and the one scale and bias of their group
// (group_size % SLICE == 0: a slice never straddles groups), and dequantizes
// them in registers; no dequantized K/V exists anywhere, not even in
// threadgroup memory. Any number of rows: grid.y = KV heads x chunks of R
// rows, so prefill shapes run here too (K/V read once per chunk); causal
// and window attention narrow each chunk's key range to its positions.
// The partials have the float decode layout, so attention_decode_merge
// (attention_decode.metal) combines the splits, adds sinks, normalizes and
// writes the row log-sum-exp.
#include <metal_stdlib>

#include "metal/attention_quantized_params.h"

using namespace metal;

constant float kQuantizedMasked = MLX_ATTN_MASKED_LOGIT;

inline float quantized_saturate_logit(float x) {
  return clamp(x, -MLX_ATTN_LOGIT_LIMIT, MLX_ATTN_LOGIT_LIMIT);
}

// Features [first, first + SLICE) of one quantized row, dequantized into
// `out`: packed_at / scale_at / bias_at locate the row's words and its
// group's scale and bias.
template <typename T, int BITS, int SLICE>
inline void dequantize_slice(
    const device uint* packed, long packed_at, long word_stride,
    const device T* scales, long scale_at,
    const device T* biases, long bias_at,
    int first, thread float* out) {
  constexpr int CODES_PER_WORD = 32 / BITS;
  constexpr uint CODE_MASK = (1u << BITS) - 1u;
  const float scale = float(scales[scale_at]);
  const float bias = float(biases[bias_at]);
  for (int e = 0; e < SLICE; ++e) {
    const int i = first + e;
    const uint word = packed[packed_at + (i / CODES_PER_WORD) * word_stride];
    const uint code = (word >> ((i % CODES_PER_WORD) * BITS)) & CODE_MASK;
    out[e] = scale * float(code) + bias;
  }
}

template <typename T, int D, int BITS>
[[kernel]] void attention_quantized_decode_partial(
    const device T* q [[buffer(0)]],
    const device uint* k [[buffer(1)]],
    const device T* k_scales [[buffer(2)]],
    const device T* k_biases [[buffer(3)]],
    const device uint* v [[buffer(4)]],
    const device T* v_scales [[buffer(5)]],
    const device T* v_biases [[buffer(6)]],
    constant AttentionParams& p [[buffer(7)]],
    constant QuantizedAttentionParams& qp [[buffer(8)]],
    const device uchar* mask [[buffer(9)]],
    device float* partial_out [[buffer(10)]],    // [B, Hkv, splits, rows, D]
    device float* partial_stats [[buffer(11)]],  // [B, Hkv, splits, rows, 2]: max, sum
    uint3 group_id [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = MLX_ATTN_DECODE_SIMDGROUPS;
  constexpr int SLICE = D / 32;                          // features per lane
  constexpr int R = MLX_ATTN_DECODE_ROW_FLOATS / SLICE;  // rows per threadgroup
  // the simdgroups' states, combined at the end (bank-friendly: e * 32 + lane)
  threadgroup float sg_out[NSG * R * D];
  threadgroup float sg_max[NSG * R];
  threadgroup float sg_sum[NSG * R];

  const int split = int(group_id.x);
  const int splits = int(groups.x);
  const int rows = p.group * p.q_len;
  const int row_chunks = (rows + R - 1) / R;
  const int kv_head = int(group_id.y) / row_chunks;
  const int r0 = (int(group_id.y) % row_chunks) * R;
  const int b = int(group_id.z);
  const int offset = p.kv_len - p.q_len;

  float q_part[R][SLICE];
  float o_part[R][SLICE];
  float m_row[R];
  float l_row[R];
  int first_pos = p.kv_len;  // the chunk's query positions (every chunk has a row)
  int last_pos = -p.q_len;
  for (int i = 0; i < R; ++i) {
    const int r = r0 + i;
    const bool real = r < rows;
    const int h = kv_head * p.group + (real ? r / p.q_len : 0);
    const int qi = real ? r % p.q_len : 0;
    if (real) {
      first_pos = min(first_pos, qi + offset);
      last_pos = max(last_pos, qi + offset);
    }
    const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
    for (int e = 0; e < SLICE; ++e) {
      q_part[i][e] = real ? float(q[q_row + (int(lane) * SLICE + e) * p.q_strides[3]]) : 0.0f;
      o_part[i][e] = 0.0f;
    }
    m_row[i] = kQuantizedMasked;
    l_row[i] = 0.0f;
  }

  const int chunk = (p.kv_len + splits - 1) / splits;
  int kv_begin = split * chunk;
  int kv_end = min(p.kv_len, kv_begin + chunk);
  if (p.causal != 0) {
    // keys after the chunk's last position, or before its first position's
    // window, are hidden from every row of the chunk
    kv_end = min(kv_end, last_pos + 1);
    if (p.window_size > 0) {
      kv_begin = max(kv_begin, first_pos - p.window_size + 1);
    }
  }

  const int first = int(lane) * SLICE;
  const int lane_group = first / qp.group_size;
  const long k_head = b * p.k_strides[0] + kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + kv_head * p.v_strides[1];
  const long k_scale_head = b * qp.k_scale_strides[0] + kv_head * qp.k_scale_strides[1] +
      lane_group * qp.k_scale_strides[3];
  const long k_bias_head = b * qp.k_bias_strides[0] + kv_head * qp.k_bias_strides[1] +
      lane_group * qp.k_bias_strides[3];
  const long v_scale_head = b * qp.v_scale_strides[0] + kv_head * qp.v_scale_strides[1] +
      lane_group * qp.v_scale_strides[3];
  const long v_bias_head = b * qp.v_bias_strides[0] + kv_head * qp.v_bias_strides[1] +
      lane_group * qp.v_bias_strides[3];
  for (int key = kv_begin + int(sg); key < kv_end; key += NSG) {
    // dequantize: this lane's features of the key and the value, in registers
    float k_slice[SLICE];
    float v_slice[SLICE];
    dequantize_slice<T, BITS, SLICE>(
        k, k_head + key * p.k_strides[2], p.k_strides[3],
        k_scales, k_scale_head + key * qp.k_scale_strides[2],
        k_biases, k_bias_head + key * qp.k_bias_strides[2], first, k_slice);
    dequantize_slice<T, BITS, SLICE>(
        v, v_head + key * p.v_strides[2], p.v_strides[3],
        v_scales, v_scale_head + key * qp.v_scale_strides[2],
        v_biases, v_bias_head + key * qp.v_bias_strides[2], first, v_slice);
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
      float s = quantized_saturate_logit(simd_sum(dot) * p.scale);  // scale
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
          // at or below the sentinel (-inf included) masks; max() keeps it finite
          const float added = max(float(((const device T*)mask)[at]), kQuantizedMasked);
          visible = added > kQuantizedMasked;
          s = quantized_saturate_logit(s + added);
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

  // combine the simdgroups' states into this split's partial
  for (int i = 0; i < R; ++i) {
    for (int e = 0; e < SLICE; ++e) {
      sg_out[(int(sg) * R + i) * D + e * 32 + int(lane)] = o_part[i][e];
    }
    if (lane == 0) {
      sg_max[int(sg) * R + i] = m_row[i];
      sg_sum[int(sg) * R + i] = l_row[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(sg); i < R && r0 + i < rows; i += NSG) {
    float m = kQuantizedMasked;
    for (int g = 0; g < NSG; ++g) {
      m = max(m, sg_max[g * R + i]);
    }
    float l = 0.0f;
    float o[SLICE];
    for (int e = 0; e < SLICE; ++e) {
      o[e] = 0.0f;
    }
    for (int g = 0; g < NSG; ++g) {
      const float weight = exp2((sg_max[g * R + i] - m) * MLX_ATTN_LOG2E);  // rescale to the common max
      l += sg_sum[g * R + i] * weight;
      for (int e = 0; e < SLICE; ++e) {
        o[e] += sg_out[(g * R + i) * D + e * 32 + int(lane)] * weight;
      }
    }
    const long base = ((long(b) * p.kv_heads + kv_head) * splits + split) * rows + r0 + i;
    for (int e = 0; e < SLICE; ++e) {
      partial_out[base * D + int(lane) * SLICE + e] = o[e];
    }
    if (lane == 0) {
      partial_stats[base * 2] = m;
      partial_stats[base * 2 + 1] = l;
    }
  }
}

#define MLX_ATTN_QUANTIZED_DECODE(tname, type, d, bits)                                                  \
  template [[host_name("attention_quantized_decode_partial_" #tname "_d" #d "_b" #bits)]] [[kernel]] \
  decltype(attention_quantized_decode_partial<type, d, bits>) attention_quantized_decode_partial<type, d, bits>;

// bfloat exists from Metal 3.1 on: an older target builds the other dtypes.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(d, bits) MLX_ATTN_QUANTIZED_DECODE(bfloat16, bfloat, d, bits)
#else
#define MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(d, bits)
#endif
#define MLX_ATTN_QUANTIZED_DECODE_TYPES(d, bits)   \
  MLX_ATTN_QUANTIZED_DECODE(float32, float, d, bits) \
  MLX_ATTN_QUANTIZED_DECODE(float16, half, d, bits)  \
  MLX_ATTN_QUANTIZED_DECODE_BFLOAT16(d, bits)
#define MLX_ATTN_QUANTIZED_DECODE_BITS(d) \
  MLX_ATTN_QUANTIZED_DECODE_TYPES(d, 4)   \
  MLX_ATTN_QUANTIZED_DECODE_TYPES(d, 8)

// Head dims of the float decode merge (attention_decode.metal) whose lane
// slice (D / 32 features) divides every group size: not 96.
MLX_ATTN_QUANTIZED_DECODE_BITS(64)
MLX_ATTN_QUANTIZED_DECODE_BITS(128)
MLX_ATTN_QUANTIZED_DECODE_BITS(256)
