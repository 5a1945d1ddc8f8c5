// What both kernel builds share (cpu_kernels.cpp for AVX-512, avx2_kernels.cpp for AVX2-only
// CPUs): the weight layouts, their checks, the scalar code that reads them, and the quantizers
// that write a float weight's int8 / int4 records at load (quantize_int8, quantize_int4: AVX2,
// which both builds have; no other vector intrinsics here), and the load of a GGUF file's blocks
// (unpack_gguf, pack_records). Each build includes this once, inside its own anonymous namespace.
//
// bf16 linear, VNNI layout: weights are packed once (pack_vnni) into 16-column blocks of 32-deep
// K steps, each step a 16 x 16 x 2 tile: element [nb][ks][kp][n][j] = W[16 nb + n][32 ks + 2 kp
// + j], N padded to a multiple of 64 and K to a multiple of 32 with zeros. One 64-byte row of a
// tile holds a K pair for 16 outputs.
//
// int8 / int4 linear: weights in blocks of 32 along K, per output: int8 (llama.cpp q8_0's
// arithmetic: w = d q, q in [-128, 127]) or 4-bit (w = d (q - z), q in [0, 15], z an int8 zero
// point: GPTQ/AWQ's form, which holds q4_0 too), d float16. Packed (thermostat/models/quant.py;
// a float weight by quantize_int8 / quantize_int4) as one record per group g of 64 outputs (4
// column blocks c of 16) and K block kb, records in (g, kb) order, so a thread reads its weights
// as one sequential stream:
//   d      64 float16                      128 bytes, [c][n]
//   z      64 int8 (int4 only)             64 bytes, [c][n]
//   int8   [kq 8][c 4][n 16][4] bytes q + 128 (unsigned)                          2048 bytes
//   int4   [kq 4][c 4][n 16][4] low nibble: K 4 kq + j, high nibble: K 16 + 4 kq + j  1024 bytes
// Each record's header and body, by format code (`bits`; quant_layout):
//   code  header (each [c][n])                              body   w, per block of 32     GGUF
//   8     d f16                                   128 bytes int8   d q                    Q8_0 Q5_0
//   4     d f16, z int8                           192       int4   d (q - z)              Q4_0
//   5     d f16, z int8, m f16                    320       int4   d (q - z) + m          Q4_1
//   6     d f32, m f32                            512       int4   d q + m                Q4_K
//   9     d f32 K 0-15, d f32 K 16-31, m f32      768       int8   d_half q + m           Q5_1 Q5_K
//                                                                                         Q6_K
// (float32 scales: a K-quant's d x its 6-bit sub-block scale needs 17 bits, which float16 has
// not; code 9's two d's per block hold Q6_K's sub-blocks of 16.)
// The super-block formats hold 6's and 9's values as the file factors them, one record per 8 K
// blocks (a K-quant's 256), header then the 8 blocks' bodies (QuantLayout's blocks, sc, mn):
//   10    d, dmin f16; sc, mn int8 [8]              1280   int4   (d sc) q - dmin mn     Q4_K
//   11    d, dmin f16; sc int8 [8][2], mn int8 [8]  1792   int8   as 9, each d d sc      Q5_K Q6_K
//                                                                                         Q3_K
//   12    d f16; sc int8 [8][2]                     1152   4-bit indices of IQ4's levels  IQ4_XS
//                                                          (int8), as 9 with no m
// Their products d sc and dmin mn are exact in float32: the same values, so the same bits.
// Activations are quantized per row and K block as q8_0 does (s = max|x| / 127, xq = round(x / s)
// to nearest even). Both builds sum the integer products of a block exactly and then, per K block
// in K order, for each output: y += (d s) float(sum_k (q - z) xq) by one fused multiply-add (code
// 9: one per half, K 0-15 first), then y += m (s sum(xq)) by another where the format has m, so a
// row's result is the same bits whatever the rows batched with it (and the same on either build).

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Dispatch on the compute dtypes the engine serves.
#define THERMOSTAT_DISPATCH_FLOAT(dtype, name, ...)                         \
  [&] {                                                                     \
    switch (dtype) {                                                        \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }    \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); } \
      default: TORCH_CHECK_VALUE(false, name, ": unsupported dtype ", dtype); \
    }                                                                       \
  }()

// f(b, e) over [0, n), `pieces` pieces per thread, each piece taken by whichever thread asks
// first. at::parallel_for gives each thread one fixed share: a thread preempted in its share (the
// server's event loop, a client) holds the op until it runs again while the others wait at the
// join; here it holds one piece, and the others take the rest. For ops whose arithmetic per
// output does not depend on the split (the linears): the same bits either way.
template <typename F>
void parallel_pieces(int64_t n, int64_t pieces, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || omp_in_parallel()) {
    f(0, n);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (n + threads * pieces - 1) / (threads * pieces));
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex mu;
#pragma omp parallel num_threads(threads)
  for (int64_t b = next.fetch_add(grain); b < n; b = next.fetch_add(grain)) {
    try {
      f(b, std::min(n, b + grain));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      next.store(n);
    }
  }
  if (error) std::rethrow_exception(error);
}

torch::Tensor pack_vnni(torch::Tensor w) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
                    "pack_vnni: weight must be [N, K] bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t Np = (N + 63) / 64 * 64, Kp = (K + 31) / 32 * 32;
  auto padded = torch::zeros({Np, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({Np / 16, 16, Kp / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// x [M, K] -> [Mp, Kp] zero-padded copy (tiles and K pairs read whole 32-element steps)
torch::Tensor pad_rows(const torch::Tensor& x, int64_t Mp, int64_t Kp) {
  if (x.size(0) == Mp && x.size(1) == Kp) return x;
  auto out = torch::zeros({Mp, Kp}, x.options());
  out.narrow(0, 0, x.size(0)).narrow(1, 0, x.size(1)).copy_(x);
  return out;
}

torch::Tensor float_bias(const c10::optional<torch::Tensor>& bias, int64_t N, int64_t Np,
                         const char* name) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK_VALUE(bias->numel() == N, name, ": bias must be [N]");
  return pad_rows(bias->to(at::kFloat).contiguous().view({1, N}), 1, Np);
}

void check_vnni_packed(const torch::Tensor& packed) {
  TORCH_CHECK_VALUE(packed.dim() == 5 && packed.is_contiguous() && packed.size(2) == 16 &&
                        packed.size(3) == 16 && packed.size(4) == 2 &&
                        packed.scalar_type() == at::kBFloat16 && packed.size(0) % 4 == 0,
                    "linear_vnni: weight must come from pack_vnni");
}

// IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl), named by a 4-bit index
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

struct QuantLayout {
  int64_t header, record;  // bytes of a record's scales (d, z, m) and of a whole record
  bool nibbles;            // 4-bit body (else int8, stored q + 128)
  int64_t d, z, m;         // offsets of d, z and m in the header (-1: none)
  bool f32;                // d and m float32 (else float16)
  bool halves;             // two d per block: K 0-15 at d (or sc), K 16-31 at d + 256 (sc + 64)
  int64_t blocks = 1;      // K blocks a record holds: 8 for the super-block formats (10, 11)
  int64_t sc = -1, mn = -1;  // those formats' int8 scales [block][(half)][64] and minimums
                             // [block][64]; d and m are then the super-block's d and dmin
  bool levels = false;       // 4-bit indices of IQ4's 16 int8 levels (kIq4Levels), run as int8
  constexpr int64_t body() const { return nibbles ? 1024 : 2048; }  // one K block's weights
  constexpr int64_t stride() const { return record / blocks; }      // bytes per K block
};

// The table above.
constexpr QuantLayout quant_layout(int bits) {
  switch (bits) {
    case 8: return {128, 128 + 2048, false, 0, -1, -1, false, false};
    case 4: return {192, 192 + 1024, true, 0, 128, -1, false, false};
    case 5: return {320, 320 + 1024, true, 0, 128, 192, false, false};
    case 6: return {512, 512 + 1024, true, 0, -1, 256, true, false};
    case 10: return {1280, 1280 + 8 * 1024, true, 0, -1, 128, false, false, 8, 256, 768};
    case 11: return {1792, 1792 + 8 * 2048, false, 0, -1, 128, false, true, 8, 256, 1280};
    case 12: return {1152, 1152 + 8 * 1024, true, 0, -1, -1, false, true, 8, 128, -1, true};
    default: return {768, 768 + 2048, false, 0, -1, 512, true, true};  // 9
  }
}

constexpr bool valid_bits(int64_t bits) {
  return bits == 8 || bits == 4 || bits == 5 || bits == 6 || bits == 9 || (bits >= 10 && bits <= 12);
}

// K block kb of a group's records (`group`: its first byte): the record holding it and the
// block's place there (0 but in the super-block formats).
struct QuantBlock {
  const uint8_t* rec;
  int j;
};

inline QuantBlock block_at(const QuantLayout& L, const uint8_t* group, int64_t kb) {
  return {group + kb / L.blocks * L.record, static_cast<int>(kb % L.blocks)};
}

template <int BITS>
inline QuantBlock quant_block_at(const uint8_t* group, int64_t kb) {
  constexpr QuantLayout layout = quant_layout(BITS);
  return block_at(layout, group, kb);
}

// Output `lane`'s d (K half `half` of the halves formats) and m (0 where the format has none) of
// a block, in float32, as the kernels compute them: a super-block format's d sc and -(dmin mn),
// each product exact (float16 times an int8), so the same values as formats 6 and 9
// store.
inline float block_d(const QuantLayout& L, QuantBlock b, int half, int64_t lane) {
  if (L.blocks > 1) {
    const int8_t sc = static_cast<int8_t>(b.rec[L.sc + ((L.halves ? 2 * b.j + half : b.j) * 64) + lane]);
    return static_cast<float>(reinterpret_cast<const c10::Half*>(b.rec + L.d)[lane]) * static_cast<float>(sc);
  }
  const int64_t at = L.d + (L.halves ? 256 * half : 0);
  return L.f32 ? reinterpret_cast<const float*>(b.rec + at)[lane]
               : static_cast<float>(reinterpret_cast<const c10::Half*>(b.rec + at)[lane]);
}

inline float block_m(const QuantLayout& L, QuantBlock b, int64_t lane) {
  if (L.m < 0) return 0.0f;
  if (L.blocks > 1) {
    const int8_t mn = static_cast<int8_t>(b.rec[L.mn + b.j * 64 + lane]);
    return -(static_cast<float>(reinterpret_cast<const c10::Half*>(b.rec + L.m)[lane]) * static_cast<float>(mn));
  }
  return L.f32 ? reinterpret_cast<const float*>(b.rec + L.m)[lane]
               : static_cast<float>(reinterpret_cast<const c10::Half*>(b.rec + L.m)[lane]);
}

// f(std::integral_constant<int, BITS>()) for the format code `bits` (checked before).
template <typename F>
void with_quant_format(int64_t bits, const F& f) {
  switch (bits) {
    case 8: f(std::integral_constant<int, 8>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 10: f(std::integral_constant<int, 10>()); break;
    case 11: f(std::integral_constant<int, 11>()); break;
    case 12: f(std::integral_constant<int, 12>()); break;
    default: f(std::integral_constant<int, 9>()); break;
  }
}

struct QuantizedActivations {
  std::vector<int8_t> q;     // [M, Kp]
  std::vector<float> s;      // [M, KB]: the block's scale
  std::vector<int32_t> sum;  // [M, KB]: sum of the block's q
  std::vector<int32_t> low;  // [M, KB]: sum of its first 16 q (code 9's halves)

  // For the AVX-512 build's AMX path, by slab of 16 rows: [M / 16][KB][2][16], each row's s,
  // then s sum(q), of each block
  std::vector<float> slabs;

  // q and slabs hold whole slabs of 16 rows: an AMX tile reads 16 rows, and those past M (zeros,
  // or what an earlier call left: finite values) give outputs that are never stored.
  void resize(int64_t M, int64_t KB) {
    const int64_t Mp = (M + 15) / 16 * 16;
    q.resize(Mp * KB * 32);
    s.resize(M * KB);
    sum.resize(M * KB);
    low.resize(M * KB);
    slabs.resize(Mp * KB * 2);
  }

  void slab_factors(int64_t m, int64_t kb, int64_t KB, float scale, float scaled_sum) {
    float* at = slabs.data() + ((m / 16) * KB + kb) * 32 + m % 16;
    at[0] = scale;
    at[16] = scaled_sum;
  }
};

void check_quant_packed(const torch::Tensor& packed, int64_t bits) {
  TORCH_CHECK_VALUE(valid_bits(bits), "linear_quant: bits must be 8, 4, 5, 6, 9, 10, 11 or 12");
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() &&
                        packed.scalar_type() == at::kByte &&
                        packed.size(2) == quant_layout(static_cast<int>(bits)).stride() &&
                        packed.size(1) % quant_layout(static_cast<int>(bits)).blocks == 0,
                    "linear_quant: weight must be packed int", bits);
}

// Rows `ids` [T] of a weight packed as above, dequantized to `dtype` [T, k] (an embedding
// lookup): w = float(q - z) * float(d) (+ m), rounded once, as QuantizedWeight.rows computes it.
torch::Tensor quant_rows(torch::Tensor packed, torch::Tensor ids, int64_t n, int64_t k,
                         int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(valid_bits(bits), "quant_rows: bits must be 8, 4, 5, 6, 9, 10, 11 or 12");
  const QuantLayout layout = quant_layout(static_cast<int>(bits));
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() &&
                        packed.scalar_type() == at::kByte && packed.size(2) == layout.stride() &&
                        packed.size(1) % layout.blocks == 0,
                    "quant_rows: weight must be packed int", bits);
  const int64_t KB = packed.size(1);
  TORCH_CHECK_VALUE(k <= KB * 32 && k > KB * 32 - 32 && n <= packed.size(0) * 64,
                    "quant_rows: n or k does not match the packed weight");
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == at::kLong,
                    "quant_rows: ids must be [T] int64");
  const int64_t T = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(ip[t] >= 0 && ip[t] < n, "quant_rows: id out of range");
  }
  auto out = torch::empty({T, k}, packed.options().dtype(dtype));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  THERMOSTAT_DISPATCH_FLOAT(dtype, "quant_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t g = ip[t] / 64, lane = ip[t] % 64, c = lane / 16, j = lane % 16;
      for (int64_t kb = 0; kb < KB; ++kb) {
        const QuantBlock b = block_at(layout, wp + g * KB * layout.stride(), kb);
        const uint8_t* body = b.rec + layout.header + b.j * layout.body();
        const float z = layout.nibbles && !layout.levels
                            ? (layout.z < 0 ? 0.0f : static_cast<float>(static_cast<int8_t>(b.rec[layout.z + lane])))
                            : 128.0f;
        const float m = block_m(layout, b, lane);
        for (int64_t i = 0; i < 32 && kb * 32 + i < k; ++i) {
          const float d = block_d(layout, b, i >= 16 ? 1 : 0, lane);
          const int64_t kq = layout.nibbles ? (i % 16) / 4 : i / 4, part = i % 4;
          const uint8_t byte = body[((kq * 4 + c) * 16 + j) * 4 + part];
          int q = layout.nibbles ? (i < 16 ? byte & 15 : byte >> 4) : byte;
          if (layout.levels) q = kIq4Levels[q] + 128;
          op[t * k + kb * 32 + i] = static_cast<scalar_t>(std::fma(static_cast<float>(q) - z, d, m));
        }
      }
    }
  });
  return out;
}

// Whether every value of a block of 32 is step * j for integers j the format holds (|value / step
// - j| <= 1e-3; int8: j in [-128, 127]; affine int4: max j - min j <= 15, |min j| <= 127).
inline bool on_grid(const float* v, float step, bool affine) {
  float lo = INFINITY, hi = -INFINITY;
  for (int i = 0; i < 32; ++i) {
    const float ratio = v[i] / step, j = std::nearbyint(ratio);  // half to even, as torch.round
    if (!(std::fabs(ratio - j) <= 1e-3f)) return false;
    lo = std::min(lo, j);
    hi = std::max(hi, j);
  }
  return affine ? hi - lo <= 15 && std::fabs(lo) <= 127 : lo >= -128 && hi <= 127;
}

// blocks [B, 32] float32 -> [B]: quant.grid_step, the step of the integer grid each block lies on
// (0 where none): the smallest gap or nonzero |value|, or that / 2, 3 or 4, the first that fits.
// The same float operations per block, ~5x faster than the tensor version (135M weights: 2.0 vs
// 11.3 s on a 2-core EPYC), which quantizing at load runs over every weight.
torch::Tensor grid_steps(torch::Tensor blocks, bool affine) {
  TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.size(1) == 32 && blocks.is_contiguous() &&
                        blocks.scalar_type() == at::kFloat,
                    "grid_steps: blocks must be [B, 32] float32, contiguous");
  const int64_t B = blocks.size(0);
  auto out = torch::empty({B}, blocks.options());
  const float* bp = blocks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* v = bp + i * 32;
      float sorted[32];
      std::memcpy(sorted, v, sizeof(sorted));
      op[i] = 0.0f;
      if (!std::all_of(sorted, sorted + 32, [](float x) { return std::isfinite(x); })) continue;
      std::sort(sorted, sorted + 32);
      float smallest = INFINITY;
      for (int k = 0; k < 32; ++k) {
        if (k > 0 && sorted[k] - sorted[k - 1] > 0) smallest = std::min(smallest, sorted[k] - sorted[k - 1]);
        if (sorted[k] != 0) smallest = std::min(smallest, std::fabs(sorted[k]));
      }
      if (!std::isfinite(smallest)) continue;  // every value 0
      for (const float divisor : {1.0f, 2.0f, 3.0f, 4.0f}) {
        const float step = divisor == 1.0f ? smallest : smallest / divisor;
        if (on_grid(v, step, affine)) {
          op[i] = step;
          break;
        }
      }
    }
  });
  return out;
}

// 8 values from p (float32, bfloat16 or float16) as floats, exactly (the AVX2 build's loads too)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A float weight [N, K] (float32, bfloat16 or float16, contiguous) into records [N / 64, K / 32,
// kRecord] of linear_quant's layout, one pass: for each record (64 outputs x a block of 32 along
// K) and each of its outputs i, `row(record, i, v, width)` gets the output's 32 weights as floats
// (zeros past N and K; `width` of them real) and writes its scales and its bytes, byte (kq x 4 +
// c) x 64 + n x 4 + j of the body for output i = 16 c + n (`body_of`).
template <int64_t kRecord, typename Row>
torch::Tensor quantized_records(const torch::Tensor& w, const char* name, Row&& row) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.is_contiguous() && w.size(0) > 0 && w.size(1) > 0, name,
                    ": weight must be [N, K], contiguous");
  const int64_t N = w.size(0), K = w.size(1), G = (N + 63) / 64, KB = (K + 31) / 32;
  auto out = torch::empty({G, KB, kRecord}, w.options().dtype(at::kByte));
  uint8_t* op = out.data_ptr<uint8_t>();
  THERMOSTAT_DISPATCH_FLOAT(w.scalar_type(), name, [&] {
    const scalar_t* wp = w.data_ptr<scalar_t>();
    at::parallel_for(0, G * KB, 64, [&](int64_t b, int64_t e) {
      alignas(32) scalar_t staged[32];
      for (int64_t u = b; u < e; ++u) {
        const int64_t g = u / KB, k0 = (u % KB) * 32, width = std::min<int64_t>(32, K - k0);
        for (int64_t i = 0; i < 64; ++i) {
          const bool real = g * 64 + i < N;
          const scalar_t* weights = real ? wp + (g * 64 + i) * K + k0 : staged;
          if (!real || width < 32) {  // padding: zeros past the weight
            for (int64_t t = 0; t < 32; ++t) {
              staged[t] = real && t < width ? weights[t] : scalar_t(0.0f);
            }
            weights = staged;
          }
          __m256 v[4];
          for (int c = 0; c < 4; ++c) v[c] = load8(weights + 8 * c);
          row(op + u * kRecord, i, v, width);
        }
      }
    });
  });
  return out;
}

inline uint8_t* body_of(uint8_t* record, int64_t header, int64_t i) {
  return record + header + (i / 16) * 64 + (i % 16) * 4;
}

inline float horizontal(__m256 x, bool most) {  // the largest (or least) of x's 8 lanes
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  return most ? *std::max_element(lanes, lanes + 8) : *std::min_element(lanes, lanes + 8);
}

// round(v x inv) (+ z), half to even, clamped to [lo, hi], as int32 q[32] (+ `offset`)
inline void rounded(const __m256 (&v)[4], float inv, float z, float lo, float hi, int32_t offset,
                    int32_t (&q)[32]) {
  for (int c = 0; c < 4; ++c) {
    const __m256 r = _mm256_add_ps(_mm256_round_ps(_mm256_mul_ps(v[c], _mm256_set1_ps(inv)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                   _mm256_set1_ps(z));
    const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * c),
                        _mm256_add_epi32(_mm256_cvtps_epi32(clamped), _mm256_set1_epi32(offset)));
  }
}

// A float weight in int8 as quant.quantize_int8 and QuantizedWeight.pack make it where no block
// lies on an integer grid (a float checkpoint's): per output and block of 32 along K, d = max|w|
// / 127 rounded to float16, q = round(w x (1 / d)) half to even (d 0: q 0), clamped to [-128,
// 127]; records of 128 + 2048 bytes (the 64 outputs' d, then q + 128). The same float operations
// as the tensor code (AVX2, which both builds have).
torch::Tensor quantize_int8(torch::Tensor w) {
  return quantized_records<128 + 2048>(w, "quantize_int8", [](uint8_t* record, int64_t i,
                                                              const __m256 (&v)[4], int64_t) {
    __m256 top = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[c]));
    const c10::Half scale(horizontal(top, true) / 127.0f);
    const float inv = static_cast<float>(scale) > 0 ? 1.0f / static_cast<float>(scale) : 0.0f;
    reinterpret_cast<c10::Half*>(record)[i] = scale;
    alignas(32) int32_t q[32];
    rounded(v, inv, 0.0f, -128.0f, 127.0f, 128, q);
    uint8_t* body = body_of(record, 128, i);
    for (int t = 0; t < 32; ++t) body[(t / 4) * 256 + t % 4] = static_cast<uint8_t>(q[t]);
  });
}

// A float weight in int4 as quant.quantize_int4 and QuantizedWeight.pack (bits 4) make it where
// no block lies on a grid or on the minimum form: per output and block of 32, d = (max - min) /
// 15 rounded to float16 and z = round(-min / d) (d 0: 1), or, where z leaves [-128, 127], d =
// max|w| / 7 rounded to float16 and z = 8; q = round(w x (1 / d)) + z clamped to [0, 15].
// Records of 192 + 1024 bytes: the 64 outputs' d (float16) and z (int8), then bytes holding K 4
// kq + j (low nibble) and 16 + 4 kq + j (high); padding q 0. The tensor code's float operations.
torch::Tensor quantize_int4(torch::Tensor w) {
  return quantized_records<192 + 1024>(w, "quantize_int4", [](uint8_t* record, int64_t i,
                                                              const __m256 (&v)[4], int64_t width) {
    __m256 least = _mm256_set1_ps(INFINITY), most = _mm256_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
      least = _mm256_min_ps(least, v[c]);
      most = _mm256_max_ps(most, v[c]);
    }
    const float lo = horizontal(least, false), hi = horizontal(most, true);
    float span = static_cast<float>(c10::Half((hi - lo) / 15.0f));
    float zp = std::nearbyint(-lo / (span > 0 ? span : 1.0f));
    if (zp < -128 || zp > 127) {  // far from 0: symmetric
      span = static_cast<float>(c10::Half(std::max(std::fabs(lo), std::fabs(hi)) / 7.0f));
      zp = 8.0f;
    }
    const float inv = span > 0 ? 1.0f / span : 0.0f;
    reinterpret_cast<c10::Half*>(record)[i] = c10::Half(span);
    reinterpret_cast<int8_t*>(record + 128)[i] = static_cast<int8_t>(zp);
    alignas(32) int32_t q[32];
    rounded(v, inv, zp, 0.0f, 15.0f, 0, q);
    std::fill(q + width, q + 32, 0);  // K's padding holds q 0, as pack writes it
    uint8_t* body = body_of(record, 192, i);
    for (int t = 0; t < 16; ++t) {
      body[(t / 4) * 256 + t % 4] = static_cast<uint8_t>(q[t] | (q[16 + t] << 4));
    }
  });
}

// IQ4's level indices by the level's byte (16: no level)
struct LevelIndices {
  uint8_t of[256];
  constexpr LevelIndices() : of() {
    for (int v = 0; v < 256; ++v) of[v] = 16;
    for (int i = 0; i < 16; ++i) of[static_cast<uint8_t>(kIq4Levels[i])] = static_cast<uint8_t>(i);
  }
};
constexpr LevelIndices kLevelIndices;

// The integer j with d == scale j to the bit (scale j negated: `negated`), j in [-128, 127]
// (Q6_K's scales take all of int8), for a super-block format's scales (scale 0: d must be 0 j,
// the sign of zero included).
inline int8_t integer_scale(float d, float scale, bool negated) {
  const auto times = [&](float j) { return negated ? -(scale * j) : scale * j; };
  float j = scale != 0.0f ? std::nearbyint((negated ? -d : d) / scale) : 0.0f;
  if (scale == 0.0f && std::signbit(times(j)) != std::signbit(d)) j = -1.0f;  // a zero's sign
  const float back = times(j);
  TORCH_CHECK_VALUE(j >= -128.0f && j <= 127.0f && std::memcmp(&back, &d, 4) == 0,
                    "pack_records: a scale is not its super-block's d (dmin) times an integer");
  return static_cast<int8_t>(j);
}

// QuantizedWeight.pack's records, byte for byte, for every format code: q [N, K] (int8 for 8, 9
// and 11, uint8 in [0, 15] for 4, 5, 6 and 10); d [N, K / 32] float16 (8, 4, 5) or float32 (6,
// 10; 9, 11: [N, K / 16], a scale per 16), z int8 [N, K / 32] (4, 5), m [N, K / 32] float16 (5)
// or float32 (6, 9, 10, 11); for the super-block formats (10, 11) `supers` [N, K / 256, 2]
// float32, each super-block's d and dmin (float16 values), of which every d and -m of its blocks
// must be an integer multiple (a K-quant's own: checked to the bit). All contiguous. N padded to
// 64 rows (scales 0, q 0) and K to 32 (q 0). One pass, where the tensor code made a zero-filled
// copy and permuted it. Into `out` [N / 64, K / 32, bytes per K block] (contiguous: a fused
// weight's groups of one part) where it is given, else a new tensor.
torch::Tensor pack_records(torch::Tensor q, torch::Tensor d, torch::Tensor z, torch::Tensor m,
                           torch::Tensor supers, int64_t bits, torch::Tensor out) {
  TORCH_CHECK_VALUE(valid_bits(bits), "pack_records: bits must be 8, 4, 5, 6, 9, 10, 11 or 12");
  const QuantLayout layout = quant_layout(static_cast<int>(bits));
  const bool wide = !layout.nibbles, f32 = layout.f32 || layout.blocks > 1;
  TORCH_CHECK_VALUE(q.dim() == 2 && q.is_contiguous() && q.size(0) > 0 && q.size(1) > 0 &&
                        q.scalar_type() == (wide || layout.levels ? at::kChar : at::kByte),
                    "pack_records: q must be [N, K] contiguous, int8 (bits 8, 9, 11, 12) or uint8");
  const int64_t N = q.size(0), K = q.size(1), G = (N + 63) / 64, KB = (K + 31) / 32;
  const int64_t per_d = layout.halves ? 2 : 1;
  const auto scales = [&](const torch::Tensor& t, at::ScalarType type, bool used, int64_t per,
                          const char* what) {
    TORCH_CHECK_VALUE(!used || (t.dim() == 2 && t.size(0) == N && t.size(1) == per * KB &&
                                t.is_contiguous() && t.scalar_type() == type),
                      "pack_records: ", what, " must be [N, ", per == 1 ? "K / 32" : "K / 16",
                      "] contiguous");
  };
  const at::ScalarType scale_type = f32 ? at::kFloat : at::kHalf;
  scales(d, scale_type, true, per_d, f32 ? "d (float32)" : "d (float16)");
  scales(z, at::kChar, layout.z >= 0, 1, "z (int8)");
  scales(m, scale_type, layout.m >= 0, 1, f32 ? "m (float32)" : "m (float16)");
  const int64_t SB = KB / layout.blocks;  // records per group
  if (layout.blocks > 1) {
    TORCH_CHECK_VALUE(KB % layout.blocks == 0, "pack_records: K must be a multiple of 256");
    TORCH_CHECK_VALUE(supers.dim() == 3 && supers.size(0) == N && supers.size(1) == SB &&
                          supers.size(2) == 2 && supers.is_contiguous() &&
                          supers.scalar_type() == at::kFloat,
                      "pack_records: supers must be [N, K / 256, 2] contiguous float32");
  }
  const int64_t stride = layout.stride();
  if (out.numel() == 0) {
    out = torch::empty({G, KB, stride}, q.options().dtype(at::kByte));
  }
  TORCH_CHECK_VALUE(out.dim() == 3 && out.size(0) == G && out.size(1) == KB &&
                        out.size(2) == stride && out.is_contiguous() &&
                        out.scalar_type() == at::kByte,
                    "pack_records: out must be [", G, ", ", KB, ", ", stride, "] contiguous uint8");
  const auto bytes = [](const torch::Tensor& t) {
    return reinterpret_cast<const uint8_t*>(t.data_ptr());
  };
  const uint8_t *qp = bytes(q), *dp = bytes(d), *zp = layout.z >= 0 ? bytes(z) : nullptr;
  const uint8_t* mp = layout.m >= 0 ? bytes(m) : nullptr;
  const float* sp = layout.blocks > 1 ? supers.data_ptr<float>() : nullptr;
  const int64_t scale_bytes = f32 ? 4 : 2;
  uint8_t* op = out.data_ptr<uint8_t>();
  // output i's 32 weights of K block kb (row `row`; `real`: not padding) into its body bytes
  const auto weights = [&](uint8_t* body, int64_t row, bool real, int64_t kb) {
    const uint8_t* qr = real ? qp + row * K + kb * 32 : qp;
    const int64_t width = real ? std::min<int64_t>(32, K - kb * 32) : 0;  // q past it: 0
    uint8_t indices[32];
    if (layout.levels && real) {  // IQ4's levels -> their 4-bit indices
      uint8_t none = 0;
      for (int64_t t = 0; t < width; ++t) {
        indices[t] = kLevelIndices.of[qr[t]];
        none |= indices[t] & 16;
      }
      TORCH_CHECK_VALUE(none == 0, "pack_records: a q is not one of IQ4's levels");
      qr = indices;
    }
    if (width == 32) {  // 4 bytes at a time: K 4 kq + j of a quad are adjacent
      for (int kq = 0; kq < (wide ? 8 : 4); ++kq) {
        uint32_t quad, high;
        std::memcpy(&quad, qr + 4 * kq, 4);
        if (wide) {
          quad ^= 0x80808080u;  // q + 128 of each int8
        } else {
          std::memcpy(&high, qr + 16 + 4 * kq, 4);
          quad |= high << 4;  // nibbles: no byte carries into the next
        }
        std::memcpy(body + kq * 256, &quad, 4);
      }
    } else if (wide) {
      for (int t = 0; t < 32; ++t) {
        body[(t / 4) * 256 + t % 4] = t < width ? static_cast<uint8_t>(qr[t] + 128) : 128;
      }
    } else {
      for (int t = 0; t < 16; ++t) {
        const int lo = t < width ? qr[t] : 0, hi = t + 16 < width ? qr[t + 16] : 0;
        body[(t / 4) * 256 + t % 4] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  };
  // a field of scales of output i (row `row`): `width` bytes from `data` (per_row of them a
  // row, the first at `first`), or zeros for padding
  const auto field = [&](uint8_t* to, const uint8_t* data, int64_t width, int64_t per_row,
                         int64_t first, int64_t row, bool real) {
    if (real) std::memcpy(to, data + (row * per_row + first) * width, width);
    else std::memset(to, 0, width);
  };
  at::parallel_for(0, G * SB, layout.blocks > 1 ? 8 : 64, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t g = u / SB, s = u % SB;
      uint8_t* rec = op + u * layout.record;
      for (int64_t i = 0; i < 64; ++i) {
        const int64_t row = g * 64 + i;
        const bool real = row < N;
        if (layout.blocks == 1) {  // d (two: halves), z, m of the one block s
          field(rec + layout.d + i * scale_bytes, dp, scale_bytes, per_d * KB, per_d * s, row, real);
          if (layout.halves) {
            field(rec + layout.d + 256 + i * scale_bytes, dp, scale_bytes, 2 * KB, 2 * s + 1, row, real);
          }
          if (layout.z >= 0) field(rec + layout.z + i, zp, 1, KB, s, row, real);
          if (layout.m >= 0) field(rec + layout.m + i * scale_bytes, mp, scale_bytes, KB, s, row, real);
          weights(body_of(rec, layout.header, i), row, real, s);
          continue;
        }
        // the super-block's d and dmin as float16, its blocks' integer scales and minimums
        const float super_d = real ? sp[(row * SB + s) * 2] : 0.0f;
        const float super_m = real ? sp[(row * SB + s) * 2 + 1] : 0.0f;
        const c10::Half hd(super_d), hm(super_m);
        TORCH_CHECK_VALUE(static_cast<float>(hd) == super_d && static_cast<float>(hm) == super_m,
                          "pack_records: supers must hold float16 values");
        reinterpret_cast<c10::Half*>(rec + layout.d)[i] = hd;
        if (layout.m >= 0) reinterpret_cast<c10::Half*>(rec + layout.m)[i] = hm;
        for (int64_t j = 0; j < layout.blocks; ++j) {
          const int64_t kb = s * layout.blocks + j;
          for (int64_t h = 0; h < per_d; ++h) {
            const float dv = real ? reinterpret_cast<const float*>(dp)[row * per_d * KB + per_d * kb + h] : 0.0f;
            rec[layout.sc + (j * per_d + h) * 64 + i] = static_cast<uint8_t>(integer_scale(dv, super_d, false));
          }
          if (layout.m >= 0) {
            const float mv = real ? reinterpret_cast<const float*>(mp)[row * KB + kb] : -0.0f;
            rec[layout.mn + j * 64 + i] = static_cast<uint8_t>(integer_scale(mv, super_m, true));
          }
          weights(rec + layout.header + j * layout.body() + (i / 16) * 64 + (i % 16) * 4, row, real, kb);
        }
      }
    }
  });
  return out;
}

// A GGUF tensor's blocks as gguf_blocks.BlockGrid holds them, the numpy code's values bit for bit
// (its `integers` and scale fields): blocks [B, bytes] of GGML type `type` (gguf's codes) ->
// q int8 [B, weights], d float32 [B, weights / 16], m float32 [B, weights / 32], w = d q + m (m
// -0.0 where the type has none). Layouts as ggml's dequantize_row_* read them.
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ3_K = 11,
                          kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23 };


// 16 bytes of 4-bit indices (K t low, 16 + t high) as their levels
inline void iq4_block(const uint8_t* qs, int8_t* q) {
  for (int t = 0; t < 16; ++t) {
    q[t] = kIq4Levels[qs[t] & 15];
    q[t + 16] = kIq4Levels[qs[t] >> 4];
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// a block of 32 of the legacy types: 16 bytes of nibbles (K t low, 16 + t high) at `qs`, the
// fifth bits (K 8 b + s: bit s of byte b) at `qh` or none, then `offset`
inline void legacy_block(const uint8_t* qs, const uint8_t* qh, int offset, int8_t* q) {
  for (int t = 0; t < 16; ++t) {
    q[t] = static_cast<int8_t>(qs[t] & 15);
    q[t + 16] = static_cast<int8_t>(qs[t] >> 4);
  }
  if (qh != nullptr) {
    for (int t = 0; t < 32; ++t) q[t] = static_cast<int8_t>(q[t] | (((qh[t / 8] >> (t % 8)) & 1) << 4));
  }
  for (int t = 0; t < 32; ++t) q[t] = static_cast<int8_t>(q[t] + offset);
}

// sub-block j's 6-bit scale and minimum of a Q4_K / Q5_K super-block's 12 bytes (get_scale_min)
inline void scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> unpack_gguf(torch::Tensor blocks,
                                                                    int64_t type) {
  int64_t weights = 32, size = 0;
  switch (type) {
    case kQ4_0: size = 18; break;
    case kQ4_1: size = 20; break;
    case kQ5_0: size = 22; break;
    case kQ5_1: size = 24; break;
    case kQ8_0: size = 34; break;
    case kIQ4_NL: size = 18; break;
    case kQ3_K: weights = 256, size = 110; break;
    case kIQ4_XS: weights = 256, size = 136; break;
    case kQ4_K: weights = 256, size = 144; break;
    case kQ5_K: weights = 256, size = 176; break;
    case kQ6_K: weights = 256, size = 210; break;
    default: TORCH_CHECK_VALUE(false, "unpack_gguf: GGML type ", type, " is not unpacked here");
  }
  TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(1) == size &&
                        blocks.scalar_type() == at::kByte,
                    "unpack_gguf: blocks must be [B, ", size, "] contiguous uint8");
  const int64_t B = blocks.size(0);
  auto q = torch::empty({B, weights}, blocks.options().dtype(at::kChar));
  auto d = torch::empty({B, weights / 16}, blocks.options().dtype(at::kFloat));
  auto m = torch::empty({B, weights / 32}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  at::parallel_for(0, B, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi) {
      const uint8_t* blk = bp + bi * size;
      int8_t* qb = qp + bi * weights;
      float* db = dp + bi * (weights / 16);
      float* mb = mp + bi * (weights / 32);
      if (weights == 32) {
        const float scale = half_at(blk);
        db[0] = db[1] = scale;
        mb[0] = (type == kQ4_1 || type == kQ5_1) ? half_at(blk + 2) : -0.0f;
        switch (type) {
          case kQ8_0: std::memcpy(qb, blk + 2, 32); break;
          case kQ4_0: legacy_block(blk + 2, nullptr, -8, qb); break;
          case kQ4_1: legacy_block(blk + 4, nullptr, 0, qb); break;
          case kQ5_0: legacy_block(blk + 6, blk + 2, -16, qb); break;
          case kIQ4_NL: iq4_block(blk + 2, qb); break;
          default: legacy_block(blk + 8, blk + 4, 0, qb); break;  // Q5_1
        }
        continue;
      }
      if (type == kQ6_K) {  // ql 128 bytes, qh 64, int8 scales per 16, d
        const uint8_t *ql = blk, *qh = blk + 128;
        const float scale = half_at(blk + 208);
        for (int r = 0; r < 2; ++r) {  // halves of 128: ql runs of 64, qh runs of 32
          for (int l = 0; l < 64; ++l) {
            const int low = ql[64 * r + l], high = qh[32 * r + l % 32] >> (2 * (l / 32));
            qb[128 * r + l] = static_cast<int8_t>(((low & 15) | ((high & 3) << 4)) - 32);
            qb[128 * r + 64 + l] = static_cast<int8_t>(((low >> 4) | (((high >> 4) & 3) << 4)) - 32);
          }
        }
        for (int j = 0; j < 16; ++j) db[j] = scale * static_cast<float>(static_cast<int8_t>(blk[192 + j]));
        for (int j = 0; j < 8; ++j) mb[j] = -0.0f;
        continue;
      }
      if (type == kIQ4_XS) {  // d, the scales' high 2 bits (uint16), their low 4, indices
        const float scale = half_at(blk);
        const int high = blk[2] | (blk[3] << 8);
        for (int j = 0; j < 8; ++j) {
          const int six = ((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
          db[2 * j] = db[2 * j + 1] = scale * static_cast<float>(six - 32);
          mb[j] = -0.0f;
          iq4_block(blk + 8 + 16 * j, qb + 32 * j);
        }
        continue;
      }
      if (type == kQ3_K) {  // hmask 32 bytes, 2-bit q 64, 12 bytes of 6-bit scales, d
        const uint8_t *hmask = blk, *qs = blk + 32, *sc = blk + 96;
        const float scale = half_at(blk + 108);
        for (int r = 0; r < 2; ++r) {  // halves of 128: K 128 r + 32 s + l
          for (int s = 0; s < 4; ++s) {
            for (int l = 0; l < 32; ++l) {
              const int low = (qs[32 * r + l] >> (2 * s)) & 3, high = (hmask[l] >> (4 * r + s)) & 1;
              qb[128 * r + 32 * s + l] = static_cast<int8_t>(low + 4 * high - 4);
            }
          }
        }
        for (int j = 0; j < 16; ++j) {  // low 4 bits two to a byte, high 2 four to a byte
          const int six = ((sc[j % 8] >> (4 * (j / 8))) & 15) | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
          db[j] = scale * static_cast<float>(six - 32);
        }
        for (int j = 0; j < 8; ++j) mb[j] = -0.0f;
        continue;
      }
      // Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of fifth
      // bits, bit j of byte l for sub-block j), nibbles in runs of 32 (low: sub-block 2 c)
      const float scale = half_at(blk), dmin = half_at(blk + 2);
      const uint8_t* qs = blk + (type == kQ4_K ? 16 : 48);
      const uint8_t* qh = type == kQ5_K ? blk + 16 : nullptr;
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min(blk + 4, j, sc, mn);
        db[2 * j] = db[2 * j + 1] = scale * static_cast<float>(sc);
        mb[j] = -(dmin * static_cast<float>(mn));
        const uint8_t* run = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; ++l) {
          int v = (run[l] >> shift) & 15;
          if (qh != nullptr) v |= ((qh[l] >> j) & 1) << 4;
          qb[32 * j + l] = static_cast<int8_t>(v);
        }
      }
    }
  });
  return {q, d, m};
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, dim] with unit stride");
  TORCH_CHECK_VALUE(t.size(1) % 16 == 0, name, ": dim must be a multiple of 16");
}

// ---------------------------------------------------------------- KV cache write

void check_slots(const torch::Tensor& slots, int64_t T, int64_t num_slots) {
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous() &&
                        slots.scalar_type() == at::kLong,
                    "write_kv: slots must be [T] int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot out of range");
  }
}

// One head's vector x [D] as fp8_e4m3 bytes and its scale, as kv_cache.PagedKVCache.put makes
// them: scale = max(amax / 448, 1e-12) in float (a NaN kept), each byte c10's rounding of
// x / scale (the conversion torch's .to(float8_e4m3fn) runs).
template <typename T>
void store_fp8_head(const T* x, int64_t D, uint8_t* dst, float* scale) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < D; ++i) {
    const float a = std::abs(static_cast<float>(x[i]));
    nan = nan || std::isnan(a);
    amax = std::max(amax, a);
  }
  if (nan) amax = std::numeric_limits<float>::quiet_NaN();
  const float s = std::max(amax / 448.0f, static_cast<float>(1e-12));  // max keeps a NaN first
  for (int64_t i = 0; i < D; ++i) dst[i] = c10::Float8_e4m3fn(static_cast<float>(x[i]) / s).x;
  *scale = s;
}

// key/value [T, Hkv, D] (views of the qkv output: D contiguous) into cache slots [T] of caches
// [num_blocks, block_size, Hkv, D]: of their dtype, or fp8_e4m3 bytes (uint8) with a float
// scale per token and head in key_scale / value_scale [num_blocks, block_size, Hkv, 1] (empty
// for a cache in the compute dtype).
void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key,
              torch::Tensor value, torch::Tensor slots, torch::Tensor key_scale,
              torch::Tensor value_scale) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                        value_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes(),
                    "write_kv: caches must be [blocks, block_size, Hkv, D], contiguous");
  const int64_t T = key.size(0), Hkv = key_cache.size(2), D = key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK_VALUE(key.dim() == 3 && value.dim() == 3 && key.size(1) == Hkv &&
                        key.size(2) == D && value.sizes() == key.sizes() && key.stride(2) == 1 &&
                        value.stride(2) == 1,
                    "write_kv: key/value must be [T, Hkv, D] with D contiguous");
  const bool fp8 = key_cache.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE((fp8 || key.scalar_type() == key_cache.scalar_type()) &&
                        value.scalar_type() == key.scalar_type() &&
                        value_cache.scalar_type() == key_cache.scalar_type(),
                    "write_kv: dtypes must match the cache (or the cache be fp8 bytes)");
  TORCH_CHECK_VALUE(!fp8 || (key_scale.scalar_type() == at::kFloat &&
                             value_scale.scalar_type() == at::kFloat &&
                             key_scale.is_contiguous() && value_scale.is_contiguous() &&
                             key_scale.numel() == num_slots * Hkv &&
                             value_scale.numel() == key_scale.numel()),
                    "write_kv: fp8 caches need float scales [blocks, block_size, Hkv, 1]");
  check_slots(slots, T, num_slots);
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (fp8) {
    uint8_t* kc = key_cache.data_ptr<uint8_t>();
    uint8_t* vc = value_cache.data_ptr<uint8_t>();
    float* ks = key_scale.data_ptr<float>();
    float* vs = value_scale.data_ptr<float>();
    THERMOSTAT_DISPATCH_FLOAT(key.scalar_type(), "write_kv", [&] {
      const scalar_t* kp = key.data_ptr<scalar_t>();
      const scalar_t* vp = value.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t row = sp[t] * Hkv + h;
          store_fp8_head(kp + t * key.stride(0) + h * key.stride(1), D, kc + row * D, ks + row);
          store_fp8_head(vp + t * value.stride(0) + h * value.stride(1), D, vc + row * D,
                         vs + row);
        }
      }
    });
    return;
  }
  const int64_t item = key.element_size() * D;
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t es = key.element_size();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t dst = (sp[t] * Hkv + h) * item;
      std::memcpy(kc + dst, kp + (t * key.stride(0) + h * key.stride(1)) * es, item);
      std::memcpy(vc + dst, vp + (t * value.stride(0) + h * value.stride(1)) * es, item);
    }
  }
}

// ---------------------------------------------------------------- paged decode attention

// Decode attention splits each row's context (its window) into chunks of kChunkTokens: the items
// (row, KV head, chunk) spread over the threads evenly even for one row of a few KV heads, and
// the chunks' partial softmaxes are merged in chunk order. The split depends on the row's own
// context length only, so a row's result is the same bits whatever it is batched with.
constexpr int64_t kChunkTokens = 256;

// One decode attention call's inputs as raw pointers.
template <typename T, typename C>
struct AttentionArgs {
  const T* q;
  int64_t q_row, q_head;  // q's strides
  const C *keys, *values;
  const float *key_scales, *value_scales;  // fp8 token scales, or null
  const int64_t *tables, *lens;
  int64_t Hq, Hkv, D, block_size, nb, window;
  float scale;
  T* out;  // [B, Hq, D]
};

// The call's items, and room for their partial results.
struct AttentionPlan {
  std::vector<int64_t> first;  // [B + 1]: row b's items are [first[b], first[b + 1]), chunk major
  std::vector<float> parts;    // [item][group][D + 2]: a chunk's max score, sum of exp, sum of exp v

  bool merge = false;           // whether a row has more than one chunk

  AttentionPlan(const int64_t* lens, int64_t B, int64_t Hkv, int64_t group, int64_t D,
                int64_t window) : first(B + 1, 0) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = window > 0 ? std::min(lens[b], window) : lens[b];
      const int64_t chunks = (n + kChunkTokens - 1) / kChunkTokens;
      first[b + 1] = first[b] + Hkv * chunks;
      merge = merge || chunks > 1;
    }
    parts.resize(first[B] * group * (D + 2));
  }
  int64_t items() const { return first.back(); }

  // Row b's query head qh (of `group` per KV head, Hkv of them) across the row's chunks, for
  // merge_chunks: its first chunk's part, the stride to the next chunk's, the count, M (the
  // largest max score m_c), and l = sum_c weight(c) l_c in chunk order.
  struct Row {
    const float* part;
    int64_t stride, chunks;
    float top, l;
    float weight(int64_t c) const { return std::exp(part[c * stride] - top); }  // exp(m_c - M)
  };
  Row row(int64_t b, int64_t qh, int64_t Hkv, int64_t group, int64_t D) const {
    const int64_t stride = group * (D + 2), chunks = (first[b + 1] - first[b]) / Hkv;
    Row r{parts.data() + (first[b] + qh / group) * stride + (qh % group) * (D + 2),
          Hkv * stride, chunks, 0.0f, 0.0f};
    r.top = r.part[0];
    for (int64_t c = 1; c < chunks; ++c) r.top = std::max(r.top, r.part[c * r.stride]);
    for (int64_t c = 0; c < chunks; ++c) r.l += r.weight(c) * r.part[c * r.stride + 1];
    return r;
  }
};

constexpr int64_t kAheadTokens = 32;  // decode attention prefetches K/V rows this far ahead

// One item of the plan (row b, chunk c of the row's `chunks`, KV head h, n tokens) and where its
// tokens lie in the cache: the slot of each token of the chunk and of the next chunk's first
// kAheadTokens, found once (a division per token cost more than the math). `row` is token i's K
// or V row; it prefetches the row kAheadTokens further on in the order they are read (the chunk's
// keys, its values, then the keys of the thread's next item: the next KV head's of the chunk, or
// after the last head the next chunk's first head's), into L2: reading the rows without it waits
// on memory token by token (2.5x slower on an AVX2 EPYC), and prefetching into L1 instead kept
// fewer rows in flight (a 32k context's K/V read at 12 GB/s instead of 21, AMD EPYC Zen 4).
template <typename T, typename C>
class ChunkReader {
 public:
  using Slots = int64_t[kChunkTokens + kAheadTokens];
  int64_t b, h, c, chunks, n;

  ChunkReader(const AttentionArgs<T, C>& a, const AttentionPlan& plan, int64_t item, Slots& slots)
      : a_(a), slots_(slots) {
    b = std::upper_bound(plan.first.begin(), plan.first.end(), item) - plan.first.begin() - 1;
    chunks = (plan.first[b + 1] - plan.first[b]) / a.Hkv;
    c = (item - plan.first[b]) / a.Hkv;
    h = (item - plan.first[b]) % a.Hkv;
    const int64_t len = a.lens[b], bs = a.block_size;
    const int64_t begin = (a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0) + c * kChunkTokens;
    n = std::min(kChunkTokens, len - begin);
    ahead_ = std::min(n + kAheadTokens, len - begin);
    for (int64_t i = 0, blk = begin / bs, off = begin % bs; i < ahead_; ++i) {
      slots_[i] = a.tables[b * a.nb + blk] * bs + off;
      if (++off == bs) off = 0, ++blk;
    }
    // a thread's first item (the items before it prefetched the others' first keys)
    for (int64_t i = 0; i < std::min(kAheadTokens, n); ++i) prefetch(a.keys, i, h);
  }

  // token i's K (keys) or V row; its fp8 scale (1 for other caches) into `scale`
  const C* row(bool keys, int64_t i, float& scale) const {
    const int64_t j = i + kAheadTokens;
    if (j < n) prefetch(keys ? a_.keys : a_.values, j, h);
    else if (keys && j - n < n) prefetch(a_.values, j - n, h);
    else if (!keys && h + 1 < a_.Hkv && j - n < n) prefetch(a_.keys, j - n, h + 1);
    else if (!keys && h + 1 == a_.Hkv && j < ahead_) prefetch(a_.keys, j, 0);
    const int64_t at = slots_[i] * a_.Hkv + h;
    const float* scales = keys ? a_.key_scales : a_.value_scales;
    scale = scales ? scales[at] : 1.0f;
    return (keys ? a_.keys : a_.values) + at * a_.D;
  }

 private:
  void prefetch(const C* base, int64_t i, int64_t head) const {
    const char* p = reinterpret_cast<const char*>(base + (slots_[i] * a_.Hkv + head) * a_.D);
    for (int64_t off = 0; off < a_.D * static_cast<int64_t>(sizeof(C)); off += 64) {
      __builtin_prefetch(p + off, 0, 2);
    }
  }

  const AttentionArgs<T, C>& a_;
  Slots& slots_;
  int64_t ahead_;
};

template <typename T, typename C>
AttentionArgs<T, C> attention_args(const torch::Tensor& q, const torch::Tensor& key_cache,
                                   const torch::Tensor& value_cache, const torch::Tensor& key_scale,
                                   const torch::Tensor& value_scale,
                                   const torch::Tensor& block_tables,
                                   const torch::Tensor& context_lens, double scale,
                                   int64_t window, torch::Tensor& out) {
  const bool scaled = key_scale.numel() > 0;
  return {q.data_ptr<T>(), q.stride(0), q.stride(1),
          reinterpret_cast<const C*>(key_cache.data_ptr()),
          reinterpret_cast<const C*>(value_cache.data_ptr()),
          scaled ? key_scale.data_ptr<float>() : nullptr,
          scaled ? value_scale.data_ptr<float>() : nullptr,
          block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
          q.size(1), key_cache.size(2), q.size(2), key_cache.size(1), block_tables.size(1),
          window, static_cast<float>(scale), out.data_ptr<T>()};
}

// Caches [num_blocks, block_size, Hkv, D] (uint8 = fp8_e4m3 bytes, with float scales
// [num_blocks, block_size, Hkv, 1]; otherwise the query's dtype and empty scales) for queries of
// Hq heads of D.
void check_caches(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& key_scale, const torch::Tensor& value_scale, int64_t Hq,
                  int64_t D, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                        value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                        value_cache.scalar_type() == key_cache.scalar_type(),
                    "decode_attention: caches must be [blocks, block_size, Hkv, D], contiguous");
  const int64_t Hkv = key_cache.size(2);
  TORCH_CHECK_VALUE(key_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
                    "decode_attention: head shapes do not match");
  TORCH_CHECK_VALUE(D % 16 == 0 && D <= 256,
                    "decode_attention: head_dim must be a multiple of 16, at most 256");
  if (key_cache.scalar_type() == at::kByte) {
    TORCH_CHECK_VALUE(key_scale.scalar_type() == at::kFloat && key_scale.is_contiguous() &&
                          value_scale.is_contiguous() &&
                          key_scale.numel() == key_cache.size(0) * key_cache.size(1) * Hkv &&
                          value_scale.numel() == key_scale.numel(),
                      "decode_attention: fp8 caches need float scales [blocks, block_size, Hkv, 1]");
  } else {
    TORCH_CHECK_VALUE(key_cache.scalar_type() == dtype,
                      "decode_attention: cache dtype must be q's dtype or fp8 bytes");
  }
}

// block_tables [B, nb] int64 and context_lens [B] int64 (the query token included) address
// blocks of a cache of num_blocks blocks of bs tokens.
void check_tables(const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t B,
                  int64_t num_blocks, int64_t bs) {
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == B &&
                        block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
                    "decode_attention: block_tables must be [B, nb] int64");
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == B &&
                        context_lens.is_contiguous() && context_lens.scalar_type() == at::kLong,
                    "decode_attention: context_lens must be [B] int64");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t nb = block_tables.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 1 && lens[b] <= nb * bs,
                      "decode_attention: context length outside the block table");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
      TORCH_CHECK_VALUE(tables[b * nb + i] >= 0 && tables[b * nb + i] < num_blocks,
                        "decode_attention: block id out of range");
    }
  }
}

// The checks and dtype dispatch of decode_attention; `run(T{}, C{}, key_scale, value_scale, out)`
// is the build's implementation for compute dtype T and cache element C (uint8_t: fp8 bytes).
template <typename Run>
torch::Tensor decode_attention_checked(const torch::Tensor& q, const torch::Tensor& key_cache,
                                       const torch::Tensor& value_cache,
                                       const torch::Tensor& key_scale,
                                       const torch::Tensor& value_scale,
                                       const torch::Tensor& block_tables,
                                       const torch::Tensor& context_lens, Run run) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.stride(2) == 1,
                    "decode_attention: q must be [B, Hq, D] with D contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  check_caches(key_cache, value_cache, key_scale, value_scale, Hq, D, q.scalar_type());
  check_tables(block_tables, context_lens, B, key_cache.size(0), key_cache.size(1));
  const bool fp8 = key_cache.scalar_type() == at::kByte;
  auto out = torch::empty({B, Hq, D}, q.options());
  THERMOSTAT_DISPATCH_FLOAT(q.scalar_type(), "decode_attention", [&] {
    if (fp8) {
      run(scalar_t{}, uint8_t{}, key_scale, value_scale, out);
    } else {
      auto none = torch::empty({0}, q.options().dtype(at::kFloat));
      run(scalar_t{}, scalar_t{}, none, none, out);
    }
  });
  return out;
}

}  // namespace
