"""Layouts of a sequence over the ranks of a context-parallel group, and the helpers that
move tensors in and out of them (:func:`shard`, :func:`unshard`). See
:mod:`diffcomm.parallel.context`."""

# Size: ~815 lines, over the ~600 guideline: the layouts' index tables, the placement
# record that travels with a sharded tensor, and shard/unshard, which read both.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ... import _lifecycle
from ... import backend as B
from ..._replication import varying_by_construction
from ..._torch import compiling, local_tensor_mode_on, transforms_active
from ...backend import args as A
from ...backend.args import PG
from ...backend.in_process import per_rank
from ...backend.local_tensor import LocalTensorBackend
from ...ops import collectives as C
from ...ops.validation import own_slice

__all__ = ["LAYOUTS", "DEFAULT_LAYOUT", "Placement", "layout_index", "placement_of", "shard", "unshard"]

#: The layouts of the sequence over the ranks of a context-parallel group.
LAYOUTS = ("contiguous", "zigzag")
#: The one layout every context-parallel entry point (``shard``, ``unshard``,
#: ``layout_index``, ``ring_attention``, ``usp_attention``, ``ring_attention_work``) uses
#: when given none and the tensor carries no :class:`Placement`: the placement a plain
#: ``x.chunk(W, dim)[rank]`` gives, and the only order :func:`ulysses_attention` takes.
DEFAULT_LAYOUT = "contiguous"


@dataclass(frozen=True)
class Placement:
    """How a tensor's sequence dim is placed over a context-parallel group: what
    :func:`shard` (and the attention ops, on their outputs) attach to the tensor they
    return, and what the ops that consume it check.

    Attributes:
        layout: one of :data:`LAYOUTS`.
        world: the ranks of the (ring) group the sequence is split over.
        ulysses: the ranks of the Ulysses group of a :func:`usp_attention` placement
            (``shard(..., ulysses_group=)``), ``None`` for a plain placement.
        seq_len: the true global length ``S`` of the sequence (``shard`` records it, so a
            padded placement needs no ``seq_len=`` later); ``None``: unknown. Not part of
            the comparison of two placements.
        cu: the packed documents' ``cu_seqlens`` the sequence was placed with (``None``:
            one sequence). Under ``"zigzag"`` it is part of the layout (each document is
            zigzagged on its own): an op told other documents (or none) raises. Not part
            of the comparison of two placements.
        ranks, uranks: the global ranks of the (ring) group and of the Ulysses group
            (``None``: not known, e.g. under torch's ``LocalTensorMode``): a sequence
            placed over one group and used over another group of as many ranks (another
            mesh axis, usp's two groups swapped) is refused, not attended in wrong order.
        dim: the sequence dim (``shard``'s ``dim``, 2 for the attention ops' outputs;
            ``None``: not recorded): :func:`unshard` along another dim raises, where it
            gathered that dim as the sequence (``unshard(shard(x, 1))`` of a ``(B, S, D)``
            ``x``, its default ``dim=2``, when ``D`` is the local length). Not part of the
            comparison of two placements.
    """

    layout: str
    world: int
    ulysses: int | None = None
    seq_len: int | None = field(default=None, compare=False)
    ranks: tuple[int, ...] | None = field(default=None, compare=False)
    uranks: tuple[int, ...] | None = field(default=None, compare=False)
    cu: tuple[int, ...] | None = field(default=None, compare=False)
    dim: int | None = field(default=None, compare=False)

    def describe(self, ranks: bool = False) -> str:
        on = f" {list(self.ranks)}" if ranks and self.ranks is not None else ""
        usp = "" if self.ulysses is None else f", split over a Ulysses group of {self.ulysses}"
        if ranks and self.ulysses is not None and self.uranks is not None:
            usp += f" {list(self.uranks)}"
        return f"layout={self.layout!r} over {self.world} ranks{on}{usp}"

    def other_ranks(self, ranks: tuple[int, ...] | None, uranks: tuple[int, ...] | None) -> str | None:
        """Which of this placement's groups has other ranks than ``ranks`` / ``uranks``
        (``"group"``, ``"Ulysses group"``), or ``None`` (the same, or not known). Not part
        of ``==`` (``None`` is unknown, not different)."""
        for mine, theirs, which in ((self.ranks, ranks, "group"), (self.uranks, uranks, "Ulysses group")):
            if mine is not None and theirs is not None and mine != theirs:
                return which
        return None


def group_ranks(pg: Any) -> tuple[int, ...] | None:
    """The global ranks of ``pg`` (``None``: the world's) for a :class:`Placement`; ``None``
    where they cannot be had (no process group, ``torch.compile``)."""
    if compiling() or not dist.is_initialized():
        return None
    try:
        return tuple(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
    except Exception:  # a group that cannot say (torch's fake group): not compared
        return None


_TAG = "_diffcomm_placement"


def placed(x: Tensor, placement: Placement) -> Tensor:
    """``x`` with ``placement`` attached (returned for chaining). A Python attribute of this
    tensor object: it survives ``requires_grad_()`` and in-place ops, not ops that make a
    new tensor (``detach()``, a projection, a reshape); nothing is attached under
    ``torch.compile`` or a ``torch.func`` transform."""
    if compiling() or transforms_active():
        return x
    try:
        setattr(x, _TAG, placement)
    except (AttributeError, RuntimeError, TypeError):  # a tensor type that takes no attributes
        pass
    return x


_GRAD_TAGGED = "_diffcomm_placement_grad_hook"


def tag_grad_of(x: Tensor) -> None:
    """Once per leaf ``x`` that requires grad: after each accumulation into ``x.grad``,
    attach ``placement`` to the gradient (it is placed like ``x``), so ``unshard(x.grad)``
    uses ``x``'s layout instead of the default."""
    if compiling() or transforms_active() or not (x.is_leaf and x.requires_grad):
        return
    if getattr(x, _GRAD_TAGGED, None) == id(x):  # (a deepcopy has the mark, not the hook)
        return

    def tag(t: Tensor) -> None:
        p = placement_of(t)
        if t.grad is not None and p is not None:
            placed(t.grad, p)

    try:
        x.register_post_accumulate_grad_hook(tag)
        setattr(x, _GRAD_TAGGED, id(x))
    except (AttributeError, RuntimeError, TypeError):  # a tensor type without hooks
        pass


# ======================================================================================
# layouts in use: an unplaced tensor's layout is ambiguous once another one is in play
# ======================================================================================

#: ``{(W, layout): how}``: the layouts other than :data:`DEFAULT_LAYOUT` this program has
#: used over ``W`` ranks (``W > 1``), and the first call that used each. Forgotten when a
#: ``LocalWorld`` rank starts a new ``run`` (on a process or in-process).
_IN_USE: dict[tuple[int, str], str] = {}
per_rank(_IN_USE)  # a rank's own in an in-process world
_lifecycle.on_program_start("parallel.context layouts", _IN_USE.clear)


def note_layout(layout: str, world: int, how: str) -> None:
    """Remember that this program used ``layout`` over ``world`` ranks (by ``how``: the
    call). Only ever makes :func:`require_layout_known` raise for unplaced tensors given
    no ``layout``, never changes a value. Also under ``torch.compile``, where nothing is
    placed and the record is the only guard (dynamo replays the write on every call)."""
    if layout != DEFAULT_LAYOUT and world > 1:
        _IN_USE.setdefault((world, layout), how)


def _ambiguous(op: str, names: list[str], world: int) -> None:
    """Raise when ``names`` carry no placement, no ``layout`` was given and this program
    used a layout other than the default over ``world`` ranks: the default would be a
    guess (zigzag shards taken by hand with ``layout_index``, or q/k/v projected from a
    zigzag-sharded ``x``, would silently run as contiguous)."""
    used = {lay: how for (w, lay), how in _IN_USE.items() if w == world}
    if not used:
        return
    args = ", ".join(f"`{n}`" for n in names)
    seen = "; ".join(f"layout={lay!r} by {how}" for lay, how in used.items())
    raise A.arg_error(
        op,
        "layout",
        f"named, one of {LAYOUTS}: {args} carry no placement (taken by hand, e.g. with "
        "parallel.layout_index, or made by an op that drops it: a projection, a reshape, detach(), "
        "the recomputation of torch.utils.checkpoint(use_reentrant=True)) "
        f"and this program used another layout over {world} ranks ({seen}), so the default "
        f"{DEFAULT_LAYOUT!r} would be a guess (a sequence used with another layout than it was "
        "placed with gives wrong attention)",
        "None",
    )


#: ``{(W, Ulysses W, padded local length, S): how}``: every sequence of length ``S`` this
#: program's :func:`shard` padded to that local length over ``W`` ranks, and the first call
#: that did (several lengths can pad to one local length: each is kept, so a refusal names
#: them all, not only the first). Forgotten as :data:`_IN_USE` is.
_PADDED: dict[tuple[int, int | None, int, int], str] = {}
per_rank(_PADDED)
_lifecycle.on_program_start("parallel.context padding", _PADDED.clear)


def note_padding(world: int, uworld: int | None, local: int, seq_len: int, how: str) -> None:
    """Remember that this program's ``shard`` padded a sequence of ``seq_len`` to ``local``
    positions per rank (only ever makes :func:`require_seq_len_known` raise); under
    ``torch.compile`` too, as :func:`note_layout`."""
    if world > 1:
        _PADDED.setdefault((world, uworld, local, seq_len), how)


def require_seq_len_known(
    op: str,
    tensors: dict[str, Any],
    seq_len: Any,
    cu_seqlens: Any,
    world: int,
    uworld: int | None,
    local: int,
) -> None:
    """Raise when the length an op would infer is a guess: no ``seq_len`` / ``cu_seqlens``
    (nor a placement that recorded one) for tensors of ``local`` positions per rank, and
    this program's :func:`shard` padded a sequence to that many over ``world`` ranks: the
    inferred ``W * local`` would count the padding slots as tokens (wrong attention). A
    rule that only ever raises (a false alarm asks for ``seq_len=``); before any
    communication."""
    if seq_len is not None or cu_seqlens is not None or world <= 1:
        return
    if any(placement_of(t) is not None for t in tensors.values()):
        return
    hits = {n: how for (w, u, lo, n), how in _PADDED.items() if (w, u, lo) == (world, uworld, local)}
    if not hits:
        return
    args = ", ".join(f"`{n}`" for n in tensors)
    how = next(iter(hits.values()))
    if len(hits) == 1:
        ((true, _),) = hits.items()
        padded, advice = f"a sequence of length {true}", f"seq_len={true}"
    else:  # (naming the first would be a wrong length for the others)
        lens = ", ".join(str(n) for n in sorted(hits))
        padded, advice = (
            f"sequences of lengths {lens}",
            f"seq_len= this sequence's true length (one of {lens})",
        )
        how += ", ..."
    raise A.arg_error(
        op,
        "seq_len",
        f"given: {args} carry no placement (made by an op that drops it: a projection, a "
        f"reshape, detach(), the recomputation of torch.utils.checkpoint(use_reentrant=True)), "
        f"and this program padded {padded} to {local} positions per rank over {world} ranks "
        f"({how}), so the length {world * local} inferred from the shards would count its padding as "
        f"tokens (wrong attention); pass {advice} (or the cu_seqlens given to shard)",
        "None",
    )


def placed_seq_len(op: str, tensors: dict[str, Any], seq_len: Any, cu_seqlens: Any) -> Any:
    """``seq_len`` as an op uses it: given, or else (without ``cu_seqlens``) the true length
    the tensors' placement recorded (``shard`` of a padded sequence). A given length (or
    ``cu_seqlens[-1]``) that contradicts the recorded one raises ``ValueError`` naming
    ``seq_len`` (or ``cu_seqlens``), before any communication."""
    known = None
    for t in tensors.values():
        p = placement_of(t)
        if p is not None and p.seq_len is not None:
            known = (p.seq_len, p)
            break
    if known is None:
        return seq_len
    if seq_len is not None:
        given = A.check_int(seq_len, op, "seq_len")
        if given != known[0]:
            raise A.arg_error(
                op,
                "seq_len",
                f"{known[0]} (or None), the length the sequence had when parallel.shard placed it",
                given,
            )
        return given
    cu = check_cu_seqlens(cu_seqlens, op)
    if cu is not None:
        if cu[-1] != known[0]:
            raise A.arg_error(
                op,
                "cu_seqlens",
                f"cumulative lengths ending at {known[0]}, the length the sequence had when "
                "parallel.shard placed it",
                cu,
            )
        return None
    return known[0]


def _documents(cu: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``cu`` as the layout sees it: ``None`` for one document (empty ones dropped)."""
    if cu is None:
        return None
    bounds = tuple(sorted(set(cu)))
    return bounds if len(bounds) > 2 else None


def placed_cu_seqlens(op: str, tensors: dict[str, Any], cu_seqlens: Any, default: bool) -> Any:
    """``cu_seqlens`` as an op uses it, checked against the documents a ``"zigzag"``
    placement of the tensors recorded (there each document is zigzagged on its own, so
    other documents, or none, would read the positions in a wrong order). ``default``
    (:func:`unshard`, the layout's inverse): ``None`` takes the recorded ones. Raises
    ``ValueError`` naming ``cu_seqlens`` before any communication."""
    for name, t in tensors.items():
        p = placement_of(t)
        if p is None or p.layout != "zigzag":
            continue
        if cu_seqlens is None and default:
            return p.cu
        given = check_cu_seqlens(cu_seqlens, op)
        recorded = _documents(p.cu)
        if _documents(given) != recorded:
            placed_as = f"cu_seqlens={list(p.cu or ())}" if recorded else "no cu_seqlens (one sequence)"
            raise A.arg_error(
                op,
                "cu_seqlens",
                f"the documents `{name}` was placed with ({placed_as}): under layout='zigzag' each "
                "document is zigzagged on its own, so other documents read its positions in a wrong "
                "order",
                None if given is None else list(given),
            )
        return cu_seqlens
    return cu_seqlens


def placement_of(x: Any) -> Placement | None:
    """The :class:`Placement` :func:`shard` or a context-parallel op attached to ``x``
    (``None``: none, e.g. after an op that made a new tensor)."""
    if compiling() or not isinstance(x, Tensor):
        return None
    p = getattr(x, _TAG, None)
    return p if isinstance(p, Placement) else None


def require_seq_dim(op: str, tensors: dict[str, Any]) -> None:
    """Raise when a tensor was placed along another dim than the attention ops' sequence
    dim 2 (``(batch, heads, seq_local, head_dim)``): ``(B, S, H, D)`` shards taken along
    dim 1 and passed as they are were attended with the heads as the sequence (and run,
    when ``H`` is the local length). ``ValueError`` naming the tensor, before any
    communication."""
    for name, t in tensors.items():
        p = placement_of(t)
        if p is not None and p.dim is not None and p.dim != 2:
            raise A.arg_error(
                op,
                name,
                "placed along the sequence dim 2 ((batch, heads, seq_local, head_dim), as "
                "scaled_dot_product_attention; transpose (B, S, H, D) tensors first)",
                f"a tensor placed along dim {p.dim} (parallel.shard(..., dim={p.dim}))",
            )


def resolve_layout(
    op: str,
    layout: Any,
    tensors: dict[str, Any],
    world: int,
    ulysses: int | None = None,
    *,
    takes_layout: bool = True,
    ranks: tuple[int, ...] | None = None,
    uranks: tuple[int, ...] | None = None,
) -> str:
    """The layout an op uses: ``layout`` if given, else the one its tensors were placed
    with, else :data:`DEFAULT_LAYOUT`. A sequence placed one way and used another is an
    error, never a value: an explicit ``layout`` other than a tensor's placement, two
    tensors placed differently, a placement over another number of ranks or other ranks
    (``ranks`` / ``uranks``: the op's groups', :func:`group_ranks`), or a Ulysses split
    where none is expected (or the reverse) raise ``ValueError`` naming the argument
    (``takes_layout=False``: the op has no ``layout`` argument, ``layout`` is its only order).

    Tensors with no placement and no ``layout`` get :data:`DEFAULT_LAYOUT`; whether that
    is a guess is :func:`require_layout_known`'s to say.
    """
    if layout is not None:
        layout = check_layout(layout, op)
    first: tuple[str, Placement] | None = None
    for name, t in tensors.items():
        p = placement_of(t)
        if p is None:
            continue
        tag_grad_of(t)
        if first is not None and (p != first[1] or first[1].other_ranks(p.ranks, p.uranks)):
            show = p == first[1]  # (only the ranks differ: name them)
            raise A.arg_error(
                op,
                name,
                f"placed like `{first[0]}` ({first[1].describe(show)})",
                f"a tensor placed with {p.describe(show)}",
            )
        first = first or (name, p)
        if layout is not None and p.layout != layout and not takes_layout:  # the op's own order
            raise A.arg_error(
                op,
                name,
                f"placed with layout={layout!r} (the only order {op} takes)",
                f"a tensor placed with {p.describe()}",
            )
        if layout is not None and p.layout != layout:
            raise A.arg_error(
                op,
                "layout",
                f"{p.layout!r}, the layout `{name}` was placed with (parallel.shard or a context-parallel "
                "op); a sequence placed with one layout and used with another gives wrong attention",
                repr(layout),
            )
        if p.world != world:
            raise A.arg_error(
                op, name, f"placed over this group's {world} ranks", f"a tensor placed with {p.describe()}"
            )
        if p.ulysses != ulysses:
            want = (
                "placed without a Ulysses split (shard without ulysses_group)"
                if ulysses is None
                else f"placed for usp_attention with a Ulysses group of {ulysses} (shard(ulysses_group=))"
            )
            raise A.arg_error(op, name, want, f"a tensor placed with {p.describe()}")
        which = p.other_ranks(ranks, uranks)
        if which is not None:
            mine = ranks if which == "group" else uranks
            raise A.arg_error(
                op,
                name,
                f"placed over this op's {which}, ranks {list(mine or ())} (a sequence split over "
                "one group and used over another gives wrong attention: another mesh axis, or "
                "usp_attention's (ulysses_group, ring_group) swapped)",
                f"a tensor placed with {p.describe(ranks=True)}",
            )
    if layout is not None:
        note_layout(layout, world, f"{op}(layout={layout!r})")
        return layout
    return first[1].layout if first is not None else DEFAULT_LAYOUT


def require_layout_known(op: str, layout: Any, tensors: dict[str, Any], world: int) -> None:
    """Raise when the layout an op would use is a guess: no ``layout`` given, no tensor of
    ``tensors`` placed, and this program used another layout than :data:`DEFAULT_LAYOUT`
    over ``world`` ranks (``shard``, ``layout_index``, an op given ``layout=``). A rule
    that only ever raises (a false alarm asks to name the layout; it never changes a
    value). Called by every op that reads a layout after its other argument checks,
    before its first communication."""
    if layout_guessed(layout, tensors, world):
        _ambiguous(op, [n for n, t in tensors.items() if isinstance(t, Tensor)], world)


def layout_guessed(layout: Any, tensors: dict[str, Any], world: int) -> bool:
    """Whether the default layout would be a guess (:func:`require_layout_known`'s test,
    for an op that must not attach a guessed placement to its output)."""
    if layout is not None or world <= 1 or any(placement_of(t) is not None for t in tensors.values()):
        return False
    return any(w == world for w, _ in _IN_USE)


# ======================================================================================
# layouts
# ======================================================================================


def check_layout(layout: Any, op: str) -> str:
    if layout not in LAYOUTS:
        raise A.arg_error(op, "layout", f"one of {LAYOUTS}", repr(layout))
    return str(layout)


def check_cu_seqlens(cu: Any, op: str, seq_len: int | None = None) -> tuple[int, ...] | None:
    """``cu_seqlens`` as a tuple of ints (``0 = c_0 <= c_1 <= ... = total``); None stays."""
    if cu is None:
        return None
    if isinstance(cu, Tensor):
        if cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            raise A.arg_error(
                op,
                "cu_seqlens",
                "a 1-D integer tensor or a sequence of ints",
                f"{cu.dtype} {tuple(cu.shape)}",
            )
        if cu.device.type == "meta":  # (no values to read: torch's NotImplementedError named nothing)
            raise A.arg_error(op, "cu_seqlens", "a tensor with values (not on the meta device)", cu.device)
        vals = tuple(int(c) for c in cu.tolist())
    elif isinstance(cu, Sequence) and all(isinstance(c, int) and not isinstance(c, bool) for c in cu):
        vals = tuple(int(c) for c in cu)
    else:
        raise A.arg_error(
            op, "cu_seqlens", "a 1-D integer tensor or a sequence of ints", type(cu).__name__, TypeError
        )
    if len(vals) < 2 or vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:], strict=False)):
        raise A.arg_error(
            op, "cu_seqlens", "cumulative lengths starting at 0, non-decreasing, at least 2 values", vals
        )
    if seq_len is not None and vals[-1] != seq_len:
        raise A.arg_error(op, "cu_seqlens", f"ending at the sequence length {seq_len}", vals)
    return vals


def _doc_spans(seq_len: int, cu: tuple[int, ...] | None) -> list[tuple[int, int]]:
    if cu is None:
        return [(0, seq_len)]
    return [(a, b) for a, b in zip(cu, cu[1:], strict=False)]


def index_table(seq_len: int, world: int, layout: str, cu: tuple[int, ...] | None) -> Tensor:
    """``(world, seq_local)`` int64: the global position each rank's slot holds (-1: pad)."""
    if layout == "contiguous":
        n = -(-seq_len // world) if seq_len else 0
        flat = torch.full((n * world,), -1, dtype=torch.int64)
        flat[:seq_len] = torch.arange(seq_len)
        return flat.view(world, n)
    per_rank: list[list[Tensor]] = [[] for _ in range(world)]
    turn = 0  # rotates which ranks get a document's longer chunks (balance over documents)
    for a, b in _doc_spans(seq_len, cu):
        length = b - a
        if length == 0:
            continue
        base, extra = divmod(length, 2 * world)
        c = base + (extra > 0)
        sizes = [base] * (2 * world)
        # the `extra` longer chunks go in pairs (r, 2W-1-r), to the ranks whose turn it is,
        # so a rank's head and tail chunks grow together and no rank always gets the short
        # tail (the most expensive chunk under causal attention)
        for i in range(extra):
            r = (turn + i // 2) % world
            sizes[r if i % 2 == 0 else 2 * world - 1 - r] += 1
        turn = (turn + -(-extra // 2)) % world
        doc = torch.full((2 * world, c), -1, dtype=torch.int64)
        start = a
        for t, n in enumerate(sizes):
            doc[t, :n] = torch.arange(start, start + n)
            start += n
        for r in range(world):
            per_rank[r] += [doc[r], doc[2 * world - 1 - r]]
    if not per_rank[0]:
        return torch.empty(world, 0, dtype=torch.int64)
    return torch.stack([torch.cat(p) for p in per_rank])


def doc_ids(table: Tensor, seq_len: int, cu: tuple[int, ...] | None) -> Tensor:
    """Document id of every slot of ``table`` (-1: pad)."""
    if cu is None:
        return torch.where(table >= 0, 0, -1)
    bounds = torch.tensor(cu[1:], dtype=torch.int64)
    ids = torch.bucketize(table.clamp(min=0), bounds, right=True)
    return torch.where(table >= 0, ids, -1)


def layout_index(seq_len: int, world: int, *, layout: str = DEFAULT_LAYOUT, cu_seqlens: Any = None) -> Tensor:
    """Which global position every rank holds under a layout.

    Args:
        seq_len: the global (packed) sequence length ``S``.
        world: the number of ranks ``W`` the sequence is split over.
        layout: ``"contiguous"`` (the default, :data:`DEFAULT_LAYOUT`: rank ``r`` holds
            ``[r*n, (r+1)*n)``, ``n = ceil(S/W)``, the last ranks padded) or ``"zigzag"``
            (each document cut into ``2W`` chunks of ``ceil(L/2W)``, its tail padded;
            rank ``r`` holds chunks ``r`` and ``2W-1-r`` of every document, documents in
            order).
        cu_seqlens: cumulative document lengths of a packed sequence (``[0, L_0,
            L_0+L_1, ..., S]``); ``None``: one document.

    A non-default ``layout`` is recorded for the program: the ops that read a layout then
    refuse tensors with no placement and no ``layout=`` over ``world`` ranks (shards
    indexed with this table carry none) instead of guessing the default.

    Returns:
        ``(W, seq_local)`` int64 tensor; entry ``[r, i]`` is the global position held by
        slot ``i`` of rank ``r``, or ``-1`` for padding. Every position appears once.

    Example::

        layout_index(8, 2, layout="zigzag")
        # tensor([[0, 1, 6, 7], [2, 3, 4, 5]])
        layout_index(8, 2)  # contiguous
        # tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    """
    op = "parallel.layout_index"
    seq_len = A.check_int(seq_len, op, "seq_len")
    world = A.check_int(world, op, "world")
    if seq_len < 0 or world < 1:
        raise A.arg_error(op, "seq_len/world", "seq_len >= 0 and world >= 1", (seq_len, world))
    layout = check_layout(layout, op)
    table = index_table(seq_len, world, layout, check_cu_seqlens(cu_seqlens, op, seq_len))
    note_layout(layout, world, f"{op}(layout={layout!r})")  # its rows index shards by hand
    return table


def group_rank_world(group: A.GroupLike, op: str) -> tuple[PG, int, int]:
    pg = A.resolve_group(group, op)
    b = B.get_backend()
    return pg, b.rank(pg), b.world_size(pg)


def group_rank_world_or_local(group: A.GroupLike, op: str) -> tuple[PG, int | None, int]:
    """``(group, this rank, its size)``; the rank ``None`` under torch's
    ``LocalTensorMode``, where one program runs for every simulated rank and an int cannot
    say which (the caller then reads the rank per simulated rank, or refuses)."""
    if not local_tensor_mode_on():
        return group_rank_world(group, op)
    pg = A.resolve_group(group, op)
    return pg, None, B.get_backend().world_size(pg)


def rank_positions(table: Tensor, pg: PG) -> Tensor:
    """Row ``rank`` of a layout table (``(world, n)``) under torch's ``LocalTensorMode``:
    a ``LocalTensor`` holding each simulated rank's own row (selected by its group rank
    as a tensor, never by one Python int for every rank)."""
    every = B.get_backend()
    assert isinstance(every, LocalTensorBackend)  # (the adapter while a mode is on)
    r = every.rank_tensor(pg, table.device)
    return table.index_select(0, r.view(1)).view(-1)


def resolve_seq(
    op: str, seq_local: int, world: int, layout: str, cu_seqlens: Any, seq_len: Any, arg: str
) -> tuple[int, tuple[int, ...] | None, Tensor]:
    """The global length, the checked ``cu_seqlens`` and the layout table, checked against
    the local length ``seq_local`` of argument ``arg``."""
    cu = check_cu_seqlens(cu_seqlens, op)
    if cu is not None:
        if seq_len is not None and int(seq_len) != cu[-1]:
            raise A.arg_error(op, "seq_len", f"cu_seqlens[-1] = {cu[-1]} (or None)", seq_len)
        total = cu[-1]
    elif seq_len is None:
        total = seq_local * world
    else:
        total = A.check_int(seq_len, op, "seq_len")
        if total < 0:
            raise A.arg_error(op, "seq_len", ">= 0", total)
    table = index_table(total, world, layout, cu)
    if table.shape[1] != seq_local:
        raise A.arg_error(
            op,
            arg,
            f"of {table.shape[1]} local positions along the sequence dim (layout {layout!r}, global "
            f"length {total}, {world} ranks{', packed documents' if cu else ''}; pass `seq_len` "
            "when the shards are padded)",
            f"{seq_local}",
        )
    return total, cu, table


def shard(
    x: Tensor,
    dim: int = 2,
    group: A.GroupLike = None,
    *,
    layout: str | None = None,
    cu_seqlens: Any = None,
    pad_value: float = 0,
    ulysses_group: A.GroupLike = None,
) -> Tensor:
    """This rank's part of a full-sequence tensor under a layout (inputs, position ids).

    Args:
        x: the whole sequence along ``dim`` (length ``S``), any dtype; the same on every
            rank (it is read locally; nothing is communicated).
        dim: the sequence dimension (default 2: ``(batch, heads, seq, head_dim)``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`layout_index`); ``None``:
            :data:`DEFAULT_LAYOUT` (``"contiguous"``), the default of every
            context-parallel entry point.
        cu_seqlens: cumulative document lengths of a packed sequence, or ``None``.
        pad_value: the value of padding slots (e.g. ``-1`` for position ids).
        ulysses_group: for :func:`usp_attention`: ``group`` is then the ring group, and
            this ring rank's positions are split contiguously (sizes differing by at most
            one) over the ranks of ``ulysses_group``. ``None`` (default): no Ulysses split
            (pass ``torch.distributed.group.WORLD`` for a Ulysses group of all ranks).

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``seq_local`` (the layout's),
        carrying its :class:`Placement`: ``ring_attention`` / ``usp_attention`` /
        ``ulysses_attention`` / ``unshard`` given it (or the tensor ``requires_grad_()``
        returns) use that layout when given none, and raise when told another. Ops that
        make a new tensor (a projection, a reshape, ``detach()``) drop it; then the
        default applies, unless this program used another layout over as many ranks (a
        zigzag ``shard`` does): then the ops refuse to guess and ask for ``layout=``.

    Gradient:
        local: the gradient of slot ``i`` goes to the position it holds; other positions
        (and padding) get zero. No communication (the sum-of-objectives convention: each
        rank's ``x`` is its own variable).

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.shard(torch.arange(8), 0))
            # [tensor([0, 1, 6, 7]), tensor([2, 3, 4, 5])]
    """
    op = "parallel.shard"
    x = A.check_tensor(x, op, "x")
    dim = A.check_dim(x, dim, op)
    layout = check_layout(DEFAULT_LAYOUT if layout is None else layout, op)
    pg, rank, world = group_rank_world_or_local(group, op)
    cu = check_cu_seqlens(cu_seqlens, op, x.shape[dim])
    table = index_table(x.shape[dim], world, layout, cu)
    # (under torch's LocalTensorMode, rank None: each simulated rank's row, and its
    # Ulysses piece, selected per rank)
    idx = table[rank] if rank is not None else rank_positions(table, pg)
    uworld, uranks = None, None
    if ulysses_group is not None:
        upg, urank, uworld = group_rank_world_or_local(ulysses_group, op)
        uranks = group_ranks(upg)
        sizes = even_sizes(table.shape[1], uworld)
        if urank is not None:
            idx = idx[sum(sizes[:urank]) : sum(sizes[: urank + 1])]
        else:
            idx = idx.narrow(0, *own_slice(sizes, upg))
    out = varying_by_construction(_select(x, dim, idx.to(x.device), pad_value, rank is None))
    note_layout(layout, world, f"{op}(layout={layout!r})")
    local = out.shape[dim]
    if isinstance(local, int) and bool((table < 0).any()):  # padded: the length is not the shards'
        note_padding(world, uworld, local, x.shape[dim], f"{op} of a length-{x.shape[dim]} dim")
    placement = Placement(
        layout, world, uworld, seq_len=x.shape[dim], ranks=group_ranks(pg), uranks=uranks, cu=cu, dim=dim
    )
    return placed(out, placement)


def _select(x: Tensor, dim: int, idx: Tensor, pad_value: float, always: bool = False) -> Tensor:
    out = x.index_select(dim, idx.clamp(min=0))
    pad = idx < 0
    if always or bool(pad.any()):  # (always per simulated rank: no one bool says it for all)
        shape = [1] * x.dim()
        shape[dim] = idx.numel()
        out = out.masked_fill(pad.view(shape), pad_value)
    return out


def unshard(
    x: Tensor,
    dim: int = 2,
    group: A.GroupLike = None,
    *,
    layout: str | None = None,
    cu_seqlens: Any = None,
    seq_len: int | None = None,
    ulysses_group: A.GroupLike = None,
) -> Tensor:
    """The whole sequence from every rank's part under a layout (outputs): all_gather, then
    the inverse of the layout's permutation (padding dropped).

    Args:
        x: this rank's part, ``seq_local`` along ``dim``; same shape on every rank.
        dim: the sequence dimension (default 2).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        layout: ``"contiguous"`` or ``"zigzag"``; ``None``: the layout ``x`` carries
            (:class:`Placement`, from :func:`shard` or an attention op), else
            :data:`DEFAULT_LAYOUT` -- refused (``ValueError`` naming ``layout``) once this
            program used another layout over as many ranks, as a guess. One that
            disagrees with ``x``'s placement raises.
        cu_seqlens: cumulative document lengths of a packed sequence, or ``None``.
        seq_len: the global length when the parts are padded (default: the length
            ``x``'s placement recorded (``shard`` of the whole sequence, or an attention
            op's output), else ``cu_seqlens[-1]``, else ``world * seq_local``); one that
            contradicts the recorded length raises.

    Returns:
        A new tensor: ``x.shape`` with ``dim`` of size ``S``, in sequence order, the same on
        every rank.

    Gradient:
        the permutation back, then ``reduce_scatter`` (the ``all_gather``'s adjoint):
        rank ``r`` gets the sum over ranks of the gradients of the positions it holds.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: parallel.unshard(parallel.shard(torch.arange(8.0), 0), 0))
            # [tensor([0., ..., 7.]), tensor([0., ..., 7.])]
    """
    op = "parallel.unshard"
    x = A.check_tensor(x, op, "x")
    dim = A.check_dim(x, dim, op)
    pg, _, world = group_rank_world_or_local(group, op)
    uworld, uranks = None, None
    if ulysses_group is not None:
        upg = group_rank_world_or_local(ulysses_group, op)
        uworld, uranks = upg[2], group_ranks(upg[0])
    p = placement_of(x)
    if p is not None and p.dim is not None and p.dim != dim:
        raise A.arg_error(op, "dim", f"{p.dim}, the sequence dim `x` was placed along", dim)
    given = layout
    layout = resolve_layout(op, layout, {"x": x}, world, uworld, ranks=group_ranks(pg), uranks=uranks)
    cu_seqlens = placed_cu_seqlens(op, {"x": x}, cu_seqlens, default=True)
    seq_len = placed_seq_len(op, {"x": x}, seq_len, cu_seqlens)
    require_seq_len_known(op, {"x": x}, seq_len, cu_seqlens, world, uworld, x.shape[dim])
    require_layout_known(op, given, {"x": x}, world)
    if ulysses_group is not None:
        upg, _, uworld = group_rank_world_or_local(ulysses_group, op)
        if seq_len is None and cu_seqlens is None:
            seq_len = uworld * world * x.shape[dim]
        n_ring = ring_local_len(op, x.shape[dim], uworld, world, layout, cu_seqlens, seq_len)
        x = C.all_gather(x, dim, upg, split_sizes=even_sizes(n_ring, uworld))
    total, _, table = resolve_seq(op, x.shape[dim], world, layout, cu_seqlens, seq_len, "x")
    full = C.all_gather(x, dim, pg, split_sizes=[x.shape[dim]] * world)
    flat = table.reshape(-1)
    inv = torch.empty(total, dtype=torch.int64)
    real = flat >= 0
    inv[flat[real]] = torch.arange(flat.numel())[real]
    return full.index_select(dim, inv.to(x.device))


def even_sizes(n: int, world: int) -> list[int]:
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def ring_local_len(
    op: str, seq_local: int, uworld: int, rworld: int, layout: str, cu_seqlens: Any, seq_len: Any
) -> int:
    cu = check_cu_seqlens(cu_seqlens, op)
    if cu is not None:
        total = cu[-1]
    elif seq_len is not None:
        total = A.check_int(seq_len, op, "seq_len")
    else:
        return seq_local * uworld
    return index_table(total, rworld, layout, cu).shape[1]
