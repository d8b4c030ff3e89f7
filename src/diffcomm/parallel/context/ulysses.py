"""Ulysses attention (all_to_all heads <-> sequence) and USP (Ulysses x ring on a 2-D
layout). See :mod:`diffcomm.parallel.context`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import _config, _torch
from ... import backend as B
from ..._replication import P, R, Rule, V, spmd_types_checking, spmd_types_invariant, spmd_types_varying
from ...backend import args as A
from ...backend.consistency import check_settings
from ...backend.local_tensor import RANK_WHY, refuse
from ...ops import collectives as C
from ...ops.base import IdentityFunction
from .args import check_causal, check_equal_lengths, check_qkv, check_scale
from .layout import (
    DEFAULT_LAYOUT,
    PG,
    Placement,
    check_cu_seqlens,
    check_layout,
    even_sizes,
    group_rank_world_or_local,
    group_ranks,
    layout_guessed,
    placed,
    placed_cu_seqlens,
    placed_seq_len,
    require_layout_known,
    require_seq_dim,
    require_seq_len_known,
    resolve_layout,
    ring_local_len,
)
from .ring import ring_attention

_FUNCTION_ATTRS = torch.autograd.Function.__dict__  # (see _replication.spmd_types_checking)

__all__ = ["ulysses_attention", "usp_attention"]

# ======================================================================================
# Ulysses
# ======================================================================================


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, **kw)


class _UlyssesAttention(IdentityFunction):
    """The entry of Ulysses (and USP) attention: identity on this rank's sequence piece,
    stating the typing rule the all_to_alls after it cannot: ``q``, ``k``, ``v`` are this
    rank's *piece* of the sequence (varying). The whole sequence on every rank
    (replicated) is refused under ``dc.spmd_check``, as ring attention refuses it —
    all_to_alls would take it for ``W`` pieces of a ``W`` times longer sequence."""

    generate_vmap_rule = True
    spmd = Rule(
        {V: V},
        group="pg",
        backward="identity (the all_to_alls' adjoints follow)",
        refuse={
            R: "q, k, v must be this rank's piece of the sequence, not the whole sequence "
            "(shard it first: parallel.shard; declare per-rank data varying)",
            P: "reduce it first",
        },
    )

    @staticmethod
    def forward(x: Tensor, pg: PG) -> Tensor:  # named: the typing rule reads ``pg`` by name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None

    @staticmethod
    def jvp(ctx: Any, t: Tensor, _: Any) -> Tensor:
        return t.view_as(t)  # a view, as the forward's output (forward-mode AD requires it)


def _pieces(q: Tensor, k: Tensor, v: Tensor, pg: PG) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_UlyssesAttention.apply(t, pg) for t in (q, k, v))


def _gathered_sizes(n: int, pg: PG, world: int, causal: bool, scale: float) -> list[int]:
    """Every rank's sequence length ``n``; ``causal`` and ``scale``, which each rank reads
    alone (it attends over its heads with its own), travel with it (free: the same
    all_gather) and ranks that disagree raise :class:`~diffcomm.CrossRankMismatchError`."""
    t = torch.tensor([n, int(causal), A.float_bits(scale)], dtype=torch.int64)
    rows = C.all_gather(t, 0, pg, split_sizes=[3] * world).view(world, 3).tolist()
    shown: tuple[tuple[str, Callable[[int], Any]], ...] = (("causal", bool), ("scale", A.float_of_bits))
    check_settings("parallel.ulysses_attention", shown, [row[1:] for row in rows])
    return [int(row[0]) for row in rows]


# Run eagerly under torch.compile (a graph break): the lengths are host ints (`.tolist()`
# breaks the graph anyway), and traced, the all_gather of a trace-time constant ran for real
# while dynamo compiled (fake-tensor constant propagation): a collective outside the graph
# that only the compiling rank makes (in-process, a hang: the peers need dynamo's lock).
_gathered_sizes = _torch.compiler_disable(
    _gathered_sizes,
    reason="parallel.ulysses_attention exchanges the ranks' sequence lengths on the host; "
    "pass seq_lens= (every rank's length) to compile it with fullgraph=True",
)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: A.GroupLike = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    attn_fn: Callable[..., Tensor] | None = None,
    seq_lens: Sequence[int] | None = None,
    layout: str | None = None,
    seq_len: int | None = None,
) -> Tensor:
    """Attention with the sequence split across ``group`` by all_to_all (DeepSpeed-Ulysses).

    Rank ``r`` holds a contiguous piece of the sequence (pieces in rank order, sizes may
    differ): the ``"contiguous"`` layout (:data:`DEFAULT_LAYOUT`) when they are equal. A
    tensor :func:`shard` placed with another layout (or for :func:`usp_attention`) raises
    ``ValueError``; the whole sequence on every rank is refused under ``dc.spmd_check``
    (as :func:`ring_attention` refuses it).

    ``q`` and ``k``/``v`` go through an ``all_to_all`` from sequence-sharded to
    head-sharded — rank ``r`` gets the heads of its share (``ceil``/``floor`` of
    ``heads / W``, no padding) over the **whole** sequence — ``attn_fn`` runs locally, and
    an ``all_to_all`` brings the output back to sequence-sharded. KV heads are sent to
    every rank that needs them (when ``kv_heads`` is not a multiple of ``W``, a KV head is
    replicated to the ranks whose query heads share it; its gradient is summed back).

    Args:
        q: ``(batch, heads, seq_local, head_dim)``, this rank's piece of the sequence.
        k, v: ``(batch, kv_heads, seq_local, head_dim[_v])``, ``kv_heads`` divides ``heads``.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        causal: causal attention over the whole sequence (pieces in rank order).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        attn_fn: the local attention, called as ``attn_fn(q, k, v, is_causal=causal,
            scale=scale)`` on ``(batch, local_heads, S, head_dim)`` tensors with as many KV
            heads as query heads; default :func:`torch.nn.functional.scaled_dot_product_attention`.
        seq_lens: every rank's ``seq_local`` (default: exchanged, one small all_gather).
        layout: ``None`` or ``"contiguous"``, the one order Ulysses takes (pieces in rank
            order). Naming it says that unplaced pieces are in that order: once this
            program used another layout over as many ranks (a zigzag ``shard``,
            ``layout_index``, an op given ``layout="zigzag"``), a causal call on pieces that
            carry no placement and no ``layout`` raises ``ValueError`` (the order would be a
            guess), as :func:`ring_attention` does. ``"zigzag"`` raises: zigzag shards go to
            :func:`ring_attention` or :func:`usp_attention`.
        seq_len: the true length ``S`` when the pieces end in padding (:func:`shard` of a
            length the group size does not divide pads the last pieces): the first ``S``
            positions in rank order are tokens, the rest attend to nothing and nothing
            attends to them (their rows and gradients are zero). Default: the length the
            pieces' placement recorded, else the sum of the pieces; a value contradicting
            the placement raises ``ValueError``, and so do unplaced pieces of a padded
            length this program sharded (the length would be a guess).

    Returns:
        ``(batch, heads, seq_local, head_dim_v)``: this rank's rows of the attention.

    Gradient:
        through autograd: ``attn_fn``'s own backward between the all_to_alls' adjoints
        (all_to_all with the dims and split sizes swapped); double backward where
        ``attn_fn`` has one.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.ulysses_attention(*(torch.randn(1, 3, 5, 8) for _ in range(3))).shape)
            # [torch.Size([1, 3, 5, 8]), torch.Size([1, 3, 5, 8])]
    """
    op = "parallel.ulysses_attention"
    q, k, v = check_qkv(q, k, v, op)
    sc = check_scale(scale, q.shape[-1], op)
    causal = check_causal(causal, op)
    pg, rank, world = group_rank_world_or_local(group, op)  # (rank None: see _rank_for_all)
    if layout is not None and check_layout(layout, op) != DEFAULT_LAYOUT:
        raise A.arg_error(
            op,
            "layout",
            f"{DEFAULT_LAYOUT!r} (Ulysses takes the pieces in rank order; zigzag shards go to "
            "parallel.ring_attention or parallel.usp_attention)",
            repr(layout),
        )
    # pieces in rank order: the contiguous layout; a tensor placed otherwise is refused
    ranks = group_ranks(pg)
    require_seq_dim(op, {"q": q, "k": k, "v": v})
    resolve_layout(op, DEFAULT_LAYOUT, {"q": q, "k": k, "v": v}, world, takes_layout=False, ranks=ranks)
    if causal:  # (without a mask the order of the pieces does not change the result)
        require_layout_known(op, layout, {"q": q, "k": k, "v": v}, world)
    # the true length: given, or the one shard recorded (padding slots are no tokens)
    true = placed_seq_len(op, {"q": q, "k": k, "v": v}, seq_len, None)
    true = None if true is None else A.check_int(true, op, "seq_len")
    require_seq_len_known(op, {"q": q, "k": k, "v": v}, true, None, world, None, q.shape[2])
    if _config.DEBUG.get():  # (the all_to_alls compare the shapes; these only each rank reads)
        B.get_backend().check_consistent(
            op,
            {
                "causal": causal,
                "scale": repr(sc),  # each rank attends over its heads with its own
                "seq_len": -1 if true is None else true,
                "seq_lens": () if seq_lens is None else tuple(int(n) for n in seq_lens),
            },
            pg,
        )
    if seq_lens is None:
        lens = _gathered_sizes(q.shape[2], pg, world, causal, sc)
    else:
        lens = [int(s) for s in seq_lens]
        if len(lens) != world or min(lens) < 0:
            raise A.arg_error(op, "seq_lens", f"{world} lengths with this rank's = {q.shape[2]}", seq_lens)
    if rank is None:  # torch's LocalTensorMode: one rank must stand for every simulated one
        rank = _rank_for_all(op, q.shape[1], k.shape[1], world, lens)
    if lens[rank] != q.shape[2]:
        raise A.arg_error(op, "seq_lens", f"{world} lengths with this rank's = {q.shape[2]}", seq_lens)
    total = sum(lens)
    if true is not None and not 0 <= true <= total:
        raise A.arg_error(op, "seq_len", f"a length in [0, {total}] (the pieces' total)", true)
    fn = attn_fn if attn_fn is not None else _sdpa
    pad = 0 if true is None else total - true
    if pad and not causal:  # the padding is the last slots in rank order: the order matters
        require_layout_known(op, layout, {"q": q, "k": k, "v": v}, world)

    def local(qh: Tensor, kh: Tensor, vh: Tensor) -> Tensor:
        if not pad:
            return fn(qh, kh, vh, is_causal=causal, scale=sc)
        # the padding slots (the last, in rank order) leave the attention: zero rows
        end = total - pad
        out = fn(qh[:, :, :end], kh[:, :, :end], vh[:, :, :end], is_causal=causal, scale=sc)
        return torch.nn.functional.pad(out, (0, 0, 0, pad))

    out = _ulysses(*_pieces(q, k, v, pg), pg, rank, world, lens, local)
    # equal pieces are the contiguous layout (unshard takes them without `layout`), unless
    # that is a guess: a non-causal call ran on unplaced pieces of a program that used
    # another layout (their rows are right in any order, their order is unknown)
    seq = total if true is None else true
    if len(set(lens)) > 1 or layout_guessed(layout, {"q": q, "k": k, "v": v}, world):
        return out
    return placed(out, Placement("contiguous", world, seq_len=seq, ranks=ranks, dim=2))


def _head_plan(Hq: int, Hk: int, world: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Every rank's query-head count and first head, and the KV heads each rank needs
    (those of its query heads ``[starts[r], starts[r] + hs[r])``)."""
    G = Hq // Hk
    hs = even_sizes(Hq, world)
    starts = [sum(hs[:r]) for r in range(world)]
    need = [sorted({h // G for h in range(starts[r], starts[r] + hs[r])}) for r in range(world)]
    return hs, starts, need


def _local_kv_heads(G: int, hs: list[int], starts: list[int], need: list[list[int]], rank: int) -> list[int]:
    """For each query head of ``rank`` (after the heads <-> sequence exchange), the index
    of its KV head among the KV heads that rank receives."""
    mine = need[rank]
    return [mine.index(h // G) for h in range(starts[rank], starts[rank] + hs[rank])]


def _rank_for_all(op: str, Hq: int, Hk: int, world: int, lens: list[int]) -> int:
    """Under torch's ``LocalTensorMode`` (one program for every simulated rank): Ulysses
    reads the rank only through the sizes of its pieces and heads and its local head map,
    so it runs when those are alike on every rank (equal sequence pieces, heads in equal
    shares) with rank 0's values standing for all; otherwise it refuses."""
    hs, starts, need = _head_plan(Hq, Hk, world)
    facts = {(lens[r], hs[r], tuple(_local_kv_heads(Hq // Hk, hs, starts, need, r))) for r in range(world)}
    if len(facts) != 1:
        raise refuse(
            op,
            f"{RANK_WHY}; here the ranks' sequence pieces {lens} or query heads {hs} differ "
            "(equal pieces and a head count divisible by the group size run)",
        )
    return 0


def _ulysses(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pg: PG,
    rank: int,
    world: int,
    lens: list[int],
    local: Callable[..., Tensor],
) -> Tensor:
    Hq, Hk = q.shape[1], k.shape[1]
    G = Hq // Hk
    hs, starts, need = _head_plan(Hq, Hk, world)
    kv_idx = torch.tensor([h for n in need for h in n], dtype=torch.int64, device=k.device)
    kv_sizes = [len(n) for n in need]
    checking = spmd_types_checking(_FUNCTION_ATTRS)
    if checking:  # spmd_types' checker: alike on every rank
        spmd_types_invariant(kv_idx, pg)
    k_send = k.index_select(1, kv_idx)  # differentiable: replicated heads' grads are summed back
    v_send = v.index_select(1, kv_idx)
    qh = _heads_to_seq(q, hs, lens, pg, rank)
    kh = _heads_to_seq(k_send, kv_sizes, lens, pg, rank)
    vh = _heads_to_seq(v_send, kv_sizes, lens, pg, rank)
    # local query head -> local KV head (one-to-one for attn_fn)
    local_kv = torch.tensor(_local_kv_heads(G, hs, starts, need, rank), dtype=torch.int64, device=k.device)
    if checking:  # this rank's own heads
        spmd_types_varying(local_kv, pg)
    if hs[rank] == 0:
        oh = q.new_zeros(q.shape[0], 0, sum(lens), v.shape[-1]) + 0 * (qh.sum() + kh.sum() + vh.sum())
    else:
        oh = local(qh, kh.index_select(1, local_kv), vh.index_select(1, local_kv))
    return _seq_to_heads(oh, lens, hs, pg, rank)


# The head <-> sequence all_to_all with uneven heads *and* uneven sequence pieces, as one
# flat all_to_all (split_dim == concat_dim == 0, whose split sizes may be anything): each
# chunk is laid out head-major so it is contiguous, and the received chunks are reshaped
# and concatenated. Reshapes, cats and the core all_to_all are all differentiable, so
# the backward (and double backward) is the core op's adjoint.


def _heads_to_seq(x: Tensor, hs: list[int], lens: list[int], pg: PG, rank: int) -> Tensor:
    """``(B, sum hs, lens[rank], D)`` sequence-sharded -> ``(B, hs[rank], sum lens, D)``."""
    Bn, _, _, D = x.shape
    flat = x.permute(1, 0, 2, 3).reshape(-1)  # head-major: head chunk j is contiguous
    ins = [h * Bn * lens[rank] * D for h in hs]
    outs = [hs[rank] * Bn * n * D for n in lens]
    got = C.all_to_all(flat, 0, 0, pg, input_split_sizes=ins, output_split_sizes=outs)
    parts = [p.view(hs[rank], Bn, n, D) for p, n in zip(got.split(outs), lens, strict=True)]
    return torch.cat(parts, 2).permute(1, 0, 2, 3)


def _seq_to_heads(o: Tensor, lens: list[int], hs: list[int], pg: PG, rank: int) -> Tensor:
    """``(B, hs[rank], sum lens, D)`` -> ``(B, sum hs, lens[rank], D)`` (the inverse)."""
    Bn, _, _, D = o.shape
    pieces = [p.permute(1, 0, 2, 3).reshape(-1) for p in o.split(lens, 2)]
    ins = [hs[rank] * Bn * n * D for n in lens]
    outs = [h * Bn * lens[rank] * D for h in hs]
    got = C.all_to_all(torch.cat(pieces), 0, 0, pg, input_split_sizes=ins, output_split_sizes=outs)
    parts = [p.view(h, Bn, lens[rank], D) for p, h in zip(got.split(outs), hs, strict=True)]
    return torch.cat(parts, 0).permute(1, 0, 2, 3)


def usp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ulysses_group: A.GroupLike,
    ring_group: A.GroupLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str | None = None,
    cu_seqlens: Any = None,
    seq_len: int | None = None,
) -> Tensor:
    """Unified sequence parallelism: Ulysses inside ``ulysses_group``, the ring across
    ``ring_group`` (a 2-D layout of ``U x R`` ranks).

    The sequence is laid out over the ring first (``layout_index(S, R, layout=...)``), and
    each ring rank's positions are split contiguously, in order, over the ``U`` ranks of
    its Ulysses group (:func:`shard` with ``ulysses_group=``). The Ulysses all_to_all
    gives every rank a share of the heads over its ring rank's positions; the ring then
    runs over ``ring_group`` on those heads; an all_to_all brings the output back.

    Args:
        q, k, v: as in :func:`ring_attention` (``seq_local`` = this rank's share).
        ulysses_group, ring_group: the two groups (``ProcessGroup`` or ``(DeviceMesh,
            axis)``); every rank belongs to one of each, they cross.
        causal, scale, layout, cu_seqlens, seq_len: as in :func:`ring_attention`
            (``seq_len`` default: the length ``shard`` recorded, else ``U * R *
            seq_local``; ``layout`` default: the one the
            tensors were placed with by ``shard(..., ulysses_group=)``, else
            ``"contiguous"``, refused as a guess once this program used another layout
            over ``R`` ranks).

    Returns:
        ``(batch, heads, seq_local, head_dim_v)``.

    Gradient:
        the all_to_alls' adjoints around the ring's backward (first order).
    """
    op = "parallel.usp_attention"
    q, k, v = check_qkv(q, k, v, op)
    upg, urank, uworld = group_rank_world_or_local(ulysses_group, op)
    rpg, _, rworld = group_rank_world_or_local(ring_group, op)
    given = layout
    ranks, uranks = group_ranks(rpg), group_ranks(upg)
    require_seq_dim(op, {"q": q, "k": k, "v": v})
    layout = resolve_layout(op, layout, {"q": q, "k": k, "v": v}, rworld, uworld, ranks=ranks, uranks=uranks)
    seq_len = placed_seq_len(op, {"q": q, "k": k, "v": v}, seq_len, cu_seqlens)
    cu_seqlens = placed_cu_seqlens(op, {"q": q, "k": k, "v": v}, cu_seqlens, default=False)
    require_seq_len_known(op, {"q": q, "k": k, "v": v}, seq_len, cu_seqlens, rworld, uworld, q.shape[2])
    n_ring = ring_local_len(op, q.shape[2], uworld, rworld, layout, cu_seqlens, seq_len)
    lens = even_sizes(n_ring, uworld)
    if urank is None:  # torch's LocalTensorMode: the Ulysses pieces alike on every rank
        urank = _rank_for_all(op, q.shape[1], k.shape[1], uworld, lens)
    if lens[urank] != q.shape[2]:
        raise A.arg_error(
            op, "q", f"{lens[urank]} local positions (of {n_ring} on this ring rank)", q.shape[2]
        )
    require_layout_known(op, given, {"q": q, "k": k, "v": v}, rworld)
    if seq_len is None and cu_seqlens is None:
        # the length is inferred from this rank's alone: unequal shards would mismatch the
        # all_to_alls and the hops, so every rank's is compared first (two small exchanges)
        check_equal_lengths(op, q.shape[2], upg, rpg)
        seq_len = n_ring * rworld

    def local(qh: Tensor, kh: Tensor, vh: Tensor) -> Tensor:
        return ring_attention(
            qh, kh, vh, rpg, causal=causal, scale=scale, layout=layout, cu_seqlens=cu_seqlens, seq_len=seq_len
        )

    out = _ulysses(*_pieces(q, k, v, upg), upg, urank, uworld, lens, local)
    cu = check_cu_seqlens(cu_seqlens, op)
    # the true length is recorded with the documents too (as the ring records it): under
    # "contiguous" unshard takes no documents from a placement, and without a length it
    # inferred each rank's own U * seq_local (Ulysses pieces of unequal sizes: unequal)
    total = seq_len if cu is None else cu[-1]
    return placed(
        out, Placement(layout, rworld, uworld, seq_len=total, ranks=ranks, uranks=uranks, cu=cu, dim=2)
    )
