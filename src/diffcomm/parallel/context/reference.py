"""The serial reference of the context-parallel ops (:func:`attention_reference`) and the
attention-dropout mask of global coordinates they share (:func:`dropout_keep_mask`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...backend import args as A
from .args import check_qkv, check_scale
from .layout import check_cu_seqlens, doc_ids

__all__ = ["attention_reference", "dropout_keep_mask"]

# ======================================================================================
# dropout: a counter-based mask of global coordinates
# ======================================================================================

_M1 = 0xFF51AFD7ED558CCD - (1 << 64)
_M2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_K = (0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019, 0x2545F4914F6CDD1D, 0x1B873593)


def _mix(h: Tensor) -> Tensor:
    h = h ^ ((h >> 33) & ((1 << 31) - 1))
    h = h * _M1
    h = h ^ ((h >> 33) & ((1 << 31) - 1))
    h = h * _M2
    return h ^ ((h >> 33) & ((1 << 31) - 1))


def dropout_keep_mask(
    seed: int, batch: int, heads: int, q_positions: Tensor, k_positions: Tensor, p: float
) -> Tensor:
    """The attention-dropout keep mask of :func:`ring_attention` and
    :func:`attention_reference`: a hash of ``(seed, batch, head, query position, key
    position)``, so it is the same whichever rank computes a block and in whatever layout.

    Args:
        seed: the dropout seed.
        batch, heads: sizes of the batch and (query) head dims.
        q_positions, k_positions: 1-D int64 global positions.
        p: the dropout probability.

    Returns:
        ``(batch, heads, len(q_positions), len(k_positions))`` bool, ``True`` = kept
        (probability ``1 - p`` each, independent across entries).
    """
    dev = q_positions.device
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    qp = q_positions.to(torch.int64).view(1, 1, -1, 1)
    kp = k_positions.to(torch.int64).view(1, 1, 1, -1)
    s = _mix(torch.tensor(int(seed) & ((1 << 63) - 1), dtype=torch.int64, device=dev))
    x = _mix(s + b * _K[0] + h * _K[1])
    x = _mix(x + qp * _K[2])
    x = _mix(x + kp * _K[3])
    u = (x & ((1 << 24) - 1)).to(torch.float64) / float(1 << 24)
    return u >= p


# ======================================================================================
# the serial reference
# ======================================================================================


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    cu_seqlens: Any = None,
    is_causal: bool | None = None,
) -> Tensor:
    """Single-process attention with the semantics of :func:`ring_attention` on the whole
    sequence (dense, O(S^2) memory): the serial reference for tests.

    Same arguments as :func:`ring_attention` with full-length tensors
    (``(batch, heads, S, head_dim)``, ``attn_mask`` broadcastable to ``(batch, heads, S,
    S)``). Rows that may attend nothing are zero (where SDPA returns NaN). Differentiable
    by autograd (double backward included).

    ``is_causal``: SDPA's name for ``causal`` (so this function is an ``attn_fn`` of
    :func:`ulysses_attention`, which calls ``attn_fn(q, k, v, is_causal=, scale=)``);
    given both, they must agree.
    """
    op = "parallel.attention_reference"
    if is_causal is not None:
        if not isinstance(is_causal, bool):
            raise A.arg_error(op, "is_causal", "a bool or None", type(is_causal).__name__, TypeError)
        if causal and not is_causal:
            raise A.arg_error(op, "is_causal", "equal to `causal` when both are given", is_causal)
        causal = is_causal
    q, k, v = check_qkv(q, k, v, op)
    S = q.shape[2]
    cu = check_cu_seqlens(cu_seqlens, op, S)
    sc = check_scale(scale, q.shape[-1], op)
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = torch.matmul(q, kk.transpose(-1, -2)) * sc
    pos = torch.arange(S, device=q.device)
    docs = doc_ids(pos, S, cu).to(q.device)
    allowed = docs.view(-1, 1) == docs.view(1, -1)
    if causal:
        allowed &= pos.view(1, -1) <= pos.view(-1, 1)
    s = s.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    w = e / torch.where(den > 0, den, torch.ones_like(den))
    if dropout_p > 0:
        keep = dropout_keep_mask(dropout_seed, q.shape[0], q.shape[1], pos, pos, dropout_p)
        w = w * keep / (1 - dropout_p)
    return torch.matmul(w, vv)
