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
// a simdgroup reads the row's D * BITS / 8 bytes of packed words and its
// D / group_size scales and biases once, coalesced, and each lane
// dequantizes its slice in registers (dequantize_slice); no dequantized K/V
// exists anywhere, not even in threadgroup memory. Any number of rows: grid.y = KV heads x chunks of R
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

// This lane's features [lane * SLICE, (lane + 1) * SLICE) of one quantized
// row, dequantized into `out`; packed_at / scale_at / bias_at locate the row.
// Every device byte of the row is read once per simdgroup: a lane whose
// slice fills whole words reads them; otherwise the first D * BITS / 32 lanes
// read one word each and the lanes sharing it take it by simd_shuffle. The
// row's D / group_size scales and biases are read by the first lanes and
// shuffled to the lanes of their group (a slice never straddles groups).
// Call from uniform control flow (simd_shuffle).
template <typename T, int D, int BITS>
inline void dequantize_slice(
    const device uint* packed, long packed_at, long word_stride,
    const device T* scales, long scale_at, long scale_stride,
    const device T* biases, long bias_at, long bias_stride,
    int group_size, uint lane, thread float* out) {
  constexpr int SLICE = D / 32;
  constexpr int CODES_PER_WORD = 32 / BITS;
  constexpr uint CODE_MASK = (1u << BITS) - 1u;
  constexpr int SLICE_WORDS = SLICE * BITS / 32;  // 0: lanes share words
  constexpr int LANES_PER_WORD = SLICE_WORDS > 0 ? 1 : 32 / (SLICE * BITS);
  const int first = int(lane) * SLICE;
  const bool reads_group = int(lane) < D / group_size;
  const float group_scale = reads_group ? float(scales[scale_at + int(lane) * scale_stride]) : 0.0f;
  const float group_bias = reads_group ? float(biases[bias_at + int(lane) * bias_stride]) : 0.0f;
  const ushort lane_group = ushort(first / group_size);
  const float scale = simd_shuffle(group_scale, lane_group);
  const float bias = simd_shuffle(group_bias, lane_group);
  if (SLICE_WORDS > 0) {
    for (int w = 0; w < SLICE_WORDS; ++w) {
      const uint word = packed[packed_at + (first / CODES_PER_WORD + w) * word_stride];
      for (int c = 0; c < CODES_PER_WORD; ++c) {
        out[w * CODES_PER_WORD + c] = scale * float((word >> (c * BITS)) & CODE_MASK) + bias;
      }
    }
  } else {
    const uint read = int(lane) < D * BITS / 32 ? packed[packed_at + int(lane) * word_stride] : 0u;
    const uint word = simd_shuffle(read, ushort(int(lane) / LANES_PER_WORD));
    const int shift = (first % CODES_PER_WORD) * BITS;
    for (int e = 0; e < SLICE; ++e) {
      out[e] = scale * float((word >> (shift + e * BITS)) & CODE_MASK) + bias;
    }
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

  const long k_head = b * p.k_strides[0] + kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + kv_head * p.v_strides[1];
  const long k_scale_head = b * qp.k_scale_strides[0] + kv_head * qp.k_scale_strides[1];
  const long k_bias_head = b * qp.k_bias_strides[0] + kv_head * qp.k_bias_strides[1];
  const long v_scale_head = b * qp.v_scale_strides[0] + kv_head * qp.v_scale_strides[1];
  const long v_bias_head = b * qp.v_bias_strides[0] + kv_head * qp.v_bias_strides[1];
  for (int key = kv_begin + int(sg); key < kv_end; key += NSG) {
    // dequantize: this lane's features of the key and the value, in registers
    float k_slice[SLICE];
    float v_slice[SLICE];
    dequantize_slice<T, D, BITS>(
        k, k_head + key * p.k_strides[2], p.k_strides[3],
        k_scales, k_scale_head + key * qp.k_scale_strides[2], qp.k_scale_strides[3],
        k_biases, k_bias_head + key * qp.k_bias_strides[2], qp.k_bias_strides[3], qp.group_size, lane, k_slice);
    dequantize_slice<T, D, BITS>(
        v, v_head + key * p.v_strides[2], p.v_strides[3],
        v_scales, v_scale_head + key * qp.v_scale_strides[2], qp.v_scale_strides[3],
        v_biases, v_bias_head + key * qp.v_bias_strides[2], qp.v_bias_strides[3], qp.group_size, lane, v_slice);
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
