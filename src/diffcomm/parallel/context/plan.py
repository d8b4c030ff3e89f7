"""The ring's block plan: which of this rank's queries meet which keys of the block that
arrives at each step, as pieces a kernel takes (rank-independent tables, no tensors of the
call, no communication); and :func:`ring_attention_work`, the work it implies per rank.
The ring itself (:mod:`~diffcomm.parallel.context.ring`) owns the communication."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .layout import DEFAULT_LAYOUT, check_cu_seqlens, check_layout, doc_ids, index_table

__all__ = ["BlockPlan", "ring_attention_work", "take", "put_add", "as_slice"]


class BlockPlan:
    """Which query rows of rank ``rank`` meet which key columns of every rank ``j`` under a
    layout (``table``: ``layout_index``; ``docs``: the document of every slot, -1 for
    padding) with or without the causal rule."""

    def __init__(self, rank: int, world: int, table: Tensor, docs: Tensor, causal: bool) -> None:
        self.rank, self.world = rank, world
        self.table, self.docs = table, docs
        self.causal = causal

    def block(self, j: int, device: torch.device) -> list[tuple[Any, ...]]:
        """Queries of this rank x keys of rank ``j`` as a list of disjoint *pieces*
        ``(rows, cols, allowed, q_positions, k_positions)``: one per document (documents
        too small to be worth a piece of their own are lumped with their neighbour), trimmed
        to the rows and cols with any allowed pair (a slice when contiguous, else an index
        tensor); ``allowed`` is the pattern on the piece (``None`` when all allowed). An
        empty list: nothing allowed (the block is skipped). Recomputed at each use
        (O(seq_local^2) booleans, like one block of scores, never kept for all blocks)."""
        qi, ki = self.table[self.rank], self.table[j]
        qd, kd = self.docs[self.rank], self.docs[j]
        allowed = (qd.view(-1, 1) == kd.view(1, -1)) & (qd.view(-1, 1) >= 0)
        if self.causal:
            allowed &= ki.view(1, -1) <= qi.view(-1, 1)
        rows_any, cols_any = allowed.any(1), allowed.any(0)
        groups: list[list[Any]] = []  # [rows, cols, useful area]
        for d in torch.unique(qd[rows_any]).tolist():
            r = ((qd == d) & rows_any).nonzero().view(-1)
            c = ((kd == d) & cols_any).nonzero().view(-1)
            area = r.numel() * c.numel()
            if groups:
                gr, gc, ga = groups[-1]
                merged = (gr.numel() + r.numel()) * (gc.numel() + c.numel())
                if merged <= max(1.25 * (ga + area), LUMP_AREA):
                    groups[-1] = [torch.cat([gr, r]), torch.cat([gc, c]), ga + area]
                    continue
            groups.append([r, c, area])
        out = []
        for r_all, c_all, _ in groups:
            # query tiles of at most TILE rows: the transient scores of a step are
            # O(TILE * seq_local), so memory stays O(S/W); each tile keeps only the
            # columns it attends (a causal diagonal block becomes a staircase of tiles)
            for r in _row_tiles(r_all, qi):
                rows_allowed = allowed.index_select(0, r)
                c = c_all[rows_allowed.index_select(1, c_all).any(0)]
                sub = rows_allowed.index_select(1, c)
                # the columns in runs of consecutive positions: on a run a causal tile is
                # full or a square triangle, each one a fused kernel can take; neighbouring
                # full runs are merged back into one piece
                parts: list[list[Any]] = []
                kp = ki.index_select(0, c)
                # (also cut where the tile's first query position starts: a query tile in
                # the middle of a causal run sees [earlier keys, full | its own triangle])
                first = qi[r[0]]
                for cc, ss in zip(_runs(c, kp, first), _runs(sub.t(), kp, first), strict=True):
                    ss = ss.t()
                    full = bool(ss.all())
                    if full and parts and parts[-1][2]:
                        parts[-1] = [torch.cat([parts[-1][0], cc]), torch.cat([parts[-1][1], ss], 1), True]
                    else:
                        parts.append([cc, ss, full])
                for cc, ss, full in parts:
                    out.append(
                        (
                            as_slice(r),
                            as_slice(cc),
                            None if full else ss.to(device),
                            qi.index_select(0, r).to(device),
                            ki.index_select(0, cc).to(device),
                            not full and _is_tril(ss),
                        )
                    )
        return out


def _runs(x: Tensor, positions: Tensor, at: Tensor | None = None) -> list[Tensor]:
    """``x`` (indexed like ``positions`` along dim 0) cut where ``positions`` stop being
    consecutive, and before the position ``at``."""
    brk = (positions[1:] - positions[:-1]) != 1
    if at is not None:
        brk |= positions[1:] == at
    cuts = brk.nonzero().view(-1) + 1
    return list(torch.tensor_split(x, cuts.tolist()))


def _row_tiles(rows: Tensor, positions: Tensor) -> list[Tensor]:
    """``rows`` cut where their global positions stop being consecutive (a zigzag rank's two
    chunks, documents), then into tiles of at most ``TILE``: on a run of consecutive
    positions a causal block is [full columns | square triangle], which the fused kernel
    takes as two pieces."""
    pos = positions.index_select(0, rows)
    cuts = ((pos[1:] - pos[:-1]) != 1).nonzero().view(-1) + 1
    out = []
    for run in torch.tensor_split(rows, cuts.tolist()):
        out += list(run.split(TILE))
    return out


def _is_tril(a: Tensor) -> bool:
    """``a`` is square and exactly its lower triangle (diagonal included): the pattern of
    ``is_causal`` in torch's attention kernels."""
    n = a.shape[0]
    return a.shape[1] == n and bool(torch.equal(a, torch.ones(n, n, dtype=torch.bool).tril()))


#: query rows per tile of a block (bounds the transient scores of one ring step)
TILE = 512

#: pieces of a block (documents) whose union's bounding area is at most this are lumped
#: into one piece (one matmul instead of many tiny ones)
LUMP_AREA = 1024


def as_slice(idx: Tensor) -> slice | Tensor:
    n = idx.numel()
    a = int(idx[0])
    if int(idx[-1]) - a + 1 == n:
        return slice(a, a + n)
    return idx


def take(x: Tensor, idx: slice | Tensor, dim: int) -> Tensor:
    if isinstance(idx, slice):
        return x.narrow(dim, idx.start, idx.stop - idx.start)
    return x.index_select(dim, idx.to(x.device))


def put_add(dst: Tensor, idx: slice | Tensor, dim: int, val: Tensor) -> None:
    val = val.to(dst.dtype)  # (a 16-bit piece into a float32 accumulator)
    if isinstance(idx, slice):
        dst.narrow(dim, idx.start, idx.stop - idx.start).add_(val)
    else:
        dst.index_add_(dim, idx.to(dst.device), val)


def ring_attention_work(
    seq_len: int, world: int, *, layout: str = DEFAULT_LAYOUT, causal: bool = True, cu_seqlens: Any = None
) -> dict[str, list[int]]:
    """Per-rank attention work of :func:`ring_attention` (per batch element and head).

    Returns:
        ``{"computed": [...], "attended": [...]}``, one entry per rank: the number of
        score entries the rank computes (its trimmed pieces; a causal square piece counts
        its triangle, which is what a causal kernel computes; the FLOPs are
        proportional), and the number of (query, key) pairs that attend.
    """
    op = "parallel.ring_attention_work"
    layout = check_layout(layout, op)
    cu = check_cu_seqlens(cu_seqlens, op, seq_len)
    table = index_table(seq_len, world, layout, cu)
    docs = doc_ids(table, seq_len, cu)
    computed, attended = [], []
    for r in range(world):
        plan = BlockPlan(r, world, table, docs, causal)
        c = a = 0
        for j in range(world):
            for rows, cols, allowed, _, _, tril in plan.block(j, torch.device("cpu")):
                nr = rows.stop - rows.start if isinstance(rows, slice) else rows.numel()
                nc = cols.stop - cols.start if isinstance(cols, slice) else cols.numel()
                c += nr * (nr + 1) // 2 if tril else nr * nc
                a += nr * nc if allowed is None else int(allowed.sum())
        computed.append(c)
        attended.append(a)
    return {"computed": computed, "attended": attended}
