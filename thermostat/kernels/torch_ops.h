// The ops' entry points, which both kernel builds compile: each op's checks (a Python
// ValueError/RuntimeError rather than a read out of bounds), its dtype dispatch and its split
// over threads, and the module's functions. Each build includes this inside its anonymous
// namespace after its own arithmetic, which these call by name (in that build's vector width):
//
//   kLanes                              floats per vector register
//   rms_row, add_rms_row                one row's norm (and residual add)
//   rotate_head                         one head's rotary embedding
//   silu_mul_lanes                      kLanes outputs of SwiGLU
//   AttentionScratch, attend_chunk,     decode attention by items of common.h's plan
//   merge_chunks
//   linear_vnni_rows                    a bf16 linear over checked, contiguous rows
//   swiglu_rows                         SwiGLU fused into its gate/up linear (false: none here)
//   quantize_blocks, quant_units<BITS>  an int8 / 4-bit linear's activations, its 32-output units
//   amx_permitted                       whether linear_vnni runs on AMX here

#pragma once

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK_VALUE(weight.is_contiguous() && weight.numel() == x.size(1) &&
                        weight.scalar_type() == x.scalar_type(),
                    "rms_norm: weight must be [dim] of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1);
  THERMOSTAT_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(xp + r * stride, wp, op + r * n, n, (float)eps);
    });
  });
  return out;
}

// residual <- residual + x (rounded to the dtype, as `residual + x` in torch); returns
// rms_norm(residual) * weight.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                           double eps) {
  check_rows(x, "add_rms_norm x");
  check_rows(residual, "add_rms_norm residual");
  TORCH_CHECK_VALUE(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
                        residual.is_contiguous(),
                    "add_rms_norm: x and residual must match, residual contiguous");
  TORCH_CHECK_VALUE(weight.is_contiguous() && weight.numel() == x.size(1) &&
                        weight.scalar_type() == x.scalar_type(),
                    "add_rms_norm: weight must be [dim] of x's dtype");
  auto out = torch::empty_like(residual);
  const int64_t n = x.size(1);
  THERMOSTAT_DISPATCH_FLOAT(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        add_rms_row(xp + r * stride, rp + r * n, wp, op + r * n, n, (float)eps);
      }
    });
  });
  return out;
}

// x: [T, H, D] (rows and heads may be strided, D contiguous); cos, sin: [T, D] contiguous.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, H, D], D contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK_VALUE(half % 16 == 0, "rotary: head_dim must be a multiple of 32");
  TORCH_CHECK_VALUE(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T &&
                        cos.size(-1) == D && cos.numel() == T * D && sin.sizes() == cos.sizes() &&
                        cos.scalar_type() == x.scalar_type() &&
                        sin.scalar_type() == x.scalar_type(),
                    "rotary: cos/sin must be [T, D] of x's dtype");
  THERMOSTAT_DISPATCH_FLOAT(x.scalar_type(), "rotary", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    at::parallel_for(0, T * H, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t t = i / H, h = i % H;
        rotate_head(xp + t * st + h * sh, cp + t * D, sp + t * D, half);
      }
    });
  });
}

// gate_up: [T, 2I] (gate columns first, as the fused projection writes them) -> silu(gate) * up,
// [T, I], computed in fp32 and rounded once.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(I % 16 == 0, "silu_mul: intermediate size must be a multiple of 16");
  auto out = torch::empty({T, I}, gate_up.options());
  THERMOSTAT_DISPATCH_FLOAT(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    // grain: a decode row (I / kLanes vectors of a few instructions each) runs inline, not forked
    at::parallel_for(0, T * (I / kLanes), 1024, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const int64_t t = c / (I / kLanes), i = (c % (I / kLanes)) * kLanes;
        silu_mul_lanes(gp + t * stride + i, gp + t * stride + I + i, op + t * I + i);
      }
    });
  });
  return out;
}

template <typename T, typename C>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, const torch::Tensor& key_scale,
                           const torch::Tensor& value_scale, const torch::Tensor& block_tables,
                           const torch::Tensor& context_lens, double scale, int64_t window,
                           torch::Tensor& out) {
  const auto args = attention_args<T, C>(q, key_cache, value_cache, key_scale, value_scale,
                                         block_tables, context_lens, scale, window, out);
  const int64_t B = q.size(0);
  AttentionPlan plan(args.lens, B, args.Hkv, args.Hq / args.Hkv, args.D, window);
  at::parallel_for(0, plan.items(), 1, [&](int64_t b, int64_t e) {
    AttentionScratch scratch;
    for (int64_t item = b; item < e; ++item) attend_chunk(args, plan, item, scratch);
  });
  if (!plan.merge) return;
  at::parallel_for(0, B * args.Hq, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) merge_chunks(args, plan, i / args.Hq, i % args.Hq);
  });
}

// q: [B, Hq, D] (D contiguous; rows and heads may be strided, e.g. a view of the qkv output);
// caches and tables as common.h's decode_attention_checked checks them.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                               torch::Tensor key_scale, torch::Tensor value_scale,
                               torch::Tensor block_tables, torch::Tensor context_lens,
                               double scale, int64_t window) {
  return decode_attention_checked(
      q, key_cache, value_cache, key_scale, value_scale, block_tables, context_lens,
      [&](auto t, auto c, const torch::Tensor& ks, const torch::Tensor& vs, torch::Tensor& out) {
        decode_attention_impl<decltype(t), decltype(c)>(q, key_cache, value_cache, ks, vs,
                                                        block_tables, context_lens, scale, window,
                                                        out);
      });
}

bool uses_amx() { return amx_permitted(); }

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
  linear_vnni_rows(x.contiguous(), Kp, wp, NB, KS, bp, yp, N);
  return y;
}

// silu(gate) * up [M, I] for x [M, K] and the gate/up weight [2I, K] (gate rows first) packed by
// pack_vnni, bias [2I] or none: linear_vnni then silu_mul, the same bits, in one pass where the
// build fuses them (swiglu_rows).
torch::Tensor linear_swiglu(torch::Tensor x, torch::Tensor packed, int64_t I,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK_VALUE(I >= 16 && I % 16 == 0, "linear_swiglu: I must be a positive multiple of 16");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1,
                    "linear_swiglu: x must be [M, K] bfloat16, M >= 1");
  check_vnni_packed(packed);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KS = packed.size(1);
  const int64_t Kp = KS * 32;
  TORCH_CHECK_VALUE(K <= Kp && K > Kp - 32 && 2 * I <= NB * 16 && 2 * I > NB * 16 - 64,
                    "linear_swiglu: x or I does not match the packed weight");
  const torch::Tensor bias_f = float_bias(bias, 2 * I, NB * 16, "linear_swiglu");
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, I}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  if (swiglu_rows(x.contiguous(), Kp, wp, KS, bp, out.data_ptr<c10::BFloat16>(), I)) return out;
  return silu_mul(linear_vnni(x, packed, 2 * I, bias));
}

template <int BITS, typename T>
void linear_quant_impl(const torch::Tensor& x, const torch::Tensor& packed, const float* bias,
                       torch::Tensor& y, int64_t N) {
  const int64_t M = x.size(0), G = packed.size(0), KB = packed.size(1);
  static thread_local QuantizedActivations buffer;  // the calling thread's, reused per call
  QuantizedActivations& a = buffer;  // a reference the workers below capture
  a.resize(M, KB);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M * KB, 256, [&](int64_t b, int64_t e) {
    quantize_blocks(xp, x.size(1), x.stride(0), KB, a, b, e);
  });
  const auto* wp = packed.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  // half groups, as DecodeStack's units (a last one past N writes nothing)
  parallel_pieces(2 * G, 8, [&](int64_t b, int64_t e) {
    quant_units<BITS>(a, M, wp, KB, bias, yp, N, b, e);
  });
}

// y [M, N] = x [M, K] W^T (+ bias), W quantized (a format code of common.h's table) and packed as
// there; x in float32, bfloat16 or float16 (y in x's dtype). Any M >= 1, the same bits per row.
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
    with_quant_format(bits, [&](auto format) {
      linear_quant_impl<decltype(format)::value, scalar_t>(x, packed, bp, y, N);
    });
    return y;
  });
}

// The ops both builds have, as the module's functions. They touch no Python object, so each
// releases the GIL while it runs (as ATen's own ops do): the server's event loop thread writes
// responses while the engine thread computes.
void def_ops(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of [rows, dim]", nogil);
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual)", nogil);
  m.def("rotary_", &rotary_, "in-place rotary embedding (half-split layout)", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up from the fused gate_up projection", nogil);
  m.def("write_kv", &write_kv, "store new tokens' K/V into their cache slots", nogil);
  m.def("decode_attention", &decode_attention, "paged attention of one query token per sequence",
        nogil);
  m.def("pack_vnni", &pack_vnni, "bf16 weight [N, K] -> the layout linear_vnni reads", nogil);
  m.def("linear_vnni", &linear_vnni, "x W^T + b for bf16 rows, the same bits per row at any M",
        nogil);
  m.def("linear_swiglu", &linear_swiglu, "silu(x W_gate^T) * (x W_up^T): linear_vnni, silu_mul",
        nogil);
  m.def("quant_rows", &quant_rows, "rows of an int8 / 4-bit packed weight, dequantized", nogil);
  m.def("grid_steps", &grid_steps, "the integer grid step of each block of 32 (0: none)", nogil);
  m.def("quantize_int8", &quantize_int8, "a float weight's int8 records (no grid search)", nogil);
  m.def("quantize_int4", &quantize_int4, "a float weight's int4 records (no grid search)", nogil);
  m.def("pack_records", &pack_records, "QuantizedWeight.pack's records, one pass", nogil);
  m.def("unpack_gguf", &unpack_gguf, "a GGUF tensor's blocks as integers, d and m", nogil);
  m.def("linear_quant", &linear_quant, "x W^T + b with int8 / 4-bit weights in blocks of 32",
        nogil);
}
