// The fused attention forward for the CPU: tiled over query rows and key/value
// blocks with the online softmax. Included once per instruction set by
// kernel_<isa>.cpp, which defines
//   MLX_ATTN_ISA        the namespace of this copy (generic, avx2, avx512, neon, ...)
// and includes its isa_<family>.h (vector width, register tile); a copy with
// native reduced-precision products also defines MLX_ATTN_NATIVE_BF16 /
// MLX_ATTN_NATIVE_FP16 (micro_kernel.h).
// Everything here has internal linkage except process_work_item and
// vector_lanes, and nothing uses the STL, so code compiled for a wide
// instruction set cannot be linked into callers on an older CPU.
//
// Algorithm steps (same names as mlx_attn/reference.py and metal/):
//   score      S = Q . K^T for one key block
//   scale      S = saturate(scale * S), logits in natural-log units
//   mask       additive (saturated; values <= the masked sentinel, -inf
//              included, mask the key), then boolean, then causal / sliding
//              window on edge blocks only: masked logits become the sentinel
//              MLX_ATTN_MASKED_LOGIT, in place on S
//   online max / rescale   m_new = max(m, rowmax S); O *= exp(m - m_new)
//   accumulate P = exp(S - m_new); l = l * alpha + rowsum P; O += P . V
//   normalize  sinks join the sum; O / l (zeros where nothing was attended)
// exp(x) is exp2(x * log2 e) of a difference to the running max, which
// saturation keeps finite (metal/attention_params.h). Saturation, visibility,
// key ranges, edge blocks and the mask read are the rules every kernel shares
// (metal/attention_rules.h, through csrc/cpu/rules.h).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "csrc/cpu/elements.h"
#include "csrc/cpu/kernels.h"
#include "csrc/cpu/micro_kernel.h"
#include "csrc/cpu/rules.h"
#include "csrc/cpu/simd.h"

namespace mlx_attn::cpu::MLX_ATTN_ISA {
namespace {

// One row of quantized K or V as load_quantized_row reads it.
struct QuantizedRow {
  const uint32_t* words;
  int64_t word_stride;
  const void* scales;
  int64_t scale_offset, scale_stride;  // of group 0, and between groups
  const void* biases;
  int64_t bias_offset, bias_stride;
};

// dst[i * dst_stride] = feature i < n of a quantized row
// (csrc/cpu/quantized_kv.h). Contiguous words are read as bytes
// (little-endian: field e of a word is its e-th byte or nibble).
template <ElemType T, int Bits>
inline void load_quantized_row(float* dst, int64_t dst_stride, const QuantizedRow& q, int group_size, int n) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "byte reads assume little-endian words");
  constexpr int kPerWord = 32 / Bits;
  constexpr uint32_t kMask = (1u << Bits) - 1;
  float row[kMaxHeadDim];
  float* out = dst_stride == 1 ? dst : row;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(q.words);
  for (int begin = 0; begin < n; begin += group_size) {
    const int64_t group = begin / group_size;
    const float scale = load_elem<T>(q.scales, q.scale_offset + group * q.scale_stride);
    const float bias = load_elem<T>(q.biases, q.bias_offset + group * q.bias_stride);
    float* o = out + begin;
    if (q.word_stride == 1 && Bits == 8) {
      const uint8_t* b = bytes + begin;
      for (int i = 0; i < group_size; ++i) o[i] = float(b[i]) * scale + bias;
    } else if (q.word_stride == 1 && Bits == 4) {
      const uint8_t* b = bytes + begin / 2;
      for (int i = 0; i < group_size / 2; ++i) {
        o[2 * i] = float(b[i] & 15) * scale + bias;
        o[2 * i + 1] = float(b[i] >> 4) * scale + bias;
      }
    } else {
      for (int i = 0; i < group_size; ++i) {
        const int f = begin + i;
        const uint32_t word = q.words[int64_t(f / kPerWord) * q.word_stride];
        o[i] = float((word >> (Bits * (f % kPerWord))) & kMask) * scale + bias;
      }
    }
  }
  if (out == row) {
    for (int i = 0; i < n; ++i) dst[i * dst_stride] = row[i];
  }
}

// bf16 dot products (vdpbf16ps, BFDOT) flush products below float32's normal
// range (2^-126) to zero, so tiny q and k with a huge scale (logits of order
// one from q.k below 2^-126, scale near float32's maximum) would all score 0.
// Moves a power of two 2^e of the scale into the packed bf16 Q panel instead
// (exact: bf16 has float32's exponents), as much as keeps every |q| below
// 2^-9 (so no q.k of D <= 256 terms can overflow where it did not before) and
// the rest of the scale >= 1; returns scale * 2^-e. Normal-range products are
// scaled exactly, so every other logit is bit for bit unchanged.
inline float move_scale_into_bf16_panel(uint16_t* panel, int64_t count, float scale) {
  float largest = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    const float x = fabsf(bfloat_to_float(panel[i]));
    largest = x > largest || x != x ? x : largest;
  }
  if (!(largest > 0.0f && largest < INFINITY) || !(fabsf(scale) >= 2.0f)) return scale;
  const int room = -10 - ilogbf(largest);  // largest * 2^room < 2^-9
  const int e = room < ilogbf(scale) ? room : ilogbf(scale);
  if (e <= 0) return scale;
  for (int64_t i = 0; i < count; ++i) panel[i] = float_to_bfloat(ldexpf(bfloat_to_float(panel[i]), e));
  return ldexpf(scale, -e);
}

// ------------------------------------------------------------- K/V layouts
// The tile loop (attention_work_item) is written once; where a work item's
// query rows, keys, values and outputs live is its layout's business (K/V
// layout is an axis, not a kernel):
//   DenseLayout  q [B, Hq, Tq, D], k / v [B, Hkv, Tkv, D], any strides
//   PagedLayout  packed q rows [total_q, Hq, D], K/V pages through a block
//                table (csrc/cpu/paged_kv.h), one sequence per item
// Quantized K/V (Bits) combine with either. A layout gives an item's Tile and
// the place of key t of the tile's sequence: (outer, slot), whose elements
// sit at outer * s[0] + kv_head * s[1] + slot * s[2] in k, v and in the
// quantized scales and biases alike; keys t + 1 .. t + run - 1 follow at
// slots slot + 1, ... of the same outer (one page, or the whole dense row).
struct Tile {
  AttentionParams seq;  // the problem as the rules see this item's sequence (its q_len, kv_len)
  int b, kv_head, q_start, qb;
  int64_t q_begin;  // the sequence's first packed row in q (paged; 0 dense)
};

struct KeyPlace {
  int64_t outer;
  int slot, run;
};

struct DenseLayout {
  // Heaviest query blocks (the last ones, under a causal mask) come first.
  static Tile tile(const KernelCall& call, int64_t item) {
    const AttentionProblem& p = call.problem;
    const int64_t per_block = int64_t(p.batch) * p.kv_heads;
    Tile t;
    t.seq = p;
    t.b = int((item % per_block) / p.kv_heads);
    t.kv_head = int(item % p.kv_heads);
    t.q_start = (call.query_blocks() - 1 - int(item / per_block)) * call.query_block;
    t.qb = (p.q_len - t.q_start) < call.query_block ? (p.q_len - t.q_start) : call.query_block;
    t.q_begin = 0;
    return t;
  }
  static int64_t out_row(const KernelCall& call, const Tile& t, int h, int qi) {
    return (int64_t(t.b) * call.problem.q_heads + h) * call.problem.q_len + qi;
  }
  static KeyPlace key(const KernelCall&, const Tile& t, int key) {
    return {t.b, key, 1 << 30};
  }
};

struct PagedLayout {
  // Items come planned, heaviest first (csrc/cpu/paged_dispatch.cpp).
  static Tile tile(const KernelCall& call, int64_t item) {
    const AttentionProblem& p = call.problem;
    const PagedItem& it = call.paged.items[item / p.kv_heads];
    Tile t;
    t.seq = p;
    t.seq.q_len = it.q_len;
    t.seq.kv_len = it.kv_len;
    t.b = it.sequence;
    t.kv_head = int(item % p.kv_heads);
    t.q_start = it.q_start;
    t.qb = (it.q_len - it.q_start) < call.query_block ? (it.q_len - it.q_start) : call.query_block;
    t.q_begin = it.q_begin;
    return t;
  }
  static int64_t out_row(const KernelCall& call, const Tile& t, int h, int qi) {
    return (t.q_begin + qi) * call.problem.q_heads + h;
  }
  static KeyPlace key(const KernelCall& call, const Tile& t, int key) {
    const int slot = key % call.paged.page_size;
    return {call.paged.page_of(t.b, key), slot, call.paged.page_size - slot};
  }
};

// ---------------------------------------------------------------- work item
// Scores are held transposed, S^T[key][row]: the score product is
// K[keys][D] . Q^T[D][rows], so K rows are the micro-kernel's broadcast
// operand (read in place for contiguous float32, no transposing pass), the
// packed Q^T panel (once per item) is its streamed operand, and the online
// softmax runs down the key axis with whole vectors of rows (no horizontal
// reductions). O += P . V then reads P^T as a transposed A operand.
//
// A key block is up to kKeyBlock keys for the softmax; its keys come in
// segments of consecutive rows (one for dense K/V; one per page touched for
// paged K/V, so page_size need not divide the block). K/V read in place are
// multiplied segment by segment; packed K/V are packed across segments.

// Keys per segment, on average, below which a block is packed rather than
// read in place (tiny pages: many short products cost more than a copy).
inline constexpr int kMinInPlaceRun = 16;

// Bits: 0 for float K/V, else their quantization (4 or 8).
template <ElemType T, int Bits, class KVLayout>
void attention_work_item(
    const KernelCall& call,
    int64_t item,
    float* scratch) {
  const AttentionProblem& p = call.problem;
  const Tile tile = KVLayout::tile(call, item);
  const AttentionParams& seq = tile.seq;
  const int group = p.group_size();
  const int D = p.head_dim, Dv = p.value_dim, Dvp = int(round_up(Dv, kLanes));
  const int KB = kKeyBlock;
  const int b = tile.b, kv_head = tile.kv_head, q_start = tile.q_start, qb = tile.qb;
  if (qb <= 0) return;
  const int rows = group * qb;
  const int rp = int(round_up(rows, kLanes));  // rows padded to whole vectors

  float* q_t = scratch;                            // [D][rp]   Q^T
  float* scores_t = q_t + D * rp;                  // [KB][rp]  S^T, then P^T
  float* acc = scores_t + KB * rp;                 // [rows][Dvp]
  float* k_rows = acc + rows * Dvp;                // [KB][D]   when K is packed
  float* v_packed = k_rows + KB * D;               // [KB][Dvp] when V is packed
  float* row_max = v_packed + KB * Dvp;            // [rp]
  float* row_sum = row_max + rp;                   // [rp]
  float* rescale = row_sum + rp;                   // [rp]

  // bf16 / fp16 where the copy multiplies them natively (NativePairProduct,
  // micro_kernel.h): the score product runs on the 16-bit inputs in pairs of
  // features; Q^T is then the product's pair panel q_pairs[D_pairs][2 rp]
  // (same bytes or fewer).
  using Native = NativePairProduct<T>;
  constexpr bool kPairScore = Native::kAvailable && Bits == 0;
  const int pairs = (D + 1) / 2;
  uint16_t* q_pairs = reinterpret_cast<uint16_t*>(q_t);
  uint16_t* k_pairs = reinterpret_cast<uint16_t*>(k_rows);  // [KB][2 pairs]

  // Rows are (head in group, query position): row = g * qb + i. A packed
  // (paged) q is seen as [1, Hq, total_q, D]: its rows start at q_begin.
  for (int r = 0; r < rows; ++r) {
    const int h = kv_head * group + r / qb;
    const int64_t qi = tile.q_begin + q_start + r % qb;
    int64_t off = b * p.q_strides[0] + h * p.q_strides[1] + qi * p.q_strides[2];
    if constexpr (kPairScore) {
      using Product = typename Native::Product;
      const uint16_t* q = static_cast<const uint16_t*>(call.q) + off;
      for (int d = 0; d < D; ++d) {
        q_pairs[(d / 2) * 2 * rp + Product::panel_offset(r, d % 2)] = q[d * p.q_strides[3]];
      }
      if (D % 2) q_pairs[(pairs - 1) * 2 * rp + Product::panel_offset(r, 1)] = 0;
    } else {
      load_row<T>(q_t + r, rp, call.q, off, p.q_strides[3], D, 1.0f);
    }
  }
  // The scale the score product's sums are multiplied by (scale step).
  float logit_scale = p.scale;
  if constexpr (kPairScore) {
    using Product = typename Native::Product;
    for (int kp = 0; kp < pairs; ++kp) {
      for (int r = rows; r < rp; ++r) {
        q_pairs[kp * 2 * rp + Product::panel_offset(r, 0)] = 0;
        q_pairs[kp * 2 * rp + Product::panel_offset(r, 1)] = 0;
      }
    }
    if constexpr (T == ElemType::bfloat16) {
      logit_scale = move_scale_into_bf16_panel(q_pairs, int64_t(pairs) * 2 * rp, p.scale);
    }
  } else {
    for (int d = 0; d < D; ++d) {
      for (int r = rows; r < rp; ++r) q_t[d * rp + r] = 0.0f;
    }
  }
  for (int r = 0; r < rp; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
  }
  memset(acc, 0, sizeof(float) * rows * Dvp);

  // Float32 K rows and V rows (of a whole number of vectors) with unit
  // feature stride can be read in place; anything else is converted per block.
  // 16-bit K for a native score product: in place when its pairs are whole.
  const bool k_can_stay = (Bits == 0 && T == ElemType::float32 && p.k_strides[3] == 1) ||
      (kPairScore && p.k_strides[3] == 1 && D % 2 == 0);
  const bool v_can_stay = Bits == 0 && T == ElemType::float32 && p.v_strides[3] == 1 && Dv == Dvp;
  // Element offset of (outer, slot) rows for this kv head.
  auto k_at = [&](int64_t outer, int slot) {
    return outer * p.k_strides[0] + kv_head * p.k_strides[1] + slot * p.k_strides[2];
  };
  auto v_at = [&](int64_t outer, int slot) {
    return outer * p.v_strides[0] + kv_head * p.v_strides[1] + slot * p.v_strides[2];
  };

  // Keys any row of this block can see.
  const int first_pos = query_position(seq, q_start);
  const int last_pos = query_position(seq, q_start + qb - 1);
  const KeyRange keys = block_key_range(seq, first_pos, last_pos);

  struct Segment {
    int64_t outer;
    int slot, first, n;  // keys first .. first + n - 1 of the block
  };
  Segment segments[kKeyBlock];

  for (int kb = keys.begin; kb < keys.end; kb += KB) {
    const int n = (keys.end - kb) < KB ? (keys.end - kb) : KB;

    // fetch: the block's segments, then K/V in place or packed
    int segment_count = 0;
    for (int j = 0; j < n;) {
      const KeyPlace at = KVLayout::key(call, tile, kb + j);
      const int len = at.run < n - j ? at.run : n - j;
      segments[segment_count++] = {at.outer, at.slot, j, len};
      j += len;
    }
    const bool long_runs = segment_count == 1 || n >= kMinInPlaceRun * segment_count;
    const bool k_in_place = k_can_stay && long_runs;
    const bool v_in_place = v_can_stay && long_runs;
    for (int s = 0; s < segment_count && !(k_in_place && v_in_place); ++s) {
      const Segment& seg = segments[s];
      for (int i = 0; i < seg.n; ++i) {
        const int j = seg.first + i;
        const int64_t koff = k_at(seg.outer, seg.slot + i);
        const int64_t voff = v_at(seg.outer, seg.slot + i);
        float* vrow = v_packed + j * Dvp;
        if constexpr (kPairScore) {
          if (!k_in_place) {
            const uint16_t* k = static_cast<const uint16_t*>(call.k) + koff;
            for (int d = 0; d < D; ++d) k_pairs[j * 2 * pairs + d] = k[d * p.k_strides[3]];
            if (D % 2) k_pairs[j * 2 * pairs + D] = 0;
          }
          if (!v_in_place) load_row<T>(vrow, 1, call.v, voff, p.v_strides[3], Dv, 1.0f);
        } else if constexpr (Bits == 0) {
          if (!k_in_place) load_row<T>(k_rows + j * D, 1, call.k, koff, p.k_strides[3], D, 1.0f);
          if (!v_in_place) load_row<T>(vrow, 1, call.v, voff, p.v_strides[3], Dv, 1.0f);
        } else {  // dequantize in the tile: no dequantized copy of K/V exists
          const QuantizedKV& qkv = call.quantized;
          const int t = seg.slot + i;
          const QuantizedRow key = {
              static_cast<const uint32_t*>(call.k) + koff, p.k_strides[3],
              qkv.k_scales, QuantizedKV::row_offset(qkv.k_scale_strides, seg.outer, kv_head, t),
              qkv.k_scale_strides[3],
              qkv.k_biases, QuantizedKV::row_offset(qkv.k_bias_strides, seg.outer, kv_head, t),
              qkv.k_bias_strides[3]};
          const QuantizedRow value = {
              static_cast<const uint32_t*>(call.v) + voff, p.v_strides[3],
              qkv.v_scales, QuantizedKV::row_offset(qkv.v_scale_strides, seg.outer, kv_head, t),
              qkv.v_scale_strides[3],
              qkv.v_biases, QuantizedKV::row_offset(qkv.v_bias_strides, seg.outer, kv_head, t),
              qkv.v_bias_strides[3]};
          load_quantized_row<T, Bits>(k_rows + j * D, 1, key, qkv.group_size, D);
          load_quantized_row<T, Bits>(vrow, 1, value, qkv.group_size, Dv);
        }
        if (!v_in_place) {
          for (int e = Dv; e < Dvp; ++e) vrow[e] = 0.0f;
        }
      }
    }

    // score: S^T[n][rp] = K[n][D] . Q^T[D][rp], segment by segment in place
    if constexpr (kPairScore) {
      if (k_in_place) {
        for (int s = 0; s < segment_count; ++s) {
          const Segment& seg = segments[s];
          matmul_overwrite_pairs<typename Native::Product>(
              static_cast<const uint16_t*>(call.k) + k_at(seg.outer, seg.slot), p.k_strides[2], q_pairs, 2 * rp,
              scores_t + seg.first * rp, rp, seg.n, pairs, rp);
        }
      } else {
        matmul_overwrite_pairs<typename Native::Product>(k_pairs, 2 * pairs, q_pairs, 2 * rp, scores_t, rp, n,
                                                         pairs, rp);
      }
    } else {
      if (k_in_place) {
        for (int s = 0; s < segment_count; ++s) {
          const Segment& seg = segments[s];
          matmul_overwrite(static_cast<const float*>(call.k) + k_at(seg.outer, seg.slot), p.k_strides[2], q_t, rp,
                           scores_t + seg.first * rp, rp, seg.n, D, rp);
        }
      } else {
        matmul_overwrite(k_rows, D, q_t, rp, scores_t, rp, n, D, rp);
      }
    }

    // scale
    const vfloat scale = splat(logit_scale);
    for (int i = 0; i < n * rp; i += kLanes) {
      store(scores_t + i, saturate(load(scores_t + i) * scale));
    }

    // mask (explicit masks, then causal / window on edge blocks only)
    if (p.mask_kind != MaskKind::none) {
      const int64_t ms = p.mask_strides[3];
      for (int r = 0; r < rows; ++r) {
        const int64_t moff = mask_offset(seq, b, kv_head * group + r / qb, q_start + r % qb, kb);
        float* s = scores_t + r;
        if (p.mask_kind == MaskKind::boolean) {
          const bool* m = static_cast<const bool*>(call.mask) + moff;
          for (int j = 0; j < n; ++j) s[j * rp] = bool_masked_logit(s[j * rp], m[j * ms]);
        } else {
          for (int j = 0; j < n; ++j) {
            s[j * rp] = additive_masked_logit(s[j * rp], load_elem<T>(call.mask, moff + j * ms));
          }
        }
      }
    }
    if (block_on_edge(seq, kb, n, first_pos, last_pos)) {
      for (int r = 0; r < rows; ++r) {
        mask_hidden_keys(seq, query_position(seq, q_start + r % qb), kb, n, scores_t + r, rp);
      }
    }

    // online max / rescale, then P^T = exp(S^T - m_new) and the row sums
    for (int c = 0; c < rp; c += kLanes) {
      vfloat block_max = splat(-INFINITY);
      for (int j = 0; j < n; ++j) block_max = vmax(block_max, load(scores_t + j * rp + c));
      const vfloat m_old = load(row_max + c);
      const vfloat m_new = vmax(block_max, m_old);
      // A row with nothing visible yet (m = -inf, or the masked sentinel)
      // takes its exponents against 0: its P and alpha are then 0.
      const vfloat m_ref = m_new <= MLX_ATTN_MASKED_LOGIT ? splat(0.0f) : m_new;
      vfloat sum = splat(0.0f);
      for (int j = 0; j < n; ++j) {
        float* s = scores_t + j * rp + c;
        const vfloat e = exp2_vec((load(s) - m_ref) * kLog2e);
        store(s, e);
        sum += e;
      }
      const vfloat alpha = exp2_vec((m_old - m_ref) * kLog2e);
      store(row_sum + c, load(row_sum + c) * alpha + sum);
      store(row_max + c, m_new);
      store(rescale + c, alpha);
    }
    for (int r = 0; r < rows; ++r) {
      if (rescale[r] != 1.0f) {
        float* o = acc + r * Dvp;
        const vfloat va = splat(rescale[r]);
        for (int c = 0; c < Dvp; c += kLanes) store(o + c, load(o + c) * va);
      }
    }

    // accumulate: O[rows][Dvp] += P[rows][n] . V[n][Dvp]
    if (v_in_place) {
      for (int s = 0; s < segment_count; ++s) {
        const Segment& seg = segments[s];
        matmul_accumulate_transposed_a(scores_t + seg.first * rp, rp,
                                       static_cast<const float*>(call.v) + v_at(seg.outer, seg.slot),
                                       p.v_strides[2], acc, Dvp, rows, seg.n, Dvp);
      }
    } else {
      matmul_accumulate_transposed_a(scores_t, rp, v_packed, Dvp, acc, Dvp, rows, n, Dvp);
    }
  }

  // normalize
  for (int r = 0; r < rows; ++r) {
    const int h = kv_head * group + r / qb;
    const int qi = q_start + r % qb;
    float m = row_max[r];
    float l = row_sum[r];
    float correction = 1.0f;
    if (p.has_sinks) {
      const float sink = saturate_logit(load_elem<T>(call.sinks, h * p.sinks_stride));
      const float m_final = sink > m ? sink : m;
      correction = exp2f((m - m_final) * kLog2e);
      l = l * correction + exp2f((sink - m_final) * kLog2e);
      m = m_final;
    }
    // l == 0: the row saw nothing (zeros); a NaN sum (NaN data) stays NaN
    const float factor = l == 0.0f ? 0.0f : correction / l;
    const int64_t row_index = KVLayout::out_row(call, tile, h, qi);
    const float* o = acc + r * Dvp;
    for (int e = 0; e < Dv; ++e) {
      store_elem<T>(call.out, row_index * Dv + e, o[e] * factor);
    }
    if (call.lse) {
      call.lse[row_index] = l == 0.0f ? -INFINITY : m + logf(l);
    }
  }
}

}  // namespace

int vector_lanes() {
  return kLanes;
}

namespace {
template <ElemType T, class KVLayout>
void work_item_of_layout(const KernelCall& call, int64_t item, float* scratch) {
  switch (call.quantized.bits) {
    case 8: return attention_work_item<T, 8, KVLayout>(call, item, scratch);
    case 4: return attention_work_item<T, 4, KVLayout>(call, item, scratch);
    default: return attention_work_item<T, 0, KVLayout>(call, item, scratch);
  }
}
// The K/V layout axis: dense or paged, each with float or quantized K/V.
template <ElemType T>
void work_item_of_type(const KernelCall& call, int64_t item, float* scratch) {
  if (call.paged.active()) return work_item_of_layout<T, PagedLayout>(call, item, scratch);
  return work_item_of_layout<T, DenseLayout>(call, item, scratch);
}
}  // namespace

void process_work_item(const KernelCall& call, int64_t item, float* scratch) {
  switch (call.problem.dtype) {
    case ElemType::float32:
      return work_item_of_type<ElemType::float32>(call, item, scratch);
    case ElemType::float16:
      return work_item_of_type<ElemType::float16>(call, item, scratch);
    case ElemType::bfloat16:
      return work_item_of_type<ElemType::bfloat16>(call, item, scratch);
  }
}

}  // namespace mlx_attn::cpu::MLX_ATTN_ISA
