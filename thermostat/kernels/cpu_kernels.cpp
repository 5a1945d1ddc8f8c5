// Thermostat's CPU kernels for the decode step (AVX-512; bf16 dot products where the CPU has them).
//
// Compiled on first use by thermostat/kernels/__init__.py for the machine it runs on
// (-march=native); the Python paths in thermostat/models stay the reference and the fallback.
//
//   rms_norm       out = x / rms(x) * w                     (fp32 math, one rounding)
//   add_rms_norm   residual += x; out = rms_norm(residual)  (the add rounds like torch's add)
//   rotary_        in-place rotary embedding, half-split layout, over a strided [T, H, D] view
//   silu_mul       SwiGLU: silu(gate) * up from the fused [T, 2I] projection
//   write_kv       new tokens' K/V (views of the qkv output) into their cache slots
//   decode_attention  one query token per sequence against its paged K/V, read in place through
//                  the block table (no gather), GQA, sliding window, fp8_e4m3 with token scales;
//                  bf16 queries with head_dim % 32 == 0 in bf16 dot products (attend_pairs)
//   prefill_attention  a chunk of one sequence's new tokens, causal over its paged bf16 K/V read
//                  in place: online softmax over key tiles (prefill_attention.h)
//   linear_vnni    y = x W^T + b in bf16, W packed once (pack_vnni): AMX tiles where the CPU has
//                  them, else bf16 dot products; one arithmetic for any batch (batch invariance)
//   linear_quant   y = x W^T + b with int8 or 4-bit weights (blocks of 32) and activations
//                  quantized per block, int8 dot products (AVX512-VNNI; from 16 rows AMX-INT8
//                  tiles where the CPU has them, the same bits); batch invariant too
//   DecodeStack    a dense Llama-family decode step through every layer in one call: the
//                  functions above in the Python forward's order (the same bits, no Python between),
//                  one team of threads through the whole step (decode_stack.h, which the AVX2
//                  build compiles too)
//
// Every function checks its inputs and raises (a Python ValueError/RuntimeError) rather than
// reading out of bounds: the entry points in torch_ops.h, which the AVX2 build compiles too.
// Threads: at::parallel_for, the linears' pieces taken by whichever thread asks first (common.h's
// parallel_pieces), for DecodeStack one OpenMP parallel region; the same OpenMP pool as torch.

#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kLanes = 16;  // floats per 512-bit register
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead weights are prefetched (see below)

// Whether the linears prefetch their weight stream in software. On AMD Zen 4 the hardware
// prefetchers alone keep a stream at memory speed, and the prefetch instructions cost 16-20% of
// a batch-1 linear (measured: int8, int4 and bf16 SmolLM2-135M-shaped layers); the AMX (Intel)
// paths keep the prefetch they were tuned with there.
inline bool prefetch_weights() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// ---------------------------------------------------------------- 16 elements <-> 16 floats

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float8_e4m3fn bytes. Moving the sign to bit 15 and exponent+mantissa to bits 7..14 gives the
// float16 whose value is the fp8 value times 2^-8 (subnormals included; NaN is never stored).
inline __m512 load16(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// 16 floats -> 16 bf16, rounded to nearest even as c10::BFloat16(float) rounds (a NaN: 0x7FC0)
inline __m256i bf16_bits(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds to nearest even too, but flushes subnormals and keeps a NaN's payload:
  // lanes of those classes (QNaN 0x01, subnormal 0x20, SNaN 0x80) take the exact path
  if (!_mm512_fpclass_ps_mask(v, 0xA1)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    return;
  }
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}

inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// ---------------------------------------------------------------- bf16 pairs
//
// A 512-bit register of bf16 pairs: dword lane i holds elements 2i (low half) and 2i + 1 (high).
// With AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake and Sapphire Rapids on) these are one
// instruction each. Without it (Intel Cascade Lake and Ice Lake, and VMs that hide the flag) they
// are emulated with the instruction's arithmetic: the two exact products added to the
// accumulator one at a time in its order (high, then low), each with one rounding, and rounding
// to bf16 to nearest-even (store16's). The instruction also flushes subnormal inputs and products
// to zero, and keeps a NaN's payload; the emulation does neither (below 2^-126, or a NaN still).

#if defined(__AVX512BF16__)
constexpr bool kBf16Hardware = true;

// acc + a.hi * b.hi + a.lo * b.lo per lane
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// words 0-15: lo's 16 floats, 16-31: hi's, each rounded to bf16
inline __m512i round_pairs(__m512 hi, __m512 lo) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
#else
constexpr bool kBf16Hardware = false;

inline __m512 high_halves(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline __m512 low_halves(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  acc = _mm512_fmadd_ps(high_halves(a), high_halves(b), acc);
  return _mm512_fmadd_ps(low_halves(a), low_halves(b), acc);
}

inline __m512i round_pairs(__m512 hi, __m512 lo) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_bits(lo)), bf16_bits(hi), 1);
}
#endif

// exp(x): 2^(x log2 e) split into an integer power (scalef) and a degree-7 Taylor polynomial of
// 2^f on [-0.5, 0.5] (relative error < 1e-8, below float rounding). Inputs below -104 give 0 and
// above 88.7 give inf, as expf does.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.8f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.540353039338161e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355814642844e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// s[0, n) <- exp(s - max s), in place; returns (max s, sum of the exps).
inline std::pair<float, float> exp_shifted(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, m, s + i));
  }
  const float top = _mm512_reduce_max_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), _mm512_set1_ps(top)));
    sum = _mm512_mask_add_ps(sum, m, sum, e);
    _mm512_mask_storeu_ps(s + i, m, e);
  }
  return {top, _mm512_reduce_add_ps(sum)};
}

// ---------------------------------------------------------------- RMSNorm

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / n + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), inv), load16(w + i)));
  }
}

// residual <- residual + x (rounded to the dtype); out <- rms_norm(residual)
template <typename T>
void add_rms_row(const T* x, T* residual, const T* w, T* out, int64_t n, float eps) {
  for (int64_t i = 0; i < n; i += kLanes) {
    store16(residual + i, _mm512_add_ps(load16(residual + i), load16(x + i)));
  }
  rms_row(residual, w, out, n, eps);
}

// ---------------------------------------------------------------- rotary

// One head v [D] rotated in place by its row's cos, sin [D] (D = 2 half).
template <typename T>
inline void rotate_head(T* v, const T* c, const T* s, int64_t half) {
  for (int64_t j = 0; j < half; j += kLanes) {
    __m512 a = load16(v + j), bb = load16(v + half + j);
    __m512 lo = _mm512_fmsub_ps(a, load16(c + j), _mm512_mul_ps(bb, load16(s + j)));
    __m512 hi = _mm512_fmadd_ps(bb, load16(c + half + j), _mm512_mul_ps(a, load16(s + half + j)));
    store16(v + j, lo);
    store16(v + half + j, hi);
  }
}

// ---------------------------------------------------------------- SwiGLU activation

// out[0, 16) = silu(gate) * up, in fp32, rounded once: exp(-gate) = 2^t as prefill attention's
// weights take it (2^f on [0, 1) by a degree-4 polynomial, relative error 3e-6, times 2^floor t
// by vscalefps: inf past 2^128, so the sigmoid's 1 / (1 + inf) = 0)
template <typename T>
inline void silu_mul_lanes(const T* gate, const T* up, T* out) {
  const __m512 g = load16(gate), u = load16(up), one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f));  // exp(-g) = 2^t
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.342668477e-02f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.224247277e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.412801981e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930448413e-01f));
  p = _mm512_fmadd_ps(p, f, one);
  const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, _mm512_scalef_ps(p, t)));
  store16(out, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
}

// ---------------------------------------------------------------- paged decode attention
//
// write_kv, the attention plan (chunks of kChunkTokens, merged in order) and the checks: common.h.

struct AttentionScratch {  // one thread's, reused across items
  std::vector<float> scores;  // [group][kChunkTokens]
  int64_t slots[kChunkTokens + kAheadTokens];  // the item's tokens' cache slots (ChunkReader)
  std::vector<__m512> qv, acc;
  std::vector<c10::BFloat16> weights, stage;  // attend_pairs: [group][kChunkTokens], fp8 rows
  std::vector<uint32_t> vpairs;               // attend_pairs: [kChunkTokens / 2][D]
};

// ---------------------------------------------------------------- decode attention, bf16 pairs
//
// A bf16 query over bf16 or fp8_e4m3 K/V whose head_dim is a multiple of 32 (attend_pairs): the
// scores and P V in bf16 dot products (vdpbf16ps: exact products, float sums), as the prefill
// kernel computes them. Scores: per 16 keys, each key's dot product as a vector of pair sums,
// the 16 reduced at once (sum16). Weights exp(s - m) (times an fp8 row's value scale) are rounded
// to bf16, as PyTorch's flash attention rounds them, and two keys' values are interleaved once
// per chunk so that one instruction adds both keys' weighted values. An fp8 row is turned into
// bf16 exactly (every e4m3 value is a bf16 value); its scale multiplies the score or the weight.

// The 16 sums of v[0..15]'s lanes, in key order: a transpose tree of adds (halves, quarters,
// pairs), then one permutation.
inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 t[8], u[4], r[2];
  for (int p = 0; p < 8; ++p) {  // lanes 0-7: v[2p]'s halves added; 8-15: v[2p + 1]'s
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  }
  for (int p = 0; p < 4; ++p) {  // 128-bit lane k: key 4p + k's four partial sums
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int p = 0; p < 2; ++p) {
    r[p] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * p], u[2 * p + 1]),
                         _mm512_unpackhi_ps(u[2 * p], u[2 * p + 1]));
  }
  const __m512 f = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  // lane 4L + e of f holds key L, 8 + L, 4 + L, 12 + L for e = 0, 1, 2, 3
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 13, 9, 5, 1, 14, 10, 6, 2, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, f);
}

// 32 float8_e4m3fn bytes as 32 bf16, exactly. A normal byte (exponent e > 0) keeps its sign,
// exponent and mantissa bits: bf16 exponent e - 7 + 127 (bias 7 -> 127), the 3 mantissa bits on
// top of bf16's 7. A subnormal one (e = 0: m 2^-9) is normal in bf16: one of 8 values by m.
inline __m512i fp8_bf16(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i magnitude = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
  const __m512i subnormals = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);  // m 2^-9, m = 0 .. 7
  const __mmask32 tiny = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8));
  const __m512i bits = _mm512_mask_permutexvar_epi16(normal, tiny, magnitude, subnormals);
  return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

// Token i's K or V row of a chunk as bf16: in place, or an fp8 row turned into bf16 in `stage`;
// its fp8 scale (1 otherwise) into `scale`.
template <typename C>
inline const c10::BFloat16* pair_row(const ChunkReader<c10::BFloat16, C>& chunk, bool keys,
                                     int64_t i, int64_t D, float& scale, c10::BFloat16* stage) {
  const C* row = chunk.row(keys, i, scale);
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    return row;
  } else {
    for (int64_t c = 0; c < D; c += 2 * kLanes) _mm512_storeu_si512(stage + c, fp8_bf16(row + c));
    return stage;
  }
}

#ifndef __AVX512BF16__
// Without AVX512-BF16 each bf16 pair is unpacked into its halves before dot_pairs' two FMAs. For
// D = 32 or 64 the group's query heads go through a key (and a value pair) together, up to 3 at a time,
// so that its halves are unpacked once for them all, not once per head: every accumulator still
// takes the same FMAs in the same order (the same bits as head by head).
constexpr int kHeadsTogether = 3;

// The 16 keys' dot products (dot_pairs' sums) with query heads qs[0 .. GN) into dots[g]
template <int DP, int GN>
inline void key_major_dots(const c10::BFloat16* const* qs, const c10::BFloat16* const* rows,
                           __m512 (*dots)[kLanes]) {
  __m512 qhigh[GN][DP], qlow[GN][DP];
  for (int g = 0; g < GN; ++g) {
    for (int p = 0; p < DP; ++p) {
      const __m512i qv = _mm512_loadu_si512(qs[g] + 32 * p);
      qhigh[g][p] = high_halves(qv), qlow[g][p] = low_halves(qv);
    }
  }
  for (int64_t j = 0; j < kLanes; ++j) {
    __m512 khigh[DP], klow[DP];
    for (int p = 0; p < DP; ++p) {
      const __m512i kv = _mm512_loadu_si512(rows[j] + 32 * p);
      khigh[p] = high_halves(kv), klow[p] = low_halves(kv);
    }
    for (int g = 0; g < GN; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int p = 0; p < DP; ++p) {
        acc = _mm512_fmadd_ps(qlow[g][p], klow[p], _mm512_fmadd_ps(qhigh[g][p], khigh[p], acc));
      }
      dots[g][j] = acc;
    }
  }
}

// P V (dot_pairs' sums) of query heads ws[0 .. GN)'s weights over the paired values into acc[g]
template <int DP, int GN>
inline void value_major_sums(const uint32_t* vpairs, const int32_t* const* ws, int64_t pairs,
                             __m512 (*acc)[2 * DP]) {
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 2 * DP; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512 vhigh[2 * DP], vlow[2 * DP];
    for (int c = 0; c < 2 * DP; ++c) {
      const __m512i vv = _mm512_loadu_si512(vpairs + p * 32 * DP + 16 * c);
      vhigh[c] = high_halves(vv), vlow[c] = low_halves(vv);
    }
    for (int g = 0; g < GN; ++g) {
      const __m512i pw = _mm512_set1_epi32(ws[g][p]);
      const __m512 whigh = high_halves(pw), wlow = low_halves(pw);
      for (int c = 0; c < 2 * DP; ++c) {
        acc[g][c] = _mm512_fmadd_ps(vlow[c], wlow, _mm512_fmadd_ps(vhigh[c], whigh, acc[g][c]));
      }
    }
  }
}
#endif

template <int DP, typename C>  // DP = D / 32
void attend_pairs(const AttentionArgs<c10::BFloat16, C>& a, AttentionPlan& plan, int64_t item,
                  AttentionScratch& s) {
  constexpr int64_t D = DP * 32;
  const ChunkReader<c10::BFloat16, C> chunk(a, plan, item, s.slots);
  const int64_t group = a.Hq / a.Hkv, b = chunk.b, h = chunk.h, n = chunk.n;
  const int64_t pairs = (n + 1) / 2;
  s.scores.resize(group * kChunkTokens);
  s.weights.resize(group * kChunkTokens);
  s.stage.resize(kLanes * D);
  s.vpairs.resize(kChunkTokens / 2 * D);
  float* scores = s.scores.data();
  // scores = scale q . k (x the key's fp8 scale), 16 keys at a time
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const c10::BFloat16* rows[kLanes];
    alignas(64) float ks[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if (i0 + j < n) {
        rows[j] = pair_row(chunk, true, i0 + j, D, ks[j], s.stage.data() + j * D);
      } else {
        rows[j] = rows[0], ks[j] = 0.0f;  // past the chunk: a score of 0, never used
      }
    }
    const __m512 kscale = _mm512_mul_ps(_mm512_load_ps(ks), _mm512_set1_ps(a.scale));
#ifndef __AVX512BF16__
    if constexpr (DP <= 2) {
      for (int64_t g0 = 0; g0 < group; g0 += kHeadsTogether) {
        const int64_t gn = std::min<int64_t>(kHeadsTogether, group - g0);
        const c10::BFloat16* qs[kHeadsTogether];
        for (int64_t g = 0; g < gn; ++g) qs[g] = a.q + b * a.q_row + (h * group + g0 + g) * a.q_head;
        __m512 dots[kHeadsTogether][kLanes];
        if (gn == 3) key_major_dots<DP, 3>(qs, rows, dots);
        else if (gn == 2) key_major_dots<DP, 2>(qs, rows, dots);
        else key_major_dots<DP, 1>(qs, rows, dots);
        for (int64_t g = 0; g < gn; ++g) {
          _mm512_storeu_ps(scores + (g0 + g) * kChunkTokens + i0, _mm512_mul_ps(sum16(dots[g]), kscale));
        }
      }
      continue;
    }
#endif
    for (int64_t g = 0; g < group; ++g) {
      const c10::BFloat16* q = a.q + b * a.q_row + (h * group + g) * a.q_head;
      __m512i qv[DP];
      for (int p = 0; p < DP; ++p) qv[p] = _mm512_loadu_si512(q + 32 * p);
      __m512 dots[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) {
        __m512 acc = _mm512_setzero_ps();
        for (int p = 0; p < DP; ++p) {
          acc = dot_pairs(acc, qv[p], _mm512_loadu_si512(rows[j] + 32 * p));
        }
        dots[j] = acc;
      }
      _mm512_storeu_ps(scores + g * kChunkTokens + i0, _mm512_mul_ps(sum16(dots), kscale));
    }
  }
  // values: keys (2p, 2p + 1)'s interleaved, dims in the paired order (dword lane l of a 16 holds
  // dim 8 (l / 4) + l % 4, of the next 16 dim 8 (l / 4) + 4 + l % 4); their fp8 scales
  alignas(64) float vs[kChunkTokens + 2 * kLanes];
  for (int64_t p = 0; p < pairs; ++p) {
    const c10::BFloat16* r0 = pair_row(chunk, false, 2 * p, D, vs[2 * p], s.stage.data());
    const c10::BFloat16* r1 = r0;
    vs[2 * p + 1] = 0.0f;  // an odd chunk's last pair: a second key of weight 0
    if (2 * p + 1 < n) r1 = pair_row(chunk, false, 2 * p + 1, D, vs[2 * p + 1], s.stage.data() + D);
    uint32_t* out = s.vpairs.data() + p * D;
    for (int c = 0; c < DP; ++c) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * c), y = _mm512_loadu_si512(r1 + 32 * c);
      _mm512_storeu_si512(out + 32 * c, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(out + 32 * c + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
  for (int64_t i = 2 * pairs; i < 2 * pairs + 2 * kLanes; ++i) vs[i] = 0.0f;
  float* part = plan.parts.data() + item * group * (D + 2);  // [g][m, l, acc...]
  const __m512i lo_dims = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi_dims = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  // head g's weights exp(s - m) x the value scale, in bf16 (pairs of keys as one dword); its m
  // and l into its part
  const auto weigh = [&](int64_t g) {
    float* sg = scores + g * kChunkTokens;
    const auto [m, l] = exp_shifted(sg, n);
    part[g * (D + 2)] = m;
    part[g * (D + 2) + 1] = l;
    c10::BFloat16* w = s.weights.data() + g * kChunkTokens;
    for (int64_t i = 0; i < 2 * pairs; i += 2 * kLanes) {
      const __mmask16 m0 = i < n ? (n - i >= kLanes ? 0xFFFF : (1u << (n - i)) - 1) : 0;
      const __mmask16 m1 = i + kLanes < n ? (n - i - kLanes >= kLanes ? 0xFFFF : (1u << (n - i - kLanes)) - 1) : 0;
      const __m512 w0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, sg + i), _mm512_loadu_ps(vs + i));
      const __m512 w1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, sg + i + kLanes), _mm512_loadu_ps(vs + i + kLanes));
      _mm512_storeu_si512(w + i, round_pairs(w1, w0));
    }
    return reinterpret_cast<const int32_t*>(w);
  };
  // head g's P V sums: its output row (normalized here when the chunk is its whole context, as
  // merge_chunks would: the same bits), else its part
  const auto finish = [&](int64_t g, const __m512* acc) {
    const bool whole = chunk.chunks == 1;
    const __m512 inv = _mm512_set1_ps(whole ? 1.0f / part[g * (D + 2) + 1] : 1.0f);
    c10::BFloat16* orow = a.out + (b * a.Hq + h * group + g) * D;
    for (int c = 0; c < DP; ++c) {
      const __m512 x = _mm512_permutex2var_ps(acc[2 * c], lo_dims, acc[2 * c + 1]);
      const __m512 y = _mm512_permutex2var_ps(acc[2 * c], hi_dims, acc[2 * c + 1]);
      if (whole) {
        store16(orow + 32 * c, _mm512_mul_ps(x, inv));
        store16(orow + 32 * c + kLanes, _mm512_mul_ps(y, inv));
      } else {
        _mm512_storeu_ps(part + g * (D + 2) + 2 + 32 * c, x);
        _mm512_storeu_ps(part + g * (D + 2) + 2 + 32 * c + kLanes, y);
      }
    }
  };
#ifndef __AVX512BF16__
  if constexpr (DP <= 2) {
    for (int64_t g0 = 0; g0 < group; g0 += kHeadsTogether) {
      const int64_t gn = std::min<int64_t>(kHeadsTogether, group - g0);
      const int32_t* ws[kHeadsTogether];
      for (int64_t g = 0; g < gn; ++g) ws[g] = weigh(g0 + g);
      __m512 acc[kHeadsTogether][2 * DP];
      if (gn == 3) value_major_sums<DP, 3>(s.vpairs.data(), ws, pairs, acc);
      else if (gn == 2) value_major_sums<DP, 2>(s.vpairs.data(), ws, pairs, acc);
      else value_major_sums<DP, 1>(s.vpairs.data(), ws, pairs, acc);
      for (int64_t g = 0; g < gn; ++g) finish(g0 + g, acc[g]);
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) {
    const int32_t* wp = weigh(g);
    __m512 acc[2 * DP];
    for (auto& x : acc) x = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i pw = _mm512_set1_epi32(wp[p]);
      const uint32_t* vp = s.vpairs.data() + p * D;
      for (int c = 0; c < 2 * DP; ++c) {
        acc[c] = dot_pairs(acc[c], _mm512_loadu_si512(vp + 16 * c), pw);
      }
    }
    finish(g, acc);
  }
}

// Item `item` of the plan: for each query head g of its KV head's group, the chunk's max score m,
// l = sum exp(s - m) and sum exp(s - m) v, into the plan's parts.
template <typename T, typename C>
void attend_chunk(const AttentionArgs<T, C>& a, AttentionPlan& plan, int64_t item,
                  AttentionScratch& s) {
  if constexpr (std::is_same_v<T, c10::BFloat16> &&
                (std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, uint8_t>)) {
    switch (a.D) {
      case 32: return attend_pairs<1>(a, plan, item, s);
      case 64: return attend_pairs<2>(a, plan, item, s);
      case 96: return attend_pairs<3>(a, plan, item, s);
      case 128: return attend_pairs<4>(a, plan, item, s);
      case 160: return attend_pairs<5>(a, plan, item, s);
      case 192: return attend_pairs<6>(a, plan, item, s);
      case 224: return attend_pairs<7>(a, plan, item, s);
      case 256: return attend_pairs<8>(a, plan, item, s);
      default: break;  // D % 32 == 16: the float path below
    }
  }
  const ChunkReader<T, C> chunk(a, plan, item, s.slots);
  const int64_t group = a.Hq / a.Hkv, D = a.D, dv = D / kLanes, b = chunk.b, h = chunk.h, n = chunk.n;
  s.qv.resize(group * dv);
  s.acc.resize(group * dv);
  s.scores.resize(group * kChunkTokens);
  float* scores = s.scores.data();
  __m512* qv = s.qv.data();
  __m512* acc = s.acc.data();
  for (int64_t g = 0; g < group; ++g) {
    const T* qrow = a.q + b * a.q_row + (h * group + g) * a.q_head;
    for (int64_t d = 0; d < dv; ++d) {
      qv[g * dv + d] = _mm512_mul_ps(load16(qrow + d * kLanes), _mm512_set1_ps(a.scale));
    }
  }
  // token i's K or V row as floats; its fp8 scale (1 otherwise)
  auto load_token = [&](bool keys, int64_t i, __m512* regs) {
    float scale;
    const C* row = chunk.row(keys, i, scale);
    for (int64_t d = 0; d < dv; ++d) regs[d] = load16(row + d * kLanes);
    return scale;
  };
  // scores = q . k for every token, read in place through the block table
  __m512 reg[16];
  for (int64_t i = 0; i < n; ++i) {
    const float ks = load_token(true, i, reg);
    for (int64_t g = 0; g < group; ++g) {
      __m512 dot = _mm512_mul_ps(qv[g * dv], reg[0]);
      for (int64_t d = 1; d < dv; ++d) dot = _mm512_fmadd_ps(qv[g * dv + d], reg[d], dot);
      scores[g * kChunkTokens + i] = _mm512_reduce_add_ps(dot) * ks;
    }
  }
  float* part = plan.parts.data() + item * group * (D + 2);  // [g][m, l, acc...]
  for (int64_t g = 0; g < group; ++g) {
    const auto [m, l] = exp_shifted(scores + g * kChunkTokens, n);
    part[g * (D + 2)] = m;
    part[g * (D + 2) + 1] = l;
    for (int64_t d = 0; d < dv; ++d) acc[g * dv + d] = _mm512_setzero_ps();
  }
  // sum exp(s_i - m) v_i
  for (int64_t i = 0; i < n; ++i) {
    const float vs = load_token(false, i, reg);
    for (int64_t g = 0; g < group; ++g) {
      __m512 p = _mm512_set1_ps(scores[g * kChunkTokens + i] * vs);
      for (int64_t d = 0; d < dv; ++d) acc[g * dv + d] = _mm512_fmadd_ps(p, reg[d], acc[g * dv + d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    if (chunk.chunks == 1) {  // the whole row: normalized here, as merge_chunks would (the same bits)
      const __m512 inv = _mm512_set1_ps(1.0f / part[g * (D + 2) + 1]);
      T* orow = a.out + (b * a.Hq + h * group + g) * D;
      for (int64_t d = 0; d < dv; ++d) store16(orow + d * kLanes, _mm512_mul_ps(acc[g * dv + d], inv));
    } else {
      for (int64_t d = 0; d < dv; ++d) _mm512_storeu_ps(part + g * (D + 2) + 2 + d * kLanes, acc[g * dv + d]);
    }
  }
}

// Output row (row b, query head qh): its KV head's chunks merged in chunk order,
// sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c with M the largest m_c. A row of one chunk
// is written by attend_chunk (acc / l: what this gives for one chunk, bit for bit).
template <typename T, typename C>
void merge_chunks(const AttentionArgs<T, C>& a, const AttentionPlan& plan, int64_t b, int64_t qh) {
  const int64_t D = a.D, dv = D / kLanes;
  const AttentionPlan::Row row = plan.row(b, qh, a.Hkv, a.Hq / a.Hkv, D);
  if (row.chunks == 1) return;  // attend_chunk wrote it
  __m512 acc[16];
  for (int64_t d = 0; d < dv; ++d) acc[d] = _mm512_setzero_ps();
  for (int64_t c = 0; c < row.chunks; ++c) {
    const float* p = row.part + c * row.stride + 2;
    const __m512 w = _mm512_set1_ps(row.weight(c));
    for (int64_t d = 0; d < dv; ++d) acc[d] = _mm512_fmadd_ps(w, _mm512_loadu_ps(p + d * kLanes), acc[d]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / row.l);
  T* orow = a.out + (b * a.Hq + qh) * D;
  for (int64_t d = 0; d < dv; ++d) store16(orow + d * kLanes, _mm512_mul_ps(acc[d], inv));
}


// ---------------------------------------------------------------- bf16 linear, VNNI layout
//
// The layout (common.h): one 64-byte row of a tile holds a K pair for 16 outputs, which is what
// both vdpbf16ps (against a broadcast pair of x) and AMX's tdpbf16ps (as its B operand) consume.
//
// Batch invariance: every output element is computed by the same sequence of operations
// whatever the number of rows M, so a row's result never depends on the rows batched with it
// (greedy output and logprobs alone equal those in a batch). One arithmetic per machine, for
// every M (decode batches and prefill alike):
//   AMX (Intel)   C tiles accumulate the K steps in order, 32-row slabs of x
//   no AMX        vdpbf16ps into one float32 accumulator per output, K pairs in order; register
//                 tiles of up to 6 rows x 4 column blocks, the weights streamed once per tile
//                 (M = 1: four streams in flight, at memory speed by the hardware prefetchers);
//                 without AVX512-BF16 its emulation, from kFloatRows rows on floats turned once

constexpr int64_t kTile = 512;           // bf16 elements in one 16 x 32 weight tile (1 KiB)
constexpr int64_t kAmxRows = 32;         // rows of x in one AMX slab

// 16 floats -> 16 outputs of row y (N columns) at column n0, masked at the end of the row
template <typename T>
inline void store_outputs(T* y, int64_t N, int64_t n0, __m512 v) {
  const int64_t left = N - n0;
  if (left <= 0) return;
  if (left >= 16) return store16(y + n0, v);
  alignas(64) T tmp[16];
  store16(tmp, v);
  std::memcpy(y + n0, tmp, sizeof(T) * std::min<int64_t>(left, 16));
}

// A tile's accumulators (+ bias) as the outputs of rows [m0, m0 + R) x blocks [nb, nb + C)
template <int R, int C>
inline void store_tile(const __m512 (&acc)[R][C], const float* bias, c10::BFloat16* y, int64_t N,
                       int64_t m0, int64_t nb) {
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      __m512 v = acc[r][c];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + (nb + c) * 16));
      store_outputs(y + (m0 + r) * N, N, (nb + c) * 16, v);
    }
  }
}

// Rows [m0, m0 + R) x column blocks [nb, nb + C): one float32 accumulator per output, every K
// pair in order.
template <int R, int C>
inline void bf16_tile(const uint16_t* x, int64_t Kp, const uint16_t* W, int64_t KS,
                      const float* bias, c10::BFloat16* y, int64_t N, int64_t m0, int64_t nb) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* B[C];
  for (int c = 0; c < C; ++c) B[c] = W + (nb + c) * KS * kTile;
  const uint16_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * Kp;
  for (int64_t kp = 0; kp < KS * 16; ++kp) {  // K pairs; tile rows are 64 bytes, consecutive
    __m512i w[C];
    for (int c = 0; c < C; ++c) {
      w[c] = _mm512_loadu_si512(B[c] + kp * 32);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr[r] + 2 * kp, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = dot_pairs(acc[r][c], xb, w[c]);
    }
  }
  store_tile<R, C>(acc, bias, y, N, m0, nb);
}

// Every row of x against column blocks [nb, nb + C): tiles of 6 rows (24 accumulators of the 32
// registers), then the rest.
template <int C>
void bf16_rows(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t KS,
               const float* bias, c10::BFloat16* y, int64_t N, int64_t nb) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) bf16_tile<6, C>(x, Kp, W, KS, bias, y, N, m, nb);
  switch (M - m) {
    case 5: bf16_tile<5, C>(x, Kp, W, KS, bias, y, N, m, nb); break;
    case 4: bf16_tile<4, C>(x, Kp, W, KS, bias, y, N, m, nb); break;
    case 3: bf16_tile<3, C>(x, Kp, W, KS, bias, y, N, m, nb); break;
    case 2: bf16_tile<2, C>(x, Kp, W, KS, bias, y, N, m, nb); break;
    case 1: bf16_tile<1, C>(x, Kp, W, KS, bias, y, N, m, nb); break;
    default: break;
  }
}

// Column blocks [nb0, nb1) of 16 outputs, four at a time. A thread's share is counted in single
// blocks so that two threads split any N evenly; an output's arithmetic is the same whichever
// tile holds it.
void bf16_blocks(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t KS,
                 const float* bias, c10::BFloat16* y, int64_t N, int64_t nb0, int64_t nb1) {
  int64_t nb = nb0;
  for (; nb + 4 <= nb1; nb += 4) bf16_rows<4>(x, M, Kp, W, KS, bias, y, N, nb);
  switch (nb1 - nb) {
    case 3: bf16_rows<3>(x, M, Kp, W, KS, bias, y, N, nb); break;
    case 2: bf16_rows<2>(x, M, Kp, W, KS, bias, y, N, nb); break;
    case 1: bf16_rows<1>(x, M, Kp, W, KS, bias, y, N, nb); break;
    default: break;
  }
}

#ifndef __AVX512BF16__
// Without AVX512-BF16, a batch of rows takes bf16_tile's arithmetic (the emulated dot_pairs: the
// high halves' product, then the low halves', one FMA each) on floats turned once: x's elements
// per call, and the halves of each quad's weights per thread, so that no pair is unpacked per
// instruction. Every output gets the same bits as from bf16_tile, so the number of rows M may
// choose the path (batch invariance holds): from kFloatRows rows, where turning a quad's weights
// costs less than the unpacking it saves.
constexpr int64_t kFloatRows = 96;

// Rows [m0, m0 + R) x the quad's C blocks: wf [pairs][C][high, low][16], xf [M][Kp].
template <int R, int C>
inline void float_tile(const float* xf, int64_t Kp, const float* wf, const float* bias,
                       c10::BFloat16* y, int64_t N, int64_t m0, int64_t nb) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kp / 2; ++kp) {
    const float* w = wf + kp * C * 32;
    __m512 high[C], low[C];
    for (int c = 0; c < C; ++c) {
      high[c] = _mm512_loadu_ps(w + c * 32);
      low[c] = _mm512_loadu_ps(w + c * 32 + 16);
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = xf + (m0 + r) * Kp + 2 * kp;
      const __m512 xhigh = _mm512_set1_ps(xr[1]), xlow = _mm512_set1_ps(xr[0]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(xlow, low[c], _mm512_fmadd_ps(xhigh, high[c], acc[r][c]));
      }
    }
  }
  store_tile<R, C>(acc, bias, y, N, m0, nb);
}

// Every row against blocks [nb, nb + C), their weights' halves turned into wf first: tiles of 6
// rows (24 accumulators, 8 weight registers; x's floats broadcast from memory), then the rest.
template <int C>
void float_rows(const float* xf, int64_t M, int64_t Kp, const uint16_t* W, int64_t KS,
                std::vector<float>& wf, const float* bias, c10::BFloat16* y, int64_t N,
                int64_t nb) {
  wf.resize(Kp / 2 * C * 32);
  for (int64_t kp = 0; kp < Kp / 2; ++kp) {
    for (int c = 0; c < C; ++c) {
      const __m512i w = _mm512_loadu_si512(W + (nb + c) * KS * kTile + kp * 32);
      _mm512_storeu_ps(&wf[(kp * C + c) * 32], high_halves(w));
      _mm512_storeu_ps(&wf[(kp * C + c) * 32 + 16], low_halves(w));
    }
  }
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) float_tile<6, C>(xf, Kp, wf.data(), bias, y, N, m, nb);
  switch (M - m) {
    case 5: float_tile<5, C>(xf, Kp, wf.data(), bias, y, N, m, nb); break;
    case 4: float_tile<4, C>(xf, Kp, wf.data(), bias, y, N, m, nb); break;
    case 3: float_tile<3, C>(xf, Kp, wf.data(), bias, y, N, m, nb); break;
    case 2: float_tile<2, C>(xf, Kp, wf.data(), bias, y, N, m, nb); break;
    case 1: float_tile<1, C>(xf, Kp, wf.data(), bias, y, N, m, nb); break;
    default: break;
  }
}

void linear_float_halves(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t NB,
                         int64_t KS, const float* bias, c10::BFloat16* y, int64_t N) {
  std::vector<float> xf(M * Kp);
  for (int64_t i = 0; i < M * Kp; i += kLanes) {
    _mm512_storeu_ps(&xf[i], load16(reinterpret_cast<const c10::BFloat16*>(x + i)));
  }
  parallel_pieces((NB + 3) / 4, 8, [&](int64_t b, int64_t e) {
    std::vector<float> wf;
    for (int64_t nb = 4 * b; nb < std::min(NB, 4 * e); nb += 4) {
      switch (std::min<int64_t>(4, NB - nb)) {
        case 4: float_rows<4>(xf.data(), M, Kp, W, KS, wf, bias, y, N, nb); break;
        case 3: float_rows<3>(xf.data(), M, Kp, W, KS, wf, bias, y, N, nb); break;
        case 2: float_rows<2>(xf.data(), M, Kp, W, KS, wf, bias, y, N, nb); break;
        default: float_rows<1>(xf.data(), M, Kp, W, KS, wf, bias, y, N, nb); break;
      }
    }
  });
}
#endif

void linear_dpbf16(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t NB,
                   int64_t KS, const float* bias, c10::BFloat16* y, int64_t N) {
#ifndef __AVX512BF16__
  if (M >= kFloatRows) return linear_float_halves(x, M, Kp, W, NB, KS, bias, y, N);
#endif
  parallel_pieces((NB + 3) / 4, 8, [&](int64_t b, int64_t e) {  // whole quads of blocks
    bf16_blocks(x, M, Kp, W, KS, bias, y, N, 4 * b, std::min(NB, 4 * e));
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The compiler does not see _tile_loadconfig read all 64 bytes (GCC dropped the stores of rows
// and colsb, and the load faulted): the barrier makes them land first.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

bool amx_permitted() {
  // Linux hands out AMX state per process on request: ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

inline void prefetch_tile(const uint16_t* tile) {
  for (int line = 0; line < 16; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetchBytes + line * 64, _MM_HINT_T0);
  }
}

// Rows [0, 16) of x (padded) against four 16-column blocks: C tiles 0-3, A tile 4, B tiles 5-7.
inline void amx_quad(const uint16_t* x, int64_t Kp, const uint16_t* W, int64_t KS, int64_t q) {
  const uint16_t* B[4];
  for (int j = 0; j < 4; ++j) B[j] = W + (4 * q + j) * KS * kTile;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t ks = 0; ks < KS; ++ks) {
    for (int j = 0; j < 4; ++j) prefetch_tile(B[j] + ks * kTile);
    _tile_loadd(4, x + ks * 32, Kp * 2);
    _tile_loadd(5, B[0] + ks * kTile, 64);
    _tile_loadd(6, B[1] + ks * kTile, 64);
    _tile_loadd(7, B[2] + ks * kTile, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, B[3] + ks * kTile, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// Rows [0, 32) of x (padded) against the 16-column blocks B0, B1: C tiles 0-3 (rows 16 (t / 2),
// block t % 2), A tiles 4-5, B 6-7.
inline void amx_pair_blocks(const uint16_t* x, int64_t Kp, const uint16_t* B0, const uint16_t* B1,
                            int64_t KS) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t ks = 0; ks < KS; ++ks) {
    prefetch_tile(B0 + ks * kTile);
    prefetch_tile(B1 + ks * kTile);
    _tile_loadd(4, x + ks * 32, Kp * 2);
    _tile_loadd(5, x + 16 * Kp + ks * 32, Kp * 2);
    _tile_loadd(6, B0 + ks * kTile, 64);
    _tile_loadd(7, B1 + ks * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

inline void amx_pair(const uint16_t* x, int64_t Kp, const uint16_t* W, int64_t KS, int64_t pr) {
  amx_pair_blocks(x, Kp, W + (2 * pr) * KS * kTile, W + (2 * pr + 1) * KS * kTile, KS);
}

inline void store_c_tile(int t, float* buf) {
  switch (t) {
    case 0: _tile_stored(0, buf, 64); break;
    case 1: _tile_stored(1, buf, 64); break;
    case 2: _tile_stored(2, buf, 64); break;
    default: _tile_stored(3, buf, 64); break;
  }
}

// y rows [m0, m0 + 16) x columns [n0, n0 + 16) from C tile t
inline void write_c_tile(int t, int64_t M, int64_t m0, int64_t N, int64_t n0, const float* bias,
                         c10::BFloat16* y) {
  alignas(64) float buf[16 * 16];
  store_c_tile(t, buf);
  const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < 16 && m0 + r < M; ++r) {
    store_outputs(y + (m0 + r) * N, N, n0, _mm512_add_ps(_mm512_load_ps(buf + r * 16), b));
  }
}

// Every tile 16 rows x 64 bytes, the one shape the bf16 tile code here uses (_tile_release after).
inline void load_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// Item i of `slabs` slabs of kAmxRows rows x `units` column units: units go by in chunks of
// `chunk`, every slab through a chunk before the next. Sized to about kAmxChunkBytes of weights,
// a chunk stays in L2 while the slabs pass (all of W per slab does not, at 1.5 MB and up), each
// weight read from memory once a call.
constexpr int64_t kAmxChunkBytes = 256 * 1024;
struct AmxUnit {
  int64_t slab, unit;
};
inline AmxUnit amx_unit(int64_t i, int64_t slabs, int64_t units, int64_t chunk) {
  const int64_t c0 = i / (slabs * chunk) * chunk, width = std::min(chunk, units - c0);
  const int64_t at = i - c0 * slabs;
  return {at / width, c0 + at % width};
}

// x padded to a multiple of 32 rows; slabs of 32 rows (16 when the slab has no more), units of
// two 16-column blocks (64 Kp bytes of weights)
void linear_amx(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t NB,
                int64_t KS, const float* bias, c10::BFloat16* y, int64_t N) {
  const int64_t slabs = (M + kAmxRows - 1) / kAmxRows, units = NB / 2;
  const int64_t chunk = std::max<int64_t>(2, kAmxChunkBytes / (64 * Kp)) / 2 * 2;  // even: quads
  parallel_pieces(slabs * units, 8, [&](int64_t b, int64_t e) {
    load_full_tiles();
    for (int64_t i = b; i < e; ++i) {
      const auto [slab, unit] = amx_unit(i, slabs, units, chunk);
      const int64_t m0 = slab * kAmxRows, rows = std::min<int64_t>(kAmxRows, M - m0);
      const uint16_t* xs = x + m0 * Kp;
      c10::BFloat16* ys = y + m0 * N;
      if (rows <= 16) {  // quads cover 4 blocks: odd units do nothing, even ones cover two pairs
        if (unit % 2) continue;
        amx_quad(xs, Kp, W, KS, unit / 2);
        for (int t = 0; t < 4; ++t) write_c_tile(t, rows, 0, N, (2 * unit + t) * 16, bias, ys);
      } else {
        amx_pair(xs, Kp, W, KS, unit);
        for (int t = 0; t < 4; ++t) write_c_tile(t, rows, (t / 2) * 16, N, (2 * unit + t % 2) * 16, bias, ys);
      }
    }
    _tile_release();
  });
}

// silu(gate) * up [M, I] from the gate/up weight [2I, K] (gate rows first, I % 16 == 0): each unit
// is a gate block and its up block over a 32-row slab, and its epilogue rounds both to bf16 as
// linear_amx writes them, then silu_mul_lanes on those: linear_vnni and silu_mul's bits, without
// the [M, 2I] product going through memory. Chunks and slabs as linear_amx's.
void swiglu_amx(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t I,
                int64_t KS, const float* bias, c10::BFloat16* out) {
  const int64_t slabs = (M + kAmxRows - 1) / kAmxRows, units = I / 16;
  const int64_t chunk = std::max<int64_t>(1, kAmxChunkBytes / (64 * Kp));
  parallel_pieces(slabs * units, 8, [&](int64_t b, int64_t e) {
    load_full_tiles();
    for (int64_t i = b; i < e; ++i) {
      const auto [slab, unit] = amx_unit(i, slabs, units, chunk);
      const int64_t m0 = slab * kAmxRows;
      amx_pair_blocks(x + m0 * Kp, Kp, W + unit * KS * kTile, W + (units + unit) * KS * kTile, KS);
      const __m512 bg = bias ? _mm512_loadu_ps(bias + unit * 16) : _mm512_setzero_ps();
      const __m512 bu = bias ? _mm512_loadu_ps(bias + I + unit * 16) : _mm512_setzero_ps();
      for (int half = 0; half < 2 && m0 + 16 * half < M; ++half) {
        alignas(64) float gate[16 * 16], up[16 * 16];
        store_c_tile(2 * half, gate);
        store_c_tile(2 * half + 1, up);
        for (int64_t r = 0, m = m0 + 16 * half; r < 16 && m < M; ++r, ++m) {
          alignas(64) c10::BFloat16 g[16], u[16];
          store16(g, _mm512_add_ps(_mm512_load_ps(gate + r * 16), bg));
          store16(u, _mm512_add_ps(_mm512_load_ps(up + r * 16), bu));
          silu_mul_lanes(g, u, out + m * I + unit * 16);
        }
      }
    }
    _tile_release();
  });
}
#else
bool amx_permitted() { return false; }
void linear_amx(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const float*,
                c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "linear_vnni: built without AMX");
}
void swiglu_amx(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const float*,
                c10::BFloat16*) {
  TORCH_CHECK(false, "linear_swiglu: built without AMX");
}
#endif

// linear_vnni's arithmetic (torch_ops.h checks): x [M, K] contiguous, padded to Kp here.
void linear_vnni_rows(const torch::Tensor& x, int64_t Kp, const uint16_t* wp, int64_t NB,
                      int64_t KS, const float* bp, c10::BFloat16* yp, int64_t N) {
  const int64_t M = x.size(0);
  if (amx_permitted()) {
    auto xpad = pad_rows(x, (M + kAmxRows - 1) / kAmxRows * kAmxRows, Kp);
    linear_amx(reinterpret_cast<const uint16_t*>(xpad.data_ptr<c10::BFloat16>()), M, Kp, wp, NB,
               KS, bp, yp, N);
  } else {
    auto xpad = pad_rows(x, M, Kp);
    linear_dpbf16(reinterpret_cast<const uint16_t*>(xpad.data_ptr<c10::BFloat16>()), M, Kp, wp,
                  NB, KS, bp, yp, N);
  }
}

// linear_swiglu's fused arithmetic where it has one (AMX): false where the caller runs
// linear_vnni, then silu_mul.
bool swiglu_rows(const torch::Tensor& x, int64_t Kp, const uint16_t* wp, int64_t KS,
                 const float* bp, c10::BFloat16* out, int64_t I) {
  if (!amx_permitted()) return false;
  const int64_t M = x.size(0);
  auto xpad = pad_rows(x, (M + kAmxRows - 1) / kAmxRows * kAmxRows, Kp);
  swiglu_amx(reinterpret_cast<const uint16_t*>(xpad.data_ptr<c10::BFloat16>()), M, Kp, wp, I, KS,
             bp, out);
  return true;
}

#include "prefill_attention.h"

// ---------------------------------------------------------------- int8 / int4 linear
//
// The layout and the arithmetic: common.h. Here vpdpbusd sums (unsigned weight byte) x (signed
// activation byte) four at a time into int32, exactly; the float part per K block subtracts
// z sum(xq) (z = 128 for int8's bytes). Tiles: 1-3 rows x a group's 64 outputs (or half of them),
// the running sums in registers (quant_group).

// Blocks [b, e) of x [M, K] (row stride `stride`; block i is row i / KB, K block i % KB) into `a`
// (sized for M x KB blocks).
template <typename T>
void quantize_blocks(const T* xp, int64_t K, int64_t stride, int64_t KB, QuantizedActivations& a,
                     int64_t b, int64_t e) {
  const int64_t Kp = KB * 32;
  for (int64_t i = b; i < e; ++i) {
    const int64_t m = i / KB, kb = i % KB, k0 = kb * 32;
    const T* row = xp + m * stride + k0;
    __m512 v[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t left = K - k0 - 16 * h;
      if (left >= 16) {
        v[h] = load16(row + 16 * h);
      } else {
        alignas(64) T tmp[16] = {};
        if (left > 0) std::memcpy(tmp, row + 16 * h, sizeof(T) * left);
        v[h] = load16(tmp);
      }
    }
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(v[0], absmask), _mm512_and_ps(v[1], absmask)));
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sums[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));  // nearest even
      sums[h] = _mm512_reduce_add_epi32(q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.data() + m * Kp + k0 + 16 * h),
                       _mm512_cvtsepi32_epi8(q));
    }
    a.s[i] = d;
    a.sum[i] = sums[0] + sums[1];
    a.low[i] = sums[0];
    a.slab_factors(m, kb, KB, d, d * static_cast<float>(a.sum[i]));  // add_mins' product
  }
}

// IQ4's 16 levels + 128 as bytes, in each 128-bit lane (vpshufb looks up within lanes)
inline __m512i iq4_bytes() {
  alignas(16) uint8_t table[16];
  for (int i = 0; i < 16; ++i) table[i] = static_cast<uint8_t>(kIq4Levels[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
}

// Rows [m0, m0 + R) x column blocks [c0, c0 + C) of a group, K block kb (one record): the integer
// dot products of the block's K quads [kq0, kq1) (4 bytes of K each; a 4-bit body's quad kq holds
// K 4kq.. and 16 + 4kq..), exact, into acc. IQ4's level indices: those of K half `half` alone
// (its nibbles, low or high), each looked up as its level + 128 (vpshufb), as int8's bytes.
template <int BITS, int R, int C, bool PREFETCH>
inline void block_dots(const QuantizedActivations& a, QuantBlock blk, int64_t KB, int64_t kb,
                       int64_t m0, int c0, int kq0, int kq1, __m512i (&acc)[R][C], int half = 0) {
  constexpr QuantLayout layout = quant_layout(BITS);
  const int64_t Kp = KB * 32;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  const uint8_t* wp = blk.rec + layout.header + blk.j * layout.body();
  for (int kq = kq0; kq < kq1; ++kq) {
    __m512i w[C], w_hi[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = wp + (kq * 4 + c0 + c) * 64;
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(p);
      if constexpr (layout.levels) {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        const __m512i index = _mm512_and_si512(half == 0 ? raw : _mm512_srli_epi16(raw, 4), low4);
        w[c] = _mm512_shuffle_epi8(iq4_bytes(), index);
      } else if (!layout.nibbles) {
        w[c] = raw;
      } else {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        w[c] = _mm512_and_si512(raw, low4);
        w_hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.q.data() + (m0 + r) * Kp + kb * 32 + (layout.levels ? 16 * half : 0);
      int32_t quad;
      std::memcpy(&quad, xr + kq * 4, sizeof(quad));
      const __m512i xb = _mm512_set1_epi32(quad);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], xb);
      if (layout.nibbles && !layout.levels) {
        std::memcpy(&quad, xr + 16 + kq * 4, sizeof(quad));
        const __m512i xh = _mm512_set1_epi32(quad);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w_hi[c], xh);
      }
    }
  }
}

// 16 of a record's scales (float16 or float32) at byte `at`, column block cc.
template <bool F32>
inline __m512 load_scales(const uint8_t* rec, int64_t at, int cc) {
  if constexpr (F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(rec + at) + cc * 16);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + at + cc * 32)));
}

// 16 of the super-block formats' float16 scales at `at` times their int8 integers at `ints`
// (block_d, block_m: exact products)
inline __m512 scaled_integers(const uint8_t* rec, int64_t at, int64_t ints, int cc) {
  const __m512i j = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + ints + cc * 16)));
  return _mm512_mul_ps(load_scales<false>(rec, at, cc), _mm512_cvtepi32_ps(j));
}

// Column block cc's d of a block (its K half `half` where the format has two), block_d's values
template <int BITS>
inline __m512 block_scales(QuantBlock blk, int half, int cc) {
  constexpr QuantLayout layout = quant_layout(BITS);
  if constexpr (layout.blocks > 1) {
    return scaled_integers(blk.rec, layout.d, layout.sc + (layout.halves ? 2 * blk.j + half : blk.j) * 64, cc);
  }
  return load_scales<layout.f32>(blk.rec, layout.d + (layout.halves ? 256 * half : 0), cc);
}

// Column block cc's m of a block (block_m's values), where the format has m
template <int BITS>
inline __m512 block_mins(QuantBlock blk, int cc) {
  constexpr QuantLayout layout = quant_layout(BITS);
  if constexpr (layout.blocks > 1) {  // -(dmin mn)
    return _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(scaled_integers(blk.rec, layout.m, layout.mn + blk.j * 64, cc)),
        _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
  }
  return load_scales<layout.f32>(blk.rec, layout.m, cc);
}

// A group's block scales d and m: read from its records, or (a super-block format's, where
// several row tiles would each multiply them out again) from `expanded`, float32 [KB][fields][64]
// (the d of each half, then m) multiplied out once for the group (the same values).
template <int BITS>
struct GroupScales {
  static constexpr QuantLayout layout = quant_layout(BITS);
  static constexpr int fields = (layout.halves ? 2 : 1) + 1;
  const uint8_t* group;
  const float* expanded;  // nullptr: from the records

  __m512 d(int64_t kb, int half, int cc) const {
    if (expanded) return _mm512_loadu_ps(expanded + (kb * fields + half) * 64 + cc * 16);
    return block_scales<BITS>(quant_block_at<BITS>(group, kb), half, cc);
  }
  __m512 m(int64_t kb, int cc) const {
    if (expanded) return _mm512_loadu_ps(expanded + (kb * fields + fields - 1) * 64 + cc * 16);
    return block_mins<BITS>(quant_block_at<BITS>(group, kb), cc);
  }
  // the group's scales of column blocks [c0, c0 + C) multiplied out into `scratch`
  static const float* expand(const uint8_t* group, int64_t KB, int c0, int C, std::vector<float>& scratch) {
    scratch.resize(KB * fields * 64);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const QuantBlock blk = quant_block_at<BITS>(group, kb);
      float* at = scratch.data() + kb * fields * 64;
      for (int cc = c0; cc < c0 + C; ++cc) {
        for (int h = 0; h < fields - 1; ++h) _mm512_storeu_ps(at + h * 64 + cc * 16, block_scales<BITS>(blk, h, cc));
        if constexpr (layout.m >= 0) _mm512_storeu_ps(at + (fields - 1) * 64 + cc * 16, block_mins<BITS>(blk, cc));
      }
    }
    return scratch.data();
  }
};

// Column block cc's running sums of row m (K blocks before kb) plus K block kb's: the integer dot
// products `dots` less z sum(xq), times d s (d: the block's scales), added in one fused step (the
// halves formats: one half's, `half` 0 for K 0-15, then 1 for K 16-31, against that half's d
// and sum(xq)).
template <int BITS>
inline __m512 add_dots(const QuantizedActivations& a, QuantBlock blk, int64_t KB, int64_t kb,
                       int64_t m, int cc, int half, __m512i dots, __m512 sums, __m512 d) {
  constexpr QuantLayout layout = quant_layout(BITS);
  const int64_t j = m * KB + kb;
  const __m512 s = _mm512_set1_ps(a.s[j]);
  if constexpr (layout.halves) {  // int8 bytes q + 128: less 128 sum(xq) of the half
    const int32_t sum = half == 0 ? a.low[j] : a.sum[j] - a.low[j];
    const __m512i fixed = _mm512_sub_epi32(dots, _mm512_set1_epi32(128 * sum));
    return _mm512_fmadd_ps(_mm512_mul_ps(d, s), _mm512_cvtepi32_ps(fixed), sums);
  }
  const __m512i z = !layout.nibbles ? _mm512_set1_epi32(128)
                    : layout.z < 0  ? _mm512_setzero_si512()
                                    : _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + layout.z + cc * 16)));
  const __m512i fixed = _mm512_sub_epi32(dots, _mm512_mullo_epi32(z, _mm512_set1_epi32(a.sum[j])));
  return _mm512_fmadd_ps(_mm512_mul_ps(d, s), _mm512_cvtepi32_ps(fixed), sums);
}

// ... then m s sum(xq) in another fused step where the format has m.
template <int BITS>
inline __m512 add_mins(const QuantizedActivations& a, int64_t KB, int64_t kb, int64_t m,
                       __m512 sums, __m512 mins) {
  const int64_t j = m * KB + kb;
  return _mm512_fmadd_ps(mins, _mm512_set1_ps(a.s[j] * static_cast<float>(a.sum[j])), sums);  // m s sum(xq)
}

// Every row x column blocks [c0, c0 + C) of group g, bias added, into y: tiles of rows whose
// running sums stay in registers through all of K (K blocks in order), each tile streaming the
// group's records (from memory for the first, from L2 for the rest). Two rows a tile (three for
// int8 at exactly three rows); measured against four-row tiles that kept the sums in L1 and read
// each record once (SmolLM2-135M-shaped layers, AMD EPYC Zen 5): int8 8 / 32 / 128 rows 8% / 31% /
// 29% faster, int4 at 128 rows 27%; one and two rows 11-26%. The same arithmetic per output
// either way, so the same bits.
template <int BITS, int C, bool PREFETCH, typename T>
void quant_group(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
                 const float* bias, T* y, int64_t N, int64_t g, int c0) {
  constexpr QuantLayout layout = quant_layout(BITS);
  const uint8_t* group = W + g * KB * layout.stride();
  GroupScales<BITS> scales{group, nullptr};
  if constexpr (layout.blocks > 1) {
    static thread_local std::vector<float> scratch;
    if (M > 2) scales.expanded = GroupScales<BITS>::expand(group, KB, c0, C, scratch);
  }
  auto tile = [&](auto rows, int64_t m0) {
    constexpr int R = decltype(rows)::value;
    __m512 run[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) run[r][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; ++kb) {
      const QuantBlock blk = quant_block_at<BITS>(group, kb);
      // the halves formats' halves one after the other (their sums would not fit the registers together)
      // (IQ4's level indices: the low nibbles are K 0-15, the high ones K 16-31)
      constexpr int halves = layout.halves ? 2 : 1, quads = (layout.nibbles ? 4 : 8) / halves;
      for (int h = 0; h < halves; ++h) {
        __m512i acc[R][C];
        if constexpr (layout.levels) {
          block_dots<BITS, R, C, PREFETCH>(a, blk, KB, kb, m0, c0, 0, 4, acc, h);
        } else {
          block_dots<BITS, R, C, PREFETCH>(a, blk, KB, kb, m0, c0, h * quads, (h + 1) * quads, acc);
        }
        __m512 d[C];
        for (int c = 0; c < C; ++c) d[c] = scales.d(kb, h, c0 + c);
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) run[r][c] = add_dots<BITS>(a, blk, KB, kb, m0 + r, c0 + c, h, acc[r][c], run[r][c], d[c]);
      }
      if constexpr (layout.m >= 0) {
        __m512 mins[C];
        for (int c = 0; c < C; ++c) mins[c] = scales.m(kb, c0 + c);
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) run[r][c] = add_mins<BITS>(a, KB, kb, m0 + r, run[r][c], mins[c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = c0; c < c0 + C; ++c) {
        __m512 v = run[r][c - c0];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + g * 64 + c * 16));
        store_outputs(y + (m0 + r) * N, N, g * 64 + c * 16, v);
      }
    }
  };
  if constexpr (BITS == 8 && C == 4) {
    if (M == 3) return tile(std::integral_constant<int, 3>(), 0);  // 29 registers
  }
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile(std::integral_constant<int, 2>(), m);
  if (m < M) tile(std::integral_constant<int, 1>(), m);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
// ---------------------------------------------------------------- int8 / 4-bit linear on AMX
//
// From kAmxQuantRows rows, where the CPU has AMX-INT8 (Intel Sapphire Rapids on): the block dot
// products of 16 rows x 16 outputs in one TDPBSSD, against the group's weights turned once into
// signed bytes laid out as B tiles. The same integers as block_dots' (the exact sum of a block's,
// or half block's, products), the float steps of add_dots and add_mins per output in K order, so
// the same bits as quant_group for every row.
//
// Each block's sums leave the tiles (a tile store) for their float steps, where bf16's AMX
// linear keeps its sums in the tiles through all of K: at 512 rows a SmolLM2-135M-shaped
// 1536 x 576 layer takes ~2x bf16's time here (VNNI: 2.7x int8, 3.5x int4), measured on a
// 2-core Xeon VM with AMX. Below 16 rows (one slab of a tile's 16) the VNNI tiles are as fast or
// faster (measured: 4 to 48 rows, layers of 1536 x 576, 576 x 1536 and 5632 x 2048).
constexpr int64_t kAmxQuantRows = 16;

// A group's column blocks [c0, c0 + C), every K block, as signed bytes [KB][C][8 K quads][64]:
// row kq of a B tile holds K 4 kq .. 4 kq + 3 for 16 outputs (the records' order; a 4-bit body's
// quads 0-3 low nibbles, then high). The value whose product with xq block_dots sums less z
// sum(xq): q for int8 (its byte less 128), q - z for 4-bit, IQ4's level. False where a 4-bit
// q - z leaves int8 (z below -112): that group takes quant_group.
template <int BITS>
bool signed_weights(const uint8_t* group, int64_t KB, int c0, int C, int8_t* out) {
  constexpr QuantLayout layout = quant_layout(BITS);
  alignas(16) int8_t levels[16];
  std::memcpy(levels, kIq4Levels, 16);
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const QuantBlock blk = quant_block_at<BITS>(group, kb);
    const uint8_t* body = blk.rec + layout.header + blk.j * layout.body();
    for (int c = 0; c < C; ++c) {
      const int cc = c0 + c;
      int8_t* dst = out + (kb * C + c) * 512;
      if constexpr (!layout.nibbles) {
        for (int kq = 0; kq < 8; ++kq) {
          const __m512i raw = _mm512_loadu_si512(body + (kq * 4 + cc) * 64);
          _mm512_storeu_si512(dst + kq * 64, _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80))));
        }
        continue;
      }
      __m512i z = _mm512_setzero_si512();
      if constexpr (layout.z >= 0) {
        const __m128i zb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + layout.z + cc * 16));
        if (_mm_cmplt_epi8_mask(zb, _mm_set1_epi8(-112))) return false;
        z = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(zb), _mm512_set1_epi32(0x01010101));
      }
      for (int kq = 0; kq < 4; ++kq) {
        const __m512i raw = _mm512_loadu_si512(body + (kq * 4 + cc) * 64);
        __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        if constexpr (layout.levels) {
          lo = _mm512_shuffle_epi8(table, lo);
          hi = _mm512_shuffle_epi8(table, hi);
        } else {
          lo = _mm512_sub_epi8(lo, z);
          hi = _mm512_sub_epi8(hi, z);
        }
        _mm512_storeu_si512(dst + kq * 64, lo);
        _mm512_storeu_si512(dst + (4 + kq) * 64, hi);
      }
    }
  }
  return true;
}

// A tiles: 16 rows x a block (or half block) of xq; B: its K quads for 16 outputs; C 0-3: int32.
template <int BITS>
void load_quant_tiles() {
  constexpr int halves = quant_layout(BITS).halves ? 2 : 1;
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = 16;
  cfg.colsb[4] = 32 / halves;
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = 8 / halves;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// Rows [0, M) x column blocks [c0, c0 + C) of group g, as quant_group computes them: slabs of 16
// rows, each K block's (each half's) sums stored from the C tiles and added into float
// accumulators `run` [16][64] by add_dots' step, then add_mins'. False (nothing written) where
// signed_weights refuses the group.
template <int BITS, int C, typename T>
bool amx_group(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
               const float* bias, T* y, int64_t N, int64_t g, int c0) {
  constexpr QuantLayout layout = quant_layout(BITS);
  constexpr int halves = layout.halves ? 2 : 1;
  const uint8_t* group = W + g * KB * layout.stride();
  static thread_local std::vector<int8_t> weights;
  weights.resize(KB * C * 512);
  if (!signed_weights<BITS>(group, KB, c0, C, weights.data())) return false;
  GroupScales<BITS> scales{group, nullptr};
  if constexpr (layout.blocks > 1) {
    static thread_local std::vector<float> scratch;
    scales.expanded = GroupScales<BITS>::expand(group, KB, c0, C, scratch);
  }
  const int64_t Kp = KB * 32;
  // Step t (K block t / halves, its half t % halves): the dot products of the slab's 16 rows and
  // the C column blocks, C tiles 0 .. C - 1 stored into sums[t % 2]; its float work a step later,
  // when the tile stores have landed (a load right after one waits for it to reach the cache)
  alignas(64) int32_t sums[2][4][256];
  alignas(64) float run[16][64];
  const int64_t steps = KB * halves;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m0);
    const float* factors = a.slabs.data() + (m0 / 16) * KB * 32;
    const int8_t* xq = a.q.data() + m0 * Kp;
    auto dots_of = [&](int64_t t) {
      const int64_t kb = t / halves, h = t % halves;
      const int8_t* w = weights.data() + kb * C * 512 + h * 256;
      int32_t(*out)[256] = sums[t % 2];
      _tile_loadd(4, xq + kb * 32 + 16 * h, Kp);
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(5, w, 64);
      _tile_loadd(6, w + 512, 64);
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 6);
      if constexpr (C == 4) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(7, w + 1024, 64);
        _tile_dpbssd(2, 4, 7);
        _tile_loadd(5, w + 1536, 64);
        _tile_dpbssd(3, 4, 5);
        _tile_stored(2, out[2], 64);
        _tile_stored(3, out[3], 64);
      }
      _tile_stored(0, out[0], 64);
      _tile_stored(1, out[1], 64);
    };
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < C; ++c) _mm512_store_ps(run[r] + 16 * c, _mm512_setzero_ps());
    dots_of(0);
    for (int64_t t = 0; t < steps; ++t) {
      if (t + 1 < steps) dots_of(t + 1);
      const int64_t kb = t / halves;
      const int h = static_cast<int>(t % halves);
      const float* s = factors + kb * 32;
      __m512 d[C];
      for (int c = 0; c < C; ++c) d[c] = scales.d(kb, h, c0 + c);
      for (int r = 0; r < 16; ++r) {  // add_dots' step
        const __m512 sr = _mm512_set1_ps(s[r]);
        for (int c = 0; c < C; ++c) {
          const __m512 dots = _mm512_cvtepi32_ps(_mm512_load_si512(sums[t % 2][c] + 16 * r));
          _mm512_store_ps(run[r] + 16 * c, _mm512_fmadd_ps(_mm512_mul_ps(d[c], sr), dots, _mm512_load_ps(run[r] + 16 * c)));
        }
      }
      if constexpr (layout.m >= 0) {  // add_mins', after the block's last half
        if (h == halves - 1) {
          __m512 mins[C];
          for (int c = 0; c < C; ++c) mins[c] = scales.m(kb, c0 + c);
          for (int r = 0; r < 16; ++r) {
            const __m512 sm = _mm512_set1_ps(s[16 + r]);
            for (int c = 0; c < C; ++c)
              _mm512_store_ps(run[r] + 16 * c, _mm512_fmadd_ps(mins[c], sm, _mm512_load_ps(run[r] + 16 * c)));
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = g * 64 + (c0 + c) * 16;
      const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 v = _mm512_load_ps(run[r] + 16 * c);
        store_outputs(y + (m0 + r) * N, N, n0, bias ? _mm512_add_ps(v, b) : v);
      }
    }
  }
  return true;
}

#else
constexpr int64_t kAmxQuantRows = 0;
template <int BITS> void load_quant_tiles() {}
template <int BITS, int C, typename T>
bool amx_group(const QuantizedActivations&, int64_t, const uint8_t*, int64_t, const float*, T*, int64_t, int64_t, int) {
  return false;
}
#endif

// Outputs [32 u0, 32 u1) for every row, in units of half a group (two column blocks): a whole group
// where the range holds one, so that two threads split any N evenly and still stream whole
// records. An output's arithmetic is the same whichever unit holds it.
template <int BITS, bool PREFETCH, typename T>
void quant_units_with(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
                      const float* bias, T* y, int64_t N, int64_t u0, int64_t u1) {
  const bool amx = kAmxQuantRows > 0 && M >= kAmxQuantRows && amx_permitted();
  if (amx) load_quant_tiles<BITS>();
  for (int64_t u = u0; u < u1;) {
    if (u % 2 == 0 && u + 2 <= u1) {
      if (!amx || !amx_group<BITS, 4>(a, M, W, KB, bias, y, N, u / 2, 0))
        quant_group<BITS, 4, PREFETCH>(a, M, W, KB, bias, y, N, u / 2, 0);
      u += 2;
    } else {
      if (!amx || !amx_group<BITS, 2>(a, M, W, KB, bias, y, N, u / 2, 2 * (u % 2)))
        quant_group<BITS, 2, PREFETCH>(a, M, W, KB, bias, y, N, u / 2, 2 * (u % 2));
      u += 1;
    }
  }
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if (amx) _tile_release();
#endif
}

template <int BITS, typename T>
void quant_units(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
                 const float* bias, T* y, int64_t N, int64_t u0, int64_t u1) {
  if (prefetch_weights()) quant_units_with<BITS, true>(a, M, W, KB, bias, y, N, u0, u1);
  else quant_units_with<BITS, false>(a, M, W, KB, bias, y, N, u0, u1);
}

#include "torch_ops.h"

}  // namespace

#include "decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_ops(m);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a chunk of one sequence's rows over its paged context",
        py::call_guard<py::gil_scoped_release>());
  m.def("uses_amx", &uses_amx, "whether linear_vnni runs on AMX tiles here");
  m.def("bf16_hardware", [] { return kBf16Hardware; },
        "whether bf16 dot products are one instruction here (AVX512-BF16), not emulated");
  def_decode_stack(m);
}
