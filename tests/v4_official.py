"""DeepSeek-V4 checkpoints in DeepSeek's official layout, for tests: a tiny random transformers
model (`write_hf_v4`), the same weights as DeepSeek ships them (`write_official_checkpoint`: their
names, fp8 e4m3 linears with e8m0 128x128 block scales, MXFP4 routed experts, bf16 compressors,
indexer weights_proj, routers, norms, embeddings and head, float32 mHC / sinks / ape / router bias,
int32 tid2eid, an `mtp.0.*` layer, legacy config keys, two shards), and those weights dequantized
back under transformers' names in float32 (`dequantized_hf_checkpoint`: the reference transformers
loads).

The name table and the dequantization here are written apart from thermostat's (a forward table
from transformers' names, block loops, e2m1 decoded from its bit fields), so tests can check the
loader against them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from thermostat.models.deepseek_v4_names import official_config
from thermostat.models.mxfp4 import quantize_mxfp4

TINY_V4 = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    sliding_window=8,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    hc_mult=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    num_hash_layers=1,
    partial_rotary_factor=0.25,
    max_position_embeddings=512,
)
BLOCK = 128
FP8_MAX = 448.0

# transformers name -> official name, applied in order (from conversion_mapping.py, read backwards)
_TO_OFFICIAL = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.sinks$", ".attn_sink"),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.e_score_correction_bias$", ".bias"),
    (r"(experts\.\d+|shared_experts)\.gate_proj\.", r"\1.w1."),
    (r"(experts\.\d+|shared_experts)\.up_proj\.", r"\1.w3."),
    (r"(experts\.\d+|shared_experts)\.down_proj\.", r"\1.w2."),
    (r"\.gate_proj\.", ".wgate."),  # the compressors' (the experts' were renamed above)
]
# official names (after the table) by how DeepSeek stores them
_FP8 = re.compile(
    r".*(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123])\.weight"
)
_EXPERT = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight")
_FLOAT32 = re.compile(r".*(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|gate\.bias)")


def official_name(name: str) -> str:
    """A transformers parameter name (per-expert for experts) -> DeepSeek's."""
    for pattern, target in _TO_OFFICIAL:
        name = re.sub(pattern, target, name)
    return name


def per_expert_state(state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> one tensor per expert
    and projection, under `experts.E.{gate_proj,up_proj,down_proj}.weight`."""
    out = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            for e in range(tensor.shape[0]):
                if leaf == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
                else:
                    out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :inter]
                    out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, inter:]
        else:
            out[name] = tensor
    return out


def write_hf_v4(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random DeepseekV4ForCausalLM saved by transformers (its save_pretrained layout, no
    tokenizer). Constant-initialised tensors (norms, sinks, mHC base/scale, router bias, tid2eid)
    are randomised so that a swapped name shows."""
    config = DeepseekV4Config(**(TINY_V4 | overrides))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                rows = [torch.randperm(config.n_routed_experts)[: config.num_experts_per_tok]
                        for _ in range(config.vocab_size)]  # fmt: skip
                tensor.copy_(torch.stack(rows))
            elif (
                tensor.is_floating_point()
                and tensor.numel()
                and bool((tensor == tensor.flatten()[0]).all())
            ):
                tensor.add_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(path)
    return path


def _e8m0_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two with amax / scale <= top, as e8m0 bytes."""
    k = torch.ceil(torch.log2(amax.double().clamp(min=2.0**-120) / top))
    return (k + 127).clamp(0, 254).to(torch.uint8)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (float8_e4m3fn, float8_e8m0fnu [ceil(out/128), ceil(in/128)])."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.uint8)
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rs, cs = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            scales[i, j] = _e8m0_scale(weight[rs, cs].abs().max(), FP8_MAX)
            fp8[rs, cs] = (weight[rs, cs].double() / 2.0 ** (int(scales[i, j]) - 127)).to(fp8.dtype)
    return fp8, scales.view(torch.float8_e8m0fnu)


def _official_tensors(state: dict[str, torch.Tensor], fp4_experts: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        official = official_name(name)
        if _EXPERT.fullmatch(official) and fp4_experts:
            packed, scale = quantize_mxfp4(tensor)
            out[official] = packed.view(torch.int8)  # as transformers allocates them
            out[official.removesuffix("weight") + "scale"] = scale
        elif _FP8.fullmatch(official) or _EXPERT.fullmatch(official):
            out[official], out[official.removesuffix("weight") + "scale"] = quantize_fp8(tensor)
        elif official.endswith("tid2eid"):
            out[official] = tensor.to(torch.int32)
        elif _FLOAT32.fullmatch(official):
            out[official] = tensor.float().contiguous()
        else:
            out[official] = tensor.to(torch.bfloat16)
    return out


def _mtp_tensors(hidden: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    e_proj, e_scale = quantize_fp8(0.02 * torch.randn(hidden, hidden))
    return {
        "mtp.0.e_proj.weight": e_proj,
        "mtp.0.e_proj.scale": e_scale,
        "mtp.0.enorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "mtp.0.hnorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "mtp.0.hc_head_base": torch.zeros(2),
        "mtp.0.attn.attn_sink": torch.zeros(4),
    }


def _save_shards(tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Two shards, neighbours in name order apart: a weight and its scale land in different
    files, the scale (`X.scale` < `X.weight`) first."""
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, members in shards.items():
        save_file({n: tensors[n].contiguous() for n in members}, out_dir / file)
    weight_map = {n: file for file, members in shards.items() for n in members}
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _copy_other_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and "safetensors" not in f.name:
            shutil.copy(f, dst / f.name)


def write_official_checkpoint(hf_dir: Path, out_dir: Path, fp4_experts: bool = True) -> Path:
    """`hf_dir` (a transformers V4 checkpoint) -> `out_dir` in DeepSeek's layout (module
    docstring). Block 128 even on tiny shapes: the edge blocks are partial."""
    model = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = model.config
    state = per_expert_state(model.state_dict(), config.moe_intermediate_size)
    tensors = _official_tensors(state, fp4_experts) | _mtp_tensors(config.hidden_size)
    _copy_other_files(hf_dir, out_dir)
    _save_shards(tensors, out_dir)
    official = official_config(config.to_dict(), "fp4" if fp4_experts else "fp8")
    (out_dir / "config.json").write_text(json.dumps(official, indent=1))
    return out_dir


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = handle.get_tensor(name)
    return out


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).double() - 127)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block by block, e8m0 scales as 2 ** (byte - 127)."""
    out, factors = torch.empty(weight.shape, dtype=torch.float64), _e8m0(scale)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rs, cs = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rs, cs] = weight[rs, cs].double() * factors[i, j]
    return out.float()


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 from its bit fields (sign 3, exponent 2..1, mantissa 0), low nibble first."""
    byte = packed.view(torch.uint8).long()
    nibbles = torch.stack([byte % 16, byte // 16], dim=-1).reshape(byte.shape[0], -1)
    sign = 1 - 2 * (nibbles // 8)
    exponent, mantissa = (nibbles // 2) % 4, nibbles % 2
    magnitude = torch.where(
        exponent == 0, 0.5 * mantissa, torch.pow(2.0, exponent - 1.0) * (1 + 0.5 * mantissa)
    )
    factors = _e8m0(scale).repeat_interleave(32, dim=-1)
    return (sign * magnitude * factors).float()


def dequantized_hf_checkpoint(official_dir: Path, out_dir: Path) -> Path:
    """`official_dir` -> `out_dir`: its weights dequantized, float32 (int64 tid2eid), under
    transformers' names with fused experts, MTP dropped; config.json without the quantization."""
    tensors = read_tensors(official_dir)
    config_dict = json.loads((official_dir / "config.json").read_text())
    for key in ("quantization_config", "expert_dtype", "torch_dtype"):
        config_dict.pop(key, None)
    config_dict["dtype"] = "float32"
    config = DeepseekV4Config.from_dict(config_dict)
    with torch.device("meta"):
        names = DeepseekV4ForCausalLM(config).state_dict()
    inter = config.moe_intermediate_size
    per_expert = per_expert_state(dict(names), inter)
    by_official = {official_name(n): n for n in per_expert}
    values: dict[str, torch.Tensor] = {}
    for official, name in by_official.items():
        tensor, scale = tensors[official], tensors.get(official.removesuffix("weight") + "scale")
        if scale is not None and tensor.dtype == torch.int8:
            values[name] = dequantize_fp4(tensor, scale)
        elif scale is not None:
            values[name] = dequantize_fp8(tensor, scale)
        elif official.endswith("tid2eid"):
            values[name] = tensor.long()
        else:
            values[name] = tensor.float()
    state = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        n = names[name].shape[0]
        if prefix.endswith(".experts") and leaf == "gate_up_proj":
            state[name] = torch.stack([torch.cat([values[f"{prefix}.{e}.gate_proj.weight"],
                                                  values[f"{prefix}.{e}.up_proj.weight"]])
                                       for e in range(n)])  # fmt: skip
        elif prefix.endswith(".experts") and leaf == "down_proj":
            state[name] = torch.stack([values[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
        else:
            state[name] = values[name]
    _copy_other_files(official_dir, out_dir)
    save_file(state, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=1))
    return out_dir
