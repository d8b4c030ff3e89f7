"""``all_to_all``: self-dual with ``split_dim``/``concat_dim`` and the split sizes
swapped; any pair of dims, uneven sizes. Re-exported by :mod:`diffcomm.ops.collectives`
(its public home, with the op -> adjoint table).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import Tensor

from .. import _config
from .._errors import CrossRankMismatchError
from .._replication import PARTIAL, SHARES, Rule, T
from .._torch import compiling
from ..backend import args as A
from ..backend.args import PG
from ..backend.buffers import joined
from . import references
from .base import CommOp, apply, call
from .precision_format import Precision, quantized
from .registry import SELF, Kwargs
from .shared_args import shared_args
from .validation import all_to_all_received as _all_to_all_received
from .validation import all_to_all_split_sizes as _all_to_all_split_sizes
from .validation import check_input as _check_input
from .validation import current_backend as _b
from .validation import debug_check as _debug_check
from .validation import other_dims as _other_dims
from .validation import rank as _rank
from .validation import records_grad as _records_grad
from .validation import with_sizes as _with
from .validation import world as _world


class _AllToAll(CommOp):
    name = "all_to_all"
    family = "collective"
    order = 50
    dual = SELF
    dims = (0, 1)
    forward_text = "chunk r of every rank's x, concatenated"
    backward_text = "all_to_all with dims and split sizes swapped"
    spmd = Rule({T.V: T.V, T.R: T.V}, in_grad=PARTIAL, refuse={T.P: SHARES})

    @staticmethod
    def run(
        x: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> Tensor:
        """all_to_all over the raw backend (dim-0, contiguous) for any pair of dims."""
        if split_dim == concat_dim:
            x0 = x if split_dim == 0 else x.movedim(split_dim, 0)
            if ins == outs and ins.count(ins[0]) == len(ins):  # even: the backend's plain all_to_all
                out = _b().all_to_all(x0, pg)
            else:
                out = _b().all_to_all(x0, pg, list(ins), list(outs))
            return out if split_dim == 0 else out.movedim(0, split_dim)
        return _across_dims(x, split_dim, concat_dim, pg, ins, outs)

    @staticmethod
    def transpose(
        g: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> Tensor:
        return call(_AllToAll, g, concat_dim, split_dim, pg, outs, ins)

    @staticmethod
    def out_shape(
        x: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
    ) -> tuple[int, ...]:
        if split_dim == concat_dim:
            return _with(x.shape, {split_dim: sum(outs)})
        return _with(x.shape, {split_dim: ins[_rank(pg)], concat_dim: sum(outs)})

    reference = references.all_to_all

    @staticmethod
    def dual_args(kw: Kwargs, world: int) -> tuple[Kwargs, float]:
        swapped = {
            "split_dim": kw.get("concat_dim", 0),
            "concat_dim": kw.get("split_dim", 0),
            "input_split_sizes": kw.get("output_split_sizes"),
            "output_split_sizes": kw.get("input_split_sizes"),
        }
        return swapped, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[Kwargs]:
        w = world
        yield {"shape": (2 * w, 3), "kwargs": {"split_dim": 0, "concat_dim": 0}}
        yield {"shape": (2, 2 * w, 3), "kwargs": {"split_dim": 1, "concat_dim": 2}}
        a2a = tuple(tuple((r + j) % 3 for j in range(w)) for r in range(w))
        yield {"shape": (0, 2), "kwargs": {"split_dim": 0, "concat_dim": 0}, "a2a": a2a}
        yield {
            "shape": (0, 2),
            "kwargs": {"split_dim": 0, "concat_dim": 0, "infer_outputs": True},
            "a2a": a2a,
        }


def _across_dims(
    x: Tensor, split_dim: int, concat_dim: int, pg: PG, ins: tuple[int, ...], outs: tuple[int, ...]
) -> Tensor:
    """:meth:`_AllToAll.run` with ``split_dim != concat_dim`` (its own function: its
    comprehensions make closure cells, which ``run``'s common path must not pay for)."""
    # split along split_dim, concatenate along concat_dim. Chunks travel flat in the layout
    # (concat_dim, split_dim, other dims...); every rank sends me a chunk of split size
    # ins[me] (validated equal across ranks) whose concat_dim size is outs[j].
    world = _world(pg)
    order = [concat_dim, split_dim] + [i for i in range(x.ndim) if i not in (split_dim, concat_dim)]
    rest = [x.shape[i] for i in order[2:]]
    rest_n = 1
    for s in rest:
        rest_n *= s
    # the chunk every rank sends me: ins[me] (read without the rank when the split is even,
    # as under torch's LocalTensorMode, where it must be: there the rank is no int)
    c_in = ins[0] if len(set(ins)) == 1 else ins[_rank(pg)]
    send = x.permute(order).split(list(ins), dim=1)
    flat_in = joined([ch.reshape(-1) for ch in send]) if world > 1 else send[0].reshape(-1)
    in_counts = [ins[j] * x.shape[concat_dim] * rest_n for j in range(world)]
    out_counts = [outs[j] * c_in * rest_n for j in range(world)]
    flat = _b().all_to_all(flat_in, pg, in_counts, out_counts)
    blocks = [p.reshape(outs[j], c_in, *rest) for j, p in enumerate(flat.split(out_counts))]
    full = joined(blocks) if world > 1 else blocks[0]  # (sum outs, c_in, *rest)
    inverse = [order.index(i) for i in range(x.ndim)]
    return full.permute(inverse)


#: The raw forward of ``all_to_all`` (``(x, split_dim, concat_dim, pg, in_sizes,
#: out_sizes)``), for op families built on it (``parallel.all_to_all_region``).
raw_all_to_all = _AllToAll.run


def _debug_check_transposed(
    op: str, pg: PG, ins: Sequence[int], outs: Sequence[int], split_dim: int, concat_dim: int, x: Tensor
) -> None:
    """Debug mode: what each rank expects is what its peers send it (one small exchange),
    else ``CrossRankMismatchError`` on every rank naming the pairs. (The sizes legitimately
    differ between ranks, so the field comparison cannot check them.)

    With ``split_dim == concat_dim``, rank ``r``'s ``output_split_sizes[j]`` is rank
    ``j``'s ``input_split_sizes[r]``. Otherwise the chunks are concatenated along another
    dim: rank ``r``'s ``output_split_sizes[j]`` is rank ``j``'s ``x.shape[concat_dim]``,
    and the chunks rank ``r`` receives agree in their ``split_dim`` size.

    Skipped inside compiled code, as the field comparison is (the exchange is a host read)."""
    if compiling():
        return
    table = _b().exchange_size_lists([*ins, *outs, x.shape[concat_dim]], pg)
    n = len(table)
    if split_dim == concat_dim:
        bad = [
            f"rank {r} expects {table[r][n + j]} from rank {j}, which sends it {table[j][r]}"
            for r in range(n)
            for j in range(n)
            if table[r][n + j] != table[j][r]
        ]
    else:
        bad = [
            f"rank {r} expects {table[r][n + j]} along concat_dim from rank {j}, whose "
            f"x.shape[concat_dim] is {table[j][2 * n]}"
            for r in range(n)
            for j in range(n)
            if table[r][n + j] != table[j][2 * n]
        ]
        bad += [
            f"rank {r} would receive chunks of split_dim sizes {[table[j][r] for j in range(n)]} "
            f"from ranks 0..{n - 1} (they are concatenated along concat_dim, so they must agree)"
            for r in range(n)
            if len({table[j][r] for j in range(n)}) > 1
        ]
    if bad:
        raise CrossRankMismatchError(
            f"diffcomm.{op}(): ranks called it with inconsistent split sizes: " + "; ".join(bad[:6])
        )


@shared_args
def all_to_all(
    x: Tensor,
    split_dim: int = 0,
    concat_dim: int = 0,
    group: A.GroupLike = None,
    input_split_sizes: Sequence[int] | None = None,
    output_split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
    precision: Precision | None = None,
) -> Tensor:
    """Send chunk ``j`` of ``x`` (along ``split_dim``) to rank ``j``; concatenate what
    arrives from every rank along ``concat_dim``.

    Args:
        x: tensor; same shape on every rank (except along ``split_dim`` when uneven).
        split_dim: dimension split into per-destination chunks.
        concat_dim: dimension the received chunks are concatenated along (in rank order).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        input_split_sizes: sizes of the chunks sent to each rank along ``split_dim``
            (``None``: even).
        output_split_sizes: sizes along ``concat_dim`` of the chunks received from each
            rank. ``None``: inferred — exchanged when ``split_dim == concat_dim`` and
            ``input_split_sizes`` is given, else ``x``'s size (even split) or
            ``x.shape[concat_dim]`` (different dims).
        async_op: {async_op}
        precision: {precision}

    Returns:
        A new tensor. ``split_dim == concat_dim == d``: ``x.shape`` with ``d`` of size
        ``sum(output_split_sizes)``. Otherwise ``x.shape`` with ``split_dim`` of size
        ``input_split_sizes[rank]`` (every rank must send rank ``r`` the same size) and
        ``concat_dim`` of size ``sum(output_split_sizes)``.

    Gradient:
        ``all_to_all(grad, split_dim=concat_dim, concat_dim=split_dim,
        input_split_sizes=output_split_sizes, output_split_sizes=input_split_sizes)``.

    Example::

        with dc.LocalWorld(2) as world:
            world.run(lambda: dc.all_to_all(torch.arange(2.0) + 2 * dc.get_rank()))
            # [tensor([0., 2.]), tensor([1., 3.])]
    """
    if precision is not None:
        io = (input_split_sizes, output_split_sizes)
        return quantized("all_to_all")(x, split_dim, concat_dim, group, *io, precision, async_op)
    op = "all_to_all"
    x = _check_input(x, op)
    split_dim = A.check_dim(x, split_dim, op, "split_dim")
    concat_dim = A.check_dim(x, concat_dim, op, "concat_dim")
    pg = A.resolve_group(group, op)
    ins, outs = _all_to_all_split_sizes(x, split_dim, concat_dim, pg, input_split_sizes, output_split_sizes)
    if _config.DEBUG.get():
        rest = _other_dims(x, split_dim, concat_dim)
        _debug_check(
            op,
            pg,
            split_dim=split_dim,
            concat_dim=concat_dim,
            other_dims=rest,
            dtype=x.dtype,
            grad=_records_grad(x),
        )
        if outs is not None:  # what each rank expects must be what its peers send it
            _debug_check_transposed(op, pg, ins, outs, split_dim, concat_dim, x)
    if outs is None:
        outs = _all_to_all_received(ins, pg)
    return apply(_AllToAll, x, split_dim, concat_dim, pg, tuple(ins), outs, async_op=async_op)
