"""GGUF files written here from a tiny random Llama as llama.cpp's converter writes them (q and k
rows permuted for its rotary layout, the tokenizer in the metadata, Q8_0 / Q4_0 blocks from
gguf.quants), against the file's own integers and against transformers on its dequantized
weights."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.conftest import hf_model
from tests.test_deepseek import PROMPTS, prompt_logprobs
from thermostat import LLM, SamplingParams, kernels
from thermostat.api.defaults import DefaultsReport
from thermostat.cli import main
from thermostat.engine.loader import load_model, model_config_dict, resolve_model_path
from thermostat.models import gguf_checkpoint, gguf_reading
from thermostat.models.gguf_blocks import BlockGrid, record_format
from thermostat.models.gguf_checkpoint import GGUFCheckpoint
from thermostat.models.linear import QuantEmbedding
from thermostat.models.quant import SUPER, QuantizedWeight, reference_linear
from thermostat.random_model import write_model
from thermostat.sampling import Policy

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="int8 / int4 need the CPU kernels")

SMALL = {"enable_prefix_caching": False, "kv_cache_memory_gb": 0.02}  # a tiny model's cache
GGUF_NAMES = {  # Hugging Face (without model.layers.N.) -> GGUF (without blk.N.)
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: q / k rows to llama.cpp's rotary layout."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_rope_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a llama3 rope: the divisor of each frequency."""
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_name(hf: str) -> str:
    if ".experts." in hf:  # stacked: model.layers.N.mlp.experts.{proj}
        layer, proj = hf.split(".")[2], hf.rsplit(".", 1)[1].removesuffix("_proj")
        return f"blk.{layer}.ffn_{proj}_exps.weight"
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def add_tokenizer(writer: gguf.GGUFWriter, src: Path, vocab_size: int) -> None:
    """The model's byte-level BPE as llama.cpp's converter stores a "gpt2" tokenizer."""
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["id"] for t in spec["added_tokens"]}
    types = [
        gguf.TokenType.CONTROL
        if i in special
        else gguf.TokenType.UNUSED
        if i >= len(vocab)
        else gguf.TokenType.NORMAL
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    template = json.loads((src / "tokenizer_config.json").read_text()).get("chat_template")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def write_gguf(
    src: Path, out: Path, qtype: Q, arch: str = "llama", experts_qtype: Q | None = None
) -> dict[str, torch.Tensor]:
    """`src` (a float32 Llama or Qwen3-MoE checkpoint) as a GGUF whose matrices are `qtype`
    (stacked experts: random valid blocks of `experts_qtype` where given, for the types gguf
    cannot quantize to); returns the file's dequantized weights under their Hugging Face names
    (q and k rows back in order, experts one by one)."""
    config = json.loads((src / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({Q.Q8_0: 7, Q.Q4_0: 2, Q.Q4_1: 3}[qtype])
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_tokenizer(writer, src, config["vocab_size"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, theta, head_dim))
    state = {k: t.float().numpy() for k, t in load_file(src / "model.safetensors").items()}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in stack_experts(state).items():
        heads_of = {"q_proj": heads, "k_proj": kv_heads}.get(name.split(".")[-2])
        if arch == "llama" and heads_of:
            w = llama_cpp_permute(w, heads_of)
        if w.ndim == 3 and experts_qtype is not None:
            rows = w.shape[0] * w.shape[1]
            blocks = random_blocks(rows, w.shape[2], experts_qtype, seed=len(dequantized))
            blocks = blocks.reshape(*w.shape[:2], -1)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=experts_qtype)
            w = gguf.quants.dequantize(blocks, experts_qtype)
        elif w.ndim >= 2:
            blocks = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=qtype)
            w = gguf.quants.dequantize(blocks, qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
        if arch == "llama" and heads_of:  # back to Hugging Face's rows
            w = w[np.argsort(llama_cpp_permute(np.arange(w.shape[0]), heads_of))]
        if ".experts." in name:
            prefix, proj = name.rsplit(".", 1)
            for e, expert in enumerate(w):
                dequantized[f"{prefix}.{e}.{proj}.weight"] = torch.from_numpy(expert.copy())
        else:
            dequantized[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def stack_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert weights `...experts.{e}.{proj}.weight` stacked as llama.cpp stores them:
    `...experts.{proj}` [E, ...]."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list[np.ndarray]] = {}
    for name, w in state.items():
        if ".experts." in name:
            prefix, _, _e, proj, _ = name.rsplit(".", 4)
            experts.setdefault(f"{prefix}.experts.{proj}", []).append(w)
        else:
            out[name] = w
    return out | {name: np.stack(ws) for name, ws in experts.items()}


def write_reference(src: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory):
    """(the Q8_0 file in a directory of its own, its dequantized weights, the float source)."""
    root = tmp_path_factory.mktemp("gguf")
    src = write_model(root / "float")
    (root / "q8").mkdir()
    path = root / "q8" / "tiny-q8_0.gguf"
    return path, write_gguf(src, path, Q.Q8_0), src


def q8_0_rows(reader: gguf.GGUFReader, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's own integers [N, K] and float16 scales [N, K / 32], from its bytes, its
    rows in Hugging Face's order (q and k back from llama.cpp's permutation)."""
    raw = next(t for t in reader.tensors if t.name == name).data
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, 34)
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0]
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[-2])
    if heads:
        inverse = np.argsort(llama_cpp_permute(np.arange(len(q)), heads))
        q, d = q[inverse], d[inverse]
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(d))


def test_the_header_reads_as_ggufs_own_reader_reads_it(q8_0, tmp_path):
    """read_header's one-pass arrays (strings, numbers, an empty one) give every field's
    contents, types and offset and every tensor as gguf's GGUFReader does."""
    path = tmp_path / "arrays.gguf"
    shutil.copy(q8_0[0], path)
    writer = gguf.GGUFWriter(tmp_path / "extra.gguf", "llama")
    writer.add_array("test.scores", [0.5, -1.25, 3.0])
    writer.add_array("test.empty", [])
    writer.add_array("test.words", ["a", "", "ünï"])
    writer.add_uint32("test.number", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    for file in (path, tmp_path / "extra.gguf"):
        ours, theirs = gguf_reading.read_header(file), gguf.GGUFReader(file)
        assert list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            mine = ours.fields[name]
            assert (mine.offset, mine.types) == (field.offset, field.types), name
            want = field.contents()
            got = mine.contents()
            assert np.array_equal(got, want) if isinstance(want, np.ndarray) else got == want, name
            if field.types[0] == gguf.GGUFValueType.ARRAY and field.data:
                assert mine.contents(-1) == field.contents(-1), name
        assert [(t.name, t.data_offset, t.shape.tolist()) for t in ours.tensors] == [
            (t.name, t.data_offset, t.shape.tolist()) for t in theirs.tensors
        ]
    assert ours.fields["test.words"].contents() == ["a", "", "ünï"]


def test_transformers_converts_the_file_alike_on_either_reader(q8_0, tmp_path, monkeypatch):
    """The config and the tokenizer transformers converts from the file on its first start, read
    through gguf_reading's reader (handed to transformers for the conversion), are what it
    converts through gguf's own: the same files saved, byte for byte."""
    path = q8_0[0]
    saved, readers = {}, []
    real_init = gguf_reading._ArrayViewReader.__init__

    def counted(self, *args, **kwargs):
        readers.append(args[0])
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(gguf_reading._ArrayViewReader, "__init__", counted)
    for name, cache in (("ours", tmp_path / "ours"), ("gguf's", tmp_path / "theirs")):
        monkeypatch.setenv("THERMOSTAT_GGUF_CACHE", str(cache))
        if name == "gguf's":  # the conversion as transformers runs it unaided
            monkeypatch.setattr(gguf_reading, "_array_view_reader", contextlib.nullcontext)
        gguf_reading.cached_config(path)
        gguf_reading.cached_tokenizer(path)
        saved[name] = {
            f.relative_to(cache): f.read_bytes() for f in cache.rglob("*") if f.is_file()
        }
        if name == "ours":
            assert len(readers) >= 2  # the config's conversion and the tokenizer's read through it
    assert len(saved["ours"]) >= 4 and saved["ours"] == saved["gguf's"]


def test_q8_0_is_served_in_int8_with_the_files_integers_and_scales(q8_0):
    path, _, _ = q8_0
    loaded = load_model(path)
    assert (loaded.weight_format, loaded.weight_source) == ("int8", "gguf Q8_0")
    assert loaded.dtype == torch.bfloat16  # "auto" for a quantized file
    reader = gguf.GGUFReader(path)
    for layer, block in enumerate(loaded.model.layers):
        for module, names in (
            (block.self_attn.qkv_proj, ["attn_q", "attn_k", "attn_v"]),
            (block.self_attn.o_proj, ["attn_output"]),
            (block.mlp.gate_up_proj, ["ffn_gate", "ffn_up"]),
            (block.mlp.down_proj, ["ffn_down"]),
        ):
            q, d, _ = module.weight.unpack()
            parts = [q8_0_rows(reader, f"blk.{layer}.{n}.weight") for n in names]
            assert torch.equal(q, torch.cat([p[0] for p in parts])), (layer, names)
            assert torch.equal(d, torch.cat([p[1] for p in parts])), (layer, names)
    embed_q, embed_d, _ = loaded.model.embed_tokens.weight.unpack()
    file_q, file_d = q8_0_rows(reader, "token_embd.weight")
    assert torch.equal(embed_q, file_q) and torch.equal(embed_d, file_d)


def test_weights_served_as_stored_are_never_made_floats(q8_0, monkeypatch):
    """The floats of a quantized tensor are made only for a module the model keeps in floats:
    nothing of a file served as stored is dequantized at load, the embeddings' table included
    (served from its blocks as soon as it is read), and the file's pages are let go of as each
    tensor is read."""
    made: list[tuple[int, ...]] = []
    real = BlockGrid.dequantize
    monkeypatch.setattr(
        BlockGrid, "dequantize", lambda self: made.append(tuple(self.q.shape)) or real(self)
    )
    released: list[str] = []
    monkeypatch.setattr(
        gguf_checkpoint, "release_pages", lambda reader, tensor: released.append(tensor.name)
    )
    loaded = load_model(q8_0[0])
    assert made == []
    assert loaded.weight_format == "int8"
    assert isinstance(loaded.model.embed_tokens, QuantEmbedding)
    assert released == [t.name for t in gguf.GGUFReader(q8_0[0]).tensors]


def mapped_kb(path: Path) -> int:
    """This process's resident kB of its maps of file `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_read_tensors_pages_leave_resident_memory_and_read_back_the_same(tmp_path):
    """release_pages drops a tensor's pages of the mapped file from the process's resident
    memory; reading it again gives the same bytes."""
    path = tmp_path / "three.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    for i in range(3):  # 256 kB each
        writer.add_tensor(f"t{i}", rng.standard_normal((256, 256)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf_reading._ArrayViewReader(path)
    tensors = list(reader.tensors)
    before = [t.data.tobytes() for t in tensors]  # every page touched
    resident = mapped_kb(path)
    for tensor in tensors:
        gguf_reading.release_pages(reader, tensor)
    released = sum(t.n_bytes for t in tensors) // 1024
    assert mapped_kb(path) <= resident - released + 8 * len(tensors), (resident, released)
    assert [t.data.tobytes() for t in tensors] == before


def test_logits_match_transformers_on_the_files_weights(q8_0, tmp_path):
    path, dequantized, src = q8_0
    assert_logits_close(path, write_reference(src, tmp_path / "ref", dequantized))


def assert_logits_close(path: Path, reference: Path) -> None:
    """The engine's prompt logprobs on the GGUF file `path` within KL 0.01 of transformers' on
    its dequantized weights (`reference`): int8 activations, per block of 32."""
    hf = hf_model(reference)
    llm = LLM(str(path), dtype="float32", **SMALL)
    prompts = [p for p in PROMPTS if len(p) > 1]
    for prompt, got in zip(prompts, prompt_logprobs(llm, prompts, 320), strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)[:-1]
        kl = (expected.exp() * (expected - got)).sum(-1)
        assert kl.max() < 0.01, kl


def test_greedy_generation_tokenizer_and_chat_template_from_the_metadata(q8_0):
    path, _, src = q8_0
    llm = LLM(str(path.parent), **SMALL)  # the directory holding one .gguf
    out = llm.generate(["It was the best of"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.finish_reason in ("length", "stop") and out.token_ids
    want = AutoTokenizer.from_pretrained(src)
    text = "It was the age of wisdom, café 日本語"
    assert llm.tokenizer.encode(text) == want.encode(text)
    assert llm.tokenizer.chat_template == want.chat_template
    assert llm.engine.loaded.generation_config.values == {}  # none beside the file: builtin


def test_tokenizer_and_generation_config_beside_the_file_win(q8_0, tmp_path):
    path, _, src = q8_0
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(path, beside / path.name)
    shutil.copy(src / "tokenizer.json", beside)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (beside / "tokenizer_config.json").write_text(json.dumps(config))
    (beside / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert resolve_model_path(beside) == beside / path.name
    loaded = load_model(beside / path.name)
    assert loaded.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert loaded.generation_config.values == {"temperature": 0.6}
    report = DefaultsReport.for_model(
        beside / path.name, "tiny", None, Policy(), model_config_dict(beside / path.name)
    )
    assert report.baseline().source["temperature"] == "generation_config"


def test_the_files_config_and_tokenizer_are_converted_once_then_read_back(
    q8_0, tmp_path, monkeypatch, caplog
):
    path, _, src = q8_0
    copy = tmp_path / "model" / path.name
    copy.parent.mkdir()
    shutil.copy(path, copy)
    monkeypatch.setenv("THERMOSTAT_GGUF_CACHE", str(tmp_path / "cache"))
    converted = []  # transformers reading the file itself (gguf_file=...)
    for auto in (gguf_reading.AutoConfig, gguf_reading.AutoTokenizer):
        real = auto.from_pretrained

        def counted(*args, real=real, **kwargs):
            converted.extend([kwargs["gguf_file"]] if "gguf_file" in kwargs else [])
            return real(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", counted)

    real_names = GGUFCheckpoint._hf_names  # transformers' model built for the tensor names
    monkeypatch.setattr(
        GGUFCheckpoint, "_hf_names", lambda self: converted.append("names") or real_names(self)
    )

    def opened() -> tuple[dict, list[int], str | None, list[str]]:
        checkpoint = GGUFCheckpoint.open(copy)
        tokenizer = checkpoint.tokenizer()
        text = "the age of wisdom"
        names = [name for name, _ in checkpoint.tensors()]
        return checkpoint.config_dict, tokenizer.encode(text), tokenizer.chat_template, names

    first = opened()
    assert sorted(converted) == ["names", copy.name, copy.name]
    assert [p.name for p in (tmp_path / "cache").iterdir()] != []
    assert "model.layers.0.self_attn.q_proj.weight" in first[3]
    converted.clear()
    assert opened() == first and converted == []  # read back, the same
    assert first[0]["_name_or_path"] == str(copy.parent)  # the file's folder, not the cache's
    (saved,) = (tmp_path / "cache").glob("*/tensor_names.json")
    saved.write_text(saved.read_text().replace(gguf_reading.GGUF_VERSION, "0.0.1"))
    assert opened() == first and converted == ["names"]  # made by another gguf: made again
    copy.touch()  # a changed file is converted again
    assert opened() == first and len(converted) == 4
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("THERMOSTAT_GGUF_CACHE", str(tmp_path / "blocked"))
    assert opened() == first  # served all the same, with warnings
    assert "cannot cache its config" in caplog.text
    assert "cannot cache its tensor names" in caplog.text


def test_a_cached_file_loads_without_transformers_modeling_code(q8_0):
    """Once its conversions are cached, a file loads without importing transformers'
    modeling_utils (its import alone took 1.4 s of a 6 s start): the names come from the cache,
    the model is built with torch's initializers skipped by the loader itself."""
    path = q8_0[0]
    list(GGUFCheckpoint.open(path).tensors())  # the cache filled
    script = (
        "import sys\n"
        "from thermostat.engine.loader import load_model\n"
        f"load_model({str(path)!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.modeling_utils')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_q4_0_is_served_in_int4_on_the_files_grid(q8_0, tmp_path):
    _, _, src = q8_0
    path = tmp_path / "tiny-q4_0.gguf"
    dequantized = write_gguf(src, path, Q.Q4_0)
    loaded = load_model(path, dtype="float32")
    assert (loaded.weight_format, loaded.weight_source) == ("int4", "gguf Q4_0")
    block = loaded.model.layers[1]
    qkv = torch.cat([dequantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(block.self_attn.qkv_proj.weight.dequantize(), qkv)
    assert torch.equal(
        block.mlp.down_proj.weight.dequantize(), dequantized["model.layers.1.mlp.down_proj.weight"]
    )


def test_q4_1_is_served_in_int4_with_the_files_scales_and_minimums(q8_0, tmp_path):
    """Q4_1 (w = d q + m): int4's minimum form holds the file's d, m and q; the kernel adds
    m s sum(xq) per block as llama.cpp's Q4_1 x Q8_1 product does."""
    _, _, src = q8_0
    path = tmp_path / "tiny-q4_1.gguf"
    dequantized = write_gguf(src, path, Q.Q4_1)
    loaded = load_model(path, dtype="float32")
    assert (loaded.weight_format, loaded.weight_source) == ("int4", "gguf Q4_1")
    block = loaded.model.layers[1]
    down = block.mlp.down_proj.weight
    assert down.bits == 5 and down.minimums() is not None
    assert torch.equal(down.dequantize(), dequantized["model.layers.1.mlp.down_proj.weight"])
    qkv = torch.cat([dequantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(block.self_attn.qkv_proj.weight.dequantize(), qkv)
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    blocks = np.ascontiguousarray(raw.data).reshape(raw.data.shape[0], -1, 20)
    d_file = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0])
    m_file = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0])
    _, d, _ = down.unpack()
    assert torch.equal(d, d_file) and torch.equal(down.minimums(), m_file)


def test_llama3_rope_factors_from_rope_freqs(tmp_path):
    """A Llama-3 GGUF carries its rope scaling as rope_freqs.weight, not in the metadata."""
    src = write_model(tmp_path / "float", "llama3-rope")
    path = tmp_path / "tiny-llama3.gguf"
    dequantized = write_gguf(src, path, Q.Q8_0)
    hf = hf_model(write_reference(src, tmp_path / "ref", dequantized))
    llm = LLM(str(path), dtype="float32", **SMALL)
    prompt = list(range(40, 90))  # past original_max_position_embeddings (64)
    (got,) = prompt_logprobs(llm, [prompt], 320)
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)[:-1]
    assert ((expected.exp() * (expected - got)).sum(-1)).max() < 0.01


def test_qwen3_moe_experts_stacked_in_the_file(tmp_path):
    """llama.cpp stores a layer's experts as one [E, ...] tensor per projection: the engine's
    logits are exactly those of the file's dequantized weights quantized at load (transformers'
    would differ where int8 activations flip a routing choice)."""
    src = write_model(tmp_path / "float", "qwen3_moe", mlp_only_layers=[])
    path = tmp_path / "tiny-moe.gguf"
    reference = write_reference(src, tmp_path / "ref", write_gguf(src, path, Q.Q8_0, "qwen3moe"))
    llm = LLM(str(path), dtype="float32", **SMALL)
    assert llm.engine.loaded.arch.architecture == "Qwen3MoeForCausalLM"
    float_llm = LLM(str(reference), dtype="float32", quantization="int8", **SMALL)
    prompts = [p for p in PROMPTS if len(p) > 1]
    for got, want in zip(
        prompt_logprobs(llm, prompts, 320), prompt_logprobs(float_llm, prompts, 320), strict=True
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_stacked_experts_are_served_as_stored(tmp_path, qtype):
    """A MoE file's stacked K-quant experts: each expert's two projections dequantize to the
    file's values exactly (gate and up rows in order), and the model generates."""
    src = write_model(
        tmp_path / "float", "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
        mlp_only_layers=[],
    )  # fmt: skip
    path = tmp_path / "moe-k.gguf"
    files = write_gguf(src, path, Q.Q8_0, "qwen3moe", experts_qtype=qtype)
    llm = LLM(str(path), dtype="float32", **SMALL)
    experts = llm.engine.loaded.model.layers[0].mlp.experts
    assert experts.per_expert is not None
    for e in (0, len(experts.per_expert) - 1):
        gate_up, down = experts.per_expert[e]
        prefix = f"model.layers.0.mlp.experts.{e}"
        want = torch.cat([files[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(gate_up.weight.dequantize(), want)
        assert torch.equal(down.weight.dequantize(), files[f"{prefix}.down_proj.weight"])
        assert gate_up.weight.bits == (10 if qtype == Q.Q4_K else 11)  # super-block records
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], greedy)[0].token_ids) == 4


SCALE_FIELDS = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q6_K": (208,),
    "Q3_K": (108,),
}


def random_blocks(rows: int, cols: int, qtype: Q, seed: int, scale: float = 2e-5) -> np.ndarray:
    """Valid random blocks of `qtype` (gguf can dequantize K-quants, not quantize to them): random
    integers and 6-bit scales, finite float16 d / dmin / m of about `scale` (a tenth of it for
    Q6_K's d, with its 8-bit sub-block scales, and IQ4's, whose levels span int8)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = scale / 10 if qtype in (Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS) else scale  # int8 levels
    for at in SCALE_FIELDS.get(qtype.name, (0,)):
        d = rng.uniform(-scale, scale, (rows, cols // block)).astype(np.float16)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize(
    "qtype",
    [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS],
)
def test_blocks_are_packed_to_exactly_the_files_weights(qtype):
    """Each served type's blocks, as read (the floats the loader makes of them) and packed for
    the kernels, dequantize to gguf's own dequantization bit for bit (float32, the sign of zero
    included), read as embedding rows the same; the kernel's product is its reference's, batch
    invariant."""
    raw = random_blocks(70, 512, qtype, seed=qtype.value, scale=0.01)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    grid = BlockGrid.read(raw, qtype.name)
    assert torch.equal(grid.dequantize().view(torch.int32), want.view(torch.int32))
    weight = grid.packed()
    assert torch.equal(weight.dequantize().view(torch.int32), want.view(torch.int32))
    ids = torch.tensor([0, 69, 33, 64])
    assert torch.equal(weight.rows(ids, torch.float32), want[ids])
    ops = kernels.ops()
    assert torch.equal(ops.quant_rows(weight, ids, torch.float32), want[ids])
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
    got = ops.linear_quant(x, weight, None)
    torch.testing.assert_close(got, reference_linear(x, weight), atol=1e-4, rtol=1e-5)
    for rows in (1, 2, 3, 5, 17):
        assert torch.equal(ops.linear_quant(x[:rows], weight, None), got[:rows]), rows


@pytest.mark.parametrize(
    "qtype",
    [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS],
)
def test_the_kernels_unpack_and_pack_blocks_as_the_numpy_code(ops, qtype):
    """The kernels' one pass over a tensor's blocks (`unpack_gguf`, then `pack_records`) gives
    the numpy code's integers and scales bit for bit (-0.0 minimums included) and its records
    byte for byte, rows of mixed types (a Q4_K_M file's fused q, k and v) and reordered rows
    (the q / k permutation) too; a block size that is not the type's is refused."""
    raw = random_blocks(70, 512, qtype, seed=qtype.value + 100, scale=0.01)
    numpy_grid, kernel_grid = BlockGrid.read(raw, qtype.name), BlockGrid.read(raw, qtype.name, ops)
    for want, got in zip(
        (numpy_grid.q, numpy_grid.d, numpy_grid.m),
        (kernel_grid.q, kernel_grid.d, kernel_grid.m),
        strict=True,
    ):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        bits = torch.int8 if want.dtype == torch.int8 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits))
    classic = record_format(numpy_grid.qtypes)  # the numpy code's format, without super-blocks
    assert torch.equal(kernel_grid.packed(ops, classic).packed, numpy_grid.packed().packed)
    assert_same_weight(kernel_grid.packed(ops), numpy_grid.packed(), ops)
    other = Q.Q6_K if qtype != Q.Q6_K else Q.Q4_K
    mixed = BlockGrid.read(random_blocks(9, 512, other, 5), other.name)
    fused = BlockGrid.cat([kernel_grid, mixed])
    order = torch.randperm(79, generator=torch.Generator().manual_seed(0))
    classic = record_format(fused.qtypes)
    reordered = fused.rows(order)
    assert torch.equal(reordered.packed(ops, classic).packed, reordered.packed().packed)
    assert_same_weight(reordered.packed(ops), reordered.packed(), ops)
    for rows in ((64, 9), (128, 64, 1)):  # packed part by part into the weight's records
        parts = [BlockGrid.read(random_blocks(r, 512, t, i), t.name, ops) for i, (r, t) in
                 enumerate(zip(rows, (qtype, other, qtype), strict=False))]  # fmt: skip
        joined = BlockGrid.joined(parts, ops)
        assert torch.equal(joined.packed, BlockGrid.cat(parts).packed(ops).packed)
        assert joined.bits == BlockGrid.cat(parts).packed(ops).bits
        assert_same_weight(joined, BlockGrid.cat(parts).packed(), ops)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    with pytest.raises(ValueError, match="unpack_gguf"):
        ops.unpack_gguf(torch.zeros(2, size + 1, dtype=torch.uint8), qtype.value)


def assert_same_weight(got: QuantizedWeight, want: QuantizedWeight, ops) -> None:
    """`got` (a super-block format, or any) holds `want`'s values, and the kernels' products and
    rows from it are the same bits (any row count)."""
    assert (got.bits == want.bits) == (got.bits not in SUPER)
    assert torch.equal(got.dequantize().view(torch.int32), want.dequantize().view(torch.int32))
    x = torch.randn(17, got.in_features, generator=torch.Generator().manual_seed(2))
    for rows in (1, 2, 3, 17):
        product = ops.linear_quant(x[:rows], got, None)
        assert torch.equal(product, ops.linear_quant(x[:rows], want, None))
    ids = torch.tensor([0, got.out_features - 1])
    rows = ops.quant_rows(got, ids, torch.float32)
    assert torch.equal(rows, ops.quant_rows(want, ids, torch.float32))


def write_k_quant_gguf(src: Path, path: Path, qtype_of, file_type: int) -> dict[str, torch.Tensor]:
    """`src`'s shapes (a Llama of width 256) as a GGUF of random valid blocks, each matrix's type
    `qtype_of(hf name)`; returns the file's weights dequantized by gguf, under Hugging Face names
    (q and k rows as stored: the model reads them permuted, as the reference does)."""
    config = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (
        ("block_count", config["num_hidden_layers"]),
        ("context_length", 512),
        ("embedding_length", config["hidden_size"]),
        ("feed_forward_length", config["intermediate_size"]),
        ("head_count", config["num_attention_heads"]),
        ("head_count_kv", config["num_key_value_heads"]),
        ("layer_norm_rms_eps", 1e-6),
        ("rope_dimension_count", config["hidden_size"] // config["num_attention_heads"]),
        ("file_type", file_type),
    ):
        getattr(writer, f"add_{key}")(value)
    add_tokenizer(writer, src, config["vocab_size"])
    files = {}
    for i, (name, tensor) in enumerate(load_file(src / "model.safetensors").items()):
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name(name), tensor.numpy())
            files[name] = tensor.float()
            continue
        qtype = qtype_of(name)
        blocks = random_blocks(*tensor.shape, qtype, seed=i)
        writer.add_tensor(gguf_name(name), blocks, raw_dtype=qtype)
        w = gguf.quants.dequantize(blocks, qtype)
        heads = {"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2])
        if heads:  # as transformers reads the file: llama.cpp's q / k permutation undone
            w = w[np.argsort(llama_cpp_permute(np.arange(w.shape[0]), heads))]
        files[name] = torch.from_numpy(np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A float Llama of width 256 (K-quants' super-blocks: 256 along K)."""
    root = tmp_path_factory.mktemp("wide")
    return write_model(root / "float", hidden_size=256, intermediate_size=256)


@pytest.mark.parametrize(
    "qtype,file_type,named,body",
    [
        (Q.Q4_K, 15, "Q4_K_M", "int4"),
        (Q.Q5_K, 17, "Q5_K_M", "int8"),
        (Q.Q6_K, 18, "Q6_K", "int8"),
        (Q.Q3_K, 12, "Q3_K_M", "int8"),
        (Q.IQ4_XS, 30, "IQ4_XS", "int8"),
        (Q.IQ4_NL, 25, "IQ4_NL", "int8"),
    ],
)
def test_k_quant_files_are_served_as_stored(wide, tmp_path, qtype, file_type, named, body):
    """A Q4_K / Q5_K / Q6_K / Q3_K / IQ4 file's weights are served as its blocks say (every
    linear layer and the embeddings dequantize to the file's values exactly), and the logits are
    transformers' on those values, within int8 activations' rounding (the Q8_0 test's bound)."""
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    files = write_k_quant_gguf(wide, path, lambda _: qtype, file_type)
    loaded = load_model(path, dtype="float32")
    assert (loaded.weight_format, loaded.weight_source) == (body, f"gguf {named}")
    for layer, block in enumerate(loaded.model.layers):
        prefix = f"model.layers.{layer}"
        qkv = torch.cat([files[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(block.self_attn.qkv_proj.weight.dequantize(), qkv)
        gate_up = torch.cat([files[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(block.mlp.gate_up_proj.weight.dequantize(), gate_up)
        down = files[f"{prefix}.mlp.down_proj.weight"]
        assert torch.equal(block.mlp.down_proj.weight.dequantize(), down)
    embed = files["model.embed_tokens.weight"]
    assert torch.equal(loaded.model.embed_tokens.weight.dequantize(), embed)
    del loaded
    assert_logits_close(path, write_reference(wide, tmp_path / "ref", files))


def test_q4_k_m_file_is_served_as_stored(wide, tmp_path, caplog):
    """A Q4_K_M file (Q4_K, with Q6_K for v, the down projections and the embeddings): a fused
    projection holding both types takes the super-block format that holds both (`bits` 11), the
    Q4_K-only ones 4-bit super-block records (`bits` 10), every value the file's; it serves.
    `--quantization int4` still requantizes, each block's 16 levels back within a step."""

    def qtype_of(name: str) -> Q:
        return Q.Q6_K if any(p in name for p in ("v_proj", "down", "embed")) else Q.Q4_K

    path = tmp_path / "tiny-q4_k_m.gguf"
    files = write_k_quant_gguf(wide, path, qtype_of, 15)
    with caplog.at_level(logging.INFO, logger="thermostat.loader"):
        loaded = load_model(path, dtype="float32")
    assert (loaded.weight_format, loaded.weight_source) == ("int4", "gguf Q4_K_M")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert said and re.fullmatch(r"weights: (\d+) of \1 as the file stores them", said[0]), said
    block = loaded.model.layers[0]
    assert (block.self_attn.qkv_proj.weight.bits, block.self_attn.o_proj.weight.bits) == (11, 10)
    qkv = torch.cat([files[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(block.self_attn.qkv_proj.weight.dequantize(), qkv)
    want = files["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(block.self_attn.o_proj.weight.dequantize(), want)
    llm = LLM(str(path), **SMALL)
    out = llm.generate(["It was the best of"], SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(out.token_ids) == 6
    loaded = load_model(path, dtype="float32", quantization="int4")
    assert loaded.weight_format == "int4"
    got = loaded.model.layers[0].self_attn.o_proj.weight.dequantize().view(256, -1, 32)
    want = want.view(256, -1, 32)
    step = (want.amax(-1, keepdim=True) - want.amin(-1, keepdim=True)) / 15
    rounding = want.abs().amax(-1, keepdim=True) / 1024  # float16 scales
    assert ((got - want).abs() <= step * 1.01 + rounding).all()


def test_files_that_cannot_be_served_are_refused_before_serve_listens(q8_0, tmp_path, capsys):
    """A truncated file, a tensor type gguf cannot read, an architecture the engine does not
    serve: `thermostat serve` exits 2 with one line naming the file and why, nothing loaded."""
    path, _, src = q8_0
    data = path.read_bytes()
    cut_in_tensors, cut_in_header = tmp_path / "cut-tensors.gguf", tmp_path / "cut-header.gguf"
    cut_in_tensors.write_bytes(data[: len(data) // 2])
    cut_in_header.write_bytes(data[:2000])
    odd_type = tmp_path / "i32.gguf"
    writer = gguf.GGUFWriter(odd_type, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.int32))  # GGML I32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    q2_k = tmp_path / "q2_k.gguf"
    writer = gguf.GGUFWriter(q2_k, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 84), dtype=np.uint8), raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(src, gpt2, Q.Q8_0, arch="gpt2")
    unreadable = "not a readable GGUF file, truncated or not GGUF"
    for file, why in (
        (cut_in_tensors, f"{unreadable} ({len(data) // 2} bytes"),
        (cut_in_header, f"{unreadable} (2000 bytes"),
        (odd_type, "holds tensors of GGML type I32, which Thermostat does not serve"),
        (q2_k, "holds tensors of GGML type Q2_K, which Thermostat does not serve"),
        (gpt2, "architectures=['GPT2LMHeadModel'] is not supported; Thermostat serves"),
    ):
        assert main(["serve", "--model", str(file), "--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"thermostat serve: error: {file}: ") and why in err, err
        assert "\n" not in err and "Traceback" not in err
