"""DeepSeek-V4 checkpoints in DeepSeek's official layout (tests/v4_official.py writes them):
e8m0 scales, MXFP4 experts, official / save_pretrained / transformers names, MTP skipping, the
legacy config keys, and the loader's dequantized tensors against the independent reference."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, DeepseekV4Config, DeepseekV4ForCausalLM

from tests.v4_official import (
    TINY_V4,
    dequantize_fp8,
    dequantized_hf_checkpoint,
    official_name,
    per_expert_state,
    quantize_fp8,
    read_tensors,
    write_hf_v4,
    write_official_checkpoint,
)
from thermostat.engine.checkpoint import iter_tensors, weight_files
from thermostat.models.deepseek_v4_names import hf_name, hf_names, official_config
from thermostat.models.fp8_weights import BlockFP8
from thermostat.models.moe import expert_target
from thermostat.models.mxfp4 import dequantize_mxfp4, e8m0_to_float32, quantize_mxfp4

INTER = TINY_V4["moe_intermediate_size"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_v4(tmp_path_factory.mktemp("v4") / "hf")


@pytest.fixture(scope="module")
def state(hf_dir):
    """transformers' parameter names and values of the tiny model."""
    return DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module", params=[True, False], ids=["fp4-experts", "fp8-experts"])
def official(request, hf_dir):
    """(official checkpoint dir, its dequantized transformers reference dir)."""
    root = hf_dir.parent / ("fp4" if request.param else "fp8")
    out = write_official_checkpoint(hf_dir, root / "official", fp4_experts=request.param)
    return out, dequantized_hf_checkpoint(out, root / "reference")


def loaded(path) -> dict[str, torch.Tensor]:
    """What the loader hands a model: dequantized, transformers names, fused here into the
    model's expert parameters with moe.expert_target."""
    fp8 = BlockFP8.from_config(AutoConfig.from_pretrained(path))
    assert fp8 is not None
    tensors = iter_tensors(weight_files(path))
    return fuse_experts(dict(hf_names(fp8.read(tensors))))


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list] = {}  # fused name -> [(index, tensor)]
    for name, tensor in tensors.items():
        target = expert_target(name, INTER)
        if target is None:
            out[name] = tensor
        else:
            parts.setdefault(target[0], []).append((target[1], tensor))
    for name, slices in parts.items():
        experts = 1 + max(index[0] for index, _ in slices)
        rows = 2 * INTER if name.endswith("gate_up_proj") else slices[0][1].shape[0]
        fused = torch.full((experts, rows, slices[0][1].shape[1]), math.nan)
        for index, tensor in slices:
            fused[index] = tensor.float()
        out[name] = fused
    return out


def test_e8m0_is_exactly_two_to_the_byte_minus_127():
    every = torch.arange(256, dtype=torch.uint8)
    got = e8m0_to_float32(every.view(torch.float8_e8m0fnu))
    expected = [math.ldexp(1.0, b - 127) for b in range(255)]
    assert got[:255].tolist() == expected  # float32 holds each exactly, 2**-127 as a subnormal
    assert math.isnan(got[255])
    assert torch.equal(e8m0_to_float32(every).view(torch.int32), got.view(torch.int32))  # uint8
    same = got[:255] == every[:255].view(torch.float8_e8m0fnu).float()
    assert bool(same.all())  # and agrees with torch's own conversion


def test_mxfp4_nibble_order_and_values_by_hand():
    """Inputs 0 and 1 of a block share byte 0: input 0 in the low nibble. 1.0 is code 2
    (exponent 1, mantissa 0), -3.0 code 8|5 = 13: byte 0xD2. A 6.0 in the block sets scale 1."""
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1], row[0, 2] = 1.0, -3.0, 6.0
    packed, scales = quantize_mxfp4(row)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert packed[0, 0] == 0xD2 and packed[0, 1] == 0x07  # 6.0 is code 7, input 3 is 0
    assert scales.view(torch.uint8).tolist() == [[127]]
    byte = torch.tensor([[0xD2] + [0] * 15], dtype=torch.uint8)
    two = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # scale 2
    assert dequantize_mxfp4(byte, two)[0, :3].tolist() == [2.0, -6.0, 0.0]
    codes = torch.arange(16, dtype=torch.uint8).repeat_interleave(2).reshape(1, 32)
    codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # byte i: code i twice
    values = dequantize_mxfp4(codes.view(torch.int8), torch.tensor([[127]], dtype=torch.uint8))
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert values[0, 0::2].tolist() == table and values[0, 1::2].tolist() == table


def test_mxfp4_round_trip_is_exact_on_representable_values():
    torch.manual_seed(0)
    weight = torch.randn(2, 8, 96) * torch.logspace(-3, 3, 8).reshape(1, 8, 1)
    packed, scales = quantize_mxfp4(weight)
    grid = dequantize_mxfp4(packed, scales)
    assert not torch.equal(grid, weight)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(grid)), grid)
    for dtype in (torch.int8, torch.float4_e2m1fn_x2):
        assert torch.equal(dequantize_mxfp4(packed.view(dtype), scales), grid)
    with pytest.raises(ValueError, match="divisible by 32"):
        dequantize_mxfp4(packed[..., :8], scales)


def test_e8m0_block_scales_with_partial_edge_blocks():
    torch.manual_seed(0)
    weight = torch.randn(300, 200)  # 3 x 2 blocks of 128, the last row and column partial
    fp8, scale = quantize_fp8(weight)
    got = dict(BlockFP8((128, 128), ue8m0=True).read([("w.scale", scale), ("w.weight", fp8)]))
    assert torch.equal(got["w.weight"], dequantize_fp8(fp8, scale))
    in_bytes = [("w.weight", fp8), ("w.scale", scale.view(torch.uint8))]
    as_bytes = dict(BlockFP8((128, 128), ue8m0=True).read(in_bytes))
    assert torch.equal(as_bytes["w.weight"], got["w.weight"])


def test_official_names_map_onto_transformers_parameters(official, state):
    official_dir, _ = official
    names = [n for n in read_tensors(official_dir) if not n.endswith(".scale")]
    mapped = {hf_name(n) for n in names} - {None}
    assert mapped == set(per_expert_state(state, INTER))  # the per-expert alternative
    fused = {target[0] if (target := expert_target(n, INTER)) else n for n in mapped}
    assert fused == set(state)
    assert {n for n in names if hf_name(n) is None} == {n for n in names if n.startswith("mtp.")}
    assert hf_name("layers.3.attn.indexer.wq_b.scale") == (
        "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight_scale_inv"
    )


def test_transformers_and_save_pretrained_names_pass(hf_dir, state):
    assert all(hf_name(n) == n for n in per_expert_state(state, INTER))
    saved = read_tensors(hf_dir)  # save_pretrained's hybrid: model.layers.N.attn.wq_a, head...
    assert any(n.startswith("model.layers.0.attn.") for n in saved) and "head.weight" in saved
    got = dict(hf_names(saved.items()))
    expected = per_expert_state(state, INTER)
    assert set(got) == set(expected)
    assert all(torch.equal(got[n].to(expected[n].dtype), expected[n]) for n in got)


def test_loader_dequantizes_to_the_reference(official):
    official_dir, reference_dir = official
    got, reference = loaded(official_dir), read_tensors(reference_dir)
    assert set(got) == set(reference)
    for name, expected in reference.items():
        assert torch.equal(got[name].to(expected.dtype), expected), name


def test_transformers_reads_the_official_names_as_thermostat_does(official, tmp_path):
    """transformers' own conversion_mapping on the dequantized weights under official names
    gives the reference: the name table agrees with transformers', tensor by tensor."""
    official_dir, reference_dir = official
    reference = read_tensors(reference_dir)
    renamed = {official_name(n): t for n, t in per_expert_state(reference, INTER).items()}
    save_file({n: t.contiguous() for n, t in renamed.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((reference_dir / "config.json").read_text())
    hf, info = DeepseekV4ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name


def test_mtp_layers_are_dropped_and_logged_once(official, caplog):
    official_dir, _ = official
    with caplog.at_level(logging.INFO, logger="thermostat.models"):
        names = [n for n, _ in hf_names(iter_tensors(weight_files(official_dir)))]
    assert not any("mtp" in n for n in names)
    records = [r for r in caplog.records if "mtp" in r.getMessage()]
    assert len(records) == 1 and "mtp.0 (6 tensors)" in records[0].getMessage()


FLASH_SHAPED = dict(
    TINY_V4,
    num_hidden_layers=6,
    layer_types=None,
    compress_rates=None,
    compress_ratios=[0, 0, 4, 128, 4, 128, 0],
    num_hash_layers=3,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                  "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip


@pytest.mark.parametrize("fields", [TINY_V4, FLASH_SHAPED], ids=["tiny-rate-16", "flash-rates"])
def test_legacy_config_keys_read_back_to_the_same_layers(fields):
    config = DeepseekV4Config(**fields)
    legacy = official_config(config.to_dict())
    ratios = legacy["compress_ratios"]  # one more than the layers: the MTP layer's, sliding
    assert len(ratios) == config.num_hidden_layers + 1 and ratios[-1] == 0
    assert legacy["quantization_config"]["scale_fmt"] == "ue8m0" and legacy["expert_dtype"] == "fp4"
    assert ("layer_types" in legacy) == (fields is TINY_V4)  # rate 16: transformers needs them
    back = DeepseekV4Config(**legacy)
    assert back.layer_types == config.layer_types
    assert back.mlp_layer_types == config.mlp_layer_types
    assert back.compress_rates == config.compress_rates
    assert back.rope_parameters == config.rope_parameters
    assert back.quantization_config["expert_dtype"] == "fp4"
    if fields is FLASH_SHAPED:
        assert Counter(back.layer_types) == {
            "sliding_attention": 2,
            "compressed_sparse_attention": 2,
            "heavily_compressed_attention": 2,
        }
        assert back.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scale_fmt": "e5m2"}, r"quantization_config.scale_fmt='e5m2' is not supported"),
        ({"expert_dtype": "nvfp4"}, r"quantization_config.expert_dtype='nvfp4' is not supported"),
        ({"activation_scheme": "static"}, r"quantization_config.activation_scheme='static'"),
    ],
)
def test_unsupported_quantization_fields_fail_clearly(official, tmp_path, change, message):
    official_dir, _ = official
    config = json.loads((official_dir / "config.json").read_text())
    if "expert_dtype" in change:
        config["expert_dtype"] = change["expert_dtype"]  # the legacy top-level key
    else:
        config["quantization_config"] |= change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        BlockFP8.from_config(AutoConfig.from_pretrained(tmp_path))


def test_packed_fp4_without_expert_dtype_fp4_is_refused():
    packed, scales = quantize_mxfp4(torch.randn(4, 32))
    tensors = [("e.weight", packed.view(torch.float4_e2m1fn_x2)), ("e.scale", scales)]
    with pytest.raises(ValueError, match="e.weight is torch.float4_e2m1fn_x2.*expert_dtype"):
        list(BlockFP8((128, 128), ue8m0=True).read(tensors))
    bad = [("e.weight", packed.view(torch.int8)), ("e.scale", scales[:, :0])]
    with pytest.raises(ValueError, match="e.weight: MXFP4 weight"):
        list(BlockFP8((128, 128), ue8m0=True, fp4_experts=True).read(bad))
