// Fused attention over keys and values quantized by mx.quantize (the kernel
// template; metal/attention_quantized.metal instantiates it): uint32
// words of 32 / BITS codes (code i of a word at bit (i % (32 / BITS)) * BITS),
// per-group scales and biases in the query dtype, feature = scale * code + bias.
//
// attention_quantized_decode_partial is the float decode kernel's body
// (decode_split, metal/attention_decode.h) with the QuantizedKV loader
// policy: the key/value
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
// writes the row log-sum-exp; with one split there is no merge: the partial
// kernel does that itself, as the float decode's (decode_launch_outputs).
#pragma once

#include <metal_stdlib>

#include "metal/attention_decode.h"
#include "metal/attention_quantized_params.h"

using namespace metal;

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

// K/V quantized by mx.quantize, the decode loader policy (metal/attention_decode.h):
// lane l owns features [l * SLICE, (l + 1) * SLICE) (a slice never
// straddles a quantization group), dequantized in registers.
template <typename T, int D, int BITS>
struct QuantizedKV {
  static constexpr int SLICE = D / 32;
  static constexpr int VEC = SLICE % 4 == 0 ? 4 : (SLICE % 2 == 0 ? 2 : 1);
  // while it loads: a lane's packed word, scale and bias (DecodePrefetch;
  // the cost model's QUANTIZED_LOADER_REGISTERS)
  static constexpr int REGISTERS = 3;
  static inline int dim(uint lane, int e) { return int(lane) * SLICE + e; }

  const device uint* k;
  const device T* k_scales;
  const device T* k_biases;
  const device uint* v;
  const device T* v_scales;
  const device T* v_biases;
  constant QuantizedAttentionParams* qp;
  int group_size;
  // [head start, key stride, word / group stride] of k, k_scales, k_biases, v, v_scales, v_biases
  attn_int64 at[6][3];

  inline void select_head(constant AttentionParams& p, int b, int kv_head) {
    const constant attn_int64* strides[6] = {
        p.k_strides, qp->k_scale_strides, qp->k_bias_strides, p.v_strides, qp->v_scale_strides, qp->v_bias_strides};
    for (int i = 0; i < 6; ++i) {
      at[i][0] = b * strides[i][0] + kv_head * strides[i][1];
      at[i][1] = strides[i][2];
      at[i][2] = strides[i][3];
    }
    group_size = qp->group_size;
  }
  inline void load(int key, uint lane, thread float* k_slice, thread float* v_slice) const {
    dequantize_slice<T, D, BITS>(k, at[0][0] + key * at[0][1], at[0][2], k_scales, at[1][0] + key * at[1][1], at[1][2],
                                 k_biases, at[2][0] + key * at[2][1], at[2][2], group_size, lane, k_slice);
    dequantize_slice<T, D, BITS>(v, at[3][0] + key * at[3][1], at[3][2], v_scales, at[4][0] + key * at[4][1], at[4][2],
                                 v_biases, at[5][0] + key * at[5][1], at[5][2], group_size, lane, v_slice);
  }
};

// The loader over a kernel's quantized K/V buffers (each a packed-word array
// with its scales and biases); select_head places it on one head. The
// quantized decode, the quantized prefill and the paged quantized decode
// take their loader from here.
template <typename T, int D, int BITS>
inline QuantizedKV<T, D, BITS> quantized_kv(
    const device uint* k, const device T* k_scales, const device T* k_biases, const device uint* v,
    const device T* v_scales, const device T* v_biases, constant QuantizedAttentionParams& qp) {
  QuantizedKV<T, D, BITS> kv;
  kv.k = k;
  kv.k_scales = k_scales;
  kv.k_biases = k_biases;
  kv.v = v;
  kv.v_scales = v_scales;
  kv.v_biases = v_biases;
  kv.qp = &qp;
  return kv;
}

// R rows and NSG simdgroups per threadgroup (decode_split's shape: the
// float decode's two); the attribute makes the compiler fit 32 x NSG
// threads in a core's registers.
template <typename T, int D, int BITS, int MASK, int R, int NSG>
[[kernel, max_total_threads_per_threadgroup(32 * NSG)]] void attention_quantized_decode_partial(
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
    const device T* sinks [[buffer(12)]],
    device T* out [[buffer(13)]],                // one split: written here, no merge
    device float* lse [[buffer(14)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup DecodeStates<D, NSG, R> states;
  QuantizedKV<T, D, BITS> kv = quantized_kv<T, D, BITS>(k, k_scales, k_biases, v, v_scales, v_biases, qp);
  const DecodeOutputs<T> outputs = decode_launch_outputs(partial_out, partial_stats, sinks, out, lse, p, groups);
  decode_split<T, D, MASK>(kv, q, p, mask, outputs, states, group_id, groups, sg, lane);
}
