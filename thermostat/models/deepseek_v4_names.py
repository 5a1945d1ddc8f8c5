"""DeepSeek-V4 checkpoint names -> transformers' `DeepseekV4ForCausalLM` names (`hf_names`), and
the legacy config.json DeepSeek ships (`official_config`, for tests that write such a checkpoint).

Three layouts reach the loader: DeepSeek's official one (below), transformers' (the parameter
names themselves: passed through) and what transformers' `save_pretrained` writes, a hybrid of the
two (`model.` + official module names, `head.weight`, `model.embed_tokens.weight`,
`model.hc_head.hc_fn`, `attn.norm` for the attention's kv_norm). The table is transformers'
`conversion_mapping.py` "deepseek_v4" entry; N a layer, E an expert, L a leaf: `weight`, or a
quantized linear's scale (`scale` -> `weight_scale_inv`, thermostat.models.fp8_weights reads both).

With `A` = `attn.` -> `self_attn.`, `F` = `ffn.` -> `mlp.`, `C` = `compressor.`:

| official                               | transformers                                           |
|----------------------------------------|--------------------------------------------------------|
| embed.weight                           | model.embed_tokens.weight                              |
| head.weight                            | lm_head.weight                                         |
| norm.weight                            | model.norm.weight                                      |
| hc_head_{fn,base,scale}                | model.hc_head.hc_{fn,base,scale}                       |
| layers.N.X                             | model.layers.N.X', X' as below                         |
| attn_norm.weight                       | input_layernorm.weight                                 |
| ffn_norm.weight                        | post_attention_layernorm.weight                        |
| hc_{attn,ffn}_{fn,base,scale}          | {attn,ffn}_hc.{fn,base,scale}                          |
| A attn_sink                            | A sinks                                                |
| A {wq_a,wq_b,wkv,wo_a,wo_b}.L          | A {q_a_proj,q_b_proj,kv_proj,o_a_proj,o_b_proj}.L      |
| A q_norm / kv_norm (hybrid: A norm)    | A q_a_norm / kv_norm                                   |
| A C {wkv,wgate,norm}.L                 | A C {kv_proj,gate_proj,kv_norm}.L                      |
| A C ape  [rate, coff * head_dim]       | A C position_bias  (the same shape)                    |
| A indexer.C *                          | A C indexer.*  (renamed as the two lines above)        |
| A indexer.wq_b.L                       | A C indexer.q_b_proj.L                                 |
| A indexer.weights_proj.L               | A C indexer.scorer.weights_proj.L                      |
| F gate.{weight,bias,tid2eid}           | F gate.{weight,e_score_correction_bias,tid2eid}        |
| F experts.E.{w1,w3,w2}.L               | F experts.E.{gate_proj,up_proj,down_proj}.L (1)        |
| F shared_experts.{w1,w3,w2}.L          | F shared_experts.{gate_proj,up_proj,down_proj}.L       |
| mtp.N.*  (model.mtp.N.*)               | dropped, logged once (transformers drops them too)     |

(1) per expert; thermostat.models.moe.expert_target maps them into the fused
`experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I].

No tensor is reshaped or transposed: `ape` is `[rate, coff * head_dim]` in DeepSeek's
inference/model.py as `position_bias` is in transformers; tid2eid is int32 there, int64 here
(the values are the same).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from thermostat.models.weights import Loaded

logger = logging.getLogger("thermostat.models")

_LEAF = {"weight": "weight", "scale": "weight_scale_inv", "weight_scale_inv": "weight_scale_inv"}
_L = r"\.(?P<leaf>weight|scale|weight_scale_inv)"
_ATTN = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj",
         "wo_b": "o_b_proj", "q_norm": "q_a_norm", "kv_norm": "kv_norm",
         "norm": "kv_norm"}  # fmt: skip
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_GATE = {"weight": "weight", "bias": "e_score_correction_bias", "tid2eid": "tid2eid"}


def _indexer(m: re.Match[str]) -> str:
    return "indexer." if m["indexer"] else ""


# a layer's official remainder (after "layers.N.") -> its transformers remainder
_LAYER_RULES: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = [
    (re.compile(p), f)
    for p, f in (
        (r"attn_norm\.weight", lambda m: "input_layernorm.weight"),
        (r"ffn_norm\.weight", lambda m: "post_attention_layernorm.weight"),
        (r"hc_(?P<b>attn|ffn)_(?P<p>fn|base|scale)", lambda m: f"{m['b']}_hc.{m['p']}"),
        (r"attn\.attn_sink", lambda m: "self_attn.sinks"),
        (
            r"attn\.(?P<indexer>indexer\.)?compressor\.ape",
            lambda m: f"self_attn.compressor.{_indexer(m)}position_bias",
        ),
        (
            r"attn\.(?P<indexer>indexer\.)?compressor\.(?P<m>wkv|wgate|norm)" + _L,
            lambda m: f"self_attn.compressor.{_indexer(m)}{_COMPRESSOR[m['m']]}.{_LEAF[m['leaf']]}",
        ),
        (
            r"attn\.indexer\.wq_b" + _L,
            lambda m: f"self_attn.compressor.indexer.q_b_proj.{_LEAF[m['leaf']]}",
        ),
        (
            r"attn\.indexer\.weights_proj" + _L,
            lambda m: f"self_attn.compressor.indexer.scorer.weights_proj.{_LEAF[m['leaf']]}",
        ),
        (
            r"attn\.(?P<m>wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm|norm)" + _L,
            lambda m: f"self_attn.{_ATTN[m['m']]}.{_LEAF[m['leaf']]}",
        ),
        (r"ffn\.gate\.(?P<p>weight|bias|tid2eid)", lambda m: f"mlp.gate.{_GATE[m['p']]}"),
        (
            r"ffn\.(?P<e>experts\.\d+|shared_experts)\.(?P<m>w[123])" + _L,
            lambda m: f"mlp.{m['e']}.{_FFN[m['m']]}.{_LEAF[m['leaf']]}",
        ),
    )
]
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER = re.compile(r"layers\.(?P<n>\d+)\.(?P<rest>.+)")
_MTP = re.compile(r"(?:model\.)?mtp\.(?P<n>\d+)\..+")


def hf_name(name: str) -> str | None:
    """One checkpoint name -> its transformers name; None for an MTP tensor. Names no rule
    knows (transformers' own) come back unchanged, under `model.` unless they are lm_head's."""
    if _MTP.fullmatch(name):
        return None
    bare = name.removeprefix("model.")
    if bare in _TOP:
        return _TOP[bare]
    layer = _LAYER.fullmatch(bare)
    if layer is not None:
        rest = layer["rest"]
        for pattern, target in _LAYER_RULES:
            match = pattern.fullmatch(rest)
            if match is not None:
                rest = target(match)
                break
        return f"model.layers.{layer['n']}.{rest}"
    return name if name.startswith("lm_head.") else f"model.{bare}"


def hf_names(
    tensors: Iterable[tuple[str, Loaded]],
) -> Iterator[tuple[str, Loaded]]:
    """Checkpoint tensors (official, transformers or save_pretrained names) -> transformers
    names, tensors untouched; `mtp.*` tensors are dropped and the skipped MTP layers logged once
    (logger "thermostat.models") when the iteration ends."""
    skipped: dict[int, int] = {}  # MTP layer -> tensors dropped
    for name, tensor in tensors:
        target = hf_name(name)
        if target is None:
            mtp = _MTP.fullmatch(name)
            assert mtp is not None
            skipped[int(mtp["n"])] = skipped.get(int(mtp["n"]), 0) + 1
            continue
        yield target, tensor
    if skipped:
        layers = ", ".join(f"mtp.{n} ({count} tensors)" for n, count in sorted(skipped.items()))
        logger.info(
            "checkpoint: skipped the multi-token-prediction layer(s) %s: Thermostat does not "
            "serve MTP (speculative decoding); transformers drops them too",
            layers,
        )


_RATE_KEYS = {"compressed_sparse_attention": "compress_rate_csa",
              "heavily_compressed_attention": "compress_rate_hca"}  # fmt: skip
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_TRANSFORMERS_RATES = {4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
_DROPPED = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
            "partial_rotary_factor", "dtype", "torch_dtype", "quantization_config")  # fmt: skip


def official_config(hf_config: dict[str, Any], expert_dtype: str = "fp4") -> dict[str, Any]:
    """A transformers DeepseekV4Config dict (`to_dict()` or its config.json) -> config.json as
    DeepSeek ships it: `compress_ratios` per layer plus one 0 per MTP layer, `num_hash_layers`,
    `qk_rope_head_dim`, `rope_theta` / `compress_rope_theta` / `rope_scaling` (yarn of the
    compressed layers), top-level `expert_dtype`, fp8 `quantization_config` with scale_fmt ue8m0.

    transformers reads `compress_ratios` through {0: sliding, 4: CSA, 128: HCA} only, so a config
    whose rates differ (tiny test models) also keeps `layer_types` and gives its rates as the
    legacy `compress_rate_csa` / `compress_rate_hca`. ValueError for what the legacy keys cannot
    say (hash layers that are not a prefix, a rope-scaled sliding layer)."""
    config = {k: v for k, v in hf_config.items() if k not in _DROPPED}
    layer_types = list(hf_config["layer_types"])
    rates = {"sliding_attention": 0, **(hf_config.get("compress_rates") or _DEFAULT_RATES)}
    ratios = [rates[t] for t in layer_types]
    config["compress_ratios"] = ratios + [0] * int(hf_config.get("num_nextn_predict_layers", 0))
    if any(_TRANSFORMERS_RATES.get(r) != t for r, t in zip(ratios, layer_types, strict=True) if r):
        config["layer_types"] = layer_types
        config.update({key: rates[t] for t, key in _RATE_KEYS.items() if t in rates})
    mlp = list(hf_config["mlp_layer_types"])
    hashed = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * hashed + ["moe"] * (len(mlp) - hashed):
        raise ValueError(f"mlp_layer_types {mlp}: num_hash_layers says only a prefix of hash_moe")
    config["num_hash_layers"] = hashed
    config["qk_rope_head_dim"] = round(hf_config["head_dim"] * hf_config["partial_rotary_factor"])
    rope = hf_config["rope_parameters"]
    main, compress = rope["main"], rope["compress"]
    if main.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.main {main}: the official config has plain rope there")
    config["rope_theta"] = main["rope_theta"]
    config["compress_rope_theta"] = compress["rope_theta"]
    if compress.get("rope_type") == "yarn":
        config["rope_scaling"] = {
            "type": "yarn",
            **{k: compress[k] for k in _YARN_KEYS if k in compress},
        }
    config["expert_dtype"] = expert_dtype
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    return config
