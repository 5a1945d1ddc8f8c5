"""Integer weights (int8, int4: thermostat.models.quant) and batch invariance, end to end: the
formats' packing round-trips, a checkpoint's own grid comes back exactly, quantized models serve
every family the engine serves, and a prompt's greedy tokens and logprobs are the same bits alone,
in a batch of 32 and after a prefix-cache hit, in bf16 and in int8."""

from __future__ import annotations

import pytest
import torch

from thermostat import LLM, SamplingParams, kernels
from thermostat.commands.diagnose import Cell, conclude, one_sided_p
from thermostat.disagg.handoff import disagreements, fingerprint
from thermostat.engine.loader import ModelLoadError
from thermostat.models.grids import grid_step, quantize_int4, quantize_int8
from thermostat.models.quant import QuantizedWeight, quantize
from thermostat.random_model import SMOLLM2_135M, write_model

needs_kernels = pytest.mark.skipif(kernels.ops() is None, reason=f"CPU kernels {kernels.status()}")

PROMPTS = [f"w{i} w{i + 7} w{3 * i + 1} hello world number {i}" for i in range(8)]
DEMO_PROMPTS = [
    "To be, or not", "The king said", "Once upon a time", "O Romeo, Romeo",
    "Friends, Romans", "All the world's", "Now is the winter", "What light",
]  # fmt: skip


# ---- the formats (pure tensor math)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(7, 33), (64, 64), (130, 100)])
def test_pack_unpack_round_trip_and_rows(fmt, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    qw = quantize(w, fmt)
    q, d, z = qw.unpack()
    again = QuantizedWeight.pack(q[:, :k], d, z)
    assert torch.equal(again.packed, qw.packed)
    full = qw.dequantize()
    assert full.shape == (n, k)
    ids = torch.tensor([[0, n - 1], [n // 2, 3 % n]])
    assert torch.equal(qw.rows(ids, torch.float32), full[ids])
    assert torch.equal(qw.rows(torch.arange(n), torch.float32), full)  # every row's own bytes
    bound = 0.01 if fmt == "int8" else 0.1  # relative to each block's largest weight
    blocks = torch.nn.functional.pad(w, (0, -k % 32)).view(n, -1, 32).abs().amax(-1)
    err = torch.nn.functional.pad(full - w, (0, -k % 32)).view(n, -1, 32).abs().amax(-1)
    assert (err <= bound * blocks + 1e-6).all()


def test_a_checkpoints_grid_comes_back_exactly():
    """Weights dequantized from q8_0, q4_0 and GPTQ/AWQ-style groups (integer zero points, a
    group of 128) requantize to the same values: loading them loses nothing."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 256, generator=g)
    q8, d8 = quantize_int8(w)
    q8_0 = (q8.float().view(16, -1, 32) * d8.float()[..., None]).view(16, 256)
    assert torch.equal(quantize(q8_0, "int8").dequantize(), q8_0)

    d = (torch.rand(16, 8, generator=g) * 0.1 + 0.01).half().float()
    q4_0 = ((torch.randint(0, 16, (16, 8, 32), generator=g) - 8) * d[..., None]).view(16, 256)
    assert torch.equal(quantize(q4_0, "int4").dequantize(), q4_0)

    scale = (torch.rand(16, 2, generator=g) * 0.01 + 0.001).half().float()
    zero = torch.randint(0, 16, (16, 2, 1), generator=g)
    gptq = (torch.randint(0, 16, (16, 2, 128), generator=g) - zero) * scale[..., None]
    assert torch.equal(quantize(gptq.view(16, 256), "int4").dequantize(), gptq.view(16, 256))


def grid_blocks() -> torch.Tensor:
    """Blocks [B, 32] of every kind grid_step tells apart: float weights (off every grid), the
    grids of q8_0, q4_0, GPTQ-style zero points and per-channel int8 (whose smallest gap is 2, 3
    or 4 steps), ties of round-half-even, values at the ranges' ends, zeros, inf and NaN."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(64, 1, generator=g) * 0.1 + 0.001).half().float()
    kinds = [
        torch.randn(256, 32, generator=g),
        torch.randn(64, 32, generator=g).bfloat16().float() * 1e-3,
        torch.randint(-128, 128, (64, 32), generator=g) * d,  # q8_0 (and -128)
        (torch.randint(0, 16, (64, 32), generator=g) - 8) * d,  # q4_0
        (torch.randint(0, 16, (64, 32), generator=g) - torch.randint(-3, 19, (64, 1))) * d,
        *((torch.randint(-30, 30, (64, 32), generator=g) * m + 1) * d for m in (2, 3, 4)),
        torch.randint(-20, 20, (64, 32), generator=g) * d * 5,  # gaps of 5 steps: off the divisors
        (torch.arange(32) - 16.0).expand(4, 32) * torch.tensor([[0.1], [0.5], [1.0], [1 / 3]]),
        torch.tensor([[127.0] * 16 + [-128.0] * 16, [7.0] * 16 + [-8.0] * 16, [0.5, 1.5] * 16]),
        torch.zeros(2, 32),
    ]
    special = torch.randn(3, 32, generator=g)
    special[0, 3], special[1, 0], special[2, 31] = float("inf"), float("nan"), float("-inf")
    blocks = torch.cat([*kinds, special])
    near = blocks[320:384].clone()
    near[:, 7] += d[:, 0] * 0.0009  # within the 1e-3 tolerance of the grid
    far = blocks[320:384].clone()
    far[:, 7] += d[:, 0] * 0.002  # outside it
    return torch.cat([blocks, near, far]).float().contiguous()


@pytest.mark.parametrize("affine", [False, True])
def test_the_compiled_grid_search_is_the_tensor_one(ops, affine):
    """The kernels' grid_steps (what quantizing at load uses) gives the tensor version's steps,
    bit for bit, on every kind of block; and it finds the grids it should."""
    blocks = grid_blocks()
    want = grid_step(blocks, affine)
    got = grid_step(blocks, affine, ops)
    assert torch.equal(got, want)
    assert (want[:320] == 0).all()  # float weights
    assert (want[320:384] > 0).all() != affine and (want[384:448] > 0).all()  # q8_0, q4_0
    with pytest.raises(ValueError, match="grid_steps"):
        ops.grid_steps(blocks[:, :16], affine)


def test_int4_of_a_block_far_from_zero_stays_close():
    w = 5 + 0.01 * torch.randn(2, 64)  # no int8 zero point reaches the range's start
    q, d, z = quantize_int4(w)
    back = QuantizedWeight.pack(q, d, z).dequantize()
    assert (back - w).abs().max() < 5 / 7  # symmetric steps of max|w| / 7


# ---- models


def greedy_logprobs(llm: LLM, prompts: list[str], max_tokens: int = 10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    return [(o.token_ids, o.completions[0].logprobs) for o in llm.generate(prompts, params)]


def assert_batch_invariant(llm: LLM, prompts: list[str], max_tokens: int = 10) -> None:
    """Alone (fresh), then 32 at once (each prompt 32 / len(prompts) times, in one batch: its
    copies and the earlier run hit the prefix cache): the same tokens and logprob bits."""
    alone = [greedy_logprobs(llm, [p], max_tokens)[0] for p in prompts]
    batch = greedy_logprobs(llm, prompts * (32 // len(prompts)), max_tokens)
    for i, out in enumerate(batch):
        assert out == alone[i % len(prompts)], (i, out[0], alone[i % len(prompts)][0])


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_batch_invariance_on_the_demo_model(quantization):
    assert_batch_invariant(LLM("demo", quantization=quantization), DEMO_PROMPTS)


@needs_kernels
def test_batch_invariance_on_the_smollm2_shape(tmp_path):
    path = write_model(tmp_path / "smol", "llama", dtype=torch.bfloat16, **SMOLLM2_135M)
    for quantization in (None, "int8"):
        assert_batch_invariant(LLM(str(path), quantization=quantization), PROMPTS[:4], 6)


@needs_kernels
def test_moe_experts_are_batch_invariant_in_bf16_and_count_in_the_weight_bytes(tmp_path):
    """bf16 experts are packed per expert like every dense layer (one arithmetic at any batch);
    quantized, their bytes are what the weights take."""
    path = write_model(tmp_path / "moe", "qwen3_moe", dtype=torch.bfloat16, initializer_range=0.02)
    bf16 = LLM(str(path))
    assert_batch_invariant(bf16, PROMPTS[:4])
    int8 = LLM(str(path), quantization="int8")
    assert 0.4 < int8.engine.loaded.weight_bytes / bf16.engine.loaded.weight_bytes < 0.6


@needs_kernels
def test_int8_demo_stays_close_to_bf16_and_halves_the_weights():
    bf16, int8 = LLM("demo"), LLM("demo", quantization="int8")
    assert int8.engine.loaded.weight_format == "int8"
    assert bf16.engine.loaded.weight_format == "bfloat16"
    checkpoint = sum(f.stat().st_size for f in bf16.engine.loaded.path.glob("*.safetensors"))
    assert int8.engine.loaded.weight_bytes <= 0.55 * checkpoint  # the bf16 file
    assert int8.engine.loaded.weight_bytes <= 0.55 * bf16.engine.loaded.weight_bytes
    params = SamplingParams(temperature=0, max_tokens=16)
    same = sum(
        a.token_ids == b.token_ids
        for a, b in zip(
            bf16.generate(DEMO_PROMPTS, params), int8.generate(DEMO_PROMPTS, params), strict=True
        )
    )
    assert same >= len(DEMO_PROMPTS) // 2, same


def prompt_distributions(llm: LLM, prompts: list[list[int]], vocab: int) -> torch.Tensor:
    params = SamplingParams(max_tokens=0, prompt_logprobs=vocab)
    rows = []
    for out in llm.generate(prompts, params):
        for lp in out.prompt_logprobs[1:]:
            row = torch.full((vocab,), float("-inf"))
            for token, value in lp.top:
                row[token] = value
            rows.append(row)
    return torch.stack(rows)


@needs_kernels
@pytest.mark.parametrize(
    "kind,formats",
    [
        ("llama-linear-rope-untied", ("int8", "int4")),
        ("deepseek_v3", ("int8", "int4")),
        ("deepseek_v4", ("int8",)),
    ],
)
def test_every_family_serves_quantized_close_to_its_dtype(kind, formats, tmp_path):
    """Dense and MoE (experts quantized per expert), MLA, V4; an untied LM head."""
    path = write_model(tmp_path / kind, kind, dtype=torch.bfloat16, initializer_range=0.02)
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8, 40, 41, 42, 43]]
    ref = LLM(str(path), enable_prefix_caching=False)
    vocab = ref.engine.loaded.arch.vocab_size
    base = prompt_distributions(ref, prompts, vocab)
    for fmt in formats:
        got = prompt_distributions(LLM(str(path), quantization=fmt), prompts, vocab)
        kl = (base.exp() * (base - got)).sum(-1).mean().item()
        assert kl < (0.01 if fmt == "int8" else 0.2), (fmt, kl)


@needs_kernels
def test_int8_with_fp8_kv_cache_and_prefix_caching():
    llm = LLM("demo", quantization="int8", kv_cache_dtype="fp8_e4m3")
    assert_batch_invariant(llm, DEMO_PROMPTS[:4])


def test_the_cli_choices_are_the_formats():
    from thermostat.engine.config import QUANTIZATIONS
    from thermostat.models.quant import FORMATS

    assert tuple(FORMATS) == QUANTIZATIONS


def test_quantization_is_refused_clearly():
    with pytest.raises(ModelLoadError, match="quantization must be one of int8, int4"):
        LLM("demo", quantization="int3")
    with pytest.raises(ModelLoadError, match="needs Thermostat's CPU kernels"):
        LLM("demo", quantization="int8", cpu_kernels=False)


# ---- what the operator sees: PD fingerprint, diagnose


def test_a_prefill_in_int8_and_a_decode_in_bf16_disagree_by_name(tmp_path):
    from thermostat.disagg.handoff import model_identity

    (tmp_path / "config.json").write_text("{}")
    sampling = {"effective": {"temperature": 0.7}, "source": {"temperature": "request"}}
    kv = {"dtype": "bfloat16"}
    ident = lambda fmt: model_identity(tmp_path, "LlamaForCausalLM", "torch.bfloat16", fmt)  # noqa: E731
    prefill = fingerprint(ident("int8"), kv, [1, 2], sampling)
    decode = fingerprint(ident("bfloat16"), kv, [1, 2], sampling)
    (found,) = disagreements(prefill, decode)
    assert "'weight_format': 'int8'" in found and "'weight_format': 'bfloat16'" in found


def test_diagnose_names_weight_quantization():
    cells = [
        Cell(decoding, "full", weights, 8, bad, "")
        for decoding in ("greedy", "defaults")
        for weights, bad in (("checkpoint", 0), ("int4", 6))
    ]
    cause, explanation = conclude(cells)
    assert cause == "weight quantization"
    assert "int4 weights 75% vs checkpoint 0%" in explanation


def test_diagnose_sets_greedy_against_the_best_sampled_level_and_wants_significance():
    def cells(greedy: int, defaults: int, recommended: int, n: int = 32) -> list[Cell]:
        return [
            Cell("greedy", "full", "checkpoint", n, greedy, ""),
            Cell("defaults", "full", "checkpoint", n, defaults, ""),
            Cell("recommended", "full", "checkpoint", n, recommended, ""),
        ]

    # the real model's case: a near-greedy recommendation loops too, temperature 1 does not
    cause, explanation = conclude(cells(6, 0, 9))
    assert cause == "greedy decoding"
    assert "greedy 19% vs sampled defaults 0%, recommended 28%" in explanation
    assert one_sided_p(6, 32, 0, 32) < 0.05 < one_sided_p(2, 8, 0, 8)
    assert conclude(cells(2, 0, 0, n=8))[0] == "neither"  # 25% vs 0% of 8: could be chance


def test_linears_are_quantized_as_their_weights_arrive(tmp_path, monkeypatch):
    """A quantized load never holds every float weight at once: each linear layer is quantized
    as soon as its last tensor is read (layer 0's long before the file ends)."""
    from thermostat.engine import loader
    from thermostat.models.linear import QuantLinear
    from thermostat.models.weight_format import LinearsAsLoaded

    path = write_model(tmp_path / "m", num_hidden_layers=4)
    read: list[str] = []
    quantized_at: dict[str, int] = {}
    stream, call = loader.trimmed, LinearsAsLoaded.__call__

    def counted(tensors):
        for name, tensor in stream(tensors):
            read.append(name)
            yield name, tensor

    def recorded(self, module_path: str, sources) -> bool:
        replaced = call(self, module_path, sources)
        if replaced:
            quantized_at[module_path] = len(read)
        return replaced

    monkeypatch.setattr(loader, "trimmed", counted)
    monkeypatch.setattr(LinearsAsLoaded, "__call__", recorded)
    loaded = loader.load_model(path, quantization="int8")
    first = [p for p in quantized_at if p.startswith("layers.0.")]
    assert len(first) == 4  # qkv, o, gate_up, down
    assert max(quantized_at[p] for p in first) <= len(read) // 2
    linears = [m for m in loaded.model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == len(quantized_at) == 16
