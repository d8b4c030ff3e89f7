"""A Llama-style block with context parallelism equals the serial block.

The block: RMSNorm -> attention with rotary position embeddings (RoPE) and grouped-query
heads -> residual -> RMSNorm -> SwiGLU MLP -> residual. Everything except attention acts
token by token, so under context parallelism each rank runs it on its own tokens; only
attention needs the whole sequence, and :func:`diffcomm.parallel.ring_attention` computes
it exactly. The sequence is laid out zigzag (balanced causal work): the inputs, the RoPE
positions and the targets are taken with :func:`diffcomm.parallel.shard`, the output is
put back with :func:`~diffcomm.parallel.unshard`.

Gradients: the weights are replicated, and each rank's loss covers its tokens, so the
objective is the sum of the per-rank losses (diffcomm's convention) and a weight's full
gradient is the sum of the ranks' gradients — one ``all_reduce`` per weight, as in data
parallelism.

Run it: ``python examples/context_parallel_llama.py`` (world 2, causal, float64) prints the
largest difference from the serial block in the output and in every weight's gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import diffcomm as dc
from diffcomm import parallel


class Block(nn.Module):
    """One Llama-style decoder block; ``attention`` is pluggable (serial or ring)."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def rope(self, x: Tensor, pos: Tensor) -> Tensor:
        """Rotary embedding of ``x (B, H, S, hd)`` at absolute positions ``pos (S,)``."""
        half = self.hd // 2
        freq = 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
        ang = pos.to(x.dtype)[:, None] * freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    def forward(self, x: Tensor, pos: Tensor, attention: object) -> Tensor:
        B, S, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(B, S, self.heads, self.hd).transpose(1, 2)
        k, v = self.wkv(h).view(B, S, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = attention(self.rope(q, pos), self.rope(k, pos), v)  # type: ignore[operator]
        x = x + self.wo(a.transpose(1, 2).reshape(B, S, -1))
        h = self.norm2(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


def serial_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def compare(seq: int = 24, layout: str = "zigzag") -> dict[str, float]:
    """On every rank: the CP block against the serial one; returns the largest differences."""
    torch.manual_seed(0)  # the same weights and data on every rank
    block = Block().double()
    x = torch.randn(2, seq, 32, dtype=torch.float64)
    target = torch.randn(2, seq, 32, dtype=torch.float64)

    # serial: the whole sequence on one rank
    y_ref = block(x, torch.arange(seq), serial_attention)
    loss_ref = ((y_ref - target) ** 2).sum()
    grads_ref = torch.autograd.grad(loss_ref, list(block.parameters()))

    # context parallel: this rank's tokens (zigzag), their positions and targets
    # (a length the layout does not divide is padded: `real` marks this rank's real tokens)
    x_l = parallel.shard(x, 1, layout=layout)
    pos_l = parallel.shard(torch.arange(seq), 0, layout=layout)
    t_l = parallel.shard(target, 1, layout=layout)
    real = parallel.shard(torch.ones(seq, dtype=torch.float64), 0, layout=layout)

    def ring(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return parallel.ring_attention(q, k, v, causal=True, layout=layout, seq_len=seq)

    y_l = block(x_l, pos_l, ring)
    loss_l = (((y_l - t_l) ** 2) * real[:, None]).sum()  # sum over ranks = loss_ref
    grads = [dc.all_reduce(g) for g in torch.autograd.grad(loss_l, list(block.parameters()))]
    y = parallel.unshard(y_l.detach(), 1, layout=layout, seq_len=seq)
    return {
        "output": float((y - y_ref.detach()).abs().max()),
        "loss": float((dc.all_reduce(loss_l.detach()) - loss_ref.detach()).abs()),
        "weights": max(float((g - r).abs().max()) for g, r in zip(grads, grads_ref, strict=True)),
    }


if __name__ == "__main__":
    with dc.LocalWorld(2) as world:
        for rank, errs in enumerate(world.run(compare)):
            print(f"rank {rank}: max |CP - serial| {errs}")
