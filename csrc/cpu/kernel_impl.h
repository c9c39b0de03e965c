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
//   softcap    (softcap > 0) S = softcap * tanh(S / softcap)
//   mask       additive (saturated; values <= the masked sentinel, -inf
//              included, mask the key), then boolean, then causal / sliding
//              window on edge blocks only: masked logits become the sentinel
//              MLX_ATTN_MASKED_LOGIT, in place on S
//   online max / rescale   m_new = max(m, rowmax S); O *= exp(m - m_new)
//   accumulate P = exp(S - m_new); l = l * alpha + rowsum P; O += P . V
//   normalize  sinks join the sum; O / l (zeros where nothing was attended)
// exp(x) is exp2(x * log2 e) of a difference to the running max, which
// saturation keeps finite (metal/attention_params.h). Saturation, softcap,
// visibility, key ranges, edge blocks and the mask read are the rules every
// kernel shares (metal/attention_rules.h, through csrc/cpu/rules.h).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "csrc/cpu/bf16_pair_scale.h"
#include "csrc/cpu/elements.h"
#include "csrc/cpu/kernels.h"
#include "csrc/cpu/micro_kernel.h"
#include "csrc/cpu/rules.h"
#include "csrc/cpu/simd.h"
#if defined(MLX_ATTN_AMX_BF16)
#include "csrc/cpu/amx_tiles.h"
#endif

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
// A key block is up to kKeyBlock keys (kMaxKeyBlock on AMX) for the softmax; its keys come in
// segments of consecutive rows (one for dense K/V; one per page touched for
// paged K/V, so page_size need not divide the block). K/V read in place are
// multiplied segment by segment; packed K/V are packed across segments.
//
// The steps below are one loop body split by step (force-inlined, so the
// split costs nothing). kPairScore: the score product runs on 16-bit inputs
// in pairs of features (NativePairProduct, micro_kernel.h); Q^T is then the
// product's pair panel q_pairs[D_pairs][2 rp] (same bytes or fewer) and
// packed K is k_pairs[KB][2 D_pairs].

// Keys per segment, on average, below which a block is packed rather than
// read in place (tiny pages: many short products cost more than a copy).
inline constexpr int kMinInPlaceRun = 16;
// Keys per AMX accumulator tile: an AMX score product computes whole tiles.
// Keys of one AMX value product step (a bf16 tile row of P's pairs).
inline constexpr int kAmxTileKeys = 16, kAmxTileDepth = 32;
#if defined(MLX_ATTN_AMX_BF16)
static_assert(kAmxTileKeys == kAmxTile && kAmxTileDepth == kAmxDepth, "amx_tiles.h and the key tiles agree");
#endif

// The float panels' layout, per copy (isa_<family>.h): S^T's row stride is
// rp + kScoreRowPad floats, and with MLX_ATTN_QUERY_PANEL_TILES Q^T is held
// in column tiles of the micro-kernel's register tile width, each its own
// [D][width] panel (otherwise one tile of all rp columns: plain [D][rp]).
// Only where rows of the panels fall; every product sums the same terms in
// the same order.
#ifndef MLX_ATTN_SCORE_ROW_PAD
#define MLX_ATTN_SCORE_ROW_PAD 0
#endif
inline constexpr int kScoreRowPad = MLX_ATTN_SCORE_ROW_PAD;
static_assert(kScoreRowPad % kLanes == 0 && kScoreRowPad <= kMaxScoreRowPad, "S^T rows stay whole vectors, in scratch");
#if defined(MLX_ATTN_AMX_BF16)
static_assert(kScoreRowPad == 0, "the AMX products read S^T / P^T with row stride rp");
#endif
#if defined(MLX_ATTN_QUERY_PANEL_TILES)
inline constexpr int kQueryPanelTile = kTileVectors * kLanes;
#else
inline constexpr int kQueryPanelTile = 1 << 30;
#endif

// One thread's scratch for an item (sized by scratch_floats, kernels.h).
struct ItemBuffers {
  float* q_t;        // [D][rp]   Q^T in column tiles (or the pair panel [D_pairs][2 rp])
  float* scores_t;   // [KB][ls]  S^T, then P^T
  float* acc;        // [rows][Dvp]
  float* k_rows;     // [KB][D]   when K is packed (or its pairs)
  float* v_packed;   // [KB][Dvp] when V is packed
  float* row_max;    // [rp]
  float* row_sum;    // [rp]
  float* rescale;    // [rp]
};

// A work item: its tile, sizes and buffers. Rows are (head in group, query
// position): row = g * qb + i. A packed (paged) q is seen as
// [1, Hq, total_q, D]: its rows start at tile.q_begin.
struct WorkItem {
  const KernelCall& call;
  const AttentionProblem& p;
  Tile tile;
  int group, D, Dv, Dvp, rows, rp, pairs;
  int ls;  // row stride of S^T / P^T (floats)
  // Both products on AMX tiles (amx_tiles.h): the bf16 pair score product,
  // and O^T[Dvp][rp] += V^T . P^T pairs, so the output accumulator is held
  // transposed (acc_at) and V is packed as V^T[Dvp][key_block] bf16.
  bool amx = false;
  int key_block = kKeyBlock;  // keys per block: kMaxKeyBlock with amx
  ItemBuffers buf;

  WorkItem(const KernelCall& c, const Tile& t, float* scratch)
      : call(c), p(c.problem), tile(t), group(p.group_size()), D(p.head_dim), Dv(p.value_dim),
        Dvp(int(round_up(Dv, kLanes))), rows(group * t.qb), rp(int(round_up(rows, kLanes))),
        pairs((D + 1) / 2), ls(rp + kScoreRowPad) {
    buf.q_t = scratch;
    buf.scores_t = buf.q_t + D * rp;
    buf.acc = buf.scores_t + kMaxKeyBlock * ls;
    buf.k_rows = buf.acc + rp * Dvp;
    buf.v_packed = buf.k_rows + kMaxKeyBlock * D;
    buf.row_max = buf.v_packed + kMaxKeyBlock * Dvp;
    buf.row_sum = buf.row_max + rp;
    buf.rescale = buf.row_sum + rp;
  }
  int head(int r) const { return tile.kv_head * group + r / tile.qb; }
  int query(int r) const { return tile.q_start + r % tile.qb; }  // in the tile's sequence
  uint16_t* q_pairs() const { return reinterpret_cast<uint16_t*>(buf.q_t); }
  // Q^T's column tile holding row r: its first row, width and panel.
  int query_tile_start(int r) const { return r / kQueryPanelTile * kQueryPanelTile; }
  int query_tile_width(int c0) const { return rp - c0 < kQueryPanelTile ? rp - c0 : kQueryPanelTile; }
  float* query_tile(int c0) const { return buf.q_t + int64_t(c0) * D; }
  // Q^T[d][r]: where row r's features start, and the distance between them.
  float* query_column(int r) const { return query_tile(query_tile_start(r)) + (r - query_tile_start(r)); }
  int query_column_stride(int r) const { return query_tile_width(query_tile_start(r)); }
  uint16_t* k_pairs() const { return reinterpret_cast<uint16_t*>(buf.k_rows); }
  uint16_t* v_t() const { return reinterpret_cast<uint16_t*>(buf.v_packed); }
  // Output accumulator element (row r, feature e) in either layout.
  float& acc_at(int r, int e) const { return amx ? buf.acc[int64_t(e) * rp + r] : buf.acc[int64_t(r) * Dvp + e]; }
  // Element offsets of (outer, slot) rows of K and V for this kv head.
  int64_t k_at(int64_t outer, int slot) const {
    return outer * p.k_strides[0] + tile.kv_head * p.k_strides[1] + slot * p.k_strides[2];
  }
  int64_t v_at(int64_t outer, int slot) const {
    return outer * p.v_strides[0] + tile.kv_head * p.v_strides[1] + slot * p.v_strides[2];
  }
};

// The keys of one block: [kb, kb + n), in segments of consecutive slots, K
// and V read in place or packed.
struct KeyBlock {
  struct Segment {
    int64_t outer;
    int slot, first, n;  // keys first .. first + n - 1 of the block
  };
  int kb, n, segment_count;
  bool k_in_place, v_in_place;
  Segment segments[kMaxKeyBlock];
};

// load queries: Q^T (float, or the pair panel) with zero padding rows; the
// running max, sum and output of every row start empty.
// Where query row r of the item starts in q (elements).
MLX_ATTN_STEP int64_t query_row_offset(const WorkItem& w, int r) {
  const AttentionProblem& p = w.p;
  const int64_t qi = w.tile.q_begin + w.query(r);
  return w.tile.b * p.q_strides[0] + w.head(r) * p.q_strides[1] + qi * p.q_strides[2];
}

template <ElemType T, bool kPairScore>
MLX_ATTN_STEP void load_queries(const WorkItem& w) {
  const AttentionProblem& p = w.p;
  const int D = w.D, rp = w.rp;
#if defined(MLX_ATTN_AMX_BF16)
  // bf16 rows with unit feature stride and whole 16 x 16 word blocks: the
  // pair panel is a transpose of the rows' 32-bit words (pairs of features).
  const bool word_transpose =
      kPairScore && T == ElemType::bfloat16 && p.q_strides[3] == 1 && D % 32 == 0 && rp % 16 == 0 && rp <= 2 * kMaxRows;
  if (word_transpose) {
    const uint16_t* rows[2 * kMaxRows];
    for (int r = 0; r < w.rows; ++r) rows[r] = static_cast<const uint16_t*>(w.call.q) + query_row_offset(w, r);
    uint32_t* words = reinterpret_cast<uint32_t*>(w.q_pairs());
    for (int r0 = 0; r0 < rp; r0 += 16) {
      for (int p0 = 0; p0 < w.pairs; p0 += 16) amx_pack_feature_pairs(rows, w.rows, r0, p0, words, rp);
    }
  }
#else
  constexpr bool word_transpose = false;
#endif
  for (int r = 0; r < (word_transpose ? 0 : w.rows); ++r) {
    const int64_t off = query_row_offset(w, r);
    if constexpr (kPairScore) {
      using Product = typename NativePairProduct<T>::Product;
      const uint16_t* q = static_cast<const uint16_t*>(w.call.q) + off;
      for (int d = 0; d < D; ++d) {
        w.q_pairs()[(d / 2) * 2 * rp + Product::panel_offset(r, d % 2)] = q[d * p.q_strides[3]];
      }
      if (D % 2) w.q_pairs()[(w.pairs - 1) * 2 * rp + Product::panel_offset(r, 1)] = 0;
    } else {
      load_row<T>(w.query_column(r), w.query_column_stride(r), w.call.q, off, p.q_strides[3], D, 1.0f);
    }
  }
  if constexpr (kPairScore) {
    using Product = typename NativePairProduct<T>::Product;
    for (int kp = 0; kp < (word_transpose ? 0 : w.pairs); ++kp) {
      for (int r = w.rows; r < rp; ++r) {
        w.q_pairs()[kp * 2 * rp + Product::panel_offset(r, 0)] = 0;
        w.q_pairs()[kp * 2 * rp + Product::panel_offset(r, 1)] = 0;
      }
    }
  } else {
    for (int d = 0; d < D; ++d) {
      for (int r = w.rows; r < rp; ++r) w.query_column(r)[d * w.query_column_stride(r)] = 0.0f;
    }
  }
  for (int r = 0; r < rp; ++r) {
    w.buf.row_max[r] = -INFINITY;
    w.buf.row_sum[r] = 0.0f;
  }
  memset(w.buf.acc, 0, sizeof(float) * w.rp * w.Dvp);
}

// Packs key j = seg.first + i of the block (K unless read in place, and V
// unless read in place), dequantizing quantized K/V in the tile (no
// dequantized copy of K/V exists).
template <ElemType T, int Bits, bool kPairScore>
MLX_ATTN_STEP void pack_key_value_row(const WorkItem& w, const KeyBlock& block, const KeyBlock::Segment& seg,
                                      int i) {
  const AttentionProblem& p = w.p;
  const int j = seg.first + i;
  const int64_t koff = w.k_at(seg.outer, seg.slot + i);
  const int64_t voff = w.v_at(seg.outer, seg.slot + i);
  float* vrow = w.buf.v_packed + j * w.Dvp;
  if constexpr (kPairScore) {
    if (!block.k_in_place) {
      const uint16_t* k = static_cast<const uint16_t*>(w.call.k) + koff;
      uint16_t* k_pairs = w.k_pairs() + j * 2 * w.pairs;
      for (int d = 0; d < w.D; ++d) k_pairs[d] = k[d * p.k_strides[3]];
      if (w.D % 2) k_pairs[w.D] = 0;
    }
    if (w.amx) return;  // V^T is packed two keys at a time (pack_values_transposed)
    if (!block.v_in_place) load_row<T>(vrow, 1, w.call.v, voff, p.v_strides[3], w.Dv, 1.0f);
  } else if constexpr (Bits == 0) {
    if (!block.k_in_place) load_row<T>(w.buf.k_rows + j * w.D, 1, w.call.k, koff, p.k_strides[3], w.D, 1.0f);
    if (!block.v_in_place) load_row<T>(vrow, 1, w.call.v, voff, p.v_strides[3], w.Dv, 1.0f);
  } else {
    const QuantizedKV& qkv = w.call.quantized;
    const int t = seg.slot + i, kv_head = w.tile.kv_head;
    const QuantizedRow key = {
        static_cast<const uint32_t*>(w.call.k) + koff, p.k_strides[3],
        qkv.k_scales, QuantizedKV::row_offset(qkv.k_scale_strides, seg.outer, kv_head, t), qkv.k_scale_strides[3],
        qkv.k_biases, QuantizedKV::row_offset(qkv.k_bias_strides, seg.outer, kv_head, t), qkv.k_bias_strides[3]};
    const QuantizedRow value = {
        static_cast<const uint32_t*>(w.call.v) + voff, p.v_strides[3],
        qkv.v_scales, QuantizedKV::row_offset(qkv.v_scale_strides, seg.outer, kv_head, t), qkv.v_scale_strides[3],
        qkv.v_biases, QuantizedKV::row_offset(qkv.v_bias_strides, seg.outer, kv_head, t), qkv.v_bias_strides[3]};
    load_quantized_row<T, Bits>(w.buf.k_rows + j * w.D, 1, key, qkv.group_size, w.D);
    load_quantized_row<T, Bits>(vrow, 1, value, qkv.group_size, w.Dv);
  }
  if (!block.v_in_place) {
    for (int e = w.Dv; e < w.Dvp; ++e) vrow[e] = 0.0f;
  }
}

// V^T[Dvp][key_block] bf16 for the AMX value product, written as 32-bit
// words of two keys (half the stores of a per-key transpose); zero from key
// n up to the tile depth and from feature Dv to Dvp.
MLX_ATTN_STEP void pack_values_transposed(const WorkItem& w, const KeyBlock& block) {
  const uint16_t* rows[kMaxKeyBlock];
  for (int s = 0; s < block.segment_count; ++s) {
    const KeyBlock::Segment& seg = block.segments[s];
    for (int i = 0; i < seg.n; ++i) {
      rows[seg.first + i] = static_cast<const uint16_t*>(w.call.v) + w.v_at(seg.outer, seg.slot + i);
    }
  }
  const int64_t fs = w.p.v_strides[3];
  const int n = block.n, padded = int(round_up(n, kAmxTileDepth));
  const int kWordsPerRow = w.key_block / 2;
  uint32_t* words = reinterpret_cast<uint32_t*>(w.v_t());
#if defined(MLX_ATTN_AMX_BF16)
  if (fs == 1 && w.Dv % 16 == 0) {  // 16 x 16 word blocks transposed in registers
    int e0 = 0;
    for (; e0 + 32 <= w.Dv; e0 += 32) {
      for (int jp0 = 0; jp0 < padded / 2; jp0 += 16) amx_pack_value_words_32(rows, n, jp0, e0, words, kWordsPerRow);
    }
    for (; e0 < w.Dv; e0 += 16) {
      for (int jp0 = 0; jp0 < padded / 2; jp0 += 16) amx_pack_value_words(rows, n, jp0, e0, words, kWordsPerRow);
    }
    memset(words + w.Dv * kWordsPerRow, 0, sizeof(uint32_t) * (w.Dvp - w.Dv) * kWordsPerRow);
    return;
  }
#endif
  for (int j = 0; j < padded; j += 2) {
    uint32_t* column = words + j / 2;
    if (j + 1 < n) {
      const uint16_t *even = rows[j], *odd = rows[j + 1];
      for (int e = 0; e < w.Dv; ++e) column[e * kWordsPerRow] = uint32_t(even[e * fs]) | uint32_t(odd[e * fs]) << 16;
    } else if (j < n) {
      const uint16_t* even = rows[j];
      for (int e = 0; e < w.Dv; ++e) column[e * kWordsPerRow] = uint32_t(even[e * fs]);
    } else {
      for (int e = 0; e < w.Dv; ++e) column[e * kWordsPerRow] = 0;
    }
  }
  memset(words + w.Dv * kWordsPerRow, 0, sizeof(uint32_t) * (w.Dvp - w.Dv) * kWordsPerRow);
}

// stage key block (Metal: stage_key_block): the block's segments, then K/V
// in place or packed. Float32 K rows and V rows (of a whole number of
// vectors) with unit feature stride can be read in place; 16-bit K for a
// pair product too when its pairs are whole; anything else is converted.
template <ElemType T, int Bits, bool kPairScore, class KVLayout>
MLX_ATTN_STEP void stage_key_block(const WorkItem& w, int kb, int n, KeyBlock& block) {
  const AttentionProblem& p = w.p;
  block.kb = kb;
  block.n = n;
  block.segment_count = 0;
  for (int j = 0; j < n;) {
    const KeyPlace at = KVLayout::key(w.call, w.tile, kb + j);
    const int len = at.run < n - j ? at.run : n - j;
    block.segments[block.segment_count++] = {at.outer, at.slot, j, len};
    j += len;
  }
  // AMX tiles read whole 16-key tiles: in place only within one segment.
  const bool k_can_stay = (Bits == 0 && T == ElemType::float32 && p.k_strides[3] == 1) ||
      (kPairScore && p.k_strides[3] == 1 && w.D % 2 == 0 &&
       (!w.amx || (block.segment_count == 1 && n % kAmxTileKeys == 0)));
  const bool v_can_stay = Bits == 0 && T == ElemType::float32 && p.v_strides[3] == 1 && w.Dv == w.Dvp;
  const bool long_runs = block.segment_count == 1 || n >= kMinInPlaceRun * block.segment_count;
  block.k_in_place = k_can_stay && long_runs;
  block.v_in_place = v_can_stay && long_runs;
  if (block.k_in_place && block.v_in_place) return;
  for (int s = 0; s < block.segment_count; ++s) {
    const KeyBlock::Segment& seg = block.segments[s];
    for (int i = 0; i < seg.n; ++i) pack_key_value_row<T, Bits, kPairScore>(w, block, seg, i);
  }
  if (w.amx && !block.k_in_place) {  // zero keys up to the whole tile
    memset(w.k_pairs() + n * 2 * w.pairs, 0, sizeof(uint16_t) * (round_up(n, kAmxTileKeys) - n) * 2 * w.pairs);
  }
  if (w.amx) pack_values_transposed(w, block);
}

// S^T[n][rp] = K[n][D] . Q^T[D][rp] for float K rows of stride lda, one
// column tile of Q^T at a time.
MLX_ATTN_STEP void score_rows(const WorkItem& w, const float* k, int64_t lda, float* scores_t, int n) {
  for (int c0 = 0; c0 < w.rp; c0 += kQueryPanelTile) {
    const int width = w.query_tile_width(c0);
    matmul_overwrite(k, lda, w.query_tile(c0), width, scores_t + c0, w.ls, n, w.D, width);
  }
}

// score: S^T[n][rp] = K[n][D] . Q^T[D][rp], segment by segment in place.
template <ElemType T, bool kPairScore>
MLX_ATTN_STEP void score_block(const WorkItem& w, const KeyBlock& block) {
  const int rp = w.rp;
  float* const scores_t = w.buf.scores_t;
  if constexpr (kPairScore) {
    using Product = typename NativePairProduct<T>::Product;
#if defined(MLX_ATTN_AMX_BF16)
    if (w.amx) {  // S^T rows n .. round_up(n, 16) are computed from zero keys, then unused
      const uint16_t* k = block.k_in_place
          ? static_cast<const uint16_t*>(w.call.k) + w.k_at(block.segments[0].outer, block.segments[0].slot)
          : w.k_pairs();
      const int64_t k_stride = block.k_in_place ? w.p.k_strides[2] : 2 * w.pairs;
      amx_matmul<false>(k, k_stride, w.q_pairs(), 2 * rp, scores_t, rp, int(round_up(block.n, kAmxTileKeys)) / kAmxTile,
                        rp / kAmxTile, w.D);
      return;
    }
#endif
    if (!block.k_in_place) {
      matmul_overwrite_pairs<Product>(w.k_pairs(), 2 * w.pairs, w.q_pairs(), 2 * rp, scores_t, w.ls, block.n, w.pairs,
                                      rp);
      return;
    }
    for (int s = 0; s < block.segment_count; ++s) {
      const KeyBlock::Segment& seg = block.segments[s];
      matmul_overwrite_pairs<Product>(static_cast<const uint16_t*>(w.call.k) + w.k_at(seg.outer, seg.slot),
                                      w.p.k_strides[2], w.q_pairs(), 2 * rp, scores_t + seg.first * w.ls, w.ls,
                                      seg.n, w.pairs, rp);
    }
  } else {
    if (!block.k_in_place) {
      score_rows(w, w.buf.k_rows, w.D, scores_t, block.n);
      return;
    }
    for (int s = 0; s < block.segment_count; ++s) {
      const KeyBlock::Segment& seg = block.segments[s];
      score_rows(w, static_cast<const float*>(w.call.k) + w.k_at(seg.outer, seg.slot), w.p.k_strides[2],
                 scores_t + seg.first * w.ls, seg.n);
    }
  }
}

// scale, then softcap where the problem has one (one branch per block):
// S = saturate_logit(logit_scale * S), then softcap_logit.
MLX_ATTN_STEP void scale_logits(const WorkItem& w, int n, float logit_scale) {
  float* const s = w.buf.scores_t;
  const vfloat scale = splat(logit_scale);
  const float cap = w.p.softcap;
  for (int j = 0; j < n; ++j) {
    float* row = s + j * w.ls;
    if (cap > 0.0f) {
      for (int c = 0; c < w.rp; c += kLanes) store(row + c, softcap_logit(saturate(load(row + c) * scale), cap));
    } else {
      for (int c = 0; c < w.rp; c += kLanes) store(row + c, saturate(load(row + c) * scale));
    }
  }
}

// mask: explicit masks (bool_masked_logit, additive_masked_logit), then
// causal / window on edge blocks only (block_on_edge, mask_hidden_keys).
template <ElemType T>
MLX_ATTN_STEP void mask_logits(const WorkItem& w, const KeyBlock& block, int first_pos, int last_pos) {
  const AttentionProblem& p = w.p;
  const AttentionParams& seq = w.tile.seq;
  const int kb = block.kb, n = block.n, ls = w.ls;
  if (p.mask_kind != MaskKind::none) {
    const int64_t ms = p.mask_strides[3];
    for (int r = 0; r < w.rows; ++r) {
      const int64_t moff = mask_offset(seq, w.tile.b, w.head(r), w.query(r), kb);
      float* s = w.buf.scores_t + r;
      if (p.mask_kind == MaskKind::boolean) {
        const bool* m = static_cast<const bool*>(w.call.mask) + moff;
        for (int j = 0; j < n; ++j) s[j * ls] = bool_masked_logit(s[j * ls], m[j * ms]);
      } else {
        for (int j = 0; j < n; ++j) {
          s[j * ls] = additive_masked_logit(s[j * ls], load_elem<T>(w.call.mask, moff + j * ms));
        }
      }
    }
  }
  if (block_on_edge(seq, kb, n, first_pos, last_pos)) {
    for (int r = 0; r < w.rows; ++r) {
      mask_hidden_keys(seq, query_position(seq, w.query(r)), kb, n, w.buf.scores_t + r, ls);
    }
  }
}

// A row's reference max m, against which P = exp(S - m), l and O are taken,
// moves when a block's max passes it by more than kRescaleSlack (P <=
// 2^kRescaleSlackLog2); exact whatever the slack (O / l and m + log l use the
// same reference). The slack is 0, the running max: with 8 / log2 e (lazy
// rescaling, as in FlashAttention-4; -15 % of the bf16 D=128 forward) a row's
// rounding depended on how its keys fell into blocks, so a decode row and the
// same row verified among drafts rounded differently and greedy speculation
// on SmolLM2 stopped being identical (bisected to this constant).
inline constexpr float kRescaleSlackLog2 = 0.0f;
inline constexpr float kRescaleSlack = kRescaleSlackLog2 / kLog2e;

// The row's next reference max: the old one unless the block's max passes it
// by more than the slack (a row that saw nothing yet, m = -inf or the masked
// sentinel, takes any larger max). A NaN block max leaves m as it is, as
// the running max did: the NaN reaches the row through P.
inline vfloat next_reference_max(vfloat m_old, vfloat block_max) {
  const vfloat m_new = vmax(block_max, m_old);
  return m_new <= m_old + kRescaleSlack ? m_old : m_new;
}

// online softmax (Metal: prefill_online_softmax): m_new = the next reference
// max, P^T = exp(S^T - m_new) in place, l = l * alpha + rowsum P; alpha per
// row into buf.rescale for rescale_rows (1 where the reference stayed).
// kScale: S^T holds the raw products and the scale step runs here, on the
// values as they are read (blocks scale_in_softmax takes): the same values
// as scale_logits then this, one pass over S^T fewer. The block max is taken
// on the raw products and scaled once: for logit_scale > 0 scaling and
// saturating are monotonic (and keep NaN), so it is the max of the scaled.
template <bool kScale = false>
MLX_ATTN_STEP void online_softmax(const WorkItem& w, int n, float logit_scale = 1.0f) {
  const int rp = w.rp, ls = w.ls;
  const vfloat scale = splat(logit_scale);
  const auto logit = [&](vfloat s) { return kScale ? saturate(s * scale) : s; };
  for (int c = 0; c < rp; c += kLanes) {
    vfloat block_max = splat(-INFINITY);
    for (int j = 0; j < n; ++j) block_max = vmax(block_max, load(w.buf.scores_t + j * ls + c));
    if (n > 0) block_max = logit(block_max);
    const vfloat m_old = load(w.buf.row_max + c);
    const vfloat m_new = next_reference_max(m_old, block_max);
    // A row with nothing visible yet (m = -inf, or the masked sentinel)
    // takes its exponents against 0: its P and alpha are then 0.
    const vfloat m_ref = m_new <= MLX_ATTN_MASKED_LOGIT ? splat(0.0f) : m_new;
    vfloat sum = splat(0.0f);
    for (int j = 0; j < n; ++j) {
      float* s = w.buf.scores_t + j * ls + c;
      const vfloat e = exp2_below((logit(load(s)) - m_ref) * kLog2e, kRescaleSlackLog2);
      store(s, e);
      sum += e;
    }
    const vfloat alpha = exp2_vec((m_old - m_ref) * kLog2e);
    store(w.buf.row_sum + c, load(w.buf.row_sum + c) * alpha + sum);
    store(w.buf.row_max + c, m_new);
    store(w.buf.rescale + c, alpha);
  }
}

#if defined(MLX_ATTN_AMX_BF16)
// The AMX path's scale, online softmax and P^T pair packing in two passes
// over S^T (blocks with no softcap, explicit mask or hidden key): the same
// values, sums and bf16 rounding as scale_logits, online_softmax and
// amx_pack_probabilities, without the three in-between stores of S^T / P^T.
// Four 16-row vectors at a time in the max pass: independent chains.
// exp2 for the fused pass, whose arguments are <= kRescaleSlackLog2 or NaN
// (scores at most the reference plus the slack): exp2_reduced's range
// reduction without clamps (AVX-512's rounding and scaling take any x; below
// -126, and -inf, whose reduction is NaN, the select still gives 0) and a
// degree-4 polynomial, relative error 2.7e-6: P is rounded to bf16 (2^-9)
// next, and l's sum is off by no more than the error.
inline constexpr float kNearReference = 32.0f;
inline vfloat amx_exp2_softmax(vfloat x) {
  const vfloat whole = (vfloat)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat f = x - whole;
  vfloat p = splat(9.570102207362652e-3f);
  p = p * f + 5.591786280274391e-2f;
  p = p * f + 2.40247443318367e-1f;
  p = p * f + 6.931217908859253e-1f;
  p = p * f + 9.999992847442627e-1f;
  return x < -126.0f ? splat(0.0f) : (vfloat)_mm512_scalef_ps((__m512)p, (__m512)whole);
}

// kEdge: a block on the causal / window edge (block_on_edge); each row's
// hidden keys take the masked sentinel in the max pass and P = 0, as
// mask_hidden_keys then the softmax would give them, tested in registers
// against the row's visible keys [first, last) of the block.
// Each of the kVectors x 16 rows from row c: its visible keys [first, last)
// of the block of n keys from kb (padding rows: all, as mask_logits leaves them).
template <int kVectors>
MLX_ATTN_STEP void amx_visible_key_ranges(const WorkItem& w, int kb, int n, int c, __m512i* first, __m512i* last) {
  for (int v = 0; v < kVectors; ++v) {
    int32_t lo[kLanes], hi[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const int r = c + v * kLanes + i;
      lo[i] = 0, hi[i] = n;
      if (r >= w.rows) continue;
      const int pos = query_position(w.tile.seq, w.query(r));
      const KeyRange seen = block_key_range(w.tile.seq, pos, pos);
      lo[i] = seen.begin - kb < 0 ? 0 : (seen.begin - kb < n ? seen.begin - kb : n);
      hi[i] = seen.end - kb < lo[i] ? lo[i] : (seen.end - kb < n ? seen.end - kb : n);
    }
    first[v] = _mm512_loadu_si512(lo);
    last[v] = _mm512_loadu_si512(hi);
  }
}

// Rows c..: the running sums rescaled from the old reference max to the
// new one plus this block's, and the rescale factor the value product reads.
template <int kVectors>
MLX_ATTN_STEP void amx_commit_row_sums(const WorkItem& w, int c, const vfloat* m_old, const vfloat* m_ref,
                                       const vfloat* sum) {
  for (int v = 0; v < kVectors; ++v) {
    const int col = c + v * kLanes;
    const vfloat alpha = exp2_vec((m_old[v] - m_ref[v]) * kLog2e);
    store(w.buf.row_sum + col, load(w.buf.row_sum + col) * alpha + sum[v]);
    store(w.buf.rescale + col, alpha);
  }
}

template <int kVectors, bool kEdge>
MLX_ATTN_STEP void amx_softmax_pack_rows(const WorkItem& w, int kb, int n, float logit_scale, int c) {
  const int rp = w.rp, padded = int(round_up(n, kAmxTileDepth));
  float* const s_t = w.buf.scores_t;
  const vfloat scale = splat(logit_scale);
  vfloat m_old[kVectors], m_ref[kVectors], sum[kVectors];
  __m512i first[kVectors], last[kVectors];
  if constexpr (kEdge) amx_visible_key_ranges<kVectors>(w, kb, n, c, first, last);
  const auto hidden = [&](int v, int j) -> __mmask16 {
    const __m512i key = _mm512_set1_epi32(j);
    return _mm512_cmplt_epi32_mask(key, first[v]) | _mm512_cmpge_epi32_mask(key, last[v]);
  };
  for (int v = 0; v < kVectors; ++v) {
    vfloat block_max = splat(-INFINITY);
    m_old[v] = load(w.buf.row_max + c + v * kLanes);
    sum[v] = splat(0.0f);
    m_ref[v] = block_max;
  }
  // Saturation is monotonic: off the edge, the max of the scaled logits is
  // saturated once (the same value, NaN included, as saturating each).
  for (int j = 0; j < n; ++j) {
    for (int v = 0; v < kVectors; ++v) {
      vfloat x = load(s_t + j * rp + c + v * kLanes) * scale;
      if constexpr (kEdge) {
        x = (vfloat)_mm512_mask_mov_ps((__m512)saturate(x), hidden(v, j), _mm512_set1_ps(MLX_ATTN_MASKED_LOGIT));
      }
      m_ref[v] = vmax(m_ref[v], x);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    if constexpr (!kEdge) m_ref[v] = saturate(m_ref[v]);
    const vfloat m_new = next_reference_max(m_old[v], m_ref[v]);
    store(w.buf.row_max + c + v * kLanes, m_new);
    m_ref[v] = m_new <= MLX_ATTN_MASKED_LOGIT ? splat(0.0f) : m_new;
  }
  // pair row j (keys 2j, 2j + 1) overwrites float row j's same columns, read
  // already (j <= 2j)
  uint16_t* const pairs = reinterpret_cast<uint16_t*>(s_t);
  // The exponent (saturate(s * scale) - m) * log2 e; where every lane's
  // reference is within kNearReference of 0 (typical logits), one FMA
  // s * (scale log2 e) - m log2 e: no saturation is needed there (a logit
  // past it gives 0 or inf either way) and the rounding of scale log2 e
  // and m log2 e moves an exponent whose P is above 2^-126 by under 2^-15,
  // i.e. P by under 2^-15 relatively, against the 2^-9 of its bf16 rounding.
  const vfloat scale_log2e = splat(logit_scale * kLog2e);
  const auto pass = [&]<bool kNear>(int v) {
    const int col = c + v * kLanes;
    const vfloat reference = m_ref[v], reference_log2e = m_ref[v] * kLog2e;
    const auto probability = [&](int j) {
      const vfloat s = load(s_t + j * rp + col);
      vfloat e = kNear ? amx_exp2_softmax(s * scale_log2e - reference_log2e)
                       : amx_exp2_softmax((saturate(s * scale) - reference) * kLog2e);
      if constexpr (kEdge) e = (vfloat)_mm512_maskz_mov_ps(~hidden(v, j), (__m512)e);
      return e;
    };
    vfloat row_sum = splat(0.0f);
    for (int j = 0; j < padded / 2; ++j) {
      vfloat e = splat(0.0f), o = splat(0.0f);
      if (2 * j < n) {
        e = probability(2 * j);
        row_sum += e;
      }
      if (2 * j + 1 < n) {
        o = probability(2 * j + 1);
        row_sum += o;
      }
      amx_store_probability_pairs(pairs + int64_t(j) * 2 * rp + 2 * col, (__m512)e, (__m512)o);
    }
    sum[v] = row_sum;
  };
  for (int v = 0; v < kVectors; ++v) {  // one vector at a time: its sum stays in a register
    const vfloat magnitude = m_ref[v] < 0.0f ? -m_ref[v] : m_ref[v];
    if (_mm512_cmp_ps_mask((__m512)magnitude, _mm512_set1_ps(kNearReference), _CMP_LE_OQ) == 0xffff) {
      pass.template operator()<true>(v);
    } else {
      pass.template operator()<false>(v);
    }
  }
  amx_commit_row_sums<kVectors>(w, c, m_old, m_ref, sum);
}

template <bool kEdge>
MLX_ATTN_STEP void amx_softmax_pack(const WorkItem& w, int kb, int n, float logit_scale) {
  int c = 0;
  for (; c + 4 * kLanes <= w.rp; c += 4 * kLanes) amx_softmax_pack_rows<4, kEdge>(w, kb, n, logit_scale, c);
  for (; c < w.rp; c += kLanes) amx_softmax_pack_rows<1, kEdge>(w, kb, n, logit_scale, c);
}
#endif

// rescale (Metal: prefill_rescale): O *= alpha, rows whose max moved.
MLX_ATTN_STEP void rescale_rows(const WorkItem& w) {
  if (w.amx) {  // O^T[Dvp][rp]: a vector of rows at a time, those whose max moved
    for (int c = 0; c < w.rp; c += kLanes) {
      const vfloat alpha = load(w.buf.rescale + c);
#if defined(MLX_ATTN_AMX_BF16)  // one compare, not one per lane (NaN counts as moved)
      if (_mm512_cmp_ps_mask((__m512)alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) == 0) continue;
#else
      bool moved = false;
      for (int i = 0; i < kLanes; ++i) moved |= alpha[i] != 1.0f;
      if (!moved) continue;
#endif
      for (int e = 0; e < w.Dvp; ++e) store(w.buf.acc + int64_t(e) * w.rp + c, load(w.buf.acc + int64_t(e) * w.rp + c) * alpha);
    }
    return;
  }
  for (int r = 0; r < w.rows; ++r) {
    if (w.buf.rescale[r] != 1.0f) {
      float* o = w.buf.acc + r * w.Dvp;
      const vfloat alpha = splat(w.buf.rescale[r]);
      for (int c = 0; c < w.Dvp; c += kLanes) store(o + c, load(o + c) * alpha);
    }
  }
}

#if defined(MLX_ATTN_AMX_BF16)
// O^T += V^T . P^T from the P^T pair panel already in scores_t.
MLX_ATTN_STEP void amx_accumulate_packed(const WorkItem& w, const KeyBlock& block) {
  amx_matmul<true>(w.v_t(), w.key_block, reinterpret_cast<const uint16_t*>(w.buf.scores_t), 2 * w.rp, w.buf.acc, w.rp,
                   w.Dvp / kAmxTile, w.rp / kAmxTile, int(round_up(block.n, kAmxTileDepth)));
}
#endif

// accumulate: O[rows][Dvp] += P[rows][n] . V[n][Dvp]
MLX_ATTN_STEP void accumulate_values(const WorkItem& w, const KeyBlock& block) {
#if defined(MLX_ATTN_AMX_BF16)
  if (w.amx) {  // O^T += V^T . P^T, P rounded to bf16 (its pair panel replaces P^T in place)
    amx_pack_probabilities(w.buf.scores_t, w.rp, block.n);
    amx_accumulate_packed(w, block);
    return;
  }
#endif
  if (!block.v_in_place) {
    matmul_accumulate_transposed_a(w.buf.scores_t, w.ls, w.buf.v_packed, w.Dvp, w.buf.acc, w.Dvp, w.rows, block.n,
                                   w.Dvp);
    return;
  }
  for (int s = 0; s < block.segment_count; ++s) {
    const KeyBlock::Segment& seg = block.segments[s];
    matmul_accumulate_transposed_a(w.buf.scores_t + seg.first * w.ls, w.ls,
                                   static_cast<const float*>(w.call.v) + w.v_at(seg.outer, seg.slot),
                                   w.p.v_strides[2], w.buf.acc, w.Dvp, w.rows, seg.n, w.Dvp);
  }
}

// normalize (Metal: prefill_normalizer, prefill_row_lse): sinks join the
// sum; O / l, zeros where the row saw nothing; the row's log-sum-exp.
template <ElemType T, class KVLayout>
MLX_ATTN_STEP void normalize_rows(const WorkItem& w) {
  const AttentionProblem& p = w.p;
  for (int r = 0; r < w.rows; ++r) {
    const int h = w.head(r);
    float m = w.buf.row_max[r];
    float l = w.buf.row_sum[r];
    float correction = 1.0f;
    if (p.has_sinks) {
      const float sink = saturate_logit(load_elem<T>(w.call.sinks, h * p.sinks_stride));
      const float m_final = sink > m ? sink : m;
      correction = exp2f((m - m_final) * kLog2e);
      l = l * correction + exp2f((sink - m_final) * kLog2e);
      m = m_final;
    }
    // l == 0: the row saw nothing (zeros); a NaN sum (NaN data) stays NaN
    const float factor = l == 0.0f ? 0.0f : correction / l;
    const int64_t row_index = KVLayout::out_row(w.call, w.tile, h, w.query(r));
    if (w.amx) {  // O^T: the row is strided
      for (int e = 0; e < w.Dv; ++e) store_elem<T>(w.call.out, row_index * w.Dv + e, w.acc_at(r, e) * factor);
    } else {
      store_row<T>(w.call.out, row_index * w.Dv, w.buf.acc + int64_t(r) * w.Dvp, factor, w.Dv);
    }
    if (w.call.lse) w.call.lse[row_index] = l == 0.0f ? -INFINITY : m + logf(l);
  }
}

// Whether online_softmax<true> may take a block's scale step (the block off
// the causal / window edge): no softcap, no explicit mask, a positive scale.
MLX_ATTN_STEP bool scale_in_softmax(const WorkItem& w, float logit_scale) {
  return w.p.softcap <= 0.0f && w.p.mask_kind == MaskKind::none && logit_scale > 0.0f;
}

// The key loop of an item whose queries are loaded: every block of keys some
// row can see, each through stage, score, scale, mask, online softmax,
// rescale and accumulate; then normalize. logit_scale: what the score
// product's sums are multiplied by (the scale step).
template <ElemType T, int Bits, bool kPairScore, class KVLayout>
void attend_keys(const WorkItem& item, float logit_scale) {
  const WorkItem w = item;  // a local copy: its fields stay in registers
  const AttentionParams& seq = w.tile.seq;
  const int first_pos = query_position(seq, w.tile.q_start);
  const int last_pos = query_position(seq, w.tile.q_start + w.tile.qb - 1);
  const KeyRange keys = block_key_range(seq, first_pos, last_pos);
  KeyBlock block;
  for (int kb = keys.begin; kb < keys.end; kb += w.key_block) {
    const int n = (keys.end - kb) < w.key_block ? (keys.end - kb) : w.key_block;
    stage_key_block<T, Bits, kPairScore, KVLayout>(w, kb, n, block);
    score_block<T, kPairScore>(w, block);
#if defined(MLX_ATTN_AMX_BF16)
    if (w.amx && w.p.softcap <= 0.0f && w.p.mask_kind == MaskKind::none) {
      if (block_on_edge(seq, kb, n, first_pos, last_pos)) {
        amx_softmax_pack<true>(w, kb, n, logit_scale);
      } else {
        amx_softmax_pack<false>(w, kb, n, logit_scale);
      }
      rescale_rows(w);
      amx_accumulate_packed(w, block);
      continue;
    }
#endif
    if (scale_in_softmax(w, logit_scale) && !block_on_edge(seq, kb, n, first_pos, last_pos)) {
      online_softmax<true>(w, n, logit_scale);  // nothing to mask: scale fused into the softmax
    } else {
      scale_logits(w, n, logit_scale);
      mask_logits<T>(w, block, first_pos, last_pos);
      online_softmax(w, n);
    }
    rescale_rows(w);
    accumulate_values(w, block);
  }
  normalize_rows<T, KVLayout>(w);
}

// Bits: 0 for float K/V, else their quantization (4 or 8). bf16 / fp16 run
// the score product natively in pairs where the copy can (NativePairProduct).
template <ElemType T, int Bits, class KVLayout>
void attention_work_item(const KernelCall& call, int64_t item, float* scratch) {
  const Tile tile = KVLayout::tile(call, item);
  if (tile.qb <= 0) return;
  WorkItem w(call, tile, scratch);
  if constexpr (NativePairProduct<T>::kAvailable && Bits == 0) {
    load_queries<T, true>(w);
    PairScale pair = {call.problem.scale, true};  // float16 pair products are exact (FMLAL)
    if constexpr (T == ElemType::bfloat16) {
      pair = bf16_pair_scale(w.q_pairs(), int64_t(w.pairs) * 2 * w.rp, pair.scale, w.D);
    }
#if defined(MLX_ATTN_AMX_BF16)
    if (pair.exact && T == ElemType::bfloat16 && w.D % kAmxDepth == 0 && w.rp % kAmxTile == 0) {
      w.amx = true;
      w.key_block = kMaxKeyBlock;
      amx_configure();
      attend_keys<T, Bits, true, KVLayout>(w, pair.scale);
      amx_release();
      return;
    }
#endif
    if (pair.exact) return attend_keys<T, Bits, true, KVLayout>(w, pair.scale);
  }
  load_queries<T, false>(w);
  attend_keys<T, Bits, false, KVLayout>(w, call.problem.scale);
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
