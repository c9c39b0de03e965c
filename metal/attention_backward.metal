// Fused attention backward (FlashAttention-2 style), launched through
// csrc/backward_launch_plan.cpp. The forward's row log-sum-exp lets every
// tile recompute P = exp(S - lse) directly; with delta = rowsum(dO * O) -
// dlse the softmax derivative is dS = P * (dP - delta), dP = dO . V^T.
// Four dispatches, each writing disjoint memory (no atomics):
//   delta   one simdgroup per query row: delta[row] (a float32 scratch)
//   dkdv    one threadgroup per (32 keys, kv head, batch): dK, dV of its keys,
//           summed in registers over every query head of the GQA group and
//           every query block that can see them
//   dq      one threadgroup per (32 query rows, query head, batch), as the
//           forward prefill kernel: dQ of its rows
//   sinks   (with sinks) one simdgroup per query head:
//           d_sink = -sum over rows of exp(sink - lse) * delta
// Logits are built exactly as the forward's (scale, saturate, mask): a logit
// that saturated has no gradient, like the CPU backward (csrc/cpu/).
// Every 8x8 tile is a simdgroup matrix; a lane owns row
// r = (lane / 16) * 4 + (lane / 2) % 4, columns c, c + 1 with
// c = ((lane / 8) % 2) * 4 + (lane % 2) * 2 (see attention_prefill.metal).
// No Tq x Tkv buffer exists: the largest tile is 8 x 32 per simdgroup.
#include <metal_stdlib>

#include "metal/attention_params.h"

using namespace metal;

constant float kMaskedLogit = MLX_ATTN_MASKED_LOGIT;

inline float clamp_logit(float x) {
  return clamp(x, -MLX_ATTN_LOGIT_LIMIT, MLX_ATTN_LOGIT_LIMIT);
}

// P and dS = P * (dP - delta) of one (query qi of head h, key) pair from its
// raw score q.k and dP, rebuilding the forward's logit (scale, saturate,
// mask). dS is 0 where a logit saturated (the clamp has no gradient); the
// caller multiplies dQ and dK by the scale once. A row that saw nothing (lse
// -inf, the forward's) has every key masked, so its lse is never used.
template <typename T>
inline float2 probability_and_gradient(
    constant AttentionParams& p, const device uchar* mask, float score, float d_prob,
    float lse, float delta, int b, int h, int qi, int key) {
  const float raw = score * p.scale;
  float s = clamp_logit(raw);
  bool has_gradient = s == raw;
  bool visible = key < p.kv_len && qi < p.q_len;
  if (p.causal != 0) {
    const int pos = qi + p.kv_len - p.q_len;
    visible = visible && key <= pos && (p.window_size <= 0 || key > pos - p.window_size);
  }
  if (visible && p.mask_kind != MLX_ATTN_MASK_NONE) {
    const long at = b * p.mask_strides[0] + h * p.mask_strides[1] + qi * p.mask_strides[2] +
        key * p.mask_strides[3];
    if (p.mask_kind == MLX_ATTN_MASK_BOOL) {
      visible = mask[at] != 0;
    } else {
      const float added = max(float(((const device T*)mask)[at]), kMaskedLogit);
      visible = added > kMaskedLogit;
      const float sum = s + added;
      s = clamp_logit(sum);
      has_gradient = has_gradient && s == sum;
    }
  }
  const float prob = visible ? exp2((s - lse) * MLX_ATTN_LOG2E) : 0.0f;
  return float2(prob, has_gradient ? prob * (d_prob - delta) : 0.0f);
}

// delta[row] = rowsum(dO * O) - dlse[row]; out, d_out, d_lse row-contiguous
// (the host makes them so). One simdgroup per row.
template <typename T, int D>
[[kernel]] void attention_backward_delta(
    const device T* out [[buffer(0)]],
    const device T* d_out [[buffer(1)]],
    const device float* d_lse [[buffer(2)]],
    device float* delta [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    uint3 group_id [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long rows = long(p.batch) * p.q_heads * p.q_len;
  const long row = long(group_id.x) * 4 + sg;
  if (row >= rows) return;  // the whole simdgroup: no collective is split
  float dot = 0.0f;
  for (int e = int(lane); e < D; e += 32) {
    dot += float(out[row * D + e]) * float(d_out[row * D + e]);
  }
  dot = simd_sum(dot);
  if (lane == 0) delta[row] = dot - d_lse[row];
}

// dK, dV of 32 keys (8 per simdgroup, held as A-operand tiles in registers
// with their accumulators) of one (batch, kv head). Query blocks of BQ rows
// (Q, dO as float, lse and delta) are staged in threadgroup memory; the
// loop runs over every query head of the group, so dK/dV sum over it.
template <typename T, int D, int BQ>
[[kernel]] void attention_backward_dkdv(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device T* d_out [[buffer(3)]],
    const device float* lse [[buffer(4)]],
    const device float* delta [[buffer(5)]],
    device T* dk [[buffer(6)]],
    device T* dv [[buffer(7)]],
    constant AttentionParams& p [[buffer(8)]],
    const device uchar* mask [[buffer(9)]],
    uint3 group_id [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = 4;
  constexpr int BK = 8 * NSG;
  constexpr int THREADS = 32 * NSG;
  constexpr int LD = D + 4;  // padded float row
  threadgroup float q_tile[BQ * LD];
  threadgroup float d_out_tile[BQ * LD];
  threadgroup float lse_tile[BQ];
  threadgroup float delta_tile[BQ];

  const int b = int(group_id.z);
  const int kv_head = int(group_id.y);
  const int k0 = int(group_id.x) * BK;
  const int offset = p.kv_len - p.q_len;
  const int r = int(lane) / 16 * 4 + int(lane) / 2 % 4;
  const int c = int(lane) / 8 % 2 * 4 + int(lane) % 2 * 2;
  const int key = k0 + int(sg) * 8 + r;  // this lane's row of K, V, dK, dV

  simdgroup_float8x8 k_rows[D / 8];
  simdgroup_float8x8 v_rows[D / 8];
  simdgroup_float8x8 dk_acc[D / 8];
  simdgroup_float8x8 dv_acc[D / 8];
  const long k_row = b * p.k_strides[0] + kv_head * p.k_strides[1] + key * p.k_strides[2];
  const long v_row = b * p.v_strides[0] + kv_head * p.v_strides[1] + key * p.v_strides[2];
  for (int d = 0; d < D / 8; ++d) {
    for (int t = 0; t < 2; ++t) {
      const int col = d * 8 + c + t;
      k_rows[d].thread_elements()[t] = key < p.kv_len ? float(k[k_row + col * p.k_strides[3]]) : 0.0f;
      v_rows[d].thread_elements()[t] = key < p.kv_len ? float(v[v_row + col * p.v_strides[3]]) : 0.0f;
      dk_acc[d].thread_elements()[t] = 0.0f;
      dv_acc[d].thread_elements()[t] = 0.0f;
    }
  }

  // Query rows that can see a key of this block (as the CPU backward's).
  const int k_last = min(k0 + BK, p.kv_len) - 1;
  int q_begin = 0;
  int q_end = p.q_len;
  if (p.causal != 0) {
    q_begin = max(0, k0 - offset);
    if (p.window_size > 0) {
      q_end = min(q_end, k_last - offset + p.window_size);
    }
  }

  for (int g = 0; g < p.group; ++g) {
    const int h = kv_head * p.group + g;
    const long q_head = b * p.q_strides[0] + h * p.q_strides[1];
    const long head_rows = (long(b) * p.q_heads + h) * p.q_len;
    for (int qs = q_begin; qs < q_end; qs += BQ) {
      // stage Q, dO (float), lse and delta of rows qs ..; rows past q_end
      // see none of this block's keys (causal / window): zeros
      for (int e = int(tid); e < BQ * D; e += THREADS) {
        const int i = e / D;
        const int col = e % D;
        const int qi = qs + i;
        const bool inside = qi < q_end;
        q_tile[i * LD + col] = inside ? float(q[q_head + qi * p.q_strides[2] + col * p.q_strides[3]]) : 0.0f;
        d_out_tile[i * LD + col] = inside ? float(d_out[(head_rows + qi) * D + col]) : 0.0f;
      }
      for (int i = int(tid); i < BQ; i += THREADS) {
        const bool inside = qs + i < q_end;
        lse_tile[i] = inside ? lse[head_rows + qs + i] : 0.0f;
        delta_tile[i] = inside ? delta[head_rows + qs + i] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      for (int j = 0; j < BQ / 8; ++j) {
        // S^T = K . Q^T and dP^T = V . dO^T: rows keys, columns queries j*8 ..
        simdgroup_float8x8 s_t = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        simdgroup_float8x8 dp_t = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int d = 0; d < D / 8; ++d) {
          simdgroup_float8x8 q_t;  // row = dim d*8 + r, column = query j*8 + c
          simdgroup_float8x8 d_out_t;
          for (int t = 0; t < 2; ++t) {
            q_t.thread_elements()[t] = q_tile[(j * 8 + c + t) * LD + d * 8 + r];
            d_out_t.thread_elements()[t] = d_out_tile[(j * 8 + c + t) * LD + d * 8 + r];
          }
          simdgroup_multiply_accumulate(s_t, k_rows[d], q_t, s_t);
          simdgroup_multiply_accumulate(dp_t, v_rows[d], d_out_t, dp_t);
        }
        for (int t = 0; t < 2; ++t) {
          const int i = j * 8 + c + t;
          const float2 grad = probability_and_gradient<T>(
              p, mask, s_t.thread_elements()[t], dp_t.thread_elements()[t], lse_tile[i], delta_tile[i],
              b, h, qs + i, key);
          s_t.thread_elements()[t] = grad.x;   // P^T
          dp_t.thread_elements()[t] = grad.y;  // dS^T
        }
        // dV += P^T . dO, dK += dS^T . Q (rows queries j*8 .., columns dims)
        for (int d = 0; d < D / 8; ++d) {
          simdgroup_float8x8 q_part;
          simdgroup_float8x8 d_out_part;
          for (int t = 0; t < 2; ++t) {
            q_part.thread_elements()[t] = q_tile[(j * 8 + r) * LD + d * 8 + c + t];
            d_out_part.thread_elements()[t] = d_out_tile[(j * 8 + r) * LD + d * 8 + c + t];
          }
          simdgroup_multiply_accumulate(dv_acc[d], s_t, d_out_part, dv_acc[d]);
          simdgroup_multiply_accumulate(dk_acc[d], dp_t, q_part, dk_acc[d]);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
    }
  }

  if (key < p.kv_len) {
    const long row = (long(b) * p.kv_heads + kv_head) * p.kv_len + key;
    for (int d = 0; d < D / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        dk[row * D + d * 8 + c + t] = T(dk_acc[d].thread_elements()[t] * p.scale);
        dv[row * D + d * 8 + c + t] = T(dv_acc[d].thread_elements()[t]);
      }
    }
  }
}

// dQ of 32 query rows (8 per simdgroup) of one (batch, query head), over the
// key blocks its rows can see; K/V blocks of BK keys staged in threadgroup
// memory in the input dtype, as the forward prefill kernel does.
template <typename T, int D, int BK>
[[kernel]] void attention_backward_dq(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    const device T* d_out [[buffer(3)]],
    const device float* lse [[buffer(4)]],
    const device float* delta [[buffer(5)]],
    device T* dq [[buffer(6)]],
    constant AttentionParams& p [[buffer(7)]],
    const device uchar* mask [[buffer(8)]],
    uint3 group_id [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = 4;
  constexpr int BQ = 8 * NSG;
  constexpr int THREADS = 32 * NSG;
  constexpr int LD = D + 16 / int(sizeof(T));
  threadgroup T k_tile[BK * LD];
  threadgroup T v_tile[BK * LD];

  const int b = int(group_id.z);
  const int h = int(group_id.y);
  const int q0 = int(group_id.x) * BQ;
  const int kv_head = h / p.group;
  const int offset = p.kv_len - p.q_len;
  const int r = int(lane) / 16 * 4 + int(lane) / 2 % 4;
  const int c = int(lane) / 8 % 2 * 4 + int(lane) % 2 * 2;
  const int qi = q0 + int(sg) * 8 + r;
  const long row = (long(b) * p.q_heads + h) * p.q_len + qi;

  simdgroup_float8x8 q_rows[D / 8];
  simdgroup_float8x8 d_out_rows[D / 8];
  simdgroup_float8x8 dq_acc[D / 8];
  const long q_row = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
  for (int d = 0; d < D / 8; ++d) {
    for (int t = 0; t < 2; ++t) {
      const int col = d * 8 + c + t;
      q_rows[d].thread_elements()[t] = qi < p.q_len ? float(q[q_row + col * p.q_strides[3]]) : 0.0f;
      d_out_rows[d].thread_elements()[t] = qi < p.q_len ? float(d_out[row * D + col]) : 0.0f;
      dq_acc[d].thread_elements()[t] = 0.0f;
    }
  }
  const float lse_row = qi < p.q_len ? lse[row] : 0.0f;
  const float delta_row = qi < p.q_len ? delta[row] : 0.0f;

  // Key range any row of this block can see (as the forward's).
  const int first_pos = q0 + offset;
  const int last_pos = min(q0 + BQ, p.q_len) - 1 + offset;
  int kv_begin = 0;
  int kv_end = p.kv_len;
  if (p.causal != 0) {
    kv_end = min(kv_end, last_pos + 1);
    if (p.window_size > 0) {
      kv_begin = max(0, first_pos - p.window_size + 1);
    }
  }

  const long k_head = b * p.k_strides[0] + kv_head * p.k_strides[1];
  const long v_head = b * p.v_strides[0] + kv_head * p.v_strides[1];
  for (int kb = kv_begin; kb < kv_end; kb += BK) {
    for (int e = int(tid); e < BK * D; e += THREADS) {
      const int j = e / D;
      const int col = e % D;
      const int key = kb + j;
      const bool inside = key < kv_end;
      k_tile[j * LD + col] = inside ? k[k_head + key * p.k_strides[2] + col * p.k_strides[3]] : T(0);
      v_tile[j * LD + col] = inside ? v[v_head + key * p.v_strides[2] + col * p.v_strides[3]] : T(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int j = 0; j < BK / 8; ++j) {
      // S = Q . K^T and dP = dO . V^T: rows queries, columns keys kb + j*8 ..
      simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      simdgroup_float8x8 dp = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < D / 8; ++d) {
        simdgroup_float8x8 k_t;  // row = dim d*8 + r, column = key j*8 + c
        simdgroup_float8x8 v_t;
        for (int t = 0; t < 2; ++t) {
          k_t.thread_elements()[t] = float(k_tile[(j * 8 + c + t) * LD + d * 8 + r]);
          v_t.thread_elements()[t] = float(v_tile[(j * 8 + c + t) * LD + d * 8 + r]);
        }
        simdgroup_multiply_accumulate(s, q_rows[d], k_t, s);
        simdgroup_multiply_accumulate(dp, d_out_rows[d], v_t, dp);
      }
      for (int t = 0; t < 2; ++t) {
        const int key = kb + j * 8 + c + t;
        const float2 grad = probability_and_gradient<T>(
            p, mask, s.thread_elements()[t], dp.thread_elements()[t], lse_row, delta_row, b, h, qi, key);
        dp.thread_elements()[t] = grad.y;  // dS
      }
      // dQ += dS . K (rows keys j*8 .., columns dims)
      for (int d = 0; d < D / 8; ++d) {
        simdgroup_float8x8 k_part;
        for (int t = 0; t < 2; ++t) {
          k_part.thread_elements()[t] = float(k_tile[(j * 8 + r) * LD + d * 8 + c + t]);
        }
        simdgroup_multiply_accumulate(dq_acc[d], dp, k_part, dq_acc[d]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block overwrites the tiles
  }

  if (qi < p.q_len) {
    for (int d = 0; d < D / 8; ++d) {
      for (int t = 0; t < 2; ++t) {
        dq[row * D + d * 8 + c + t] = T(dq_acc[d].thread_elements()[t] * p.scale);
      }
    }
  }
}

// d_sinks[h] = -sum over (batch, row) of exp(sink - lse) * delta: the sink's
// probability, whose dP is 0. A sink that saturated gets no gradient. With a
// sink every row's sum is positive: its lse is finite.
template <typename T>
[[kernel]] void attention_backward_sinks(
    const device T* sinks [[buffer(0)]],
    const device float* lse [[buffer(1)]],
    const device float* delta [[buffer(2)]],
    device T* d_sinks [[buffer(3)]],
    constant AttentionParams& p [[buffer(4)]],
    uint3 group_id [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int h = int(group_id.x);
  const float raw = float(sinks[h * p.sinks_stride]);
  const float sink = clamp_logit(raw);
  float sum = 0.0f;
  for (int b = 0; b < p.batch; ++b) {
    const long head_rows = (long(b) * p.q_heads + h) * p.q_len;
    for (int qi = int(lane); qi < p.q_len; qi += 32) {
      sum -= exp2((sink - lse[head_rows + qi]) * MLX_ATTN_LOG2E) * delta[head_rows + qi];
    }
  }
  sum = simd_sum(sum);
  if (lane == 0) d_sinks[h] = T(sink == raw ? sum : 0.0f);
}

#define MLX_ATTN_BACKWARD(tname, type, d, bq, bk)                                                     \
  template [[host_name("attention_backward_delta_" #tname "_d" #d)]] [[kernel]] decltype(          \
      attention_backward_delta<type, d>) attention_backward_delta<type, d>;                         \
  template [[host_name("attention_backward_dkdv_" #tname "_d" #d)]] [[kernel]] decltype(           \
      attention_backward_dkdv<type, d, bq>) attention_backward_dkdv<type, d, bq>;                   \
  template [[host_name("attention_backward_dq_" #tname "_d" #d)]] [[kernel]] decltype(             \
      attention_backward_dq<type, d, bk>) attention_backward_dq<type, d, bk>;
#define MLX_ATTN_BACKWARD_SINKS(tname, type)                                                         \
  template [[host_name("attention_backward_sinks_" #tname)]] [[kernel]] decltype(                  \
      attention_backward_sinks<type>) attention_backward_sinks<type>;

// BQ: query rows per staged block of dkdv (backward_query_block); BK: keys per
// staged block of dq (prefill_key_block), both in csrc/backward_launch_plan.cpp.
#if __METAL_VERSION__ >= 310
#define MLX_ATTN_BACKWARD_BFLOAT16(d, bq, bk) MLX_ATTN_BACKWARD(bfloat16, bfloat, d, bq, bk)
#define MLX_ATTN_BACKWARD_SINKS_BFLOAT16 MLX_ATTN_BACKWARD_SINKS(bfloat16, bfloat)
#else
#define MLX_ATTN_BACKWARD_BFLOAT16(d, bq, bk)
#define MLX_ATTN_BACKWARD_SINKS_BFLOAT16
#endif
#define MLX_ATTN_BACKWARD_TYPES(d, bq, bk)     \
  MLX_ATTN_BACKWARD(float32, float, d, bq, bk) \
  MLX_ATTN_BACKWARD(float16, half, d, bq, bk)  \
  MLX_ATTN_BACKWARD_BFLOAT16(d, bq, bk)

MLX_ATTN_BACKWARD_TYPES(64, 32, 32)
MLX_ATTN_BACKWARD_TYPES(80, 16, 16)
MLX_ATTN_BACKWARD_TYPES(96, 16, 16)
MLX_ATTN_BACKWARD_TYPES(128, 16, 16)
MLX_ATTN_BACKWARD_SINKS(float32, float)
MLX_ATTN_BACKWARD_SINKS(float16, half)
MLX_ATTN_BACKWARD_SINKS_BFLOAT16
