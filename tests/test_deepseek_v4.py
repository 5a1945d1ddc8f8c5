"""DeepSeek-V4 (hyper-connections, CSA/HCA compressed attention, the lightning indexer, hash and
score routing) against transformers' DeepseekV4ForCausalLM on the same random weights (float32),
and the engine's invariances on it: batching, chunked prefill, prefix hits inside an open HCA
window, preemption, prefill/decode handoff, the fp8 cache, DeepSeek's own fp8/MXFP4 checkpoints,
HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import DeepseekV4Config

from tests.conftest import hf_greedy, hf_model
from tests.server_utils import running_server
from tests.test_deepseek import compare, prompt_logprobs
from tests.test_handoff import run as run_group
from tests.v4_official import dequantized_hf_checkpoint, write_hf_v4, write_official_checkpoint
from thermostat import LLM, SamplingParams
from thermostat.cli import main
from thermostat.engine.block_manager import compute_block_hashes
from thermostat.engine.kv_blocks import size_pools
from thermostat.models.deepseek_v4 import V4Arch
from thermostat.models.v4_cache import v4_cache_requirement, v4_cache_spec
from thermostat.random_model import build_tokenizer, write_model

VOCAB = 320
# 7, 1, 50 and 65 tokens: past several HCA windows (rates 16 and 32) and many CSA windows
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [11],
    list(range(40, 90)),
    [200, 201, 202, 203] * 9 + list(range(1, 30)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def greedy_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v4_pro"])
def v4(request, tmp_path_factory):
    """(model dir, transformers' model, each prompt's greedy tokens alone without prefix
    caching)."""
    path = write_model(tmp_path_factory.mktemp(request.param), request.param)
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    return path, hf_model(path), [greedy_tokens(llm, [p])[0] for p in PROMPTS]


def test_greedy_matches_transformers_generate(v4):
    path, hf, alone = v4
    assert alone == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    batched = greedy_tokens(LLM(str(path), dtype="float32", enable_prefix_caching=False))
    assert batched == alone  # mixed lengths in one batch


def test_prompt_logprobs_match_transformers(v4):
    path, hf, _ = v4
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    for prompt, got in zip(PROMPTS, prompt_logprobs(llm, PROMPTS, VOCAB), strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        torch.testing.assert_close(got, expected[:-1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("budget", [7, 3])
def test_chunked_prefill_equals_unchunked(v4, budget):
    """Chunks that end inside CSA and HCA windows: the compressor state carries over."""
    path, _, alone = v4
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=budget, block_size=4)
    assert greedy_tokens(llm) == alone


def test_prefix_hit_inside_an_open_hca_window_equals_a_miss(v4):
    path, _, alone = v4
    llm = LLM(str(path), dtype="float32", block_size=4)
    assert greedy_tokens(llm) == alone  # fills the cache
    outs = llm.generate(PROMPTS, GREEDY)  # served from it
    assert [o.token_ids for o in outs] == alone
    assert [o.num_cached_tokens for o in outs] == [4, 0, 48, 64]
    # 38 shared tokens: a hit of 36, inside the HCA window [32, 48) (rate 16) or [32, 64) (32)
    branch = PROMPTS[2][:38] + [7, 8, 9, 10, 11]
    miss = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    (hit,) = llm.generate([branch], GREEDY)
    assert hit.num_cached_tokens == 36
    assert hit.token_ids == greedy_tokens(miss, [branch])[0]
    llm.engine.blocks.check_integrity()


@pytest.mark.parametrize("v4", ["deepseek_v4"], indirect=True)  # one layer mix is enough
def test_long_generation_holds_a_bounded_window(v4):
    """160 tokens (blocks of 4, past several windows of every pool): between steps the sequence
    holds at most ceil(window / 4) + 1 blocks of each window pool, while the main pool (entries
    and index keys only, at their rates) holds a block per 4 tokens of context."""
    path, _, alone = v4
    # --speculative is asked for and stays off: window pools and compressors keep state that a
    # rejected proposal would change (engine/speculative.py)
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              speculative="ngram")  # fmt: skip
    assert not llm.engine.scheduler.speculation.on
    engine, spec = llm.engine, llm.engine.cache.spec
    assert all(c.rate > 1 for c in spec.components if c.window is None)
    assert len(spec.pools) > 2 and spec.pools[1] == 7  # kv rows (W = 8 or 16), CSA state
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    (queued,) = engine.add_group("long", engine.plan([PROMPTS[2]], params))
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.new_token_ids
        req = engine.scheduler.requests.get(queued.req_id)
        if req is None:
            continue
        held = [pool.num_blocks - pool.num_free_blocks for pool in engine.blocks.pools]
        assert held[0] == -(-req.num_computed_tokens // 4)
        for window, n in zip(spec.pools[1:], held[1:], strict=True):
            assert n <= spec.window_blocks(window), (req.num_computed_tokens, window, n)
    assert len(tokens) == 160 and tokens[:20] == alone[2]
    engine.blocks.check_integrity()


@pytest.mark.parametrize("v4", ["deepseek_v4"], indirect=True)  # one layer mix is enough
def test_prefix_hit_lacking_a_window_block_falls_back_to_a_shorter_exact_hit(v4):
    """The window pool's block of positions [32, 36) is evicted: a hit of 36 tokens would lack
    window rows, so the hit is 32 tokens, and its continuation is a miss's."""
    path, _, alone = v4
    llm = LLM(str(path), dtype="float32", block_size=4)
    assert greedy_tokens(llm, [PROMPTS[2]]) == [alone[2]]
    blocks = llm.engine.blocks
    kv_pool = blocks.pools[llm.engine.cache.spec.pool_of("kv_nope")]
    hashes = compute_block_hashes(PROMPTS[2], 4)
    evicted = kv_pool._hash_to_block.pop(hashes[8])  # as the allocator evicts a free block
    kv_pool.blocks[evicted].hash = None
    blocks.check_integrity()
    branch = PROMPTS[2][:38] + [7, 8, 9, 10, 11]
    (hit,) = llm.generate([branch], GREEDY)
    assert hit.num_cached_tokens == 32
    miss = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    assert hit.token_ids == greedy_tokens(miss, [branch])[0]
    blocks.check_integrity()


def test_preemption_equals_no_preemption(v4):
    """A cache whose main pool is 24 blocks (the window pools take at most half the memory,
    never less than one sequence's window and chunk; the main pool the rest)."""
    path, _, alone = v4
    spec = LLM(str(path), dtype="float32", block_size=4).engine.cache.spec
    low, high = 1, 2**30  # the least memory with 24 main blocks
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if size_pools(spec, mid, 64, 16, 2**20)[0] < 24 else (low, mid)
    config = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 16}
    llm = LLM(str(path), kv_cache_memory_gb=low / 2**30, **config)
    assert llm.engine.cache.pool_blocks == tuple(
        size_pools(spec, low, 64, 16, llm.engine.loaded.max_model_len)
    )
    assert llm.engine.blocks.num_blocks == 24 and len(llm.engine.blocks.pools) > 2
    assert greedy_tokens(llm) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    for pool in llm.engine.blocks.pools:
        assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize(
    ("kind", "kv_cache_dtype"), [("deepseek_v4", "fp8_e4m3"), ("deepseek_v4_pro", "auto")]
)
def test_rows_hand_off_between_engines(tmp_path, kind, kv_cache_dtype):
    """Window rows, compressor state, entries and index keys move between caches of different
    block sizes; the continuation is what one engine generates."""
    path = write_model(tmp_path / kind, kind)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = {"dtype": "float32", "kv_cache_dtype": kv_cache_dtype}
    single = LLM(str(path), enable_prefix_caching=False, **config).engine
    prefill = LLM(str(path), block_size=16, **config).engine
    decode = LLM(str(path), block_size=4, **config).engine
    for prompt in (PROMPTS[0], PROMPTS[3]):  # within and past the first HCA window
        expected = run_group(single, prompts=[prompt], params=params)[0][0]
        (_, prefilled) = run_group(prefill, prompts=[prompt], params=params, handoff=True)[0]
        assert prefilled is not None
        got = run_group(decode, prompts=[prompt], params=params, handoffs=[prefilled])[0][0]
        assert got.token_ids == expected.token_ids


def test_fp8_cache_stays_close_to_full_precision(tmp_path):
    """fp8_e4m3 window rows, entries and index keys (the rope parts and compressor state stay in
    the model dtype) vs a float32 cache: next-token distributions at every prompt position, in
    8-token chunks and one token per step (bfloat16 for scale, in chunks only). At a quarter of
    the usual init scale: at 0.2 the random model is chaotic (the indexer's top-k and the
    routing are discrete, a bfloat16 cache alone flips top-1 choices by margins of 1.5 nats),
    which would measure the model, not the cache."""
    path = write_model(tmp_path / "v4", "deepseek_v4", initializer_range=0.05)
    long_prompts = [list(range(1, 200, 3))]
    report = {}
    for chunk, dtypes in ((8, ("bfloat16", "fp8_e4m3")), (1, ("fp8_e4m3",))):
        runs = {}
        for kv in ("float32", *dtypes):
            llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=chunk)
            runs[kv] = torch.cat(prompt_logprobs(llm, long_prompts, VOCAB))
        for kv in dtypes:
            report[kv, chunk] = compare(runs["float32"], runs[kv])
    print(f"DeepSeek-V4 KV vs float32 (agreement, mean KL, largest flipped margin): {report}")
    for chunk in (8, 1):
        agree, kl_mean, worst_margin = report["fp8_e4m3", chunk]
        assert agree >= 0.85 and kl_mean < 0.02 and worst_margin < 1.0
    assert report["bfloat16", 8][1] < report["fp8_e4m3", 8][1]  # the cheaper cache costs more


def test_official_fp8_mxfp4_checkpoint_equals_transformers_on_its_dequantized_weights(tmp_path):
    """DeepSeek's names, fp8 e4m3 linears with e8m0 128x128 scales, MXFP4 routed experts, an MTP
    layer, legacy config keys: the engine serves what transformers computes on the same weights
    dequantized."""
    hf_dir = write_hf_v4(tmp_path / "hf")
    build_tokenizer().save_pretrained(hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    official = write_official_checkpoint(hf_dir, tmp_path / "official")
    reference = hf_model(dequantized_hf_checkpoint(official, tmp_path / "dequantized"))
    llm = LLM(str(official), dtype="float32")
    prompts = [PROMPTS[0], PROMPTS[2]]
    assert greedy_tokens(llm, prompts) == [hf_greedy(reference, p, 20) for p in prompts]
    for prompt, got in zip(prompts, prompt_logprobs(llm, prompts, 256), strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(got, torch.log_softmax(logits, -1)[:-1], atol=1e-3, rtol=1e-3)


def test_served_over_http_as_by_the_engine(v4):
    path, _, alone = v4
    with running_server(path, dtype="float32") as server:
        client = server.client()
        got = client.completions.create(
            model=server.model, prompt=PROMPTS[2], temperature=0, max_tokens=20
        )
        chat = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "hello"}],
            temperature=0,
            max_tokens=8,
            stream=True,
        )
        chunks = list(chat)
        info = httpx.get(f"{server.url}/server_info").json()
        spec = server.engine.cache.spec
    assert info["kv_bytes_per_token"] == spec.bytes_per_token > 0
    assert info["kv_fixed_bytes_per_sequence"] == spec.fixed_bytes_per_sequence > 0
    assert got.choices[0].text == server_text(path, alone[2])
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None


def server_text(path, token_ids: list[int]) -> str:
    return LLM(str(path), dtype="float32").tokenizer.decode(token_ids)


def test_flash_shapes_cache_bytes():
    """The config's shapes at V4-Flash (a bfloat16 model, blocks of 16): what the engine stores
    per token of context and per sequence whatever its length, against what the shapes require
    (thermostat.models.v4_cache). Per token within 1.25x in fp8 and bfloat16 (the engine keeps
    one HCA row per block of 16 where 1 per 128 is needed); fixed per sequence within 1.25x of
    the note's requirement, which keeps compressor state in float32 (SGLang, vLLM), while the
    engine keeps it in the model dtype; against a bfloat16-state requirement it is ~1.35x
    (CSA state: two blocks of 16 for a window of 7 positions)."""
    arch = V4Arch.from_config(
        DeepseekV4Config(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0]), "DeepseekV4ForCausalLM"
    )
    assert arch.kinds.count("csa") == 21 and arch.kinds.count("hca") == 20
    assert arch.layers_of("sliding") == (0, 1)
    fp8_per_token, _ = v4_cache_requirement(arch, torch.float8_e4m3fn, torch.float32)
    assert fp8_per_token == pytest.approx(3850, abs=1)  # the note's 21*(584+132)/4 + 20*584/128
    report = {}
    for kv in (torch.float8_e4m3fn, torch.bfloat16):
        spec = v4_cache_spec(arch, 16, kv, torch.bfloat16)
        assert spec.pools == (None, 7, 127)  # CSA state; window rows and HCA state
        for state in (torch.float32, torch.bfloat16):
            per_token, fixed = v4_cache_requirement(arch, kv, state)
            report[str(kv), str(state)] = (
                spec.bytes_per_token,
                spec.fixed_bytes_per_sequence,
                round(spec.bytes_per_token / per_token, 3),
                round(spec.fixed_bytes_per_sequence / fixed, 3),
            )
            assert spec.bytes_per_token <= 1.25 * per_token
            if state == torch.float32:
                assert spec.fixed_bytes_per_sequence <= 1.25 * fixed
    print(f"V4-Flash (kv, required state dtype) -> bytes/token, fixed/seq, ratios: {report}")


def test_diagnose_names_greedy_decoding_on_v4(tmp_path, capsys):
    """The case on its own architecture: greedy decoding loops, sampling does not, and the fp8
    cache changes nothing; `diagnose` says so."""
    path = write_model(tmp_path / "v4", "deepseek_v4", initializer_range=0.02)
    code = main(
        ["diagnose", "--model", str(path), "--max-tokens", "48", "--dtype", "float32",
         "--weights", "checkpoint"]
    )  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "cause: greedy decoding" in out
