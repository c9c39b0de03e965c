// The rules every attention kernel applies between the score q.k and the
// online softmax, written once for the Metal kernels (metal/*.metal) and the
// CPU kernels (csrc/cpu/): logit saturation, the softcap, key visibility
// (causal, sliding window, bounds), the key range of a query block, whether
// a key block needs per-element tests at all, the mask read and the masked
// sentinel. The
// reference path (mlx_attn/reference.py) states the same rules in MLX ops.
//
// Positions: query row i of a problem sits at key position
// pos = i + kv_len - q_len (lower-right aligned causal). Under a causal mask
// it sees keys <= pos; with a window of w > 0 also only keys > pos - w.
#pragma once

#include "metal/attention_params.h"

#ifdef __METAL_VERSION__
#define ATTN_DEVICE device
#define ATTN_PARAMS constant AttentionParams&
#else
#define ATTN_DEVICE
#define ATTN_PARAMS const AttentionParams&
#endif

// scale: every logit saturates to [-LIMIT, LIMIT]; NaN passes through.
inline float saturate_logit(float x) {
  return x < -MLX_ATTN_LOGIT_LIMIT ? -MLX_ATTN_LOGIT_LIMIT : (x > MLX_ATTN_LOGIT_LIMIT ? MLX_ATTN_LOGIT_LIMIT : x);
}

// softcap (Gemma 2, Grok; AttentionParams::softcap > 0): the saturated
// logit s becomes cap * tanh(s / cap), bounded by cap. It comes before any
// mask, as in Hugging Face's eager attention (an additive mask is added to
// the capped logit), so the log-sum-exp is over capped logits. attn_tanh
// takes any argument (a quotient that overflowed to +-inf gives +-1):
// metal::precise::tanh here, a vector tanh on the CPU (csrc/cpu/rules.h).
// F: float, or the CPU kernels' float vector.
#ifdef __METAL_VERSION__
inline float attn_tanh(float x) {
  return metal::precise::tanh(x);
}
#endif
template <typename F>
inline F softcap_logit(F s, float cap) {
  return cap * attn_tanh(s / cap);
}
// d softcap_logit / ds, from the capped logit c: 1 - tanh^2 = 1 - (c / cap)^2
// (the backward multiplies the capped logit's gradient by it).
template <typename F>
inline F softcap_slope(F capped, float cap) {
  const F t = capped / cap;
  return 1.0f - t * t;
}

// The key position of query row `query` (lower-right alignment).
inline int query_position(ATTN_PARAMS p, int query) {
  return query + p.kv_len - p.q_len;
}

// Whether the causal / window rule lets a query at `pos` see `key`.
inline bool key_visible(ATTN_PARAMS p, int key, int pos) {
  return p.causal == 0 || (key <= pos && (p.window_size <= 0 || key > pos - p.window_size));
}

// Keys [begin, end) that some query at positions [first_pos, last_pos] may
// see; empty (begin >= end) when none can.
struct KeyRange {
  int begin;
  int end;
};
inline KeyRange block_key_range(ATTN_PARAMS p, int first_pos, int last_pos) {
  KeyRange range;
  range.begin = 0;
  range.end = p.kv_len;
  if (p.causal != 0) {
    range.end = last_pos + 1 < p.kv_len ? last_pos + 1 : p.kv_len;
    if (p.window_size > 0) {
      const int lo = first_pos - p.window_size + 1;
      range.begin = lo > 0 ? lo : 0;
    }
  }
  if (range.end < range.begin) range.end = range.begin;
  return range;
}

// Whether the key block [first_key, first_key + keys) holds a key that the
// causal / window rule hides from one of the queries at [first_pos, last_pos]
// (an edge block); interior blocks need no per-element visibility test.
inline bool block_on_edge(ATTN_PARAMS p, int first_key, int keys, int first_pos, int last_pos) {
  if (p.causal == 0) return false;
  const bool past_diagonal = first_key + keys - 1 > first_pos;
  const bool before_window = p.window_size > 0 && first_key <= last_pos - p.window_size;
  return past_diagonal || before_window;
}

// Where the mask value of (batch b, query head h, query qi, key) is, in
// elements of the mask seen as [B, Hq, Tq, Tkv] (0 strides broadcast).
inline attn_int64 mask_offset(ATTN_PARAMS p, int b, int h, int qi, int key) {
  return b * p.mask_strides[0] + h * p.mask_strides[1] + qi * p.mask_strides[2] + key * p.mask_strides[3];
}

// The logit after a boolean mask value (false masks the key).
inline float bool_masked_logit(float s, bool keep) {
  return keep ? s : MLX_ATTN_MASKED_LOGIT;
}

// The logit after an additive mask value: values at or below the sentinel
// (-inf included) mask the key; otherwise the sum saturates. NaN passes.
inline float additive_masked_logit(float s, float added) {
  return added <= MLX_ATTN_MASKED_LOGIT ? MLX_ATTN_MASKED_LOGIT : saturate_logit(s + added);
}

// Whether a logit returned above is masked.
inline bool logit_masked(float s) {
  return s <= MLX_ATTN_MASKED_LOGIT;
}

// Query rows [begin, end) of which some may see a key in
// [first_key, last_key] (the backward's key blocks); empty when none can.
struct QueryRange {
  int begin;
  int end;
};
inline QueryRange block_query_range(ATTN_PARAMS p, int first_key, int last_key) {
  const int offset = p.kv_len - p.q_len;
  // causal: rows from the first key's position on; a window also ends them
  // window_size rows after the last key's position
  const int earliest = p.causal != 0 && first_key - offset > 0 ? first_key - offset : 0;
  const attn_int64 window_end = attn_int64(last_key) - offset + p.window_size;
  const bool windowed = p.causal != 0 && p.window_size > 0 && window_end < p.q_len;
  QueryRange range;
  range.begin = earliest < p.q_len ? earliest : p.q_len;
  range.end = windowed ? int(window_end) : p.q_len;
  if (range.end < range.begin) range.end = range.begin;
  return range;
}
