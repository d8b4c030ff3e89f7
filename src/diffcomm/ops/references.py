"""Serial references of the collectives: what each op computes, with plain torch ops on
the list of every rank's input (``xs[r]``: rank ``r``'s tensor; ``kws[r]``: the keyword
arguments rank ``r`` passed). The registry entries of :mod:`diffcomm.ops.collectives` carry
them; ``diffcomm.testing`` and ``python -m diffcomm check`` compare the parallel ops with
them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .registry import Kwargs


def avg_scale(kw: Kwargs, world: int) -> float:
    return 1.0 / world if kw.get("op", "sum") == "avg" else 1.0


def reduce_serial(xs: Sequence[Tensor], op: str) -> Tensor:
    """The reduction over ranks of ``xs`` with plain torch ops (serial references)."""
    st = torch.stack(list(xs))
    if op in ("sum", "avg"):
        return st.sum(0) / len(xs) if op == "avg" else st.sum(0)
    return getattr(st, {"max": "amax", "min": "amin", "product": "prod"}[op])(0)


def even(total: int, world: int) -> list[int]:
    return [total // world] * world


def all_reduce(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    red = reduce_serial(xs, kws[0].get("op", "sum"))
    return [red for _ in xs]


def broadcast(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    return [xs[kws[0].get("src", 0)] for _ in xs]


def reduce(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    red, dst = reduce_serial(xs, kws[0].get("op", "sum")), kws[0].get("dst", 0)
    return [red if r == dst else torch.zeros_like(red) for r in range(len(xs))]


def all_gather(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    full = torch.cat(xs, dim=kws[0].get("dim", 0))
    return [full for _ in xs]


def gather(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    full, dst = torch.cat(xs, dim=kws[0].get("dim", 0)), kws[0].get("dst", 0)
    return [full if r == dst else torch.zeros_like(full) for r in range(len(xs))]


def reduce_scatter(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    kw, w = kws[0], len(xs)
    red, dim = reduce_serial(xs, kw.get("op", "sum")), kw.get("dim", 0)
    return list(red.split(list(kw.get("split_sizes") or even(red.shape[dim], w)), dim=dim))


def scatter(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    kw, w = kws[0], len(xs)
    dim, src = kw.get("dim", 0), kw.get("src", 0)
    return list(xs[src].split(list(kw.get("split_sizes") or even(xs[src].shape[dim], w)), dim=dim))


def all_to_all(xs: list[Tensor], kws: list[Kwargs]) -> list[Tensor]:
    w = len(xs)
    sd, cd = kws[0].get("split_dim", 0), kws[0].get("concat_dim", 0)
    splits = [kws[j].get("input_split_sizes") or even(xs[j].shape[sd], w) for j in range(w)]
    chunks = [xs[j].split(list(splits[j]), dim=sd) for j in range(w)]
    return [torch.cat([chunks[j][r] for j in range(w)], dim=cd) for r in range(w)]
