// DecodeStack, which both kernel builds compile: a dense Llama-family decode step through every
// layer in one call, and the team of threads it runs in. Each build includes this after its own
// ops, which it calls by name (each in that build's vector width, the same arithmetic):
//
//   kLanes                              floats per vector register
//   rms_row, add_rms_row                one row's norm (and residual add)
//   rotate_head                         one head's rotary embedding
//   silu_mul_lanes                      kLanes outputs of SwiGLU
//   AttentionScratch, attend_chunk,     decode attention by items of common.h's plan
//   merge_chunks
//   bf16_blocks                         a bf16 linear's column blocks [nb0, nb1) of 16 outputs
//   quantize_blocks, quant_units<BITS>  an int8 / 4-bit linear's activations, its 32-output units
//   amx_permitted                       whether linear_vnni runs on AMX here
//   rms_norm ... linear_quant           the ops themselves (torch_ops.h: the per-op way through)

#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------- a team for a whole call
//
// The pool's threads through a whole call, in one OpenMP parallel region (the pool torch's
// at::parallel_for uses: the same libgomp). Each op is a step over units of work, handed out a
// piece at a time to whichever thread asks first; a step ends once all its units are done, not
// once every thread has arrived, so a thread that comes late skips the steps already done.
//
// On a 2-core machine the OS preempts a team thread whenever a server's event loop or a client
// wakes up, for as long as they run; with a barrier after each op its teammate then waited out
// that whole time (a SmolLM2-135M decode step with 2 threads, a process busy 0.8 ms every 8 ms
// beside it: +0.6 to +2 ms a step, where sharing one core's loss would cost 0.4). So a linear's
// pieces are redoable (`redo_step`): a piece is computed into its thread's own buffer and
// published (copied into the output) by whichever thread finishes it first; a thread left waiting
// on a piece a teammate holds for longer than a few pieces take redoes it itself, and the
// teammate, when it runs again, drops its copy. The output's bits are the same whoever computes
// a piece. Forking and joining per op costs ~2.5 us; a step ~0.3 us. An exception in a piece is
// kept and rethrown by `run_team` after the region; the steps after it do nothing.

struct alignas(64) StepCounters {
  std::atomic<int64_t> next{0};  // the first unit no thread has claimed
  std::atomic<int64_t> done{0};  // units done (published)
};

enum PieceState : uint8_t { kFree = 0, kClaimed = 1, kTaken = 2, kPublished = 3 };

struct TeamState {  // shared by one team's threads
  TeamState(int64_t max_steps, int64_t max_pieces)
      : steps(static_cast<size_t>(max_steps)), pieces(new std::atomic<uint8_t>[max_pieces]()),
        max_pieces(max_pieces) {}
  std::vector<StepCounters> steps;  // by step, in the order every thread takes them
  std::unique_ptr<std::atomic<uint8_t>[]> pieces;  // redoable steps' pieces, step after step
  int64_t max_pieces;
  StepCounters spare;  // past the planned steps: the team has failed
  std::atomic<bool> failed{false};
  std::atomic<int64_t> redone{0};  // pieces a thread redid for a preempted teammate
  std::exception_ptr error;
  std::mutex mu;
};

class Team {
 public:
  Team(int64_t id, int64_t size, TeamState& state, int64_t stall_us)
      : id_(id), size_(size), state_(state), stall_us_(stall_us) {}

  int64_t id() const { return id_; }
  bool leader() const { return id_ == 0; }  // the calling thread (torch's thread-local state)

  // f(begin, end) over units [0, n), `grain` at a time; returns once all n are done
  template <typename F>
  void step(int64_t n, int64_t grain, F&& f) {
    StepCounters& c = counters();
    for (int64_t b = claim(c, grain); b < n; b = claim(c, grain)) {
      const int64_t e = std::min(n, b + grain);
      guarded([&] { f(b, e); });
      c.done.fetch_add(e - b, std::memory_order_release);
    }
    wait(c, n, [] { return false; });
  }

  // f over units [0, n) in one piece per thread at most
  template <typename F>
  void split(int64_t n, F&& f) {
    step(n, std::max<int64_t>(1, (n + size_ - 1) / size_), std::forward<F>(f));
  }

  // f() on the leader only (torch's own ops); the others wait for it
  template <typename F>
  void lead(F&& f) {
    StepCounters& c = counters();
    if (leader()) {
      if (!state_.failed.load(std::memory_order_relaxed)) guarded(f);
      c.done.store(1, std::memory_order_release);
    }
    wait(c, 1, [] { return false; });
  }

  // Units [0, n), `grain` at a time: compute(b, e, own) writes units [b, e) into this thread's
  // buffer `own` (reading only what no step before the next one writes), publish(b, e, own)
  // copies them into the output. A piece is published once, by whoever computed it first of
  // the thread that claimed it and a teammate that took it over.
  template <typename Compute, typename Publish, typename B>
  void redo_step(int64_t n, int64_t grain, B* own, Compute&& compute, Publish&& publish) {
    StepCounters& c = counters();
    const int64_t first = pieces_, count = (n + grain - 1) / grain;
    pieces_ += count;
    if (pieces_ > state_.max_pieces) {
      guarded([] { TORCH_CHECK(false, "Team: more pieces than planned"); });
      return;
    }
    std::atomic<uint8_t>* piece = state_.pieces.get() + first;
    // piece p computed, then published if its state is still `from` (now `to`)
    auto run_piece = [&](int64_t p, PieceState from, PieceState to) {
      const int64_t b = p * grain, e = std::min(n, b + grain);
      guarded([&] { compute(b, e, own); });
      uint8_t expected = from;
      if (from == to || piece[p].compare_exchange_strong(expected, to)) {
        guarded([&] { publish(b, e, own); });
        c.done.fetch_add(e - b, std::memory_order_release);
      }
    };
    int64_t longest = 0;  // ns: this thread's slowest piece of the step
    for (int64_t b = claim(c, grain); b < n; b = claim(c, grain)) {
      piece[b / grain].store(kClaimed, std::memory_order_release);
      const auto start = std::chrono::steady_clock::now();
      if (stall_us_ > 0 && !leader()) {
        std::this_thread::sleep_for(std::chrono::microseconds(stall_us_));
      }
      run_piece(b / grain, kClaimed, kPublished);
      longest = std::max<int64_t>(longest, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               std::chrono::steady_clock::now() - start).count());
    }
    // waiting longer than three of our pieces (20 us at least, 100 us if we had none) means the
    // holder is off its core: take its piece over
    const int64_t patience_ns = longest > 0 ? std::max<int64_t>(3 * longest, 20000) : 100000;
    const auto since = std::chrono::steady_clock::now();
    wait(c, n, [&] {
      if (std::chrono::steady_clock::now() - since < std::chrono::nanoseconds(patience_ns)) {
        return false;
      }
      for (int64_t p = 0; p < count; ++p) {
        uint8_t claimed = kClaimed;
        if (piece[p].load(std::memory_order_acquire) == kClaimed &&
            piece[p].compare_exchange_strong(claimed, kTaken)) {
          run_piece(p, kTaken, kTaken);  // ours now: the holder's publish will fail
          state_.redone.fetch_add(1, std::memory_order_relaxed);
          return true;
        }
      }
      return false;
    });
  }

 private:
  StepCounters& counters() {
    if (steps_ < static_cast<int64_t>(state_.steps.size())) return state_.steps[steps_++];
    guarded([] { TORCH_CHECK(false, "Team: more steps than planned"); });
    return state_.spare;
  }

  // the next piece's first unit, or past the end once the team failed
  int64_t claim(StepCounters& c, int64_t grain) {
    if (state_.failed.load(std::memory_order_relaxed)) return INT64_MAX;
    return c.next.fetch_add(grain, std::memory_order_relaxed);
  }

  template <typename F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(state_.mu);
      if (!state_.error) state_.error = std::current_exception();
      state_.failed = true;
    }
  }

  // until n units of the step are done (or the team failed), checking `help` (whether it did
  // some of the work) every so many spins; yielding the core now and then
  template <typename Help>
  void wait(StepCounters& c, int64_t n, Help&& help) {
    for (int64_t spins = 1; c.done.load(std::memory_order_acquire) < n; ++spins) {
      if (state_.failed.load(std::memory_order_relaxed)) return;
      if (spins % 64 == 0 && help()) continue;
      if (spins % 4096 == 0) std::this_thread::yield();
      else _mm_pause();
    }
  }

  int64_t id_, size_, steps_ = 0, pieces_ = 0;
  TeamState& state_;
  int64_t stall_us_;
};

// body(team) on each of the pool's threads, in at most max_steps team steps and max_pieces
// redoable pieces; body does its work in team steps only. Returns how many pieces were redone.
// stall_us > 0 (tests): every thread but the leader sleeps that long in each redoable piece.
template <typename F>
int64_t run_team(int64_t max_steps, int64_t max_pieces, int64_t stall_us, F&& body) {
  TeamState state(max_steps, max_pieces);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Team team(omp_get_thread_num(), omp_get_num_threads(), state, stall_us);
    body(team);
  }
  if (state.error) std::rethrow_exception(state.error);
  return state.redone.load();
}

// ---------------------------------------------------------------- decode stack
//
// A dense Llama-family decoder's decode step (one new token per row, every row a decode) in one
// call: per layer, norm, the qkv projection, q/k norms (Qwen3), rotary, the cache write, decode
// attention, the output projection, add + norm and the SwiGLU MLP, then the final add + norm.
// It runs the per-row and per-output arithmetic of the build's ops, in the order the layers'
// Python forward (thermostat/models/llama.py) calls them, so its hidden states are the same bits;
// what it saves is the Python between the ops and, in a team (below), their forks and joins.
// thermostat/models/compiled_decode.py decides where it applies.
//
// Two ways through: `team` runs the whole step in one parallel region, each op a team step
// whose pieces go to whichever thread is free (a linear's piece redone by a teammate when the
// thread holding it is preempted; see Team); `ops` calls the ops one after another (each forking
// its own threads). The team takes every stack it can: int8 / 4-bit linears, bf16 ones off AMX,
// widths multiples of 32 and a KV cache in the compute dtype or fp8_e4m3 (store_fp8_head);
// the AMX bf16 kernel keeps the per-op way (it could not be measured inside a team here).

struct StackLinear {
  torch::Tensor packed;
  int64_t n;
  int64_t bits;  // 16: bf16 packed by pack_vnni (linear_vnni); else linear_quant's format code
  c10::optional<torch::Tensor> bias;
  torch::Tensor bias_f;  // float32, padded: what the kernels add

  StackLinear(torch::Tensor packed_, int64_t n_, int64_t bits_, c10::optional<torch::Tensor> bias_)
      : packed(std::move(packed_)), n(n_), bits(bits_), bias(std::move(bias_)) {
    if (bits == 16) check_vnni_packed(packed);
    else check_quant_packed(packed, bits);
    const int64_t padded_n = packed.size(0) * (bits == 16 ? 16 : 64);
    TORCH_CHECK_VALUE(n <= padded_n && n > padded_n - 64,
                      "StackLinear: n does not match the packed weight");
    bias_f = float_bias(bias, n, padded_n, "StackLinear");
  }

  int64_t k() const { return packed.size(1) * 32; }  // K, padded to a multiple of 32

  torch::Tensor operator()(const torch::Tensor& x) const {
    return bits == 16 ? linear_vnni(x, packed, n, bias)
                      : linear_quant(x.contiguous(), packed, n, bits, bias);
  }

  // Units of work (bf16: blocks of 16 outputs; int8 / 4-bit: half groups of 32) and units per
  // piece at M rows. Quantized units per piece: at a few rows a piece is a short read of memory,
  // and six groups a claim streamed faster than two (AMD EPYC Zen 5, whole engine, one process,
  // alternating: int8 batch 1 -1% to +9% in five runs, median +2.5%; int4 +10% and +13%); at 32
  // rows two groups a claim keep the threads even (six: -5%).
  int64_t units() const { return bits == 16 ? packed.size(0) : 2 * packed.size(0); }
  int64_t grain(int64_t M) const { return bits == 16 || M > 4 ? 4 : 12; }
  int64_t pieces(int64_t M) const { return (units() + grain(M) - 1) / grain(M); }

  // y [M, n] = x [M, k()] W^T (+ bias), contiguous rows, in team steps (one redoable); `a`
  // holds M x k() / 32 quantized blocks, `own` is the calling thread's [M, n] buffer
  template <typename T>
  void run(Team& team, const T* x, int64_t M, T* y, QuantizedActivations& a, T* own) const {
    const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
    const int64_t width = bits == 16 ? 16 : 32;  // outputs per unit
    auto publish = [&](int64_t b, int64_t e, const T* src) {
      const int64_t c0 = b * width, c1 = std::min(n, e * width);
      for (int64_t m = 0; m < M && c1 > c0; ++m) {
        std::memcpy(y + m * n + c0, src + m * n + c0, (c1 - c0) * sizeof(T));
      }
    };
    if (bits == 16) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const auto* W = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
        const int64_t KS = packed.size(1);
        team.redo_step(units(), grain(M), own, [&](int64_t b, int64_t e, T* dst) {
          bf16_blocks(reinterpret_cast<const uint16_t*>(x), M, KS * 32, W, KS, bp, dst, n, b, e);
        }, publish);  // fmt: skip
      }
      return;
    }
    const int64_t KB = packed.size(1);
    const uint8_t* W = packed.data_ptr<uint8_t>();
    team.split(M * KB, [&](int64_t b, int64_t e) {
      quantize_blocks(x, KB * 32, KB * 32, KB, a, b, e);
    });
    team.redo_step(units(), grain(M), own, [&](int64_t b, int64_t e, T* dst) {
      with_quant_format(bits, [&](auto format) {
        quant_units<decltype(format)::value>(a, M, W, KB, bp, dst, n, b, e);
      });
    }, publish);
  }
};

struct StackLayer {
  torch::Tensor input_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;  // per head (Qwen3): torch's rms_norm, as in Python
  torch::Tensor key_cache, value_cache, key_scale, value_scale;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              torch::Tensor final_norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        final_norm_(std::move(final_norm)) {}

  void add_layer(StackLayer layer) {
    const int64_t hidden = final_norm_.numel(), H = heads_, Hkv = kv_heads_, D = head_dim_;
    TORCH_CHECK_VALUE(layer.qkv.n == (H + 2 * Hkv) * D && layer.o.n == hidden &&
                          layer.down.n == hidden,
                      "DecodeStack: the layer's projections do not match the stack's shape");
    TORCH_CHECK_VALUE(layer.q_norm.has_value() == layer.k_norm.has_value(),
                      "DecodeStack: q and k norms come together");
    check_caches(layer.key_cache, layer.value_cache, layer.key_scale, layer.value_scale, H, D,
                 final_norm_.scalar_type());
    TORCH_CHECK_VALUE(layers_.empty() || layer.key_cache.sizes() == layers_[0].key_cache.sizes(),
                      "DecodeStack: every layer's cache has the same shape");
    // the team reads every projection's input whole: widths multiples of 32, no padding
    teamable_ = teamable_ && hidden % 32 == 0 && (H * D) % 32 == 0 &&
                layer.qkv.k() == hidden && layer.gate_up.k() == hidden &&
                layer.o.k() == H * D && layer.down.k() % 32 == 0 &&
                layer.down.k() * 2 == layer.gate_up.n;
    for (const StackLinear* lin : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      if (lin->bits == 16) has_bf16_ = true;
    }
    layers_.push_back(std::move(layer));
  }

  // x [T, hidden]: the rows' embeddings; cos, sin [T, head_dim]; slots [T]; block_tables
  // [T, nb]; context_lens [T]; window 0 = none. Returns the final norm's output [T, hidden].
  // team: run as a team where the stack allows it (the same bits either way); stall_us (tests):
  // every team thread but the caller sleeps that long in each piece of a linear.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slots, const torch::Tensor& block_tables,
                        const torch::Tensor& context_lens, int64_t window, bool team,
                        int64_t stall_us) const {
    TORCH_CHECK_VALUE(!layers_.empty(), "DecodeStack: no layers");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == final_norm_.numel() && x.size(0) >= 1,
                      "DecodeStack: x must be [T, hidden]");
    const auto dtype = x.scalar_type();
    const auto cache = layers_[0].key_cache.scalar_type();
    if (team && teamable_ && (cache == dtype || cache == at::kByte) &&
        (!has_bf16_ || (dtype == at::kBFloat16 && !amx_permitted()))) {
      return THERMOSTAT_DISPATCH_FLOAT(dtype, "DecodeStack", [&] {
        return forward_team<scalar_t>(x, cos, sin, slots, block_tables, context_lens, window,
                                       stall_us);
      });
    }
    return forward_ops(x, cos, sin, slots, block_tables, context_lens, window);
  }

 private:
  torch::Tensor forward_ops(const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& slots,
                            const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                            int64_t window) const {
    const int64_t T = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_;
    torch::Tensor residual = x.contiguous();
    torch::Tensor out;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& L = layers_[i];
      torch::Tensor h = i == 0 ? rms_norm(residual, L.input_norm, eps_)
                               : add_rms_norm(out, residual, L.input_norm, eps_);
      const torch::Tensor qkv = L.qkv(h);
      torch::Tensor qk = qkv.narrow(1, 0, (H + Hkv) * D).view({T, H + Hkv, D});
      const torch::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
      if (L.q_norm) qk = qk_norms(qk, L);
      rotary_(qk, cos, sin);
      write_kv(L.key_cache, L.value_cache, qk.narrow(1, H, Hkv), v, slots, L.key_scale,
               L.value_scale);
      const torch::Tensor o =
          decode_attention(qk.narrow(1, 0, H), L.key_cache, L.value_cache, L.key_scale,
                           L.value_scale, block_tables, context_lens, scale_, window);
      h = add_rms_norm(L.o(o.reshape({T, H * D})), residual, L.post_norm, eps_);
      out = L.down(silu_mul(L.gate_up(h)));
    }
    return add_rms_norm(out, residual, final_norm_, eps_);
  }

  // Qwen3's per-head q and k norms through torch's rms_norm, as the Python forward does
  torch::Tensor qk_norms(const torch::Tensor& qk, const StackLayer& L) const {
    const std::vector<int64_t> dim{head_dim_};
    return at::cat({at::rms_norm(qk.narrow(1, 0, heads_), dim, *L.q_norm, eps_),
                    at::rms_norm(qk.narrow(1, heads_, kv_heads_), dim, *L.k_norm, eps_)},
                   1);
  }

  // A team's rotary, cache write and decode attention of one layer: q and k rotated in place
  // in qk (rows of qk_row), K and V stored in the cache of element C (T, or uint8_t: fp8_e4m3
  // bytes with their scales, store_fp8_head), then attention into attn [T, H * D].
  template <typename C, typename T>
  void attend_layer(Team& team, const StackLayer& L, T* qk, int64_t qk_row, const T* qkv,
                    int64_t Nqkv, const T* cp, const T* sp, const int64_t* slot,
                    const torch::Tensor& block_tables, const int64_t* lens, int64_t window,
                    AttentionPlan& plan, AttentionScratch& scratch, T* attn) const {
    const int64_t T_ = block_tables.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_;
    constexpr bool fp8 = std::is_same_v<C, uint8_t>;
    C* kc = L.key_cache.data_ptr<C>();
    C* vc = L.value_cache.data_ptr<C>();
    float* ks = fp8 ? L.key_scale.data_ptr<float>() : nullptr;
    float* vs = fp8 ? L.value_scale.data_ptr<float>() : nullptr;
    team.split(T_ * (H + Hkv), [&](int64_t b, int64_t e) {  // rotary, K and V cached
      for (int64_t item = b; item < e; ++item) {
        const int64_t t = item / (H + Hkv), head = item % (H + Hkv);
        T* row = qk + t * qk_row + head * D;
        rotate_head(row, cp + t * D, sp + t * D, D / 2);
        if (head < H) continue;
        const int64_t at_slot = slot[t] * Hkv + head - H;
        const T* value = qkv + t * Nqkv + (Hkv + head) * D;
        if constexpr (fp8) {
          store_fp8_head(row, D, kc + at_slot * D, ks + at_slot);
          store_fp8_head(value, D, vc + at_slot * D, vs + at_slot);
        } else {
          std::memcpy(kc + at_slot * D, row, D * sizeof(T));
          std::memcpy(vc + at_slot * D, value, D * sizeof(T));
        }
      }
    });
    const AttentionArgs<T, C> args{qk, qk_row, D, kc, vc, ks, vs,
                                   block_tables.data_ptr<int64_t>(), lens, H, Hkv, D,
                                   L.key_cache.size(1), block_tables.size(1), window,
                                   static_cast<float>(scale_), attn};
    team.step(plan.items(), 1, [&](int64_t item, int64_t) {
      attend_chunk(args, plan, item, scratch);
    });
    if (plan.merge) {
      team.split(T_ * H, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) merge_chunks(args, plan, i / H, i % H);
      });
    }
  }

  template <typename T>
  torch::Tensor forward_team(const torch::Tensor& x, const torch::Tensor& cos,
                             const torch::Tensor& sin, const torch::Tensor& slots,
                             const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                             int64_t window, int64_t stall_us) const {
    const int64_t T_ = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_;
    const int64_t hidden = x.size(1), Nqkv = (H + 2 * Hkv) * D, I = layers_[0].down.k();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T_ * D &&
                          sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
                          sin.scalar_type() == x.scalar_type() && D % 32 == 0,
                      "rotary: cos/sin must be [T, D] of x's dtype");
    TORCH_CHECK_VALUE(I % 16 == 0, "silu_mul: intermediate size must be a multiple of 16");
    const torch::Tensor& cache0 = layers_[0].key_cache;
    check_slots(slots, T_, cache0.size(0) * cache0.size(1));
    check_tables(block_tables, context_lens, T_, cache0.size(0), cache0.size(1));

    torch::Tensor residual = x.contiguous();
    auto buffer = [&](int64_t width) { return torch::empty({T_, width}, x.options()); };
    torch::Tensor h = buffer(hidden), qkv = buffer(Nqkv), attn = buffer(H * D),
                  gate_up = buffer(2 * I), act = buffer(I), out = buffer(hidden),
                  result = buffer(hidden);
    QuantizedActivations a;
    a.resize(T_, std::max({hidden, H * D, I}) / 32);
    T *res = residual.data_ptr<T>(), *hp = h.data_ptr<T>(), *qkvp = qkv.data_ptr<T>(),
      *attnp = attn.data_ptr<T>(), *gup = gate_up.data_ptr<T>(), *actp = act.data_ptr<T>(),
      *outp = out.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const float eps = static_cast<float>(eps_);
    torch::Tensor qk_normed;  // Qwen3's q and k after their norms, [T, H + Hkv, D]
    AttentionPlan plan(lens, T_, Hkv, H / Hkv, D, window);  // the same for every layer

    // every row: norm(residual) or, with x, residual += x then its norm
    auto norm_rows = [&](Team& team, const T* xrows, const torch::Tensor& w, T* dst) {
      team.split(T_, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          if (xrows) add_rms_row(xrows + r * hidden, res + r * hidden, w.data_ptr<T>(), dst + r * hidden, hidden, eps);
          else rms_row(res + r * hidden, w.data_ptr<T>(), dst + r * hidden, hidden, eps);
        }
      });
    };

    // a layer takes 15 steps at most (two per quantized linear), then the final norm; each
    // thread computes a linear's pieces into its own [T, n] buffer
    int64_t pieces = 0;
    for (const StackLayer& L : layers_) {
      for (const StackLinear* lin : {&L.qkv, &L.o, &L.gate_up, &L.down}) pieces += lin->pieces(T_);
    }
    const int64_t widest = std::max({Nqkv, hidden, 2 * I});
    torch::Tensor own = torch::empty({at::get_num_threads(), T_ * widest}, x.options());
    redone_ = run_team(static_cast<int64_t>(layers_.size()) * 16 + 1, pieces, stall_us, [&](Team& team) {
      AttentionScratch scratch;  // this thread's
      T* mine = own.data_ptr<T>() + team.id() * T_ * widest;
      for (size_t i = 0; i < layers_.size(); ++i) {
        const StackLayer& L = layers_[i];
        norm_rows(team, i == 0 ? nullptr : outp, L.input_norm, hp);
        L.qkv.run(team, hp, T_, qkvp, a, mine);
        T* qk = qkvp;
        int64_t qk_row = Nqkv;
        if (L.q_norm) {
          team.lead([&] {  // torch's own ops, on the calling thread
            qk_normed = qk_norms(qkv.narrow(1, 0, (H + Hkv) * D).view({T_, H + Hkv, D}), L);
          });
          qk = qk_normed.data_ptr<T>();
          qk_row = (H + Hkv) * D;
        }
        if (L.key_cache.scalar_type() == at::kByte) {
          attend_layer<uint8_t>(team, L, qk, qk_row, qkvp, Nqkv, cp, sp, slot, block_tables, lens,
                                window, plan, scratch, attnp);
        } else {
          attend_layer<T>(team, L, qk, qk_row, qkvp, Nqkv, cp, sp, slot, block_tables, lens,
                          window, plan, scratch, attnp);
        }
        L.o.run(team, attnp, T_, outp, a, mine);
        norm_rows(team, outp, L.post_norm, hp);
        L.gate_up.run(team, hp, T_, gup, a, mine);
        team.split(T_ * (I / kLanes), [&](int64_t b, int64_t e) {
          for (int64_t c = b; c < e; ++c) {
            const int64_t t = c / (I / kLanes), j = (c % (I / kLanes)) * kLanes;
            silu_mul_lanes(gup + t * 2 * I + j, gup + t * 2 * I + I + j, actp + t * I + j);
          }
        });
        L.down.run(team, actp, T_, outp, a, mine);
      }
      norm_rows(team, outp, final_norm_, result.data_ptr<T>());
    });
    return result;
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  std::vector<StackLayer> layers_;
  bool teamable_ = true, has_bf16_ = false;
  mutable int64_t redone_ = 0;  // pieces the last team call redid for a preempted thread

 public:
  int64_t redone() const { return redone_; }
};


}  // namespace

// The module's DecodeStack classes (its kernels release the GIL as the ops do).
inline void def_decode_stack(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init<torch::Tensor, int64_t, int64_t, c10::optional<torch::Tensor>>());
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init<torch::Tensor, torch::Tensor, StackLinear, StackLinear, StackLinear,
                    StackLinear, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>());
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, "a decode step through every layer", py::arg("x"),
           py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("block_tables"),
           py::arg("context_lens"), py::arg("window"), py::arg("team") = true,
           py::arg("stall_us") = 0, nogil)
      .def_property_readonly("redone", &DecodeStack::redone,
                             "pieces the last team call redid for a thread the OS preempted");
}
