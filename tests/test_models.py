"""Thermostat's model code against transformers on the same random weights (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CONFIGS, hf_greedy, hf_model, write_model
from thermostat import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11], [200, 201, 202, 203] * 9, [64, 3, 8, 150, 77, 31]]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp(request.param), request.param)
    return path, hf_model(path)


def test_prompt_logprobs_match_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    vocab = hf.config.vocab_size
    params = SamplingParams(max_tokens=0, prompt_logprobs=vocab)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None
        for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
            got = torch.full((vocab,), float("nan"))
            for token, value in lp.top:
                got[token] = value
            torch.testing.assert_close(got, expected[pos - 1], atol=2e-4, rtol=1e-4)
            assert lp.token_id == prompt[pos]


def test_greedy_matches_transformers_generate(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs = llm.generate(PROMPTS, params)  # different lengths, submitted together
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 24)
        assert out.finish_reason == "length"
