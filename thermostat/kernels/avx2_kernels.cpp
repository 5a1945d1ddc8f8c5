// Thermostat's linear layers for CPUs with AVX2 but not AVX-512 BF16/VNNI (AMD Zen 2/3, Intel
// before Ice Lake): the bf16, int8 and 4-bit weight layouts of common.h, read by AVX2 + FMA code.
// The rest of a step (norms, rotary, attention) runs in PyTorch on these CPUs.
//
//   pack_vnni / linear_vnni  y = x W^T + b in bf16 (the same packing as the AVX-512 build)
//   linear_quant             y = x W^T + b with int8 / 4-bit weights, activations per q8_0 block
//   quant_rows               rows of a quantized weight (an embedding lookup), common.h's
//
// Batch invariance as in the AVX-512 build: each output is one fixed sequence of operations
// whatever the number of rows, so a row's bits never depend on the rows batched with it.
// Threads: at::parallel_for over 16- or 32-output units.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

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

// ---------------------------------------------------------------- bf16 linear
//
// Per output one float32 accumulator over K pairs in order: a 32-bit element of the packing
// holds W[n][k] (low half) and W[n][k + 1] (high half), widened to float by a shift and a mask,
// two fused multiply-adds against broadcast x[k], x[k + 1]. Tiles: up to 4 rows x one column
// block of 16 outputs (8 accumulators), K outermost within the tile.

template <int R>
inline void bf16_tile(const uint16_t* x, int64_t Kp, const uint16_t* W, int64_t KS,
                      const float* bias, c10::BFloat16* y, int64_t N, int64_t m0, int64_t nb) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* wb = W + nb * KS * 512;
  for (int64_t ks = 0; ks < KS; ++ks) {
    for (int kp = 0; kp < 16; ++kp) {
      const uint16_t* p = wb + (ks * 16 + kp) * 32;
      __m256 even[2], odd[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      const int64_t k = ks * 32 + 2 * kp;
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + (m0 + r) * Kp + k, sizeof(pair));
        const __m256 x0 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(pair << 16)));
        const __m256 x1 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(pair & 0xFFFF0000u)));
        for (int h = 0; h < 2; ++h) {
          acc[r][h] = _mm256_fmadd_ps(even[h], x0, acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(odd[h], x1, acc[r][h]);
        }
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

// y [M, N] = x [M, K] W^T (+ bias) with W packed by pack_vnni; any M >= 1, the same bits per row.
torch::Tensor linear_vnni(torch::Tensor x, torch::Tensor packed, int64_t N,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1,
                    "linear_vnni: x must be [M, K] bfloat16, M >= 1");
  check_vnni_packed(packed);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KS = packed.size(1);
  const int64_t Kp = KS * 32;
  TORCH_CHECK_VALUE(K <= Kp && K > Kp - 32 && N <= NB * 16 && N > NB * 16 - 64,
                    "linear_vnni: x or N does not match the packed weight");
  const torch::Tensor bias_f = float_bias(bias, N, NB * 16, "linear_vnni");
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const auto xpad = pad_rows(x.contiguous(), M, Kp);
  const auto* xp = reinterpret_cast<const uint16_t*>(xpad.data_ptr<c10::BFloat16>());
  const int64_t used = (N + 15) / 16;  // column blocks holding outputs (the rest is padding)
  at::parallel_for(0, used, 1, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) bf16_tile<4>(xp, Kp, wp, KS, bp, yp, N, m, nb);
      switch (M - m) {
        case 3: bf16_tile<3>(xp, Kp, wp, KS, bp, yp, N, m, nb); break;
        case 2: bf16_tile<2>(xp, Kp, wp, KS, bp, yp, N, m, nb); break;
        case 1: bf16_tile<1>(xp, Kp, wp, KS, bp, yp, N, m, nb); break;
        default: break;
      }
    }
  });
  return y;
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
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    // [q0 q1 | q2 q3] packed to bytes come out lane-interleaved; the permute puts K back in order
    const __m256i words01 = _mm256_packs_epi32(q[0], q[1]), words23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + m * Kp + k0), bytes);
    a.s[i] = d;
    a.sum[i] = hsum(s);
  }
}

// Rows [m0, m0 + R) x column block c (16 outputs) of one record (K block kb): the block's
// integer sums in registers, then added into the rows' running float sums (`sums`, [row][64]).
template <int BITS, int R>
inline void quant_block(const QuantizedActivations& a, const uint8_t* rec, int64_t KB, int64_t kb,
                        int64_t m0, int c, float* sums) {
  constexpr int64_t header = BITS == 8 ? 128 : 192;
  const int64_t Kp = KB * 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int kq = 0; kq < (BITS == 8 ? 8 : 4); ++kq) {
    const uint8_t* p = rec + header + (kq * 4 + c) * 64;
    __m256i w[2], w_abs[2], w_hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
      if (BITS == 8) {
        w[h] = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
        w_abs[h] = _mm256_sign_epi8(w[h], w[h]);
      } else {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        w[h] = _mm256_and_si256(raw, low4);
        w_hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.q.data() + (m0 + r) * Kp + kb * 32;
      int32_t quad;
      std::memcpy(&quad, xr + kq * 4, sizeof(quad));
      const __m256i xb = _mm256_set1_epi32(quad);
      if (BITS == 8) {
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(w_abs[h], _mm256_sign_epi8(xb, w[h]));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
        }
      } else {
        std::memcpy(&quad, xr + 16 + kq * 4, sizeof(quad));
        const __m256i xh = _mm256_set1_epi32(quad);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w[h], xb),
                                                 _mm256_maddubs_epi16(w_hi[h], xh));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int lane = c * 16 + h * 8;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * lane)));
    const __m256i z = BITS == 8 ? _mm256_setzero_si256()
                                : _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 128 + lane)));
    for (int r = 0; r < R; ++r) {
      const int64_t j = (m0 + r) * KB + kb;
      float* at = sums + (m0 + r) * 64 + lane;
      const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.s[j]));
      const __m256i fixed = _mm256_sub_epi32(acc[r][h], _mm256_mullo_epi32(z, _mm256_set1_epi32(a.sum[j])));
      _mm256_storeu_ps(at, _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(fixed), _mm256_loadu_ps(at)));
    }
  }
}

// Every row x column blocks [c0, c0 + C) of group g: K blocks in order, the columns and every row
// tile of a record while it is in L1.
template <int BITS, typename T>
void quant_group(const QuantizedActivations& a, int64_t M, const uint8_t* W, int64_t KB,
                 const float* bias, T* y, int64_t N, int64_t g, int c0, int C,
                 std::vector<float>& sums) {
  constexpr int64_t record = BITS == 8 ? 128 + 2048 : 192 + 1024;
  sums.assign(M * 64, 0.0f);
  float* sp = sums.data();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* rec = W + (g * KB + kb) * record;
    for (int c = c0; c < c0 + C; ++c) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) quant_block<BITS, 4>(a, rec, KB, kb, m, c, sp);
      switch (M - m) {
        case 3: quant_block<BITS, 3>(a, rec, KB, kb, m, c, sp); break;
        case 2: quant_block<BITS, 2>(a, rec, KB, kb, m, c, sp); break;
        case 1: quant_block<BITS, 1>(a, rec, KB, kb, m, c, sp); break;
        default: break;
      }
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

template <int BITS, typename T>
void linear_quant_impl(const torch::Tensor& x, const torch::Tensor& packed, const float* bias,
                       torch::Tensor& y, int64_t N) {
  const int64_t M = x.size(0), KB = packed.size(1);
  static thread_local QuantizedActivations buffer;  // the calling thread's, reused per call
  QuantizedActivations& a = buffer;  // a reference the workers below capture
  a.resize(M, KB);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M * KB, 256, [&](int64_t b, int64_t e) {
    quantize_blocks(xp, x.size(1), x.stride(0), KB, a, b, e);
  });
  const auto* wp = packed.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  const int64_t units = (N + 31) / 32;  // 32-output units holding outputs
  at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
    quant_units<BITS>(a, M, wp, KB, bias, yp, N, b, e);
  });
}

// y [M, N] = x [M, K] W^T (+ bias), W quantized (bits 8 or 4) and packed as in common.h; x in
// float32, bfloat16 or float16 (y in x's dtype). Any M >= 1, the same bits per row.
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t bits,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.stride(1) == 1,
                    "linear_quant: x must be [M, K] with unit stride, M >= 1");
  check_quant_packed(packed, bits);
  const int64_t G = packed.size(0), KB = packed.size(1), K = x.size(1);
  TORCH_CHECK_VALUE(K <= KB * 32 && K > KB * 32 - 32 && N <= G * 64 && N > G * 64 - 64,
                    "linear_quant: x or N does not match the packed weight");
  const torch::Tensor bias_f = float_bias(bias, N, G * 64, "linear_quant");
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto y = torch::empty({x.size(0), N}, x.options());
  return THERMOSTAT_DISPATCH_FLOAT(x.scalar_type(), "linear_quant", [&] {
    if (bits == 8) linear_quant_impl<8, scalar_t>(x, packed, bp, y, N);
    else linear_quant_impl<4, scalar_t>(x, packed, bp, y, N);
    return y;
  });
}

bool uses_amx() { return false; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack_vnni", &pack_vnni, "bf16 weight [N, K] -> the layout linear_vnni reads", nogil);
  m.def("linear_vnni", &linear_vnni, "x W^T + b for bf16 rows, the same bits per row at any M",
        nogil);
  m.def("uses_amx", &uses_amx, "whether linear_vnni runs on AMX tiles here (never: AVX2)");
  m.def("quant_rows", &quant_rows, "rows of an int8 / 4-bit packed weight, dequantized", nogil);
  m.def("linear_quant", &linear_quant, "x W^T + b with int8 / 4-bit weights in blocks of 32",
        nogil);
}
