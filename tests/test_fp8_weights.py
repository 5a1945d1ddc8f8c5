"""Block-fp8 checkpoints in DeepSeek's layout (float8_e4m3fn weights, float32 weight_scale_inv per
block, quantization_config fp8) against transformers on the dequantized float32 weights.

transformers' own fp8 path is not the reference: on a machine without a GPU it dequantizes to
bfloat16, and it needs accelerate, which this environment does not install."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_greedy, hf_model
from tests.test_deepseek import PROMPTS, prompt_logprobs
from thermostat import LLM, SamplingParams
from thermostat.engine.loader import ModelLoadError, load_model
from thermostat.models.fp8_weights import BlockFP8
from thermostat.random_model import write_model

FP8_MAX = 448.0  # largest float8_e4m3fn


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/b), ceil(in/b)]),
    one scale = amax / 448 per block, as DeepSeek quantizes."""
    (bo, bi), (rows, cols) = block, weight.shape
    scales = torch.empty(-(-rows // bo), -(-cols // bi))
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            scales[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            fp8[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (part / scales[i, j]).to(fp8.dtype)
    return fp8, scales


def dequantize(fp8: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: block by block, written apart from the loader's broadcast."""
    (bo, bi), out = block, torch.empty(fp8.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
            out[rows, cols] = fp8[rows, cols].float() * scales[i, j]
    return out


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The linear layers' weights, as DeepSeek's checkpoints choose them: not embeddings, norms,
    the router (mlp.gate) or lm_head."""
    return "_proj" in name and name.endswith(".weight") and tensor.dim() == 2


def write_fp8(src: Path, fp8_dir: Path, ref_dir: Path, block: tuple[int, int]) -> int:
    """From the float32 checkpoint `src`: `fp8_dir` in the block-fp8 layout, `ref_dir` with its
    dequantized float32 weights. Returns how many weights were quantized."""
    state = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if is_quantized(name, tensor):
            fp8, scales = quantize(tensor, block)
            quantized[name], quantized[name + "_scale_inv"] = fp8, scales
            dequantized[name] = dequantize(fp8, scales, block)
            assert not torch.equal(dequantized[name], tensor)  # really quantized
        else:
            quantized[name] = dequantized[name] = tensor
    for out, tensors in ((fp8_dir, quantized), (ref_dir, dequantized)):
        shutil.copytree(src, out)
        save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return len(quantized) - len(state)


# (family, weight_block_size, sizes): every case has partial edge blocks (160 = 128 + 32,
# 80 = 2 * 32 + 16, the tiny models' ranks and expert sizes below one block)
CASES = {
    "v3-128": ("deepseek_v3", (128, 128), {"hidden_size": 160}),
    "v3-32": ("deepseek_v3", (32, 32), {"hidden_size": 80}),
    "v2-128": ("deepseek_v2", (128, 128), {"hidden_size": 160}),
    "v2-32": ("deepseek_v2", (32, 32), {"hidden_size": 80}),
    "qwen3-128": ("qwen3", (128, 128), {"hidden_size": 160}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8_checkpoint(request, tmp_path_factory):
    """(fp8 checkpoint dir, dequantized float32 checkpoint dir, transformers on the latter)."""
    kind, block, sizes = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = write_model(root / "float32", kind, **sizes)
    assert write_fp8(src, root / "fp8", root / "ref", block) > 0
    return root / "fp8", root / "ref", hf_model(root / "ref")


def test_logits_match_transformers_on_the_dequantized_weights(fp8_checkpoint):
    fp8_dir, _, hf = fp8_checkpoint
    llm = LLM(str(fp8_dir), dtype="float32", enable_prefix_caching=False)
    vocab = hf.config.vocab_size
    for prompt, got in zip(PROMPTS, prompt_logprobs(llm, PROMPTS, vocab), strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        torch.testing.assert_close(got, expected[:-1], atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_generate(fp8_checkpoint):
    fp8_dir, _, hf = fp8_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    outs = LLM(str(fp8_dir), dtype="float32").generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_bfloat16_serving_holds_the_dequantized_weights(fp8_checkpoint):
    """Served in bfloat16, the fp8 checkpoint is the dequantized one rounded once to bfloat16:
    the same logits, bit for bit."""
    fp8_dir, ref_dir, hf = fp8_checkpoint
    vocab = hf.config.vocab_size
    fp8 = prompt_logprobs(LLM(str(fp8_dir), dtype="bfloat16"), PROMPTS, vocab)
    ref = prompt_logprobs(LLM(str(ref_dir), dtype="bfloat16"), PROMPTS, vocab)
    for a, b in zip(fp8, ref, strict=True):
        assert torch.equal(a, b)


def test_read_pairs_weights_and_scales_in_any_order():
    """Scale before or after its weight (one shard or two), partial blocks, a stacked [E, out, in]
    expert tensor; unquantized tensors pass through untouched."""
    torch.manual_seed(0)
    block = (4, 8)
    w = torch.randn(10, 20)
    fp8, scales = quantize(w, block)
    expected = dequantize(fp8, scales, block)
    norm = torch.randn(20)
    stacked = torch.stack([fp8, fp8]), torch.stack([scales, 2 * scales])
    got = dict(
        BlockFP8(block).read(
            [
                ("a.weight_scale_inv", scales),
                ("a.weight", fp8),
                ("norm.weight", norm),
                ("b.weight", fp8),
                ("b.weight_scale_inv", scales),
                ("experts.weight", stacked[0]),
                ("experts.weight_scale_inv", stacked[1]),
            ]
        )
    )
    assert sorted(got) == ["a.weight", "b.weight", "experts.weight", "norm.weight"]
    assert torch.equal(got["a.weight"], expected) and torch.equal(got["b.weight"], expected)
    assert torch.equal(got["experts.weight"], torch.stack([expected, 2 * expected]))
    assert got["norm.weight"] is norm
    per_tensor = dict(
        BlockFP8(None).read([("c.weight", fp8), ("c.weight_scale_inv", scales[:1, 0])])
    )
    assert torch.equal(per_tensor["c.weight"], fp8.float() * scales[0, 0])


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([("a.weight", torch.zeros(4, 8, dtype=torch.float8_e4m3fn))], r"\['a.weight'\] without"),
        ([("a.weight_scale_inv", torch.ones(1, 1))], "without a float8 weight"),
        (
            [
                ("a.weight", torch.zeros(5, 8, dtype=torch.float8_e4m3fn)),
                ("a.weight_scale_inv", torch.ones(1, 1)),
            ],
            r"a.weight_scale_inv has shape \(1, 1\), expected \(2, 1\)",
        ),
        (
            [
                ("a.weight", torch.zeros(4, 8, dtype=torch.float8_e5m2)),
                ("a.weight_scale_inv", torch.ones(1, 1)),
            ],
            "a.weight is torch.float8_e5m2",
        ),
    ],
)
def test_read_names_the_tensor_at_fault(tensors, message):
    with pytest.raises(ValueError, match=message):
        list(BlockFP8((4, 8)).read(tensors))


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method='bitsandbytes'"),
        (
            {"quant_method": "fp8", "activation_scheme": "static"},
            r"quantization_config.activation_scheme='static'",
        ),
        ({"quant_method": "fp8", "scale_fmt": "e4m3"}, r"quantization_config.scale_fmt='e4m3'"),
        ({"quant_method": "fp8", "expert_dtype": "int4"}, r"quantization_config.expert_dtype="),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ],
)
def test_other_quantizations_are_refused_by_field(tmp_path, quant, message):
    path = write_model(tmp_path / "v3", "deepseek_v3")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)
