// Paged prefill attention (the AVX-512 build): a chunk of one sequence's new tokens, the rows at
// positions start .. start + T - 1, attends causally to the sequence's context, read in place
// through its block table (no gather, no mask tensor). cpu_kernels.cpp includes this after its
// helpers (kLanes, round_pairs) and common.h's parallel_pieces.
//
// Flash attention's online softmax over tiles of kKeyTile keys (in base 2: the scale times log2 e
// folded into one fused step per score, the mask only on tiles that cross a row's position),
// in bf16 dot products (vdpbf16ps)
// for both Q K^T and P V, the weights P rounded to bf16 as PyTorch's flash attention rounds them
// for bf16 inputs. A lane block is up to kQueryLanes query vectors of one KV head (rows x the
// head's group of query heads); the lanes of a register run over those queries, so each key's
// score is one vector, the softmax's max and sum are vertical, and a key's K pair is one
// broadcast. An item is up to kLaneBlocks lane blocks: each key tile is read from the cache rows
// as they lie and V paired (two keys' values interleaved) once for all of them.
//
// The same bits whole or in chunks: key tiles start at position 0 whatever chunk a row arrives
// in, each query lane's arithmetic is its own, and a tile wholly past a row's position leaves the
// row's state exactly as it was (max unchanged, correction exp(0) = 1, weights exp(-inf) = 0).
// So a prompt's rows come out the same prefilled whole, in chunks, or after a prefix-cache hit.
//
// Where the CPU has no bf16 dot product (cpu_kernels.cpp emulates it as two FMAs a pair, the
// high halves' product first), the operands are turned into floats once instead: the queries'
// halves per item, each tile's keys, values and (bf16-rounded) weights, so that the inner loops
// are FMAs on a broadcast float, the emulation's arithmetic in its order without unpacking a pair
// per instruction (the kernel about 1.4x faster on a Xeon without AVX512-BF16; the same bits).
//
// Where the CPU has AMX (and the build AVX512-BF16), Q K^T and P V run on its tiles instead
// (tile_scores, tile_values): the same operands, laid out as they already are but for the
// values' pairs, transposed 16 x 16 per tile; P V summed fresh per tile, then o = corr o + P V in
// one fused step. Other bits than the vdpbf16ps loops', the same whole or in chunks (measured:
// 2.4x the loops' speed at 2k and 8k tokens of context, Xeon VM with AMX, 2 threads).
//
// An fp8_e4m3 cache (bytes, a float scale per token and head) is read the same way: each tile's
// rows are turned into bf16 as the SDPA path's gather turns them, (fp8 -> float) x scale rounded
// to nearest even, so the result is the bf16 kernel's on those dequantized rows, bit for bit.

#pragma once

constexpr int64_t kKeyTile = 32;
constexpr int64_t kQueryVecs = 3;                      // query vectors (of kLanes) per item
constexpr int64_t kQueryLanes = kQueryVecs * kLanes;  // 48 queries
constexpr int64_t kKeyStep = 8;                        // keys per Q K^T register tile
constexpr int64_t kValueStep = 8;                      // value pairs per P V register tile
constexpr int64_t kLaneBlocks = 8;  // blocks of kQueryLanes per item at most (prefill_attention)

template <typename C>  // the cache's element: c10::BFloat16, or uint8_t for fp8_e4m3 bytes
struct PrefillArgs {
  const c10::BFloat16* q;
  int64_t q_row, q_head;  // q's strides
  const C *keys, *values;
  const float *key_scales, *value_scales;  // fp8's per token and head, else null
  const int64_t* table;
  int64_t T, start, Hq, Hkv, D, block_size;
  float scale;
  c10::BFloat16* out;  // [T, Hq, D]
};

// One block of an item's query lanes (kQueryLanes: rows x the head's group): its queries and its
// online softmax's state.
struct LaneBlock {
  std::vector<uint32_t> qpairs;  // [D / 2][kQueryLanes]: query m's dims (2p, 2p + 1)
  std::vector<__m512> o;         // [D][kQueryVecs], dims in the paired order (paired_dim)
  std::vector<float> qhalves;    // without AVX512-BF16: [D / 2][2][kQueryLanes], dims 2p + 1, 2p
  __m512i pos[kQueryVecs];       // each lane's position (-1: no query, every key masked)
  __m512 top[kQueryVecs], sum[kQueryVecs];  // top: the max of scale log2(e) q . k so far
  int64_t first, last;           // its first row's position, the last position any row attends
};

using Scores = __m512[kKeyTile][kQueryVecs];  // [key][query vector]

struct PrefillScratch {
  std::vector<LaneBlock> blocks;
  std::vector<c10::BFloat16> kstage, vstage;  // [kKeyTile][D]: an fp8 tile's rows in bf16
  Scores s;                          // scores, then weights
  // AMX tiles' operands: the tile's keys [kKeyTile][D] (krow's rows, contiguous), vpairs
  // transposed [D / 16][16 dims][kKeyTile / 2], a product tile [16][16]
  std::vector<c10::BFloat16> ktile;
  std::vector<uint32_t> vtiles;
  alignas(64) float product[16 * 16];
#ifdef __AVX512BF16__
  std::vector<uint32_t> vpairs;      // [kKeyTile / 2][D]: keys (2j, 2j + 1)'s values, paired
  __m512i p[kKeyTile / 2][kQueryVecs];  // weights of keys (2j, 2j + 1), bf16 pairs
#else
  std::vector<float> keys;     // [kKeyTile][D]: the tile's keys as floats
  std::vector<float> vhalves;  // [kKeyTile / 2][2][D]: keys 2j + 1 and 2j's values, paired order
  __m512 phigh[kKeyTile / 2][kQueryVecs], plow[kKeyTile / 2][kQueryVecs];  // keys 2j + 1, 2j
#endif
};

// 2^t for the softmax's finite t <= 0 (and the max's own rounding above it), exactly 1 at 0:
// 2^f for f = t - floor t in [0, 1) by a degree-4 polynomial (relative error 3e-6, fit with its
// constant term 1; the weights are rounded to bf16 after), times 2^floor t (vscalefps floors).
// exp2_masked also takes -inf, to 0.
inline __m512 exp2_weights(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.342668477e-02f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.224247277e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.412801981e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930448413e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, t);
}
inline __m512 exp2_masked(__m512 t) {
  return exp2_weights(_mm512_max_ps(t, _mm512_set1_ps(-160.0f)));
}

#ifndef __AVX512BF16__
inline __m512 bf16_rounded(__m512 x) {  // x rounded to bf16 as round_pairs rounds it, a float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(x)), 16));
}
#endif

// unpacklo/hi_epi16 pair two 32-dim rows lane by lane (128 bits): word w of the pair holds dim
// paired_dim(w) of both keys.
inline int64_t paired_dim(int64_t w) {
  const int64_t base = (w / 32) * 32, i = w % 32, hi = i / 16, lane = (i % 16) / 4;
  return base + lane * 8 + hi * 4 + i % 4;
}

inline __m512i bf16_pairs(__m512 even, __m512 odd) {  // lane m: (even[m], odd[m]) in bf16
  static const __m512i order = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, round_pairs(odd, even));
}

// The bf16 row of cache row `at` (token slot x Hkv + head): in place, or an fp8 row turned into
// bf16 in `stage` as (fp8 -> float) x its scale, rounded to nearest even (store16).
inline const c10::BFloat16* bf16_row(const c10::BFloat16* cache, const float*, int64_t at,
                                     int64_t D, c10::BFloat16*) {
  return cache + at * D;
}
inline const c10::BFloat16* bf16_row(const uint8_t* cache, const float* scales, int64_t at,
                                     int64_t D, c10::BFloat16* stage) {
  const __m512 scale = _mm512_set1_ps(scales[at]);
  for (int64_t c = 0; c < D; c += kLanes) {
    store16(stage + c, _mm512_mul_ps(load16(cache + at * D + c), scale));
  }
  return stage;
}

// 16 rows of 16 dwords (r) -> out, their transpose: unpacks pair, then quad, the rows' dwords in
// each 128-bit lane, then 128-bit lanes move across the four registers that hold a column.
inline void transpose16(const __m512i (&r)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k] lane L: column 4 L + k of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    out[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[4 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    out[8 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// The tile's scores on AMX: sc[j][v] = q_v . k_j (TDPBF16PS over D, 32 dims a step) for its
// 32 keys (k: s.ktile) and a block's 48 query lanes (q: its qpairs, the B operand as they lie):
// C tiles 0-5 (key block b, query vector v: tile 3 b + v), A tile 6, B tile 7; store_products
// stores them into sc.
inline void tile_products(const uint32_t* q, int64_t D, const c10::BFloat16* k) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const uint32_t* qd = q + (d0 / 2) * kQueryLanes;
    _tile_loadd(6, k + d0, D * 2);
    _tile_loadd(7, qd, kQueryLanes * 4);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, qd + kLanes, kQueryLanes * 4);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(7, qd + 2 * kLanes, kQueryLanes * 4);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, k + 16 * D + d0, D * 2);
    _tile_loadd(7, qd, kQueryLanes * 4);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(7, qd + kLanes, kQueryLanes * 4);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, qd + 2 * kLanes, kQueryLanes * 4);
    _tile_dpbf16ps(5, 6, 7);
  }
}

inline void store_products(Scores& sc) {
  constexpr int64_t row = kQueryVecs * 64;  // bytes between keys in sc
  auto* out = reinterpret_cast<char*>(&sc[0][0]);
  _tile_stored(0, out, row);
  _tile_stored(1, out + 64, row);
  _tile_stored(2, out + 128, row);
  _tile_stored(3, out + 16 * row, row);
  _tile_stored(4, out + 16 * row + 64, row);
  _tile_stored(5, out + 16 * row + 128, row);
}

// Whether this thread computes with tiles (AMX, permitted): their shapes loaded, all 16 x 64
// bytes; release_attention_tiles after.
inline bool attention_tiles() {
  if (!amx_permitted()) return false;
  load_full_tiles();
  return true;
}
inline void release_attention_tiles() { _tile_release(); }

// The tile's values' pairs transposed, 16 dims x 16 key pairs at a time (s.vtiles: A tiles).
inline void transpose_values(PrefillScratch& s, int64_t D) {
  s.vtiles.resize(D * kKeyTile / 2);
  for (int64_t w0 = 0; w0 < D; w0 += 16) {
    __m512i r[16], t[16];
    for (int64_t jp = 0; jp < 16; ++jp) r[jp] = _mm512_loadu_si512(s.vpairs.data() + jp * D + w0);
    transpose16(r, t);
    uint32_t* vt = s.vtiles.data() + w0 * 16;
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(vt + i * 16, t[i]);
  }
}

// o = corr o + P V on AMX: for each 16 of the (paired-order) dims, TDPBF16PS of the values'
// pairs transposed (A, tile 6: dims x the tile's 16 key pairs) and the weights' pairs as they
// lie (B, tiles 3-5: key pairs x 16 query lanes), a fresh sum of the tile's keys per query, then
// added to the corrected state in one fused step.
inline void tile_values(PrefillScratch& s, __m512* o, int64_t D, const __m512 (&corr)[kQueryVecs]) {
  constexpr int64_t row = kQueryVecs * 64;  // bytes between key pairs in s.p
  const auto* p = reinterpret_cast<const char*>(&s.p[0][0]);
  _tile_loadd(3, p, row);
  _tile_loadd(4, p + 64, row);
  _tile_loadd(5, p + 128, row);
  for (int64_t w0 = 0; w0 < D; w0 += 16) {
    _tile_loadd(6, s.vtiles.data() + w0 * 16, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    _tile_dpbf16ps(0, 6, 3);
    _tile_dpbf16ps(1, 6, 4);
    _tile_dpbf16ps(2, 6, 5);
    for (int v = 0; v < kQueryVecs; ++v) {
      if (v == 0) _tile_stored(0, s.product, 64);
      if (v == 1) _tile_stored(1, s.product, 64);
      if (v == 2) _tile_stored(2, s.product, 64);
      for (int64_t i = 0; i < 16; ++i) {
        __m512& out = o[(w0 + i) * kQueryVecs + v];
        out = _mm512_fmadd_ps(out, corr[v], _mm512_load_ps(s.product + i * 16));
      }
    }
  }
}
#else
inline bool attention_tiles() { return false; }
inline void release_attention_tiles() {}
inline void tile_products(const uint32_t*, int64_t, const c10::BFloat16*) {}
inline void store_products(Scores&) {}
inline void transpose_values(PrefillScratch&, int64_t) {}
template <typename V>
inline void tile_values(PrefillScratch&, __m512*, int64_t, const V&) {}
#endif

// One lane block's scores q . k_j against the staged key tile (krow, s.ktile, or the float
// copies without AVX512-BF16): into sc, or on AMX into C tiles 0-5 (store_products).
template <typename C>
void block_scores(const PrefillArgs<C>& a, PrefillScratch& s, const LaneBlock& lb,
                  const c10::BFloat16* const* krow, bool tiles, Scores& sc) {
  const int64_t D = a.D, pairs = D / 2;
  if (tiles) tile_products(lb.qpairs.data(), D, s.ktile.data());
  for (int64_t j0 = 0; j0 < kKeyTile && !tiles; j0 += kKeyStep) {
    __m512 acc[kKeyStep][kQueryVecs];
    for (auto& row : acc) for (auto& x : row) x = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
#ifdef __AVX512BF16__
      __m512i qv[kQueryVecs];
      for (int64_t v = 0; v < kQueryVecs; ++v) {
        qv[v] = _mm512_loadu_si512(lb.qpairs.data() + p * kQueryLanes + v * kLanes);
      }
      for (int64_t j = 0; j < kKeyStep; ++j) {
        const __m512i kp = _mm512_set1_epi32(
            static_cast<int>(reinterpret_cast<const uint32_t*>(krow[j0 + j])[p]));
        for (int64_t v = 0; v < kQueryVecs; ++v) acc[j][v] = dot_pairs(acc[j][v], qv[v], kp);
      }
#else
      __m512 high[kQueryVecs], low[kQueryVecs];
      for (int64_t v = 0; v < kQueryVecs; ++v) {
        high[v] = _mm512_loadu_ps(lb.qhalves.data() + 2 * p * kQueryLanes + v * kLanes);
        low[v] = _mm512_loadu_ps(lb.qhalves.data() + (2 * p + 1) * kQueryLanes + v * kLanes);
      }
      for (int64_t j = 0; j < kKeyStep; ++j) {
        const float* k = s.keys.data() + (j0 + j) * D + 2 * p;
        const __m512 khigh = _mm512_set1_ps(k[1]), klow = _mm512_set1_ps(k[0]);
        for (int64_t v = 0; v < kQueryVecs; ++v) {
          acc[j][v] = _mm512_fmadd_ps(low[v], klow, _mm512_fmadd_ps(high[v], khigh, acc[j][v]));
        }
      }
#endif
    }
    for (int64_t j = 0; j < kKeyStep; ++j) {
      for (int64_t v = 0; v < kQueryVecs; ++v) sc[j0 + j][v] = acc[j][v];
    }
  }
}

// The block's online softmax step over its scores sc of the key tile at t0: -inf past each
// lane's position (no lane's is before the block's first row: only a tile past it masks), in base
// 2 (c = scale log2 e) the new max of c s, the old state's correction `corr`, the tile's weights
// 2^(c s - max) (c s - max in one rounding) into s.p.
inline void softmax_step(float scale, PrefillScratch& s, LaneBlock& lb, int64_t t0, Scores& sc,
                         __m512 (&corr)[kQueryVecs]) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const bool masks = t0 + kKeyTile - 1 > lb.first;
  for (int64_t j = 0; j < kKeyTile && masks; ++j) {
    const __m512i t = _mm512_set1_epi32(static_cast<int>(t0 + j));
    for (int64_t v = 0; v < kQueryVecs; ++v) {
      sc[j][v] = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(t, lb.pos[v]), sc[j][v], minus_inf);
    }
  }
  const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
  for (int64_t v = 0; v < kQueryVecs; ++v) {
    __m512 m = minus_inf;
    for (int64_t j = 0; j < kKeyTile; ++j) m = _mm512_max_ps(m, sc[j][v]);
    m = _mm512_max_ps(lb.top[v], _mm512_mul_ps(m, c));  // c > 0: the max of the products
    const __mmask16 none = _mm512_cmp_ps_mask(m, minus_inf, _CMP_EQ_OQ);
    const __m512 shift = _mm512_mask_blend_ps(none, m, _mm512_setzero_ps());
    corr[v] = exp2_masked(_mm512_sub_ps(lb.top[v], shift));  // exactly 1 where m held
    const __m512 minus_shift = _mm512_sub_ps(_mm512_setzero_ps(), shift);
    __m512 add = _mm512_setzero_ps();
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const __m512 t = _mm512_fmadd_ps(sc[j][v], c, minus_shift);
      sc[j][v] = masks ? exp2_masked(t) : exp2_weights(t);
      add = _mm512_add_ps(add, sc[j][v]);
    }
    lb.sum[v] = _mm512_fmadd_ps(lb.sum[v], corr[v], add);
    lb.top[v] = m;
    for (int64_t j = 0; j < kKeyTile; j += 2) {
#ifdef __AVX512BF16__
      s.p[j / 2][v] = bf16_pairs(sc[j][v], sc[j + 1][v]);
#else
      s.phigh[j / 2][v] = bf16_rounded(sc[j + 1][v]);
      s.plow[j / 2][v] = bf16_rounded(sc[j][v]);
#endif
    }
  }
}

// o = corr o + P V for the block (staged: s.vpairs / vtiles, or the float copies without
// AVX512-BF16), kValueStep paired dims at a time.
inline void values_step(PrefillScratch& s, LaneBlock& lb, int64_t D, bool tiles,
                        const __m512 (&corr)[kQueryVecs]) {
  if (tiles) tile_values(s, lb.o.data(), D, corr);
  for (int64_t w0 = 0; w0 < D && !tiles; w0 += kValueStep) {
    __m512 acc[kValueStep][kQueryVecs];
    for (int64_t w = 0; w < kValueStep; ++w) {
      for (int64_t v = 0; v < kQueryVecs; ++v) {
        acc[w][v] = _mm512_mul_ps(lb.o[(w0 + w) * kQueryVecs + v], corr[v]);
      }
    }
    for (int64_t jp = 0; jp < kKeyTile / 2; ++jp) {
#ifdef __AVX512BF16__
      const uint32_t* vp = s.vpairs.data() + jp * D + w0;
      for (int64_t w = 0; w < kValueStep; ++w) {
        const __m512i vv = _mm512_set1_epi32(static_cast<int>(vp[w]));
        for (int64_t v = 0; v < kQueryVecs; ++v) {
          acc[w][v] = dot_pairs(acc[w][v], s.p[jp][v], vv);
        }
      }
#else
      const float* high = s.vhalves.data() + 2 * jp * D + w0;
      for (int64_t w = 0; w < kValueStep; ++w) {
        const __m512 vhigh = _mm512_set1_ps(high[w]), vlow = _mm512_set1_ps(high[D + w]);
        for (int64_t v = 0; v < kQueryVecs; ++v) {
          acc[w][v] = _mm512_fmadd_ps(s.plow[jp][v], vlow,
                                      _mm512_fmadd_ps(s.phigh[jp][v], vhigh, acc[w][v]));
        }
      }
#endif
    }
    for (int64_t w = 0; w < kValueStep; ++w) {
      for (int64_t v = 0; v < kQueryVecs; ++v) lb.o[(w0 + w) * kQueryVecs + v] = acc[w][v];
    }
  }
}

// Item (KV head h, rows [r0, r0 + rows)): blocks of kQueryLanes / group rows, each with its own
// query lanes and softmax state, over one pass through the keys: a key tile is read, staged and
// paired once for all the blocks (from a block's last position on, it skips the tiles: what a
// chunk ending there computes).
template <typename C>
void prefill_item(const PrefillArgs<C>& a, int64_t h, int64_t r0, int64_t rows,
                  PrefillScratch& s, const c10::BFloat16* zeros, bool tiles) {
  const int64_t group = a.Hq / a.Hkv, D = a.D, pairs = D / 2, bs = a.block_size;
  const int64_t per = kQueryLanes / group, nblocks = (rows + per - 1) / per;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  s.blocks.resize(std::max<int64_t>(nblocks, static_cast<int64_t>(s.blocks.size())));
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    LaneBlock& lb = s.blocks[bi];
    const int64_t b0 = r0 + bi * per, brows = std::min(per, r0 + rows - b0);
    lb.qpairs.resize(pairs * kQueryLanes);
    lb.o.assign(D * kQueryVecs, _mm512_setzero_ps());
    lb.first = a.start + b0;
    lb.last = a.start + b0 + brows - 1;
    alignas(64) int32_t pos[kQueryLanes];
    for (int64_t m = 0; m < kQueryLanes; ++m) {
      pos[m] = m / group < brows ? static_cast<int32_t>(a.start + b0 + m / group) : -1;  // -1: every key masked
    }
    // lane m's query (row m / group, head h group + m % group; zero past the rows), 16 lanes x
    // 16 dim pairs transposed at a time
    for (int64_t v = 0; v < kQueryVecs; ++v) {
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        __m512i r[16], t[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t m = v * kLanes + i;
          r[i] = m / group < brows
                     ? _mm512_loadu_si512(a.q + (b0 + m / group) * a.q_row +
                                          (h * group + m % group) * a.q_head + 2 * p0)
                     : _mm512_setzero_si512();
        }
        transpose16(r, t);
        for (int64_t i = 0; i < 16; ++i) {
          _mm512_storeu_si512(lb.qpairs.data() + (p0 + i) * kQueryLanes + v * kLanes, t[i]);
        }
      }
    }
    for (int64_t v = 0; v < kQueryVecs; ++v) {
      lb.pos[v] = _mm512_load_si512(pos + v * kLanes);
      lb.top[v] = minus_inf;
      lb.sum[v] = _mm512_setzero_ps();
    }
#ifndef __AVX512BF16__
    lb.qhalves.resize(pairs * 2 * kQueryLanes);
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t v = 0; v < kQueryVecs; ++v) {
        const __m512i x = _mm512_loadu_si512(lb.qpairs.data() + p * kQueryLanes + v * kLanes);
        float* dst = lb.qhalves.data() + 2 * p * kQueryLanes + v * kLanes;
        _mm512_storeu_ps(dst, high_halves(x));
        _mm512_storeu_ps(dst + kQueryLanes, low_halves(x));
      }
    }
#endif
  }
  s.kstage.resize(kKeyTile * D);
  s.vstage.resize(kKeyTile * D);
  if (tiles) s.ktile.resize(kKeyTile * D);
#ifdef __AVX512BF16__
  s.vpairs.resize(kKeyTile / 2 * D);
#else
  s.keys.resize(kKeyTile * D);
  s.vhalves.resize(kKeyTile * D);
#endif
  const int64_t last = a.start + r0 + rows - 1;  // the last position any row attends
  const c10::BFloat16 *krow[kKeyTile], *vrow[kKeyTile];
  for (int64_t t0 = 0; t0 <= last; t0 += kKeyTile) {
    for (int64_t j = 0; j < kKeyTile; ++j) {  // keys past `last` are masked for every row
      const int64_t t = t0 + j;
      const int64_t at = t <= last ? (a.table[t / bs] * bs + t % bs) * a.Hkv + h : -1;
      krow[j] = at < 0 ? zeros : bf16_row(a.keys, a.key_scales, at, D, s.kstage.data() + j * D);
      vrow[j] = at < 0 ? zeros : bf16_row(a.values, a.value_scales, at, D, s.vstage.data() + j * D);
      if (tiles) std::memcpy(s.ktile.data() + j * D, krow[j], D * sizeof(c10::BFloat16));
#ifndef __AVX512BF16__
      for (int64_t c = 0; c < D; c += kLanes) _mm512_storeu_ps(&s.keys[j * D + c], load16(krow[j] + c));
#endif
    }
    // values of keys (2j, 2j + 1) interleaved, 32 dims at a time
    for (int64_t j = 0; j < kKeyTile; j += 2) {
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i even = _mm512_loadu_si512(vrow[j] + c), odd = _mm512_loadu_si512(vrow[j + 1] + c);
        const __m512i first = _mm512_unpacklo_epi16(even, odd), second = _mm512_unpackhi_epi16(even, odd);
#ifdef __AVX512BF16__
        uint32_t* dst = s.vpairs.data() + (j / 2) * D + c;
        _mm512_storeu_si512(dst, first);
        _mm512_storeu_si512(dst + 16, second);
#else
        float* high = s.vhalves.data() + j * D + c;  // [j / 2][2][D]: key j + 1's, then key j's
        _mm512_storeu_ps(high, high_halves(first));
        _mm512_storeu_ps(high + 16, high_halves(second));
        _mm512_storeu_ps(high + D, low_halves(first));
        _mm512_storeu_ps(high + D + 16, low_halves(second));
#endif
      }
    }
    if (tiles) transpose_values(s, D);
    for (int64_t bi = 0; bi < nblocks; ++bi) {
      LaneBlock& lb = s.blocks[bi];
      if (t0 > lb.last) continue;
      __m512 corr[kQueryVecs];
      block_scores(a, s, lb, krow, tiles, s.s);
      if (tiles) store_products(s.s);
      softmax_step(a.scale, s, lb, t0, s.s, corr);
      values_step(s, lb, D, tiles, corr);
    }
  }
  // each lane's o / sum into its output row: 16 lanes x 32 (paired-order) dims transposed at a
  // time, rounded to bf16 and put in dimension order
  static const __m512i dims = [] {
    alignas(64) int16_t order[32];
    for (int w = 0; w < 32; ++w) order[paired_dim(w)] = static_cast<int16_t>(w);
    return _mm512_load_si512(order);
  }();
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    LaneBlock& lb = s.blocks[bi];
    const int64_t b0 = r0 + bi * per, brows = std::min(per, r0 + rows - b0);
    for (int64_t v = 0; v < kQueryVecs && v * kLanes < brows * group; ++v) {
      for (int64_t w0 = 0; w0 < D; w0 += 32) {
        __m512i first[16], second[16], tf[16], ts[16];  // paired-order dims w0 + i, w0 + 16 + i
        for (int64_t i = 0; i < 16; ++i) {
          first[i] = _mm512_castps_si512(_mm512_div_ps(lb.o[(w0 + i) * kQueryVecs + v], lb.sum[v]));
          second[i] = _mm512_castps_si512(_mm512_div_ps(lb.o[(w0 + 16 + i) * kQueryVecs + v], lb.sum[v]));
        }
        transpose16(first, tf);
        transpose16(second, ts);
        for (int64_t i = 0; i < 16 && v * kLanes + i < brows * group; ++i) {
          const int64_t m = v * kLanes + i;
          c10::BFloat16* orow = a.out + ((b0 + m / group) * a.Hq + h * group + m % group) * D;
          const __m512i words = round_pairs(_mm512_castsi512_ps(ts[i]), _mm512_castsi512_ps(tf[i]));
          _mm512_storeu_si512(orow + w0, _mm512_permutexvar_epi16(dims, words));
        }
      }
    }
  }
}

// q [T, Hq, D] bf16 (D contiguous; rows and heads may be strided), the rows at positions
// start .. start + T - 1 of a sequence whose blocks are `table` [nb] int64 in caches
// [num_blocks, block_size, Hkv, D], bf16 or fp8_e4m3 bytes with float scales [num_blocks,
// block_size, Hkv, 1] (empty for bf16), the chunk's own K/V already written. Returns [T, Hq, D]:
// row t attends to positions 0 .. start + t.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor key_cache,
                                torch::Tensor value_cache, torch::Tensor key_scale,
                                torch::Tensor value_scale, torch::Tensor table, int64_t start,
                                double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16 &&
                        q.size(0) >= 1,
                    "prefill_attention: q must be [T, Hq, D] bfloat16 with D contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  check_caches(key_cache, value_cache, key_scale, value_scale, Hq, D, at::kBFloat16);
  const int64_t Hkv = key_cache.size(2), bs = key_cache.size(1);
  TORCH_CHECK_VALUE(D % 32 == 0 && Hq / Hkv <= kQueryLanes,
                    "prefill_attention: head_dim must be a multiple of 32, the group at most 48");
  TORCH_CHECK_VALUE(table.dim() == 1 && table.is_contiguous() && table.scalar_type() == at::kLong,
                    "prefill_attention: table must be [nb] int64");
  TORCH_CHECK_VALUE(scale > 0, "prefill_attention: scale must be positive");
  TORCH_CHECK_VALUE(start >= 0 && start + T <= table.size(0) * bs,
                    "prefill_attention: the rows lie outside the block table");
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (start + T + bs - 1) / bs; ++i) {
    TORCH_CHECK_VALUE(tp[i] >= 0 && tp[i] < key_cache.size(0),
                      "prefill_attention: block id out of range");
  }
  auto out = torch::empty({T, Hq, D}, q.options());
  // items of up to kLaneBlocks lane blocks (each key tile read once an item), as many as leave
  // each thread 4 items to share out
  const int64_t per = std::max<int64_t>(1, kQueryLanes / (Hq / Hkv)), blocks = (T + per - 1) / per;
  const int64_t rows = per * std::clamp<int64_t>(blocks * Hkv / (4 * at::get_num_threads()), 1, kLaneBlocks);
  const int64_t tiles = (T + rows - 1) / rows;
  const std::vector<c10::BFloat16> zeros(D, c10::BFloat16(0.0f));
  auto run = [&](auto element) {
    using C = decltype(element);
    const bool fp8 = std::is_same_v<C, uint8_t>;
    const PrefillArgs<C> args{q.data_ptr<c10::BFloat16>(), q.stride(0), q.stride(1),
                              reinterpret_cast<const C*>(key_cache.data_ptr()),
                              reinterpret_cast<const C*>(value_cache.data_ptr()),
                              fp8 ? key_scale.data_ptr<float>() : nullptr,
                              fp8 ? value_scale.data_ptr<float>() : nullptr,
                              tp, T, start, Hq, Hkv, D, bs, static_cast<float>(scale),
                              out.data_ptr<c10::BFloat16>()};
    // the last rows attend to the most keys: handed out first, so the threads end together
    parallel_pieces(Hkv * tiles, 4, [&](int64_t b, int64_t e) {
      PrefillScratch scratch;
      const bool amx = attention_tiles();
      for (int64_t i = b; i < e; ++i) {
        const int64_t tile = tiles - 1 - i / Hkv, r0 = tile * rows;
        prefill_item(args, i % Hkv, r0, std::min(rows, T - r0), scratch, zeros.data(), amx);
      }
      if (amx) release_attention_tiles();
    });
  };
  if (key_cache.scalar_type() == at::kByte) run(uint8_t{});
  else run(c10::BFloat16{});
  return out;
}
