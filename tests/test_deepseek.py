"""DeepSeek-V2/V3 (MLA + MoE), Qwen3-MoE and Mixtral against transformers on the same random
weights (float32), and the engine's invariances on them."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.conftest import hf_greedy, hf_model, prompt_logprobs
from tests.test_handoff import run as run_group
from thermostat import LLM, SamplingParams, kernels
from thermostat.models.deepseek import DeepseekArch
from thermostat.models.kv_spec import CacheComponent
from thermostat.models.layers import MLP
from thermostat.models.moe import MoEArch, SparseMoE, expert_target
from thermostat.models.weights import ParameterFiller
from thermostat.random_model import MOE_CONFIGS, write_model

HIDDEN = 64
MOE_BLOCKS = {
    "deepseek_v3": (
        DeepseekV3MoE,
        DeepseekV3Config(
            hidden_size=HIDDEN,
            moe_intermediate_size=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        MoEArch(16, 4, 32, "sigmoid", True, 2.5, 4, 2, "top2_sum", True, 64),
    ),
    "deepseek_v2_group_limited": (
        DeepseekV2Moe,
        DeepseekV2Config(
            hidden_size=HIDDEN,
            moe_intermediate_size=32,
            n_routed_experts=16,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            n_shared_experts=1,
            routed_scaling_factor=16.0,
        ),
        MoEArch(16, 3, 32, "softmax", False, 16.0, 4, 2, "max", False, 32),
    ),
    "qwen3_moe": (
        Qwen3MoeSparseMoeBlock,
        Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        MoEArch(8, 2, 32, "softmax", True),
    ),
    "mixtral": (
        MixtralSparseMoeBlock,
        MixtralConfig(hidden_size=HIDDEN, intermediate_size=48, num_local_experts=4),
        MoEArch(4, 2, 48, "softmax", True),
    ),
}


@pytest.mark.parametrize("family", sorted(MOE_BLOCKS))
def test_moe_block_matches_transformers(family):
    """Routing (softmax/sigmoid, bias, group limit, normalisation, scaling), grouped experts and
    shared experts, on a random block whose router bias is not zero."""
    hf_cls, config, moe = MOE_BLOCKS[family]
    torch.manual_seed(0)
    hf = hf_cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        if hasattr(hf.gate, "e_score_correction_bias"):
            hf.gate.e_score_correction_bias.normal_(0.0, 0.3)
    ops = kernels.ops()
    shared = None
    if moe.shared_intermediate_size:
        shared = MLP(HIDDEN, moe.shared_intermediate_size, False, ops)
    ours = SparseMoE(moe, HIDDEN, ops, shared)
    filler = ParameterFiller(ours)
    rows = moe.shared_intermediate_size
    for name, tensor in hf.state_dict().items():  # the fused expert layout of transformers 5.x
        index: tuple[slice, ...] = ()
        for half, proj in enumerate(("gate_proj", "up_proj")):
            if name == f"shared_experts.{proj}.weight":
                name, index = (
                    "shared_experts.gate_up_proj.weight",
                    (slice(half * rows, (half + 1) * rows),),
                )
        filler.copy(name, tensor, index)
    filler.check_complete()
    x = torch.randn(1, 37, HIDDEN)
    with torch.no_grad():
        expected = hf(x)
        got = ours(x[0])
    torch.testing.assert_close(got, expected.reshape(37, HIDDEN), atol=1e-4, rtol=1e-4)


def test_expert_names_map_to_slices_of_the_fused_parameters():
    assert expert_target("layers.3.mlp.experts.5.up_proj.weight", 32) == (
        "layers.3.mlp.experts.gate_up_proj",
        (5, slice(32, 64)),
    )
    assert expert_target("layers.0.mlp.experts.1.w1.weight", 8) == (
        "layers.0.mlp.experts.gate_up_proj",
        (1, slice(0, 8)),
    )
    assert expert_target("layers.0.mlp.experts.7.w2.weight", 8) == (
        "layers.0.mlp.experts.down_proj",
        (7,),
    )
    assert expert_target("layers.0.mlp.shared_experts.up_proj.weight", 8) is None
    assert expert_target("layers.0.mlp.experts.gate_up_proj", 8) is None


# --- whole models through the engine -------------------------------------------------------

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11], [200, 201, 202, 203] * 9, [64, 3, 8, 150, 77, 31]]
FAMILIES = sorted(MOE_CONFIGS)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp(request.param), request.param)
    return path, hf_model(path)


def test_prompt_logprobs_match_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    vocab = hf.config.vocab_size
    for prompt, got in zip(PROMPTS, prompt_logprobs(llm, PROMPTS, vocab), strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        torch.testing.assert_close(got, expected[:-1], atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_generate(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs = llm.generate(PROMPTS, params)  # different lengths, submitted together
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_fused_expert_layout_and_mtp_layers_load(tmp_path, caplog):
    """transformers 5.x's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj)
    loads to the same model as the per-expert checkpoint save_pretrained writes; layers past
    num_hidden_layers (DeepSeek's multi-token prediction) are skipped with a log line."""
    for kind in ("deepseek_v3", "mixtral"):
        path = write_model(tmp_path / kind, kind)
        hf = hf_model(path)
        fused = tmp_path / f"{kind}-fused"
        fused.mkdir()
        for f in (
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ):
            (fused / f).write_bytes((path / f).read_bytes())
        state = {name: t.clone() for name, t in hf.state_dict().items()}
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
        mtp = hf.config.num_hidden_layers
        if kind == "deepseek_v3":
            state[f"model.layers.{mtp}.eh_proj.weight"] = torch.randn(64, 128)
            state[f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight"] = torch.randn(16, 64)
        save_file(state, fused / "model.safetensors")
        with caplog.at_level(logging.INFO, logger="thermostat.models"):
            got = greedy_tokens(LLM(str(fused), dtype="float32"))
        assert got == greedy_tokens(LLM(str(path), dtype="float32"))
        if kind == "deepseek_v3":
            assert f"skipped multi-token-prediction layers [{mtp}]" in caplog.text


# --- engine invariances on MoE models ------------------------------------------------------

ENGINE_PROMPTS = [*PROMPTS, list(range(40, 90))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def greedy_tokens(llm: LLM, prompts=ENGINE_PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def engine_model(request, tmp_path_factory):
    """(model dir, each prompt's greedy tokens alone without prefix caching, cache bytes per
    token)."""
    path = write_model(tmp_path_factory.mktemp(request.param), request.param)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    reference = [greedy_tokens(llm, [p])[0] for p in ENGINE_PROMPTS]
    spec = llm.engine.cache.spec
    return path, reference, spec.bytes_per_block // spec.block_size


def test_batched_equals_alone(engine_model):
    path, reference, _ = engine_model
    assert greedy_tokens(LLM(str(path), dtype="float32", enable_prefix_caching=False)) == reference


def test_chunked_prefill_equals_unchunked(engine_model):
    path, reference, _ = engine_model
    assert greedy_tokens(LLM(str(path), dtype="float32", max_num_batched_tokens=7)) == reference


def test_prefix_cache_hit_equals_miss(engine_model):
    path, reference, _ = engine_model
    llm = LLM(str(path), dtype="float32", block_size=4)
    assert greedy_tokens(llm) == reference  # fills the cache
    outs = llm.generate(ENGINE_PROMPTS, GREEDY)  # served from it
    assert [o.token_ids for o in outs] == reference
    assert outs[2].num_cached_tokens == 32  # 36 tokens: 8 full blocks, last token recomputed
    llm.engine.blocks.check_integrity()


def test_preemption_equals_no_preemption(engine_model):
    path, reference, bytes_per_token = engine_model
    memory_gb = 20 * 4 * bytes_per_token / 2**30  # 20 blocks of 4 tokens
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory_gb=memory_gb)
    assert llm.engine.blocks.num_blocks == 20
    assert greedy_tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


# --- the latent cache ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek_v3_dir(tmp_path_factory):
    """The tiny DeepSeek-V3 at half the usual init scale: at 0.2, routed_scaling_factor 2.5 makes
    the random model chaotic (a bfloat16 cache alone flips 2% of top-1 choices, by margins up to
    1.9 nats, through routing flips), which would measure the model, not the cache."""
    path = tmp_path_factory.mktemp("deepseek_v3")
    return write_model(path, "deepseek_v3", initializer_range=0.1)


LONG_PROMPTS = [list(range(1, 200, 3)), PROMPTS[2], list(range(40, 90))]


def test_absorbed_decode_equals_expanded_prefill(deepseek_v3_dir):
    """One token per step runs every position through the absorbed form (decode rows); whole
    prompts run the expanded form: the same distributions."""
    vocab = 320
    expanded = LLM(str(deepseek_v3_dir), dtype="float32", enable_prefix_caching=False)
    absorbed = LLM(
        str(deepseek_v3_dir), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=1
    )
    for a, b in zip(
        prompt_logprobs(absorbed, LONG_PROMPTS, vocab),
        prompt_logprobs(expanded, LONG_PROMPTS, vocab),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def compare(full: torch.Tensor, approx: torch.Tensor) -> tuple[float, float, float]:
    """Log-probability rows [N, V] -> (top-1 agreement, mean KL(full || approx), the largest
    full-precision margin of a flipped top-1: a flip only between near-ties keeps it small)."""
    kl = (full.exp() * (full - approx)).sum(-1)
    top = approx.argmax(-1)
    flips = top != full.argmax(-1)
    margin = full.max(-1).values - full.gather(1, top[:, None])[:, 0]
    worst = float(margin[flips].max()) if flips.any() else 0.0
    return 1 - flips.float().mean().item(), kl.mean().item(), worst


def test_bfloat16_model_stays_close_to_float32(deepseek_v3_dir):
    """The bfloat16 path (packed linears, compiled kernels where they apply, float32 router)."""
    vocab = 320
    full = torch.cat(
        prompt_logprobs(LLM(str(deepseek_v3_dir), dtype="float32"), LONG_PROMPTS, vocab)
    )
    approx = prompt_logprobs(LLM(str(deepseek_v3_dir), dtype="bfloat16"), LONG_PROMPTS, vocab)
    agree, kl_mean, _ = compare(full, torch.cat(approx))
    print(f"DeepSeek-V3 bfloat16 vs float32 weights: agreement {agree:.3f}, mean KL {kl_mean:.4f}")
    assert agree >= 0.85 and kl_mean < 0.05


def test_fp8_latent_cache_stays_close_to_full_precision(deepseek_v3_dir):
    """fp8_e4m3 latent KV (one float32 scale per token's latent) vs float32 KV: next-token
    distributions over every prompt position, read in the expanded form (16-token chunks) and in
    the absorbed form (one token per step)."""
    vocab = 320
    sizes = {}

    def dists(kv: str, chunk: int) -> torch.Tensor:
        llm = LLM(
            str(deepseek_v3_dir), dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=chunk
        )
        spec = llm.engine.cache.spec
        sizes[kv] = spec.bytes_per_block // spec.block_size
        return torch.cat(prompt_logprobs(llm, LONG_PROMPTS, vocab))

    report = {}
    for chunk in (16, 1):
        full = dists("float32", chunk)
        for kv in ("bfloat16", "fp8_e4m3"):
            report[kv, chunk] = compare(full, dists(kv, chunk))
    # bytes per token, all layers: the tiny model, and DeepSeek-V3's real shape (61 layers of 576)
    real = DeepseekArch.from_config(DeepseekV3Config(), "DeepseekV3ForCausalLM")
    real_sizes = {
        kv: real.num_layers * CacheComponent("latent", (real.mla.latent_dim,), dtype).bytes_per_row
        for kv, dtype in (("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn))
    }
    print(
        "DeepSeek-V3 latent KV vs float32 (agreement, mean KL, largest flipped margin) per "
        f"(dtype, chunk): {report}; bytes/token tiny {sizes}, real V3 {real_sizes}"
    )
    assert real.mla.latent_dim == 576 and real_sizes == {
        "bfloat16": 61 * 1152,
        "fp8_e4m3": 61 * 580,
    }
    assert sizes == {"float32": 3 * 64 * 4, "bfloat16": 3 * 64 * 2, "fp8_e4m3": 3 * (64 + 4)}
    for chunk in (16, 1):
        agree, kl_mean, worst_margin = report["fp8_e4m3", chunk]
        assert agree >= 0.85 and kl_mean < 0.02 and worst_margin < 1.0
        assert report["bfloat16", chunk][1] < kl_mean  # 8 mantissa bits beat 3


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_latent_rows_hand_off_between_engines(deepseek_v3_dir, kv_cache_dtype):
    """Prefill/decode disaggregation moves the latent rows (fp8 with their scales) between
    caches of different block sizes; the continuation is what one engine generates."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = {"dtype": "float32", "kv_cache_dtype": kv_cache_dtype}
    single = LLM(str(deepseek_v3_dir), enable_prefix_caching=False, **config).engine
    prefill = LLM(str(deepseek_v3_dir), block_size=16, **config).engine
    decode = LLM(str(deepseek_v3_dir), block_size=4, **config).engine
    for prompt in ENGINE_PROMPTS:
        expected = run_group(single, prompts=[prompt], params=params)[0][0]
        (_, prefilled) = run_group(prefill, prompts=[prompt], params=params, handoff=True)[0]
        assert prefilled is not None and set(prefilled.rows.tensors) <= {"latent", "latent.scale"}
        got = run_group(decode, prompts=[prompt], params=params, handoffs=[prefilled])[0][0]
        assert got.token_ids == expected.token_ids
