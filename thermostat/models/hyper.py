"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is `hc` streams per token,
[T, hc, D] in the model dtype, mixed in float32 around every block.

Per block, from the streams s (`HyperConnection`):

| step     | what                                                                         |
|----------|------------------------------------------------------------------------------|
| mix      | m = unweighted_rms_norm(flatten(s)) @ fn^T, split into pre [hc], post [hc],  |
|          | comb [hc, hc]                                                                |
| pre      | sigmoid(m_pre * scale[0] + base_pre) + eps                                   |
| post     | 2 * sigmoid(m_post * scale[1] + base_post)                                   |
| comb     | softmax(m_comb * scale[2] + base_comb, rows) + eps, then Sinkhorn: columns   |
|          | normalised once, then (iters - 1) rounds of rows then columns                |
| in       | the block's input x = sum_i pre_i * s_i                                      |
| out      | s' = post (x) block(x) + comb^T s                                            |

`HyperHead` collapses the streams once after the last layer: sum_i (sigmoid(m_i * scale + base_i)
+ eps) * s_i. Everything is per token: the streams add no cache state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from thermostat.models.layers import Float32Module


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, the rsqrt taken in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] positive -> close to doubly stochastic (columns, then rows and columns)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(Float32Module):
    """The mixing around one block (attention or feed-forward); parameters in float32."""

    def __init__(self, hc: int, hidden_size: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        width = (2 + hc) * hc
        self.fn = torch.nn.Parameter(torch.zeros(width, hc * hidden_size))
        self.base = torch.nn.Parameter(torch.zeros(width))
        self.scale = torch.nn.Parameter(torch.ones(3))

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D] -> (block input [T, D] in the streams' dtype, post [T, hc],
        comb [T, hc, hc] float32)."""
        hc, t = self.hc, streams.shape[0]
        flat = unweighted_rms_norm(streams.reshape(t, -1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mix[:, :hc], mix[:, hc : 2 * hc], mix[:, 2 * hc :]
        pre_b, post_b, comb_b = self.base[:hc], self.base[hc : 2 * hc], self.base[2 * hc :]
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(t, hc, hc) * self.scale[2] + comb_b.view(hc, hc), dim=-1)
        comb = sinkhorn(comb + self.eps, self.iters, self.eps)
        x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return x, post, comb

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a block whose output is `out` [T, D]: post (x) out + comb^T s."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(Float32Module):
    """The final collapse of the streams into one hidden state per token."""

    def __init__(self, hc: int, hidden_size: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = torch.nn.Parameter(torch.zeros(hc, hc * hidden_size))
        self.hc_base = torch.nn.Parameter(torch.zeros(hc))
        self.hc_scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
