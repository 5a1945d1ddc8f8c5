"""`--speculative mtp`: DeepSeek-V3's multi-token-prediction layer as the proposer. Its drafts
are checked against the layer computed with transformers' own decoder layer (transformers
itself drops these layers), and output with it on is the output with speculation off."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
)

import thermostat.engine.scheduler as scheduler_module
from tests.conftest import hf_model, write_model, write_v3_with_next_n
from tests.server_utils import running_server
from tests.test_pd_server import pd_post, single_post
from thermostat import LLM, SamplingParams
from thermostat.engine.checkpoint import ModelLoadError
from thermostat.engine.config import EngineConfig
from thermostat.server.app import create_app
from thermostat.server.config import ServerConfig

OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 5, 17], [200, 201, 202, 203, 204, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return write_v3_with_next_n(tmp_path_factory.mktemp("v3") / "v3")


def reference_drafts(path, tokens: list[int]) -> list[int]:
    """At each position i: the next-n layer's choice from the main model's final hidden state at
    i and the token at i + 1 (what it proposes for i + 2), with transformers' decoder layer."""
    hf = hf_model(path)
    config = hf.config
    layers = config.num_hidden_layers
    weights = load_file(path / "model.safetensors")
    prefix = f"model.layers.{layers}."
    mine = {k.removeprefix(prefix): v.float() for k, v in weights.items() if k.startswith(prefix)}
    layer = DeepseekV3DecoderLayer(config, layer_idx=layers).eval()
    state = {k: v for k, v in mine.items() if not k.startswith(OWN) and ".experts." not in k}
    experts = range(config.n_routed_experts)

    def expert(e: int, proj: str) -> torch.Tensor:
        return mine[f"mlp.experts.{e}.{proj}.weight"]

    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in experts]
    )
    state["mlp.experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in experts])
    layer.load_state_dict(state)

    def norm(name: str) -> DeepseekV3RMSNorm:
        module = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        module.weight.data = mine[f"{name}.weight"]
        return module

    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = hf.model(ids).last_hidden_state[:, :-1]
        embeds = hf.model.embed_tokens(ids[:, 1:])
        x = torch.cat([norm("enorm")(embeds), norm("hnorm")(hidden)], dim=-1)
        x = x @ mine["eh_proj.weight"].T
        positions = torch.arange(x.shape[1])[None]
        mask = create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
        )
        rope = hf.model.rotary_emb(x, positions)
        y = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        logits = norm("shared_head.norm")(y) @ mine["shared_head.head.weight"].T
    return logits[0].argmax(dim=-1).tolist()


def test_drafts_are_the_next_n_layers_choice(v3, monkeypatch) -> None:
    """After every step, a request's draft is the layer's choice at its last token: prefill,
    plain decode steps and steps that checked a draft (accepted or not) keep its cache right."""
    llm = LLM(str(v3), dtype="float32", speculative="mtp", max_num_batched_tokens=8)
    scheduler = llm.engine.scheduler
    seen: list[tuple[list[int], list[int]]] = []
    update = scheduler.update

    def recording(out, result):
        progressed = update(out, result)
        seen.extend((r.prompt_token_ids + r.output_token_ids, r.drafts) for r in progressed)
        return progressed

    monkeypatch.setattr(scheduler, "update", recording)
    outs = llm.generate(PROMPTS, GREEDY)  # prompts prefilled in chunks of 8
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = reference_drafts(v3, prompt + out.token_ids)
        mine = [(s, d) for s, d in seen if s[: len(prompt)] == prompt and d]
        assert len(mine) >= len(out.token_ids) // 2
        for sequence, draft in mine:
            assert draft == [want[len(sequence) - 2]]


def test_output_with_mtp_is_the_output_without(v3) -> None:
    """Greedy tokens and logprobs, and seeded sampling, equal speculation off (in bfloat16, whose
    kernels give a row the same bits in any batch; float32's BLAS does not); drafts were checked
    (a random layer's seldom hold)."""
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)
    off = LLM(str(v3), dtype="bfloat16").generate(PROMPTS * 2, [GREEDY] * 2 + [seeded] * 2)
    llm = LLM(str(v3), dtype="bfloat16", speculative="mtp")
    on = llm.generate(PROMPTS * 2, [GREEDY] * 2 + [seeded] * 2)
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs
    assert all(o.sampling["speculative"]["method"] == "mtp" for o in on)
    assert all(o.sampling["speculative"]["k"] == 1 for o in on)
    assert sum(o.sampling["speculative"]["proposed"] for o in on) > 0


def test_a_held_draft_saves_a_step(v3, monkeypatch) -> None:
    """Drafts that hold are accepted: with the layer's choice replaced by the model's own next
    token (from a run without speculation), every draft holds and the output is unchanged."""
    want = LLM(str(v3), dtype="float32").generate(PROMPTS[:1], GREEDY)[0].token_ids
    llm = LLM(str(v3), dtype="float32", speculative="mtp")
    proposal = scheduler_module.Scheduler._proposal

    def oracle(self, req, budget):
        drafts = proposal(self, req, budget)
        at = req.num_output_tokens
        return [want[at]] * len(drafts) if drafts and at < len(want) else drafts

    monkeypatch.setattr(scheduler_module.Scheduler, "_proposal", oracle)
    out = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert out.token_ids == want
    spec = out.sampling["speculative"]
    assert spec["accepted"] == spec["proposed"] > 0 and spec["steps"] < len(want)


def test_mtp_without_next_n_layers_is_refused(tmp_path) -> None:
    path = write_model(tmp_path / "v2", "deepseek_v2")
    with pytest.raises(ModelLoadError, match="no multi-token-prediction layers"):
        LLM(str(path), speculative="mtp")
    engine = EngineConfig(model=str(path), speculative="mtp")
    with pytest.raises(ModelLoadError, match="no multi-token-prediction layers"):
        create_app(ServerConfig(engine=engine))  # `serve` refuses it before loading anything


def test_pd_halves_both_drafting_answer_as_a_single_server(v3) -> None:
    """The next-n layer's cache slots are cache rows like any layer's: a prefill that runs the
    layer hands them over and a drafting decode continues as a single server does; a prefill
    without it is refused by the decode, naming the cache layout."""
    body = {"prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    with (
        running_server(v3, speculative="mtp") as single,
        running_server(
            v3, disaggregation_mode="prefill", bootstrap_port=0, speculative="mtp"
        ) as prefill,
        running_server(v3, disaggregation_mode="decode", speculative="mtp") as decode,
        running_server(v3, disaggregation_mode="prefill", bootstrap_port=0) as plain_prefill,
    ):
        p, d = pd_post(prefill, decode, "/v1/completions", body)
        assert p.status_code == 200 and d.status_code == 200, d.text
        want = single_post(single, "/v1/completions", body).json()
        assert d.json()["choices"][0]["text"] == want["choices"][0]["text"]
        assert d.json()["sampling"]["speculative"]["proposed"] > 0
        _, refused = pd_post(plain_prefill, decode, "/v1/completions", body)
        assert refused.status_code >= 400, refused.text
        assert "num_layers" in refused.text or "kv_cache" in refused.text, refused.text
