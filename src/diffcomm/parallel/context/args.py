"""The argument checks shared by the context-parallel ops (:func:`ring_attention`,
:func:`ulysses_attention`, :func:`usp_attention`, :func:`attention_reference`): public
to the sibling modules, so none reaches into another's privates. All local, except
:func:`check_equal_lengths` (one small exchange, where only the ranks together can tell)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ... import backend as B
from ...backend import args as A
from ...backend.args import PG
from ...backend.consistency import check_settings

__all__ = ["check_qkv", "check_scale", "check_causal", "check_dropout", "draw_seed", "check_equal_lengths"]


def check_qkv(q: Any, k: Any, v: Any, op: str) -> tuple[Tensor, Tensor, Tensor]:
    """``q``, ``k``, ``v`` as 4-D floating tensors of one dtype in the SDPA layout, with
    matching batch, sequence and (k) head dims and ``kv_heads`` dividing ``heads``."""
    q = A.check_tensor(q, op, "q")
    k = A.check_tensor(k, op, "k")
    v = A.check_tensor(v, op, "v")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise A.arg_error(op, name, "4-D (batch, heads, seq_local, head_dim)", f"shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise A.arg_error(op, name, "a floating-point tensor", t.dtype, TypeError)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise A.arg_error(op, "k/v", f"of q's dtype {q.dtype}", f"{k.dtype}/{v.dtype}", TypeError)
    if (
        k.shape[:3] != v.shape[:3]
        or k.shape[0] != q.shape[0]
        or k.shape[2] != q.shape[2]
        or k.shape[3] != q.shape[3]
    ):
        raise A.arg_error(
            op,
            "k/v",
            f"(batch, kv_heads, seq_local, head_dim) matching q {tuple(q.shape)} in batch, sequence "
            "and (k) head_dim, with the same kv_heads",
            f"k {tuple(k.shape)}, v {tuple(v.shape)}",
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise A.arg_error(op, "k", f"a number of heads dividing q's {q.shape[1]} (GQA)", k.shape[1])
    return q, k, v


def check_scale(scale: Any, head_dim: int, op: str) -> float:
    """The softmax scale: ``scale`` as a float, default ``1 / sqrt(head_dim)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise A.arg_error(op, "scale", "a float or None", type(scale).__name__, TypeError)
    return float(scale)


def check_causal(causal: Any, op: str) -> bool:
    if not isinstance(causal, bool):
        raise A.arg_error(op, "causal", "a bool", type(causal).__name__, TypeError)
    return causal


def check_dropout(p: Any, op: str) -> float:
    """The attention dropout probability, a float in ``[0, 1)``."""
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
        raise A.arg_error(op, "dropout_p", "a float in [0, 1)", repr(p))
    return float(p)


def draw_seed(seed: Any, p: float, op: str) -> int:
    """The dropout seed: ``seed``, or drawn from the default generator (0 without dropout)."""
    if p == 0:
        return 0
    if seed is None:
        return int(torch.randint(0, 1 << 62, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise A.arg_error(op, "dropout_seed", "an int or None", type(seed).__name__, TypeError)
    return seed


def check_equal_lengths(
    op: str,
    seq_local: int,
    pg: PG,
    across: PG | None = None,
    settings: dict[str, tuple[int, Callable[[int], Any]]] | None = None,
) -> None:
    """Every rank's ``seq_local`` is the same, or ``ValueError`` naming ``q`` and the
    lengths, on every rank (``across``: a second group crossing ``pg``, for
    :func:`usp_attention`: then over all ranks of both).

    Needed only where the global length is inferred (``W * seq_local``: no placement that
    recorded it, no ``seq_len``, no ``cu_seqlens``): shards of unequal length
    (``x.chunk(W, 2)[rank]`` with ``S % W != 0``) look right to each rank alone, and the
    ring's hops would then carry blocks of different sizes (gloo aborts a rank). No hop
    can carry the check: a rank must know the size of the block it receives before
    receiving it, and a hop tells a rank only its neighbour's length. So it costs one
    small exchange of host integers (an all_gather of one int64 per rank, and the
    ``settings``, on the CPU side channel; measured in docs/context_parallel.md), two
    across two groups; a given
    ``seq_len`` (or a :func:`shard` placement) makes the lengths known and skips it.

    ``settings`` (without ``across``): ``{name: (code, decode)}``, settings each rank reads
    alone (``causal``, ``scale``, ``layout``) as ints that travel with the length in the
    same exchange (free); ranks that disagree raise
    :class:`~diffcomm.CrossRankMismatchError` naming each rank's value (``decode(code)``)."""
    b = B.get_backend()
    if settings and across is None:
        rows = b.exchange_size_lists([seq_local, *(code for code, _ in settings.values())], pg)
        lens = [row[0] for row in rows]
        shown = [(name, decode) for name, (_, decode) in settings.items()]
        check_settings(op, shown, [row[1:] for row in rows])
    else:
        lens = b.exchange_sizes(seq_local, pg)
    lo, hi = min(lens), max(lens)
    if across is not None:  # every row's extremes over the crossing group: all ranks'
        rows = b.exchange_size_lists([lo, hi], across)
        lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
    if lo == hi:
        return
    got = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lens))
    if across is not None:
        got = f"lengths from {lo} to {hi} (in this rank's group {got})"
    else:
        got = f"lengths {got}"
    raise A.arg_error(
        op,
        "q",
        "of the same length along the sequence dim (2) on every rank when no `seq_len` is given "
        "(pad the shards to the layout's length and pass seq_len=S, or use parallel.shard, "
        "which pads and records S)",
        got,
    )
