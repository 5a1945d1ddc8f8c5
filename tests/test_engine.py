"""Engine behaviour: batching, chunking, prefix caching and preemption never change greedy
output; stops, seeds, n, logprobs, abort."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_model, write_model
from thermostat import LLM, SamplingParams
from thermostat.engine.detokenizer import IncrementalDetokenizer
from thermostat.engine.loader import ModelLoadError, load_model

PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [11],
    [200, 201, 202, 203] * 9,
    list(range(40, 90)),
    [64, 3, 8, 150, 77, 31],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
KB = 2**-20  # kv_cache_memory_gb per KiB


def greedy_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("engine"), "llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """Each prompt alone, no prefix caching, whole prefill in one step."""
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False)
    return [greedy_tokens(llm, [p])[0] for p in PROMPTS]


def test_batched_equals_alone(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False)
    assert greedy_tokens(llm) == reference


def test_equal_length_prompts_batched_equal_alone(model_dir):
    """Runs of fresh prompts of one length share one attention call; results must not change."""
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [8, 9, 10, 11, 12, 13, 14], [100, 2, 3, 4, 5, 6, 7]]
    prompts += [[11], [1, 2, 3, 4, 5, 6, 7], [60, 61]]
    alone = [greedy_tokens(llm, [p])[0] for p in prompts]
    assert greedy_tokens(llm, prompts) == alone


def test_chunked_prefill_equals_unchunked(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=7)
    assert greedy_tokens(llm) == reference


def test_prefix_cache_hit_equals_miss(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    assert greedy_tokens(llm) == reference  # fills the cache
    outs = llm.generate(PROMPTS, GREEDY)  # served from it
    assert [o.token_ids for o in outs] == reference
    assert outs[2].num_cached_tokens == 32  # 36 tokens: 8 full blocks, last token recomputed
    assert llm.engine.blocks.prefix_cache_hits > 0
    llm.engine.blocks.check_integrity()


def test_preemption_equals_no_preemption(model_dir, reference):
    # 2 layers x K,V x 2 heads x 16 dims x fp32 = 512 bytes per token; 20 blocks of 4 tokens.
    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory_gb=40 * KB)
    assert greedy_tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_request_larger_than_cache_is_refused(model_dir):
    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory_gb=8 * KB)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([list(range(1, 60))], GREEDY)
    assert not llm.engine.has_unfinished()


def test_seeded_request_same_alone_and_in_mixed_batch(model_dir):
    llm = LLM(str(model_dir), dtype="float32")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    others = [
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=7, top_k=5, max_tokens=16, ignore_eos=True),
    ]
    mixed = llm.generate(
        [PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], seeded, *others[1:]]
    )
    assert mixed[1].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    draws = {tuple(llm.generate([PROMPTS[0]], unseeded)[0].token_ids) for _ in range(3)}
    assert len(draws) > 1  # sampling actually samples


def test_top_k_one_equals_greedy(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=1.3, top_k=1, max_tokens=20, ignore_eos=True)
    assert greedy_tokens(llm, params=params) == reference


def test_n_completions_and_logprobs(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, logprobs=2, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params)[0]
    assert len(out.completions) == 3
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    for c in out.completions:
        assert len(c.logprobs) == len(c.token_ids) == 8
        for token, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 2
            assert lp.top[0][1] >= lp.top[1][1]


def test_max_tokens_min_tokens_stop_token_ids(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32")
    first = reference[0]
    stop_at = first[5]
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == first[: first.index(stop_at) + 1]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, stop_token_ids=[stop_at])
    out = llm.generate([PROMPTS[0]], params)[0]
    assert len(out.token_ids) == 10 and stop_at not in out.token_ids


def test_stop_string_is_cut_and_never_emitted_partially(model_dir):
    llm = LLM(str(model_dir), dtype="float32")
    engine = llm.engine
    base = llm.generate(
        [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    engine.add_group("g", engine.plan([PROMPTS[3]], params))
    streamed, final = "", None
    for _ in range(100):
        for out in engine.step():
            streamed += out.new_text
            assert stop not in streamed
            final = out
        if final is not None and final.finished:
            break
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert streamed == text[: text.index(stop)]
    assert not engine.has_unfinished()  # ended in the step that found the stop string


def test_abort_frees_blocks(model_dir):
    llm = LLM(str(model_dir), dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    ids = [item.req_id for item in engine.add_group("g", engine.plan(PROMPTS, GREEDY))]
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    for req_id in ids:
        engine.abort(req_id)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check_integrity()
    engine.step()  # the runner drops their state
    assert engine.runner.requests == {}


def test_text_prompts_and_incremental_detokenization(model_dir):
    llm = LLM(str(model_dir), dtype="float32")
    tok = llm.tokenizer
    text = "naïve café 日本語 🙂 it was the age"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    out = llm.generate("It was the", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[
        0
    ]
    assert out.text == tok.decode(out.token_ids)


def test_fp8_kv_cache_stays_close_to_full_precision(model_dir):
    """fp8_e4m3 KV vs float32 KV: next-token distributions over every prompt position."""
    vocab = 320
    params = SamplingParams(max_tokens=0, prompt_logprobs=vocab)
    prompts = [list(range(1, 200, 3)), PROMPTS[2], PROMPTS[3]]

    def dists(kv: str) -> torch.Tensor:
        llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=16)
        rows = []
        for out in llm.generate(prompts, params):
            for lp in out.prompt_logprobs[1:]:
                row = torch.empty(vocab)
                for token, value in lp.top:
                    row[token] = value
                rows.append(row)
        return torch.stack(rows)

    full = dists("float32")
    report = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        approx = dists(kv)
        kl = (full.exp() * (full - approx)).sum(-1)
        top = approx.argmax(-1)
        flips = top != full.argmax(-1)
        # A flip only between near-ties: the full-precision margin of the flipped pair is small.
        margin = full.max(-1).values - full.gather(1, top[:, None])[:, 0]
        report[kv] = (
            1 - flips.float().mean().item(),
            kl.mean().item(),
            float(margin[flips].max()) if flips.any() else 0.0,
        )
    print(f"KV cache vs float32 (agreement, mean KL, largest flipped margin): {report}")
    agree, kl_mean, worst_margin = report["fp8_e4m3"]
    assert agree >= 0.85 and kl_mean < 0.02 and worst_margin < 1.0
    assert report["bfloat16"][1] < kl_mean  # 8 mantissa bits beat 3


def test_load_errors_name_the_file_or_field(tmp_path, model_dir):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    )
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tmp_path)
    broken = write_model(tmp_path / "broken", "llama")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(broken)


def test_sharded_checkpoint_and_dtypes(tmp_path, model_dir, reference):
    """A sharded save (model.safetensors.index.json) loads to the same model; float16 and
    bfloat16 run and mostly agree with float32 greedy output."""
    hf = hf_model(model_dir)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (sharded / name).write_bytes((model_dir / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert greedy_tokens(LLM(str(sharded), dtype="float32")) == reference
    for dtype in ("float16", "bfloat16"):
        tokens = greedy_tokens(LLM(str(model_dir), dtype=dtype), [PROMPTS[0]])[0]
        assert tokens[:3] == reference[0][:3], dtype


def test_before_forward_runs_once_per_forward_with_the_inputs_ready(model_dir):
    """The server hands out a step's deltas from this hook, while the next forward runs: it is
    called once per step that runs the model, right before the model, and never otherwise."""
    llm = LLM(str(model_dir), dtype="float32")
    engine = llm.engine
    events: list[str] = []
    model = engine.runner.model
    real_forward = model.forward

    def forward(*args, **kwargs):
        events.append("forward")
        return real_forward(*args, **kwargs)

    model.forward = forward
    engine.add_group("g", engine.plan([PROMPTS[0]], GREEDY))
    steps = 0
    while engine.has_unfinished() and steps < 100:
        engine.step(before_forward=lambda: events.append("hook"))
        steps += 1
    assert steps == GREEDY.max_tokens
    assert events == ["hook", "forward"] * steps
    assert engine.step(before_forward=lambda: events.append("idle")) == []
    assert "idle" not in events
