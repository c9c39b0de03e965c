// Paged, ragged attention over pages quantized by mx.quantize (the
// QuantizedKVCache format): the kernel template;
// metal/attention_paged_quantized.metal instantiates it. The float paged
// kernel's body (paged_decode_partial, metal/attention_paged.h) with
// PagedKV<QuantizedKV>: the quantized loader reads a page as its batch entry
// (packed words, scales and biases strides[0] = their page strides). The
// partials have the float layout: attention_paged_decode_merge combines them
// (a sequence of one split writes its rows itself, as the float kernel's).
#pragma once

#include "metal/attention_paged.h"
#include "metal/attention_quantized.h"

// R rows and NSG simdgroups per threadgroup (decode_split's shape); the
// attribute makes the compiler fit 32 x NSG threads in a core's registers.
template <typename T, int D, int BITS, int R, int NSG>
[[kernel, max_total_threads_per_threadgroup(32 * NSG)]] void attention_paged_quantized_decode_partial(
    const device T* q [[buffer(0)]],
    const device uint* k_pages [[buffer(1)]],  // packed [num_pages, Hkv, page_size, D * BITS / 32]
    const device T* k_scales [[buffer(2)]],    // [num_pages, Hkv, page_size, D / group_size]
    const device T* k_biases [[buffer(3)]],
    const device uint* v_pages [[buffer(4)]],
    const device T* v_scales [[buffer(5)]],
    const device T* v_biases [[buffer(6)]],
    const device int* block_table [[buffer(7)]],
    constant PagedSequence* sequences [[buffer(8)]],
    constant QuantizedAttentionParams& qp [[buffer(9)]],
    device float* partial_out [[buffer(10)]],
    device float* partial_stats [[buffer(11)]],
    const device T* sinks [[buffer(12)]],
    device T* out [[buffer(13)]],  // [total_q, Hq, D]: sequences of one split
    device float* lse [[buffer(14)]],
    MLX_ATTN_THREAD_POSITION) {
  threadgroup DecodeStates<D, NSG, R> states;
  PagedKV<QuantizedKV<T, D, BITS>, PagedWindowRounds<R>::value> kv;
  kv.rows = quantized_kv<T, D, BITS>(k_pages, k_scales, k_biases, v_pages, v_scales, v_biases, qp);
  paged_decode_partial<T, D>(kv, q, block_table, sequences, partial_out, partial_stats, sinks, out, lse, states,
                             group_id, groups, sg, lane);
}
