"""DeepSeek-V2/V3 (MLA + MoE), Qwen3-MoE and Mixtral against transformers on the same random
weights (float32), and the engine's invariances on them."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.conftest import hf_greedy, hf_model
from thermostat import LLM, SamplingParams, kernels
from thermostat.models.llama import MLP
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


def prompt_logprobs(llm: LLM, prompts: list[list[int]], vocab: int) -> list[torch.Tensor]:
    """Per prompt, the engine's next-token log-probabilities at every position but the last
    [len - 1, vocab]."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=vocab)
    rows = []
    for out in llm.generate(prompts, params):
        got = torch.full((len(out.prompt_logprobs) - 1, vocab), float("nan"))
        for pos, lp in enumerate(out.prompt_logprobs[1:]):
            for token, value in lp.top:
                got[pos, token] = value
        rows.append(got)
    return rows


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
