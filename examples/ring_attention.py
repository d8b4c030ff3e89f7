"""Ring attention: exact attention over a sequence split across ranks (sequence parallel).

Rank ``r`` of ``n`` holds a contiguous block of the sequence: ``q, k, v`` of shape
``(batch, heads, seq_local, dim)`` for positions ``[r * seq_local, (r + 1) * seq_local)``.
The K/V blocks travel around the ring with :func:`diffcomm.ops.p2p.shift` (``n - 1`` shifts of
one stacked K/V tensor); each rank folds every block into its output with the online
softmax (running max and log-sum-exp), so no rank ever holds the full sequence.

Gradients need no hand-written backward: autograd differentiates the local math, and
each ``shift``'s backward is ``shift(grad, -1)``, which carries the K/V gradients back
around the ring to the rank that owns the block.

Run it: ``python examples/ring_attention.py`` compares against full attention on 2 ranks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import diffcomm as dc
from diffcomm.ops.p2p import shift


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: object = None, causal: bool = False, scale: float | None = None
) -> Tensor:
    """Attention of this rank's queries over the whole (ring-distributed) sequence.

    Args:
        q, k, v: this rank's block, each ``(batch, heads, seq_local, dim)``; the same
            shapes on every rank (rank ``r`` holds block ``r`` of the sequence).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        causal: mask keys after the query position (global positions).
        scale: softmax scale; default ``1 / sqrt(dim)``.

    Returns:
        ``(batch, heads, seq_local, dim)``: this rank's block of
        ``softmax(Q K^T * scale [+ causal mask]) V`` over the full sequence.

    Gradient:
        Through autograd: local math plus ``shift``'s adjoint ``shift(grad, -1)``; ``q``'s
        gradient stays local, ``k``/``v``'s return to their owner around the ring.

    Example::

        def attend():
            torch.manual_seed(dc.get_rank())
            q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
            return ring_attention(q, k, v, causal=True)

        with dc.LocalWorld(2) as world:
            world.run(attend)       # two (1, 2, 4, 8) blocks of the full output
    """
    n, r = dc.get_world_size(group), dc.get_rank(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kv = torch.stack([k, v])  # one message per hop instead of two
    out = lse_max = denom = None
    for i in range(n):
        if i:
            kv = shift(kv, 1, group=group)  # now holding block (r - i) mod n
        j = (r - i) % n
        if causal and j > r:
            # every key of block j is after every query here. Skip the math but keep the
            # block in the graph with a zero: each rank must run the backward of every
            # shift (the SPMD rule), and this shift's output is otherwise unused here.
            out = out + 0.0 * kv.sum()
            continue
        s = torch.matmul(q, kv[0].transpose(-1, -2)) * scale
        if causal and j == r:
            mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        # the running max only keeps exp() in range; the result does not depend on it,
        # so it is detached (exact, and it keeps its gradient out of the way)
        m_blk = s.amax(dim=-1, keepdim=True).detach()
        if out is None:
            lse_max = m_blk
            p = torch.exp(s - lse_max)
            denom = p.sum(dim=-1, keepdim=True)
            out = torch.matmul(p, kv[1])
        else:
            m_new = torch.maximum(lse_max, m_blk)
            alpha = torch.exp(lse_max - m_new)
            p = torch.exp(s - m_new)
            denom = denom * alpha + p.sum(dim=-1, keepdim=True)
            out = out * alpha + torch.matmul(p, kv[1])
            lse_max = m_new
    assert out is not None and denom is not None
    return out / denom


def _demo() -> tuple[float, float]:
    n, r = dc.get_world_size(), dc.get_rank()
    torch.manual_seed(0)
    q_full, k_full, v_full = (torch.randn(2, 2, 4 * n, 8, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True)
    blk = slice(4 * r, 4 * (r + 1))
    out = ring_attention(q_full[:, :, blk], k_full[:, :, blk], v_full[:, :, blk], causal=True)
    return float((out - ref[:, :, blk]).abs().max()), float(out.abs().max())


if __name__ == "__main__":
    with dc.LocalWorld(2) as world:
        for rank, (err, mag) in enumerate(world.run(_demo)):
            print(f"rank {rank}: max |ring - full| = {err:.2e} (output magnitude {mag:.2f})")
