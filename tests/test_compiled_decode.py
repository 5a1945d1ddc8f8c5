"""The compiled decode step (thermostat/models/compiled_decode.py) gives the same bits as the
layers' Python forward, for every dense Llama-family shape it takes, and steps aside where it
does not apply."""

from __future__ import annotations

import pytest
import torch

import thermostat.models.llama as llama
from tests.conftest import write_model
from thermostat import LLM, SamplingParams, kernels
from thermostat.models.compiled_decode import compiled_decode
from thermostat.models.layers import DecoderStack


@pytest.fixture(autouse=True)
def build(ops, monkeypatch):
    """Every test once per kernel build this CPU runs (conftest's `ops`): models load with it."""
    monkeypatch.setattr(kernels, "ops", lambda: ops)


SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
CASES = {  # name: (kind, overrides, quantization)
    "llama-bf16": ("llama", {}, None),
    "llama-int8": ("llama", {}, "int8"),
    "llama-int4": ("llama", {}, "int4"),
    "llama-int8-fp16": ("llama", {}, "int8"),  # run in float16
    "qwen2-bias-int8": ("qwen2", {}, "int8"),  # qkv bias
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}, None),
    "mistral-window": ("mistral", {"sliding_window": 8}, "int8"),
    "llama-untied": ("llama", {"tie_word_embeddings": False}, None),
    "llama-fp8-kv": ("llama", {}, None),  # an fp8_e4m3 KV cache
    "llama-int8-fp8-kv": ("llama", {}, "int8"),
}
# the last one's 300 tokens are two chunks of decode attention (merged)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11], [200, 201, 202, 203] * 5, [7, 8, 9] * 100]


def _llm(tmp_path, case: str, **options) -> LLM:
    kind, overrides, quantization = CASES[case]
    path = write_model(tmp_path / case, kind, **(SHAPE | overrides))
    dtype = "float16" if case.endswith("fp16") else "bfloat16"
    kv_cache_dtype = "fp8_e4m3" if case.endswith("fp8-kv") else "auto"
    return LLM(
        str(path), dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype, **options
    )


def _run(llm: LLM, params: SamplingParams) -> list[tuple[list[int], str]]:
    outs = llm.generate(PROMPTS, params)
    return [(o.token_ids, repr(o.completions[0].logprobs)) for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_compiled_step_is_the_python_forward_bit_for_bit(tmp_path, case):
    """One decode batch of four sequences of different lengths (past the sliding window, past
    one chunk of attention): the compiled call (as a team of threads and op by op) and the
    Python layers give equal hidden states; then whole generations (greedy, with logprobs) are
    equal with it on and off."""
    llm = _llm(tmp_path, case)
    runner = llm.engine.runner
    model, cache = runner.model, runner.cache
    captured = []
    execute = runner.execute

    def capture(out, before_forward=None):
        chunks = [c for c in out.chunks if c.token_ids]
        if not captured and chunks and all(len(c.token_ids) == 1 for c in chunks):
            captured.append(runner._prepare(chunks))
        return execute(out, before_forward)

    runner.execute = capture
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    with_compiled = _run(llm, params)
    assert model._compiled is not None and model._compiled[1] is not None
    ids, positions, meta = captured[0]
    assert meta.num_decodes == len(PROMPTS) and not meta.prefills
    compiled = model(ids, positions, meta, cache)
    python = DecoderStack.forward(model, ids, positions, meta, cache)
    assert torch.equal(compiled, python)
    cos, sin = model.rotary.tables(positions)
    step = (meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
    window = meta.sliding_window or 0
    for team in (True, False):
        stack = model._compiled[1].stack
        out = stack.forward(model.embed_tokens(ids), cos, sin, *step, window, team=team)
        assert torch.equal(out, python), f"team={team}"

    model._compiled = (cache, None)  # the Python layers from here on
    assert _run(llm, params) == with_compiled


def test_bad_step_inputs_are_refused_before_any_thread_starts(tmp_path):
    """A slot or a context length outside the cache is a ValueError (no hang, no write), and a
    team of one thread gives the same bits as the pool's."""
    llm = _llm(tmp_path, "llama-int8")
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    model, cache = llm.engine.runner.model, llm.engine.runner.cache
    stack = model._compiled[1].stack
    hidden = model.arch.hidden_size
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    cos, sin = model.rotary.tables(torch.tensor([3]))
    tables, lens = torch.tensor([[0]]), torch.tensor([4])
    slots = cache.spec.block_size * cache.num_blocks
    with pytest.raises(ValueError, match="slot out of range"):
        stack.forward(x.clone(), cos, sin, torch.tensor([slots]), tables, lens, 0)
    with pytest.raises(ValueError, match="context length"):
        stack.forward(x.clone(), cos, sin, torch.tensor([3]), tables, torch.tensor([10**6]), 0)
    pool = stack.forward(x.clone(), cos, sin, torch.tensor([3]), tables, lens, 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = stack.forward(x.clone(), cos, sin, torch.tensor([3]), tables, lens, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, pool)


@pytest.mark.parametrize("case", ["llama-int8", "llama-int4"])
def test_a_preempted_teammate_has_its_pieces_redone_with_the_same_bits(tmp_path, case):
    """A team thread the OS preempts while it holds a piece of a linear (here: every thread but
    the caller sleeps 2 ms in each piece it takes) has that piece redone by the caller, which
    then goes on; the sleeper's late copy is dropped, and the output is the same bits."""
    llm = _llm(tmp_path, case)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    model, cache = llm.engine.runner.model, llm.engine.runner.cache
    stack = model._compiled[1].stack
    rows, bs = 8, cache.spec.block_size  # 8 rows: two pieces of each linear
    x = torch.randn(rows, model.arch.hidden_size, dtype=torch.bfloat16)
    cos, sin = model.rotary.tables(torch.full((rows,), 3))
    step = (torch.arange(rows) * bs + 3, torch.arange(rows)[:, None], torch.full((rows,), 4), 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # (no count is asserted of this call: another process may preempt a teammate here too)
        steady = stack.forward(x.clone(), cos, sin, *step)
        redone = 0
        for _ in range(5):  # the caller may claim every piece of a call before its teammate
            stalled = stack.forward(x.clone(), cos, sin, *step, stall_us=2000)
            assert torch.equal(stalled, steady)
            redone += stack.redone
            if redone:
                break
        assert redone > 0
    finally:
        torch.set_num_threads(threads)


def test_speculative_rows_take_the_compiled_step(tmp_path):
    """Prompt-lookup speculation checks several rows of one sequence in a decode batch: the same
    tokens with the compiled step on and off."""
    llm = _llm(tmp_path, "llama-int8", speculative="ngram")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    on = _run(llm, params)
    model = llm.engine.runner.model
    assert model._compiled is not None and model._compiled[1] is not None
    model._compiled = (llm.engine.runner.cache, None)
    assert _run(llm, params) == on


def test_it_steps_aside_where_an_op_is_not_compiled(tmp_path):
    """float32 linears stay PyTorch's."""
    path = write_model(tmp_path / "llama", "llama", **SHAPE)
    llm = LLM(str(path), dtype="float32")
    runner = llm.engine.runner
    assert compiled_decode(runner.model, runner.cache) is None
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    assert all(len(o.token_ids) == 4 for o in out)


def test_a_mixture_of_experts_layer_keeps_the_python_forward(tmp_path):
    path = write_model(
        tmp_path / "mixtral", "mixtral", **SHAPE, num_local_experts=4, num_experts_per_tok=2
    )
    llm = LLM(str(path), dtype="bfloat16")
    runner = llm.engine.runner
    assert isinstance(runner.model, llama.LlamaFamilyModel)
    assert compiled_decode(runner.model, runner.cache) is None
