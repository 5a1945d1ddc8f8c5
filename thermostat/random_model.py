"""Random-weight Hugging Face checkpoints, written with transformers: what tests compare the
engine against and what benchmarks run on (no model can be downloaded here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV4Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity. "
    "def main():\n    return [x * 2 for x in range(10)]\n"
    '<div id="nav"><a href="#top">top</a></div> Ünïcödé — naïve café 日本語 🙂\n'
) * 4

CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama3-rope": (
        LlamaConfig,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-linear-rope-untied": (
        LlamaConfig,
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": False},
    ),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    "gemma3": (  # one local layer of a 4-token window, one global; their own rotary bases
        Gemma3TextConfig,
        {
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 30.0,
        },
    ),
}

# Mixture-of-experts families (tests/test_deepseek.py runs them against transformers).
MOE_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "deepseek_v2": (  # softmax greedy top-k, no q LoRA, every layer MoE, default rope
        DeepseekV2Config,
        {
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 24,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 2,
            "first_k_dense_replace": 0,
            "tie_word_embeddings": False,
        },
    ),
    "deepseek_v3": (  # sigmoid + bias, group-limited top-k, q LoRA, YaRN, a dense first layer
        DeepseekV3Config,
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 32,
            "v_head_dim": 16,
            "n_routed_experts": 16,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "rope_interleave": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.9,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral": (MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


_S, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_V4_BASE: dict[str, Any] = dict(
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    index_n_heads=8,
    index_head_dim=16,
    partial_rotary_factor=0.25,
)
# DeepSeek-V4 (tests/test_deepseek_v4.py runs them against transformers). Flash's layer mix is
# two sliding-only layers, then CSA and HCA alternating, ending on CSA.
V4_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "deepseek_v4": (  # Flash's mix at small rates: prompts run past several HCA windows
        DeepseekV4Config,
        _V4_BASE
        | dict(
            num_hidden_layers=5,
            layer_types=[_S, _S, _C, _H, _C],
            compress_rates={_C: 4, _H: 16},
            sliding_window=8,
            hc_mult=2,
            o_groups=2,
            index_topk=3,
            num_hash_layers=1,
            scoring_func="sqrtsoftplus",
        ),
    ),
    "deepseek_v4_pro": (  # Pro's default schedule (two HCA first), sigmoid router, 4 streams
        DeepseekV4Config,
        _V4_BASE
        | dict(
            num_hidden_layers=4,
            layer_types=[_H, _H, _C, _H],
            compress_rates={_C: 4, _H: 32},
            sliding_window=16,
            hc_mult=4,
            o_groups=4,
            index_topk=64,
            num_hash_layers=2,
            scoring_func="sigmoid",
        ),
    ),
    "deepseek_v4_flash": (  # Flash's rates, window and mix at tiny widths (benchmarks, the case)
        DeepseekV4Config,
        _V4_BASE
        | dict(
            num_hidden_layers=6,
            layer_types=[_S, _S, _C, _H, _C, _H],
            compress_rates={_C: 4, _H: 128},
            sliding_window=128,
            hc_mult=4,
            o_groups=2,
            index_topk=512,
            num_hash_layers=3,
            max_position_embeddings=4096,
        ),
    ),
}


def _randomise_constants(model: torch.nn.Module, config: PretrainedConfig) -> None:
    """DeepSeek-V4's tensors that transformers initialises to constants (sinks, norms,
    hyper-connection bases and scales, position biases, the router bias, tid2eid) get random
    values, so every one of them is exercised."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                e, k = config.n_routed_experts, config.num_experts_per_tok
                tensor.copy_(torch.stack([torch.randperm(e)[:k] for _ in range(len(tensor))]))
            elif (
                tensor.is_floating_point()
                and tensor.numel()
                and "rotary" not in name
                and bool((tensor == tensor.flatten()[0]).all())
            ):
                tensor.add_(0.1 * torch.randn_like(tensor))


def build_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=(
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        ),
    )


def write_model(
    path: Path,
    kind: str = "llama",
    seed: int = 0,
    generation_config: dict | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Path:
    """Save a tiny random model of `kind` (a CONFIGS, MOE_CONFIGS or V4_CONFIGS key) with a
    tokenizer to `path`. DeepSeek-V3's router bias, which transformers initialises to zero, is
    randomised, and so are DeepSeek-V4's constant-initialised tensors."""
    config_cls, extra = (CONFIGS | MOE_CONFIGS | V4_CONFIGS)[kind]
    fields: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    if kind in V4_CONFIGS:
        del fields["intermediate_size"], fields["num_key_value_heads"]  # V4: experts only
    config = config_cls(**(fields | extra | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind in V4_CONFIGS:
        _randomise_constants(model, config)
    if kind == "gemma3":  # its norms start at 0 (a scale of 1 + 0): every one made to count
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                if name.endswith("norm.weight"):
                    tensor.normal_(0.0, 0.3)
    model = model.to(dtype)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    gen = generation_config if generation_config is not None else {"eos_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


# Shaped like SmolLM2-135M: the benchmarks' model (docs/benchmarks.md).
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    initializer_range=0.02,
)
