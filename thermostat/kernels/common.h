// What both kernel builds share (cpu_kernels.cpp for AVX-512, avx2_kernels.cpp for AVX2-only
// CPUs): the weight layouts, their checks, and the scalar code that reads them. No vector
// intrinsics here; each build includes this once, inside its own anonymous namespace.
//
// bf16 linear, VNNI layout: weights are packed once (pack_vnni) into 16-column blocks of 32-deep
// K steps, each step a 16 x 16 x 2 tile: element [nb][ks][kp][n][j] = W[16 nb + n][32 ks + 2 kp
// + j], N padded to a multiple of 64 and K to a multiple of 32 with zeros. One 64-byte row of a
// tile holds a K pair for 16 outputs.
//
// int8 / int4 linear: weights in blocks of 32 along K, per output: int8 (llama.cpp q8_0's
// arithmetic: w = d q, q in [-128, 127]) or 4-bit (w = d (q - z), q in [0, 15], z an int8 zero
// point: GPTQ/AWQ's form, which holds q4_0 too), d float16. Packed (in Python,
// thermostat/models/quant.py) as one record per group g of 64 outputs (4 column blocks c of 16)
// and K block kb, records in (g, kb) order, so a thread reads its weights as one sequential stream:
//   d      64 float16                      128 bytes, [c][n]
//   z      64 int8 (int4 only)             64 bytes, [c][n]
//   int8   [kq 8][c 4][n 16][4] bytes q + 128 (unsigned)                          2048 bytes
//   int4   [kq 4][c 4][n 16][4] low nibble: K 4 kq + j, high nibble: K 16 + 4 kq + j  1024 bytes
// Activations are quantized per row and K block as q8_0 does (s = max|x| / 127, xq = round(x / s)
// to nearest even). Both builds sum the integer products of a block exactly and then, per K block
// in K order, for each output: y += (d s) float(sum_k (q - z) xq) by one fused multiply-add, so a
// row's result is the same bits whatever the rows batched with it (and the same on either build).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

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

struct QuantLayout {
  int64_t header, record;  // bytes of d (+ z) and of a whole record
};

inline QuantLayout quant_layout(int bits) {
  return bits == 8 ? QuantLayout{128, 128 + 2048} : QuantLayout{192, 192 + 1024};
}

struct QuantizedActivations {
  std::vector<int8_t> q;     // [M, Kp]
  std::vector<float> s;      // [M, KB]: the block's scale
  std::vector<int32_t> sum;  // [M, KB]: sum of the block's q

  void resize(int64_t M, int64_t KB) {
    q.resize(M * KB * 32);
    s.resize(M * KB);
    sum.resize(M * KB);
  }
};

void check_quant_packed(const torch::Tensor& packed, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "linear_quant: bits must be 8 or 4");
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() &&
                        packed.scalar_type() == at::kByte &&
                        packed.size(2) == quant_layout(static_cast<int>(bits)).record,
                    "linear_quant: weight must be packed int", bits);
}

// Rows `ids` [T] of a weight packed as above, dequantized to `dtype` [T, k] (an embedding
// lookup): w = float(q - z) * float(d), rounded once, as QuantizedWeight.rows computes it.
torch::Tensor quant_rows(torch::Tensor packed, torch::Tensor ids, int64_t n, int64_t k,
                         int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "quant_rows: bits must be 8 or 4");
  const QuantLayout layout = quant_layout(static_cast<int>(bits));
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() &&
                        packed.scalar_type() == at::kByte && packed.size(2) == layout.record,
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
        const uint8_t* rec = wp + (g * KB + kb) * layout.record;
        const float d = static_cast<float>(reinterpret_cast<const c10::Half*>(rec)[lane]);
        const float z = bits == 8 ? 128.0f : static_cast<float>(static_cast<int8_t>(rec[128 + lane]));
        for (int64_t i = 0; i < 32 && kb * 32 + i < k; ++i) {
          const int64_t kq = bits == 8 ? i / 4 : (i % 16) / 4, part = i % 4;
          const uint8_t byte = rec[layout.header + ((kq * 4 + c) * 16 + j) * 4 + part];
          const int q = bits == 8 ? byte : (i < 16 ? byte & 15 : byte >> 4);
          op[t * k + kb * 32 + i] = static_cast<scalar_t>((static_cast<float>(q) - z) * d);
        }
      }
    }
  });
  return out;
}

}  // namespace
