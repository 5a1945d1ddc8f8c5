// Thermostat's CPU kernels for CPUs with AVX2 but not AVX-512 with VNNI (AMD Zen 2/3, Intel
// before Cascade Lake): the ops of cpu_kernels.cpp in 8-float registers, on the same layouts
// (common.h), through the same entry points (torch_ops.h), and DecodeStack (decode_stack.h) over
// them. The ops' contracts are cpu_kernels.cpp's:
//
//   rms_norm, add_rms_norm, rotary_, silu_mul   as there (fp32 math, one rounding)
//   write_kv                 common.h's
//   decode_attention         the same chunks of kChunkTokens merged in order (common.h's plan)
//   pack_vnni / linear_vnni  y = x W^T + b in bf16 (the same packing as the AVX-512 build)
//   linear_quant             y = x W^T + b with int8 / 4-bit weights, activations per q8_0 block
//   quant_rows               rows of a quantized weight (an embedding lookup), common.h's
//
// Batch invariance as in the AVX-512 build: each output is one fixed sequence of operations
// whatever the number of rows, so a row's bits never depend on the rows batched with it.
// Threads: 16- or 32-output units, the linears' taken by whichever thread asks first
// (common.h's parallel_pieces); DecodeStack: decode_stack.h's team.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

constexpr int64_t kLanes = 8;  // floats per 256-bit register

// How far ahead the linears prefetch their weight stream. A step's linears are small (0.1-2 MB
// each) and read from memory (the model is larger than L3): with the hardware prefetchers alone
// (AMD Zen 3, 2 threads) 120 SmolLM2-135M-shaped linears streamed at 14.6 GB/s in bf16 and
// 8.7 GB/s in int8; these distances (the best of 1-8 KiB) gave 18.8 and 10.8 GB/s.
constexpr int64_t kPrefetchBf16 = 2048, kPrefetchQuant = 4096;

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = c10::BFloat16(tmp[i]);  // nearest even, as torch rounds
}

inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// float8_e4m3fn bytes: sign to bit 15, exponent and mantissa to bits 7..14 give the float16 of
// the value times 2^-8 (as cpu_kernels.cpp's load16).
inline __m256 load8(const uint8_t* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
}

inline float hadd(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// exp(x) as cpu_kernels.cpp's exp_ps (the same polynomial), with 2^n built in the exponent bits:
// inputs are clamped to [-87, 88.8] (below, exp is under float's normal range; the result is
// then ~1e-38 instead of a subnormal or 0, where every use here adds it to 1 or a larger sum).
// the sums of 4 vectors' lanes, each added in the same order as its neighbours'
inline __m128 hadd4(const __m256 (&v)[4]) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.8f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.540353039338161e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.333355814642844e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));  // n = 128 (x > 88.7): inf, as expf
}

// s[0, n) <- exp(s - max s), in place; returns (max s, sum of the exps).
inline std::pair<float, float> exp_shifted(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  __m256 mx = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + i));
  top = hmax(mx);
  for (int64_t j = i; j < n; ++j) top = std::max(top, s[j]);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(top)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + i, e);
  }
  if (i < n) {  // the tail through a padded register (-inf: exp 0)
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? s[i + j] : -std::numeric_limits<float>::infinity();
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(tail), _mm256_set1_ps(top)));
    _mm256_store_ps(tail, _mm256_and_ps(e, _mm256_cmp_ps(_mm256_load_ps(tail), _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ)));
    sum = _mm256_add_ps(sum, _mm256_load_ps(tail));
    for (int64_t j = i; j < n; ++j) s[j] = tail[j - i];
  }
  return {top, hadd(sum)};
}

// ---------------------------------------------------------------- RMSNorm

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hadd(acc) / n + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), inv), load8(w + i)));
  }
}

// residual <- residual + x (rounded to the dtype, as `residual + x` in torch); out <- rms_norm(residual)
template <typename T>
void add_rms_row(const T* x, T* residual, const T* w, T* out, int64_t n, float eps) {
  for (int64_t i = 0; i < n; i += kLanes) {
    store8(residual + i, _mm256_add_ps(load8(residual + i), load8(x + i)));
  }
  rms_row(residual, w, out, n, eps);
}

// ---------------------------------------------------------------- rotary

// One head v [D] rotated in place by its row's cos, sin [D] (D = 2 half).
template <typename T>
inline void rotate_head(T* v, const T* c, const T* s, int64_t half) {
  for (int64_t j = 0; j < half; j += kLanes) {
    const __m256 a = load8(v + j), bb = load8(v + half + j);
    const __m256 lo = _mm256_fmsub_ps(a, load8(c + j), _mm256_mul_ps(bb, load8(s + j)));
    const __m256 hi = _mm256_fmadd_ps(bb, load8(c + half + j), _mm256_mul_ps(a, load8(s + half + j)));
    store8(v + j, lo);
    store8(v + half + j, hi);
  }
}

// ---------------------------------------------------------------- SwiGLU activation

// out[0, 8) = silu(gate) * up, in fp32, rounded once
template <typename T>
inline void silu_mul_lanes(const T* gate, const T* up, T* out) {
  const __m256 g = load8(gate), u = load8(up);
  const __m256 sig = _mm256_div_ps(
      _mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  store8(out, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
}

// ---------------------------------------------------------------- paged decode attention

struct AttentionScratch {  // one thread's, reused across items
  std::vector<float> scores;  // [group][kChunkTokens]
  int64_t slots[kChunkTokens + kAheadTokens];  // the item's tokens' cache slots (ChunkReader)
  std::vector<__m256> qv;
  std::vector<float> keys;  // 4 tokens' key rows as floats
};

// Query heads [g0, g0 + G) x vectors [d0, d0 + V) of sum exp(s_i - m) v_i over the chunk's
// tokens in order (scores holds exp(s - m)), into the plan's parts, or, for a row of one chunk,
// divided by l into the output.
template <int G, int V, typename T, typename C>
inline void value_tile(const AttentionArgs<T, C>& a, const ChunkReader<T, C>& chunk,
                       const float* scores, float* part, int64_t g0, int64_t d0) {
  const int64_t D = a.D;
  __m256 acc[G][V];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < V; ++j) acc[g][j] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < chunk.n; ++i) {
    float vs;
    const C* row = chunk.row(false, i, vs) + d0 * kLanes;
    __m256 v[V];
    for (int j = 0; j < V; ++j) v[j] = load8(row + j * kLanes);
    for (int g = 0; g < G; ++g) {
      const __m256 p = _mm256_set1_ps(scores[(g0 + g) * kChunkTokens + i] * vs);
      for (int j = 0; j < V; ++j) acc[g][j] = _mm256_fmadd_ps(p, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* gp = part + (g0 + g) * (D + 2);
    if (chunk.chunks == 1) {
      const __m256 inv = _mm256_set1_ps(1.0f / gp[1]);
      T* orow = a.out + (chunk.b * a.Hq + chunk.h * (a.Hq / a.Hkv) + g0 + g) * D + d0 * kLanes;
      for (int j = 0; j < V; ++j) store8(orow + j * kLanes, _mm256_mul_ps(acc[g][j], inv));
    } else {
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(gp + 2 + (d0 + j) * kLanes, acc[g][j]);
    }
  }
}

// Item `item` of the plan (row, KV head, chunk): for each query head of the KV head's group the
// chunk's max score m, l = sum exp(s - m) and sum exp(s - m) v (a row of one chunk: normalized
// and written out), as cpu_kernels.cpp's attend_chunk.
template <typename T, typename C>
void attend_chunk(const AttentionArgs<T, C>& a, AttentionPlan& plan, int64_t item,
                  AttentionScratch& s) {
  const ChunkReader<T, C> chunk(a, plan, item, s.slots);
  const int64_t group = a.Hq / a.Hkv, D = a.D, dv = D / kLanes, b = chunk.b, h = chunk.h, n = chunk.n;
  s.qv.resize(group * dv);
  s.scores.resize(group * kChunkTokens);
  s.keys.resize(4 * D);
  float* scores = s.scores.data();
  __m256* qv = s.qv.data();
  for (int64_t g = 0; g < group; ++g) {
    const T* qrow = a.q + b * a.q_row + (h * group + g) * a.q_head;
    for (int64_t d = 0; d < dv; ++d) qv[g * dv + d] = _mm256_mul_ps(load8(qrow + d * kLanes), _mm256_set1_ps(a.scale));
  }
  // scores = q . k by 4 tokens: their rows widened once, then for each query head 4 independent
  // dot products (one token at a time waits on each multiply-add's latency: ~2x slower)
  float* kf = s.keys.data();  // [4][D]
  alignas(16) float ks[4];
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t m = std::min<int64_t>(4, n - i0);
    for (int64_t t = 0; t < 4; ++t) {
      ks[t] = 0.0f;
      const C* row = t < m ? chunk.row(true, i0 + t, ks[t]) : nullptr;
      for (int64_t d = 0; d < dv; ++d) {
        _mm256_storeu_ps(kf + t * D + d * kLanes, row ? load8(row + d * kLanes) : _mm256_setzero_ps());
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const __m256* qg = qv + g * dv;
      __m256 dot[4];
      for (int t = 0; t < 4; ++t) dot[t] = _mm256_mul_ps(qg[0], _mm256_loadu_ps(kf + t * D));
      for (int64_t d = 1; d < dv; ++d) {
        for (int t = 0; t < 4; ++t) dot[t] = _mm256_fmadd_ps(qg[d], _mm256_loadu_ps(kf + t * D + d * kLanes), dot[t]);
      }
      alignas(16) float out[4];
      _mm_store_ps(out, _mm_mul_ps(hadd4(dot), _mm_load_ps(ks)));
      std::memcpy(scores + g * kChunkTokens + i0, out, m * sizeof(float));
    }
  }
  float* part = plan.parts.data() + item * group * (D + 2);  // [g][m, l, acc...]
  for (int64_t g = 0; g < group; ++g) {
    const auto [m, l] = exp_shifted(scores + g * kChunkTokens, n);
    part[g * (D + 2)] = m;
    part[g * (D + 2) + 1] = l;
  }
  // sum exp(s_i - m) v_i by tiles of up to 3 query heads x 4 vectors, the tile's sums in registers
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    for (int64_t d0 = 0; d0 < dv; d0 += 4) {
      const int64_t heads = std::min<int64_t>(3, group - g0);
      const bool four = dv - d0 >= 4;  // else 2 (D is a multiple of 16)
      if (heads == 3) four ? value_tile<3, 4>(a, chunk, scores, part, g0, d0) : value_tile<3, 2>(a, chunk, scores, part, g0, d0);
      else if (heads == 2) four ? value_tile<2, 4>(a, chunk, scores, part, g0, d0) : value_tile<2, 2>(a, chunk, scores, part, g0, d0);
      else four ? value_tile<1, 4>(a, chunk, scores, part, g0, d0) : value_tile<1, 2>(a, chunk, scores, part, g0, d0);
    }
  }
}

// Output row (row b, query head qh) of a row of several chunks: merged in chunk order.
template <typename T, typename C>
void merge_chunks(const AttentionArgs<T, C>& a, const AttentionPlan& plan, int64_t b, int64_t qh) {
  const int64_t D = a.D, dv = D / kLanes;
  const AttentionPlan::Row row = plan.row(b, qh, a.Hkv, a.Hq / a.Hkv, D);
  if (row.chunks == 1) return;  // attend_chunk wrote it
  __m256 acc[32];
  for (int64_t d = 0; d < dv; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t c = 0; c < row.chunks; ++c) {
    const float* p = row.part + c * row.stride + 2;
    const __m256 w = _mm256_set1_ps(row.weight(c));
    for (int64_t d = 0; d < dv; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p + d * kLanes), acc[d]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / row.l);
  T* orow = a.out + (b * a.Hq + qh) * D;
  for (int64_t d = 0; d < dv; ++d) store8(orow + d * kLanes, _mm256_mul_ps(acc[d], inv));
}

// ---------------------------------------------------------------- bf16 linear
//
// Per output one float32 accumulator over K pairs in order: a 32-bit element of the packing
// holds W[n][k] (low half) and W[n][k + 1] (high half), widened to float by a shift and a mask,
// two fused multiply-adds against x[k], x[k + 1]. x's rows are widened to float once per call
// (per piece in the decode team; exactly: a bf16 is the high half of its float), so a tile
// broadcasts them straight from memory. Tiles: up to kRows rows x one column block of 16 outputs
// (2 kRows accumulators), K outermost within the tile.

constexpr int kRows = 4;

template <int R>
inline void bf16_tile(const float* x, int64_t Kp, const uint16_t* W, int64_t KS,
                      const float* bias, c10::BFloat16* y, int64_t N, int64_t m0, int64_t nb) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* wb = W + nb * KS * 512;
  const int64_t pf = R == 1 ? kPrefetchBf16 : 0;  // a tile of more rows reads slower than memory
  for (int64_t kp = 0; kp < KS * 16; ++kp) {  // K pairs; tile rows are 64 bytes, consecutive
    const uint16_t* p = wb + kp * 32;
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(p) + pf, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * Kp + 2 * kp;
        acc[r][h] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xr), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xr + 1), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int64_t i = 0; i < 16 && nb * 16 + i < N; ++i) {
      const float v = bias ? out[i] + bias[nb * 16 + i] : out[i];
      y[(m0 + r) * N + nb * 16 + i] = c10::BFloat16(v);
    }
  }
}

// Column blocks [nb0, nb1) of 16 outputs for every row of xf [M, Kp] (x widened to float), in
// row tiles of kRows then the rest; an output's arithmetic is the same whichever tile holds it.
void float_blocks(const float* xf, int64_t M, int64_t Kp, const uint16_t* W, int64_t KS,
                  const float* bias, c10::BFloat16* y, int64_t N, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) bf16_tile<kRows>(xf, Kp, W, KS, bias, y, N, m, nb);
    switch (M - m) {
      case 4: bf16_tile<4>(xf, Kp, W, KS, bias, y, N, m, nb); break;
      case 3: bf16_tile<3>(xf, Kp, W, KS, bias, y, N, m, nb); break;
      case 2: bf16_tile<2>(xf, Kp, W, KS, bias, y, N, m, nb); break;
      case 1: bf16_tile<1>(xf, Kp, W, KS, bias, y, N, m, nb); break;
      default: break;
    }
  }
}

// The same for x [M, Kp] in bf16 bits, widened into this thread's buffer first.
void bf16_blocks(const uint16_t* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t KS,
                 const float* bias, c10::BFloat16* y, int64_t N, int64_t nb0, int64_t nb1) {
  static thread_local std::vector<float> widened;  // this thread's, reused per call
  widened.resize(M * Kp);
  float* xf = widened.data();
  for (int64_t i = 0; i < M * Kp; i += kLanes) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(xf + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  float_blocks(xf, M, Kp, W, KS, bias, y, N, nb0, nb1);
}

// linear_vnni's arithmetic (torch_ops.h checks): x [M, K] contiguous, padded to Kp and widened
// to float once here (exact).
void linear_vnni_rows(const torch::Tensor& x, int64_t Kp, const uint16_t* wp, int64_t NB,
                      int64_t KS, const float* bp, c10::BFloat16* yp, int64_t N) {
  const int64_t M = x.size(0);
  const auto xf = pad_rows(x, M, Kp).to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  const int64_t used = (N + 15) / 16;  // column blocks holding outputs (the rest is padding)
  parallel_pieces(used, 8, [&](int64_t b, int64_t e) {
    float_blocks(xp, M, Kp, wp, KS, bp, yp, N, b, e);
  });
}

// ---------------------------------------------------------------- int8 / int4 linear
//
// The integer sums without VNNI, as llama.cpp's AVX2 path forms them: int8 bytes become signed q
// (xor 0x80), vpmaddubsw multiplies |q| by xq with q's sign (pairs of products fit int16:
// 2 x 128 x 127), vpmaddwd adds the pairs into int32. 4-bit nibbles are unsigned (0..15) and
// multiply xq directly, both halves of a byte summed in int16 before widening. Either way the
// block's integer is exact, then the float step of common.h.

// Blocks [b, e) of x [M, K] (row stride `stride`; block i is row i / KB, K block i % KB) into `a`.
template <typename T>
void quantize_blocks(const T* xp, int64_t K, int64_t stride, int64_t KB, QuantizedActivations& a,
                     int64_t b, int64_t e) {
  const int64_t Kp = KB * 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = b; i < e; ++i) {
    const int64_t m = i / KB, kb = i % KB, k0 = kb * 32;
    const T* row = xp + m * stride + k0;
    __m256 v[4];
    for (int h = 0; h < 4; ++h) {
      const int64_t left = K - k0 - 8 * h;
      if (left >= 8) {
        v[h] = load8(row + 8 * h);
      } else {
        alignas(32) T tmp[8] = {};
        if (left > 0) std::memcpy(tmp, row + 8 * h, sizeof(T) * left);
        v[h] = load8(tmp);
      }
    }
    __m256 mx = _mm256_and_ps(v[0], absmask);
    for (int h = 1; h < 4; ++h) mx = _mm256_max_ps(mx, _mm256_and_ps(v[h], absmask));
    const float d = hmax(mx) / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i q[4];
    for (int h = 0; h < 4; ++h) {
      q[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(id)));  // nearest even
    }
    const __m256i low = _mm256_add_epi32(q[0], q[1]);  // K 0-15
    const __m256i s = _mm256_add_epi32(low, _mm256_add_epi32(q[2], q[3]));
    // [q0 q1 | q2 q3] packed to bytes come out lane-interleaved; the permute puts K back in order
    const __m256i words01 = _mm256_packs_epi32(q[0], q[1]), words23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + m * Kp + k0), bytes);
    a.s[i] = d;
    a.sum[i] = hsum(s);
    a.low[i] = hsum(low);
  }
}

// 8 of a record's scales (float16 or float32) at byte `at`, from output `lane`.
template <bool F32>
inline __m256 load_scales(const uint8_t* rec, int64_t at, int lane) {
  if constexpr (F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + at) + lane);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + at + 2 * lane)));
}

// 8 of the super-block formats' float16 scales at `at` times their int8 integers at `ints`
// (block_d, block_m: exact products)
inline __m256 scaled_integers(const uint8_t* rec, int64_t at, int64_t ints, int lane) {
  const __m256i j = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + ints + lane)));
  return _mm256_mul_ps(load_scales<false>(rec, at, lane), _mm256_cvtepi32_ps(j));
}

// d of outputs [lane, lane + 8) of a block (its K half `half` where the format has two)
template <int BITS>
inline __m256 block_scales(QuantBlock blk, int half, int lane) {
  constexpr QuantLayout layout = quant_layout(BITS);
  if constexpr (layout.blocks > 1) {
    return scaled_integers(blk.rec, layout.d, layout.sc + (layout.halves ? 2 * blk.j + half : blk.j) * 64, lane);
  }
  return load_scales<layout.f32>(blk.rec, layout.d + (layout.halves ? 256 * half : 0), lane);
}

// m of outputs [lane, lane + 8) of a block (block_m's values), where the format has m
template <int BITS>
inline __m256 block_mins(QuantBlock blk, int lane) {
  constexpr QuantLayout layout = quant_layout(BITS);
  if constexpr (layout.blocks > 1) {  // -(dmin mn)
    return _mm256_xor_ps(scaled_integers(blk.rec, layout.m, layout.mn + blk.j * 64, lane),
                         _mm256_set1_ps(-0.0f));
  }
  return load_scales<layout.f32>(blk.rec, layout.m, lane);
}

// A block's scales as add_half reads them: from its record, or (a super-block format's) from
// `expanded`, float32 [fields][64] (the d of each half, then m), multiplied out once for all
// of the block's rows (the same values).
template <int BITS>
struct BlockScales {
  static constexpr QuantLayout layout = quant_layout(BITS);
  static constexpr int fields = (layout.halves ? 2 : 1) + 1;
  QuantBlock blk;
  const float* expanded;  // nullptr: from the record

  __m256 d(int half, int lane) const {
    return expanded ? _mm256_loadu_ps(expanded + half * 64 + lane) : block_scales<BITS>(blk, half, lane);
  }
  __m256 m(int lane) const {
    return expanded ? _mm256_loadu_ps(expanded + (fields - 1) * 64 + lane) : block_mins<BITS>(blk, lane);
  }
};

// Row m's integer sums of half h (8 outputs) of column block c of one block (K block kb; the
// halves formats: `acc` K 0-15's, `up` K 16-31's) into the row's running float sums (`sums`,
// [row][64]): common.h's float step.
template <int BITS>
inline void add_half(const QuantizedActivations& a, const BlockScales<BITS>& scales, int64_t KB,
                     int64_t kb, int64_t m, int c, int h, __m256i acc, __m256i up, float* sums) {
  constexpr QuantLayout layout = quant_layout(BITS);
  const int64_t j = m * KB + kb;
  const int lane = c * 16 + h * 8;
  const __m256 s = _mm256_set1_ps(a.s[j]);
  const __m256 d = scales.d(0, lane);
  float* at = sums + m * 64 + lane;
  __m256 added;
  if constexpr (layout.halves) {  // the bytes' q are signed here (xor 0x80): no zero point
    const __m256 d_hi = scales.d(1, lane);
    added = _mm256_fmadd_ps(_mm256_mul_ps(d, s), _mm256_cvtepi32_ps(acc), _mm256_loadu_ps(at));
    added = _mm256_fmadd_ps(_mm256_mul_ps(d_hi, s), _mm256_cvtepi32_ps(up), added);
  } else {
    const __m256i z = layout.z < 0 ? _mm256_setzero_si256()
                                   : _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales.blk.rec + layout.z + lane)));
    const __m256i fixed = _mm256_sub_epi32(acc, _mm256_mullo_epi32(z, _mm256_set1_epi32(a.sum[j])));
    added = _mm256_fmadd_ps(_mm256_mul_ps(d, s), _mm256_cvtepi32_ps(fixed), _mm256_loadu_ps(at));
  }
  if constexpr (layout.m >= 0) {  // m s sum(xq)
    added = _mm256_fmadd_ps(scales.m(lane), _mm256_set1_ps(a.s[j] * static_cast<float>(a.sum[j])), added);
  }
  _mm256_storeu_ps(at, added);
}

// IQ4's 16 levels as signed bytes, in each 128-bit lane (vpshufb looks up within lanes)
inline __m256i iq4_levels() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
}

// The integer sums of signed weight bytes w and activation bytes x, 4 to an int32, as the int8
// path forms them: |w| times x with w's sign (pairs fit int16: 2 x 128 x 127).
inline __m256i signed_dots(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// Rows [m0, m0 + R) x column block c (16 outputs) of one record (K block kb), a half (8 outputs)
// at a time: the rows' integer sums stay in registers (both halves of 4 rows spilled), then are
// added into the rows' running float sums. The integer sums are exact: any R, the same bits.
template <int BITS, int R>
inline void quant_block(const QuantizedActivations& a, const BlockScales<BITS>& scales, int64_t KB,
                        int64_t kb, int64_t m0, int c, const int32_t* xt, float* sums) {
  constexpr QuantLayout layout = quant_layout(BITS);
  const uint8_t* body = scales.blk.rec + layout.header + scales.blk.j * layout.body();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256i acc[R], up[R];  // code 9: K 16-31 into up
    for (int r = 0; r < R; ++r) acc[r] = up[r] = _mm256_setzero_si256();
    for (int kq = 0; kq < (layout.nibbles ? 4 : 8); ++kq) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + (kq * 4 + c) * 64 + 32 * h));
      if constexpr (layout.levels) {  // low nibbles K 0-15 into acc, high ones K 16-31 into up
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        const __m256i lo = _mm256_shuffle_epi8(iq4_levels(), _mm256_and_si256(raw, low4));
        const __m256i hi = _mm256_shuffle_epi8(iq4_levels(), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_add_epi32(acc[r], signed_dots(lo, _mm256_set1_epi32(xt[kq * R + r])));
          up[r] = _mm256_add_epi32(up[r], signed_dots(hi, _mm256_set1_epi32(xt[(4 + kq) * R + r])));
        }
      } else if (!layout.nibbles) {
        const __m256i w = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
        const __m256i w_abs = _mm256_sign_epi8(w, w);
        __m256i (&into)[R] = layout.halves && kq >= 4 ? up : acc;
        for (int r = 0; r < R; ++r) {
          const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(_mm256_set1_epi32(xt[kq * R + r]), w));
          into[r] = _mm256_add_epi32(into[r], _mm256_madd_epi16(pairs, ones));
        }
      } else {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int r = 0; r < R; ++r) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xt[kq * R + r])),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xt[(4 + kq) * R + r])));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r) add_half<BITS>(a, scales, KB, kb, m0 + r, c, h, acc[r], up[r], sums);
  }
}

// One row x column blocks [c0, c0 + C) of a record: quant_block<BITS, 1>'s integer sums for each
// block (exact, so the same), but K quads outer and blocks inner, reading the record in order.
template <int BITS, int C>
inline void quant_row(const QuantizedActivations& a, const BlockScales<BITS>& scales, int64_t KB,
                      int64_t kb, int64_t m, int c0, float* sums) {
  constexpr QuantLayout layout = quant_layout(BITS);
  const uint8_t* body = scales.blk.rec + layout.header + scales.blk.j * layout.body();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xr = a.q.data() + m * KB * 32 + kb * 32;
  __m256i acc[C][2], up[C][2];  // code 9: K 16-31 into up
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = up[c][0] = up[c][1] = _mm256_setzero_si256();
  for (int kq = 0; kq < (layout.nibbles ? 4 : 8); ++kq) {
    int32_t quad;
    std::memcpy(&quad, xr + kq * 4, sizeof(quad));
    const __m256i xb = _mm256_set1_epi32(quad);
    std::memcpy(&quad, xr + (layout.nibbles ? 16 : 0) + kq * 4, sizeof(quad));
    const __m256i xh = _mm256_set1_epi32(quad);  // int4: the high nibbles' K
    __m256i (&into)[C][2] = layout.halves && kq >= 4 ? up : acc;
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = body + (kq * 4 + c0 + c) * 64;
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
        if constexpr (layout.levels) {  // low nibbles K 0-15 into acc, high ones K 16-31 into up
          const __m256i low4 = _mm256_set1_epi8(0x0F);
          const __m256i lo = _mm256_shuffle_epi8(iq4_levels(), _mm256_and_si256(raw, low4));
          const __m256i hi = _mm256_shuffle_epi8(iq4_levels(), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
          acc[c][h] = _mm256_add_epi32(acc[c][h], signed_dots(lo, xb));
          up[c][h] = _mm256_add_epi32(up[c][h], signed_dots(hi, xh));
          continue;
        }
        __m256i pairs;
        if (!layout.nibbles) {
          const __m256i w = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
          pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xb, w));
        } else {
          const __m256i low4 = _mm256_set1_epi8(0x0F);
          pairs = _mm256_add_epi16(
              _mm256_maddubs_epi16(_mm256_and_si256(raw, low4), xb),
              _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), xh));
        }
        into[c][h] = _mm256_add_epi32(into[c][h], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int h = 0; h < 2; ++h) add_half<BITS>(a, scales, KB, kb, m, c0 + c, h, acc[c][h], up[c][h], sums);
  }
}

// Every row x column blocks [c0, c0 + C) of group g: K blocks in order, the columns and every row
// tile of a record while it is in L1.
constexpr int64_t kQuantRows = 8;  // rows of a batched int8 / int4 tile

template <int BITS, typename T>
void quant_group(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
                 const float* bias, T* y, int64_t N, int64_t g, int c0, int C,
                 std::vector<float>& sums) {
  constexpr QuantLayout layout = quant_layout(BITS);
  sums.assign(M * 64, 0.0f);
  float* sp = sums.data();
  for (int64_t kb = 0; kb < KB; ++kb) {
    BlockScales<BITS> scales{quant_block_at<BITS>(W + g * KB * layout.stride(), kb), nullptr};
    const uint8_t* ahead = W + (g * KB + kb) * layout.stride();  // this block's share of bytes
    for (int64_t off = 0; off < layout.stride(); off += 64) {  // (past the tensor's end: no fault)
      _mm_prefetch(reinterpret_cast<const char*>(ahead) + kPrefetchQuant + off, _MM_HINT_T0);
    }
    alignas(32) float expanded[3 * 64];
    if constexpr (layout.blocks > 1) {  // multiplied out once for every row
      constexpr int fields = BlockScales<BITS>::fields;
      for (int lane = c0 * 16; lane < (c0 + C) * 16; lane += 8) {
        for (int h = 0; h < fields - 1; ++h) _mm256_storeu_ps(expanded + h * 64 + lane, scales.d(h, lane));
        if constexpr (layout.m >= 0) _mm256_storeu_ps(expanded + (fields - 1) * 64 + lane, scales.m(lane));
      }
      scales.expanded = expanded;
    }
    // rows [m, m + R) of x's K block kb as quads [quad][row], for broadcasts from one pointer
    int32_t xt[8 * kQuantRows];
    auto tile = [&](auto rows, int64_t m) {
      constexpr int R = decltype(rows)::value;
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q.data() + (m + r) * KB * 32 + kb * 32;
        for (int q = 0; q < 8; ++q) std::memcpy(&xt[q * R + r], xr + 4 * q, 4);
      }
      for (int c = c0; c < c0 + C; ++c) quant_block<BITS, R>(a, scales, KB, kb, m, c, xt, sp);
    };
    int64_t m = 0;
    for (; m + kQuantRows <= M; m += kQuantRows) tile(std::integral_constant<int, kQuantRows>(), m);
    for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>(), m);
    if (M - m == 3) tile(std::integral_constant<int, 3>(), m);
    if (M - m == 2) tile(std::integral_constant<int, 2>(), m);
    if (M - m == 1) {  // a row alone (every decode step of one sequence): the record in order
      if (C == 4) quant_row<BITS, 4>(a, scales, KB, kb, m, c0, sp);
      else quant_row<BITS, 2>(a, scales, KB, kb, m, c0, sp);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = c0 * 16; i < (c0 + C) * 16 && g * 64 + i < N; ++i) {
      const float v = sums[m * 64 + i];
      y[m * N + g * 64 + i] = static_cast<T>(bias ? v + bias[g * 64 + i] : v);
    }
  }
}

// Outputs [32 u0, 32 u1) for every row, in units of half a group: a whole group where the range
// holds one (its records streamed once, in order), so that two threads split any N evenly.
template <int BITS, typename T>
void quant_units(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
                 const float* bias, T* y, int64_t N, int64_t u0, int64_t u1) {
  std::vector<float> sums;
  for (int64_t u = u0; u < u1;) {
    const bool whole = u % 2 == 0 && u + 2 <= u1;
    quant_group<BITS>(a, M, W, KB, bias, y, N, u / 2, whole ? 0 : 2 * (u % 2), whole ? 4 : 2, sums);
    u += whole ? 2 : 1;
  }
}

bool amx_permitted() { return false; }

bool swiglu_rows(const torch::Tensor&, int64_t, const uint16_t*, int64_t, const float*,
                 c10::BFloat16*, int64_t) {
  return false;  // no fused SwiGLU: linear_vnni, then silu_mul
}

#include "torch_ops.h"

}  // namespace

#include "decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_ops(m);
  m.def("uses_amx", &uses_amx, "whether linear_vnni runs on AMX tiles here (never: AVX2)");
  m.def("bf16_hardware", [] { return false; }, "whether bf16 dot products are one instruction here (never: AVX2)");
  def_decode_stack(m);
}
