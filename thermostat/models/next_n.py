"""DeepSeek-V3's multi-token-prediction (next-n) layers, served as a speculative proposer
(`--speculative mtp`, thermostat.engine.speculative).

The layer at depth 1 takes, for each position i, the main model's final hidden state h_i (after
its norm) and the embedding of the token at i + 1, and predicts the token at i + 2:

    x = eh_proj([enorm(embed(t[i + 1])), hnorm(h[i])])
    y = a decoder layer of the main model's kind (its own slot in the KV cache, its own MoE)
    logits = shared_head.head(shared_head.norm(y))

Checkpoint names: `model.layers.{L + j}.{enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head}` and the decoder layer's `self_attn`, `mlp` and norms under the same prefix
(L = num_hidden_layers); its `embed_tokens` is the main model's (not loaded twice).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from thermostat.kernels import CpuOps
from thermostat.models.attention import AttentionMetadata
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.layers import RMSNorm

_OWN = re.compile(r"(enorm|hnorm|eh_proj)\.(.+)")
_HEAD = re.compile(r"shared_head\.(norm|head)\.(.+)")


class NextNLayer(nn.Module):
    def __init__(
        self, hidden_size: int, vocab_size: int, eps: float, block: nn.Module, ops: CpuOps | None
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps, ops)
        self.hnorm = RMSNorm(hidden_size, eps, ops)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block  # called as (x, residual, cos, sin, meta, cache) -> (x, residual)
        self.head_norm = RMSNorm(hidden_size, eps, ops)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """[T, H] main hidden states and [T, H] embeddings of each row's next token -> [T, H]:
        the head's input (normed)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        y, residual = self.block(x, None, cos, sin, meta, cache)
        out: torch.Tensor = self.head_norm.add_forward(y, residual)
        return out


def next_n_name(name: str, num_layers: int) -> str | None:
    """A checkpoint name of next-n layer j (`layers.{num_layers + j}.*`, no `model.` prefix) ->
    its name under `next_n.{j}`; None for its copy of the embeddings. Names of the decoder
    layer (attention, MLP, norms) go under `next_n.{j}.block`, where the family's own mapping
    (fused projections, experts) applies next."""
    match = re.match(r"layers\.(\d+)\.(.+)", name)
    assert match is not None and int(match[1]) >= num_layers
    j, rest = int(match[1]) - num_layers, match[2]
    if rest.startswith("embed_tokens."):
        return None
    if own := _OWN.fullmatch(rest):
        return f"next_n.{j}.{own[1]}.{own[2]}"
    if head := _HEAD.fullmatch(rest):
        return f"next_n.{j}.{'head_norm' if head[1] == 'norm' else 'head'}.{head[2]}"
    return f"next_n.{j}.block.{rest}"
