"""GPTQ, AWQ and compressed-tensors checkpoints, packed here from a tiny random Llama as the
quantizers pack them (AutoGPTQ's and AutoAWQ's `pack`, compressed-tensors' `pack_to_int32`,
written apart from the loader's unpacking), against the integers they hold: the served weights
are the checkpoint's grid exactly, and the logits are transformers' on the dequantized weights
(within the engine's activation quantization)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_model
from tests.test_deepseek import PROMPTS, prompt_logprobs
from thermostat import LLM, kernels
from thermostat.engine.loader import ModelLoadError, load_model
from thermostat.models.grids import grid_step
from thermostat.models.int_packing import AWQ_ORDER, unpack_int32
from thermostat.models.quant import quantize, reference_linear
from thermostat.random_model import write_model

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="int8 / int4 need the CPU kernels")

SMALL = {"enable_prefix_caching": False, "kv_cache_memory_gb": 0.02}  # a tiny model's cache

# Hugging Face projection -> (engine module, rows of it), for the tiny Llama (hidden 64, 4 heads
# of 16, 2 KV heads, intermediate 128)
PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, 64)),
    "self_attn.k_proj": ("self_attn.qkv_proj", slice(64, 96)),
    "self_attn.v_proj": ("self_attn.qkv_proj", slice(96, 128)),
    "self_attn.o_proj": ("self_attn.o_proj", slice(0, 64)),
    "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, 128)),
    "mlp.up_proj": ("mlp.gate_up_proj", slice(128, 256)),
    "mlp.down_proj": ("mlp.down_proj", slice(0, 64)),
}


# ---------------------------------------------------------------- the quantizers' packings


def pack_words(fields: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """[R, C] unsigned fields -> int32 words [R, C * bits / 32] along the columns: word w holds
    column (32 / bits) w + order[i] in bits [bits i, bits (i + 1)) (AutoAWQ's loop; order None:
    i itself, AutoGPTQ's qzeros and compressed-tensors' pack_to_int32)."""
    per = 32 // bits
    fields = fields.astype(np.uint32)
    words = np.zeros((fields.shape[0], -(-fields.shape[1] // per)), dtype=np.uint32)
    for w in range(words.shape[1]):
        for i in range(per):
            col = w * per + (order[i] if order else i)
            if col < fields.shape[1]:
                words[:, w] |= fields[:, col] << np.uint32(bits * i)
    return words.view(np.int32)


def to_torch(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words))


def groups_of(k: int, group: int) -> torch.Tensor:
    return torch.arange(k) // group


def affine_grid(
    w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in [0, 2^bits), zeros [N, G], scales [N, G] in `dtype`), one scale
    and zero per (row, group) as GPTQ / AWQ choose them (min-max)."""
    levels, groups = (1 << bits) - 1, int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        part = w[:, g_idx == g]
        lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
        if sym:
            scales[:, g] = torch.maximum(-lo, hi) * 2 / levels
            zeros[:, g] = (levels + 1) // 2
        else:
            scales[:, g] = (hi - lo) / levels
            zeros[:, g] = (-lo / scales[:, g]).round().clamp(1, levels)  # v1 cannot store 0
    scales = scales.to(dtype)
    q = (w / scales.float()[:, g_idx]).round() + zeros[:, g_idx]
    return q.clamp(0, levels).long(), zeros, scales


def dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    """The reference: (q - z) s per element, in float32 (exact for float16 / bfloat16 s)."""
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


@dataclass(frozen=True)
class Case:
    config: dict
    serve_as: str
    source: str
    exact: bool = True  # the served weights are the checkpoint's grid exactly


def gptq(w, bits=4, group=32, sym=True, v2=False, act_order=False):
    k = w.shape[1]
    g_idx = groups_of(k, group)
    if act_order:  # groups over a permutation of the inputs, as desc_act orders them
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))] = groups_of(k, group)
    q, zeros, scales = affine_grid(w, bits, g_idx, sym, torch.float16)
    stored = zeros if v2 else (zeros - 1)  # AutoGPTQ's pack: zeros -= 1
    tensors = {
        "qweight": to_torch(pack_words(q.numpy(), bits).T),  # packed along K: W^T's rows
        "qzeros": to_torch(pack_words(stored.T.numpy(), bits)),
        "scales": scales.T.contiguous(),
        "g_idx": g_idx.int(),
    }
    return tensors, dequantized(q, zeros, scales, g_idx)


def awq(w, group=32):
    g_idx = groups_of(w.shape[1], group)
    q, zeros, scales = affine_grid(w, 4, g_idx, sym=False, dtype=torch.float16)
    tensors = {
        "qweight": to_torch(pack_words(q.T.numpy(), 4, AWQ_ORDER)),
        "qzeros": to_torch(pack_words(zeros.T.numpy(), 4, AWQ_ORDER)),
        "scales": scales.T.contiguous(),
    }
    return tensors, dequantized(q, zeros, scales, g_idx)


def ct_int8(w):
    """compressed-tensors W8A8: per-channel symmetric int8 in [-128, 127], scale = amax / 127.5
    (so a row's most negative weight rounds to -128), bfloat16 scales, int-quantized."""
    scale = (w.abs().amax(1, keepdim=True) / 127.5).bfloat16()
    q = (w / scale.float()).round().clamp(-128, 127)
    assert (q == -128).any()
    return {"weight": q.to(torch.int8), "weight_scale": scale}, q * scale.float()


def ct_pack(w, group=32, sym=True):
    """compressed-tensors W4A16, pack-quantized: signed q in [-8, 7] stored + 8, zero points
    (asymmetric) packed along the outputs."""
    g_idx = groups_of(w.shape[1], group)
    q, zeros, scales = affine_grid(w, 4, g_idx, sym, torch.bfloat16)
    q, zeros = q - 8, zeros - 8  # compressed-tensors' signed range
    tensors = {
        "weight_packed": to_torch(pack_words((q + 8).numpy(), 4)),
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
        "weight_scale": scales,
    }
    if not sym:
        tensors["weight_zero_point"] = to_torch(pack_words((zeros + 8).T.numpy(), 4).T)
    return tensors, dequantized(q, zeros, scales, g_idx)


def ct_config(fmt, bits, strategy, group=None, sym=True, inputs=None):
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy}
    weights |= {"group_size": group, "dynamic": False, "actorder": None}
    group_0 = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group_0},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
CASES = {
    "gptq-v1-sym-g32": (
        lambda w: gptq(w),
        Case(GPTQ_CONFIG, "int4", "gptq 4-bit g32"),
    ),
    "gptq-v2-asym-g64": (
        lambda w: gptq(w, group=64, sym=False, v2=True),
        Case(GPTQ_CONFIG | {"group_size": 64, "checkpoint_format": "gptq_v2"}, "int4", "g64"),
    ),
    "gptq-8bit": (
        lambda w: gptq(w, bits=8),
        Case(GPTQ_CONFIG | {"bits": 8}, "int8", "gptq 8-bit g32"),
    ),
    "gptq-act-order": (
        lambda w: gptq(w, act_order=True),
        Case(GPTQ_CONFIG | {"desc_act": True}, "int8", "act-order", exact=False),
    ),
    "awq-g32": (
        lambda w: awq(w),
        Case(
            {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, "int4", "awq"
        ),
    ),
    "ct-w8a8": (
        ct_int8,
        Case(ct_config("int-quantized", 8, "channel", inputs=TOKENS), "int8", "int8 per-channel"),
    ),
    "ct-w4a16-asym": (
        lambda w: ct_pack(w, sym=False),
        Case(ct_config("pack-quantized", 4, "group", 32, sym=False), "int4", "int4 g32"),
    ),
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("float") / "m")


def write_quantized(src: Path, root: Path, name: str) -> tuple[Path, Path, dict]:
    """(checkpoint dir, dir of its dequantized float32 weights, those weights by name)."""
    pack, case = CASES[name]
    state = load_file(src / "model.safetensors")
    packed, reference = {}, {}
    for key, tensor in state.items():
        if ".layers." in key and "_proj." in key:
            parts, reference[key] = pack(tensor)
            packed |= {key.removesuffix("weight") + part: t for part, t in parts.items()}
        else:
            packed[key] = reference[key] = tensor
    out, ref = root / name, root / f"{name}-float"
    for d, tensors in ((out, packed), (ref, reference)):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": case.config}))
    return out, ref, reference


def served_weight(model, layer: int, proj: str) -> torch.Tensor:
    module, rows = PROJECTIONS[proj]
    q = model.layers[layer].get_submodule(module).weight
    return q.dequantize()[rows]


@pytest.mark.parametrize("name", sorted(CASES))
def test_served_weights_are_the_checkpoints_grid(name, float_dir, tmp_path):
    case = CASES[name][1]
    path, _, reference = write_quantized(float_dir, tmp_path, name)
    loaded = load_model(path, dtype="float32", quantization=None)
    assert loaded.weight_format == case.serve_as
    assert case.source in loaded.weight_source
    for key, want in reference.items():
        if ".layers." not in key or "_proj." not in key:
            continue
        layer, proj = int(key.split(".")[2]), ".".join(key.split(".")[3:5])
        got = served_weight(loaded.model, layer, proj)
        if case.exact:
            assert torch.equal(got, want), key
        else:  # act-order: several groups in a block of 32, requantized in int8
            blocks = want.view(want.shape[0], -1, 32)
            step = blocks.abs().amax(-1, keepdim=True) / 127
            assert ((got.view_as(blocks) - blocks).abs() <= step * 0.51 + 1e-7).all(), key


@pytest.mark.parametrize("name", ["gptq-v1-sym-g32", "ct-w8a8"])
def test_logits_are_the_dequantized_models(name, float_dir, tmp_path):
    """Exactly the engine's logits for the dequantized float32 weights quantized at load, and
    transformers' on those weights within what quantizing the activations per block costs."""
    path, ref, _ = write_quantized(float_dir, tmp_path, name)
    llm = LLM(str(path), dtype="float32", **SMALL)
    fmt = llm.engine.loaded.weight_format
    assert fmt == CASES[name][1].serve_as
    float_llm = LLM(str(ref), dtype="float32", quantization=fmt, **SMALL)
    hf = hf_model(ref)
    prompts = [p for p in PROMPTS if len(p) > 1]
    got, want = prompt_logprobs(llm, prompts, 320), prompt_logprobs(float_llm, prompts, 320)
    for prompt, logprobs, same in zip(prompts, got, want, strict=True):
        assert torch.equal(logprobs, same)
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)[:-1]
        kl = (expected.exp() * (expected - logprobs)).sum(-1)  # measured: below 0.004
        assert kl.max() < 0.01, kl


def test_quantization_given_wins(float_dir, tmp_path):
    path, _, _ = write_quantized(float_dir, tmp_path, "gptq-v1-sym-g32")
    loaded = load_model(path, dtype="float32", quantization="int8")
    assert (loaded.weight_format, loaded.weight_source) == ("int8", "gptq 4-bit g32")


def test_without_the_cpu_kernels_the_dequantized_weights_are_served(float_dir, tmp_path):
    path, _, reference = write_quantized(float_dir, tmp_path, "awq-g32")
    loaded = load_model(path, dtype="float32", cpu_kernels=False)
    assert (loaded.weight_format, loaded.weight_source) == ("float32", "awq 4-bit g32")
    o_proj = loaded.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(o_proj, reference["model.layers.0.self_attn.o_proj.weight"])


def refused(tmp_path: Path, float_dir: Path, quant: dict) -> str:
    path = tmp_path / "m"
    shutil.copytree(float_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    return str(info.value)


@pytest.mark.parametrize(
    "quant,field",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        (GPTQ_CONFIG | {"bits": 3}, "quantization_config.bits=3"),
        (GPTQ_CONFIG | {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        (ct_config("int-quantized", 8, "channel", inputs=TOKENS | {"dynamic": False}), "dynamic"),
        (ct_config("float-quantized", 8, "channel"), "quantization_config.format"),
        (ct_config("int-quantized", 2, "channel"), "weights.num_bits=2"),
    ],
)
def test_unsupported_fields_are_refused_by_name(quant, field, float_dir, tmp_path):
    message = refused(tmp_path, float_dir, quant)
    assert "config.json: quantization_config." in message and field in message, message


def test_a_missing_part_is_named(float_dir, tmp_path):
    path, _, _ = write_quantized(float_dir, tmp_path, "awq-g32")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.qzeros"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj .*\['qzeros'\]"):
        load_model(path)


def test_a_float_checkpoint_under_a_quantization_config_is_refused(float_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(float_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": GPTQ_CONFIG}))
    with pytest.raises(ModelLoadError, match="no GPTQ layer in the weights"):
        load_model(path)


def test_unpack_inverts_the_packings():
    g = torch.Generator().manual_seed(0)
    fields = torch.randint(0, 16, (6, 40), generator=g)
    words = to_torch(pack_words(fields.numpy(), 4))
    assert torch.equal(unpack_int32(words, 4, dim=1), fields.int())
    assert torch.equal(unpack_int32(words.T.contiguous(), 4, dim=0), fields.int().T)
    bytes8 = torch.randint(0, 256, (3, 8), generator=g)
    assert torch.equal(unpack_int32(to_torch(pack_words(bytes8.numpy(), 8)), 8, 1), bytes8.int())


def test_per_channel_int8_grid_is_found_and_minus_128_runs_in_the_kernel():
    """compressed-tensors' rows: a block whose smallest gap is several steps still finds its
    step, and q = -128 is served as it is."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-64, 64, (64, 96), generator=g) * 2 + 1  # odd: no value or gap is 1 step
    q[:, 5] = -128
    scale = ((0.5 + torch.rand(64, 1, generator=g)) / 100).bfloat16().float()
    w = q * scale
    steps = grid_step(w.view(-1, 32), affine=False)
    assert torch.equal(steps, scale.repeat_interleave(3, 0).view(-1))
    qw = quantize(w, "int8")
    assert torch.equal(qw.dequantize(), w)
    x = torch.randn(5, 96, generator=g)
    ops = kernels.ops()
    assert ops is not None
    got = ops.linear_quant(x, qw, None)
    torch.testing.assert_close(got, reference_linear(x, qw), atol=1e-4, rtol=1e-4)
