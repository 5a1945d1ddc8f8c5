"""Gemma 3 (thermostat/models/gemma3.py) against transformers on random checkpoints (float32):
a local layer with a 4-token window beside a global one, so every prompt here outgrows the
window. tests/test_models.py holds its prompt logprobs and greedy tokens to transformers'; here
the same tokens and logprobs whatever the engine does around them: batched with other prompts,
prefilled in chunks, from the prefix cache, in the pure-PyTorch path, in bf16 and int8 without
breaking, and served from a GGUF file."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy, hf_model, write_model
from thermostat import LLM, SamplingParams
from thermostat.models.attention import windowed

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [200, 201, 202, 203] * 5, [64, 3, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=3)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("gemma3"), "gemma3")
    return path, hf_model(path)


def run(path, prompts=PROMPTS, **options):
    return LLM(str(path), dtype=options.pop("dtype", "float32"), **options).generate(
        prompts, GREEDY
    )


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        xs, ys = x.completions[0].logprobs or [], y.completions[0].logprobs or []
        assert len(xs) == len(ys) == 12
        for lx, ly in zip(xs, ys, strict=True):
            assert lx.token_id == ly.token_id
            assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4)


def test_greedy_equals_transformers_alone_and_batched(gemma):
    path, hf = gemma
    batched = run(path)
    alone = [run(path, [p])[0] for p in PROMPTS]
    same(batched, alone)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 12)


def test_chunked_prefix_cached_and_pytorch_paths_agree(gemma):
    path, _ = gemma
    want = run(path, enable_prefix_caching=False)
    same(want, run(path, max_num_batched_tokens=5, enable_prefix_caching=False))  # chunks
    cached = LLM(str(path), dtype="float32", block_size=4)
    cached.generate(PROMPTS, GREEDY)  # fills the prefix cache
    same(want, cached.generate(PROMPTS, GREEDY))  # served from it
    same(want, run(path, cpu_kernels=False))


def test_bf16_and_int8_serve(gemma):
    path, hf = gemma
    for options in ({"dtype": "bfloat16"}, {"quantization": "int8"}):
        outs = run(path, **options)
        assert all(len(o.token_ids) == 12 for o in outs)
    int8 = LLM(str(path), dtype="float32", quantization="int8")
    assert int8.engine.loaded.weight_format == "int8"


def test_a_local_layers_window_masks_decodes_and_prefill_chunks():
    from thermostat.models.attention import AttentionMetadata, PrefillSegment

    lens = torch.tensor([3, 9])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(5, dtype=torch.int64),
        num_decodes=2,
        decode_block_tables=torch.zeros(2, 3, dtype=torch.int64),
        decode_context_lens=lens,
        decode_mask=(torch.arange(12)[None, :] < lens[:, None])[:, None, None, :],
        prefills=[PrefillSegment(3, 6, torch.zeros(1, 2, dtype=torch.int64), None)],
    )
    local = windowed(meta, 4)
    assert local.sliding_window == 4
    seen = local.decode_mask[:, 0, 0]
    assert seen[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert seen[1].nonzero().flatten().tolist() == [5, 6, 7, 8]  # the last 4, its own included
    mask = local.prefills[0].mask  # positions 3..5 of 6
    assert mask is not None and mask.tolist()[0] == [True, True, True, True, False, False]
    assert mask.tolist()[2] == [False, False, True, True, True, True]  # position 5: 2..5


def test_served_from_a_gguf_file_as_transformers_reads_it(tmp_path):
    """A Gemma 3 GGUF as llama.cpp's converter writes one (norms stored as 1 + w, no q/k
    permutation, the local/global pattern and query scale left to the config's defaults), Q8_0:
    the engine's greedy tokens are transformers' on the file's dequantized weights."""
    import shutil

    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = write_model(
        tmp_path / "hf", "gemma3", num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=256
    )
    config = hf_model(src).config
    out = tmp_path / "gguf"
    out.mkdir()
    path = out / "tiny-gemma3-q8_0.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_vocab_size(config.vocab_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for name, tensor in load_file(src / "model.safetensors").items():
        base, _, suffix = name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        values = tensor.float().numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name, values + 1.0)  # llama.cpp's converter: 1 + w
        else:
            q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)  # the metadata's tokenizer would be Gemma's own
    reference = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.loaded.arch.local_layers == (0, 1, 2, 3, 4)  # every 6th layer global
    assert llm.engine.loaded.weight_source == "gguf Q8_0"
    outs = llm.generate(PROMPTS, GREEDY)
    wanted = [hf_greedy(reference.eval(), p, 12) for p in PROMPTS]
    agree = sum(o.token_ids == w for o, w in zip(outs, wanted, strict=True))
    assert agree >= 2, agree  # int8 activations (q8_0's arithmetic) may flip a near tie
