"""The torch-op name tables of ``dc.spmd_check`` (which plain torch ops a partial value may
go through, which draw randomness, which are products with a weight, ...) and the small
helpers that classify one call's arguments (the rank as a :class:`RankInt`, zero
constants, varying weights). Data and pure functions: the check's state lives in
:mod:`diffcomm.spmd.check`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .. import rng
from .._replication import R, T, V
from ..backend.in_process import per_rank

# ======================================================================================
# classification of plain torch ops (what a partial value may go through)
# ======================================================================================


def _names(*names: str) -> frozenset[str]:
    return frozenset(names)


#: value-preserving casts and copies (dtype, device, autograd flags): every element kept
_CASTS = _names(
    "to", "float", "double", "half", "bfloat16", "type", "type_as", "cpu", "cuda", "detach", "requires_grad_"
)
#: copies and signs: every element where it was
_COPIES = _names("contiguous", "clone", "neg", "negative", "positive")
#: views and splits: the same elements, laid out anew
_VIEWS = _names(
    "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "T", "mT", "unsqueeze",
    "squeeze", "flatten", "unflatten", "expand", "expand_as", "narrow", "select", "getitem", "chunk",
    "split", "split_with_sizes", "tensor_split", "unbind", "movedim", "moveaxis", "swapaxes", "swapdims",
)  # fmt: skip
#: ops linear in their one tensor input (shape, view, copy, reduction over dims, sign)
_STRUCTURAL = (
    _CASTS
    | _COPIES
    | _VIEWS
    | _names(
        "sum",
        "mean",
        "index_select",
        "gather",
        "real",
        "imag",
        "conj",
        "flip",
        "roll",
        "repeat",
        "tile",
        "masked_fill",
        "diagonal",
        "tril",
        "triu",
        "pad",
        "narrow_copy",
        "as_strided",
        "unfold",
        "cumsum",
        "trace",
        "einsum_identity",
        "zeros_like",
        "sum_to_size",
        "nan_to_num",
        "data",
        "copy_",
    )  # fmt: skip
)
#: their second tensor is only a template (shape, dtype): typed by the first alone
_TEMPLATE_2ND = _names("view_as", "reshape_as", "expand_as", "type_as")
#: sums of their tensor inputs: every float input partial
_ADDITIVE = _names(
    "add",
    "sub",
    "add_",
    "sub_",
    "iadd",
    "isub",
    "radd",
    "rsub",
    "cat",
    "concat",
    "concatenate",
    "stack",
    "hstack",
    "vstack",
    "subtract",
)
#: linear in exactly one partial input, the others replicated (products)
_SCALING = _names(
    "mul",
    "mul_",
    "imul",
    "rmul",
    "div",
    "div_",
    "truediv",
    "itruediv",
    "true_divide",
    "multiply",
    "matmul",
    "rmatmul",
    "mm",
    "bmm",
    "einsum",
    "linear",
    "dropout",
    "dropout_",
    "outer",
    "tensordot",
    "kron",
    "mv",
    "dot",
    "inner",
    "scaled_dot_product_attention_value",
)
#: a term plus a product (``input + t1 * t2``): linear in partial operands when the product
#: has one partial factor and the term is partial or zero
_ACCUMULATING = _names("addcmul", "addcmul_", "baddbmm", "baddbmm_")
#: masked assignment and selection: linear in a partial operand when the other one is zero
_MASKING = _names("setitem", "where", "masked_fill", "masked_fill_")
#: products with a weight: a replicated activation meeting a varying weight here is the
#: entry of a column-parallel region (where copy_to_region belongs)
_WEIGHTED = _names("linear", "matmul", "mm", "bmm", "einsum", "embedding", "conv1d", "conv2d", "rmatmul")
#: ops whose output is still the weight they are given, for the input-gradient rule (a
#: replicated activation meeting a varying weight needs copy_to_region): value-preserving
#: casts and copies, views, and the scalings of ``_WEIGHT_SCALING`` (manual mixed precision,
#: ``F.linear(x, w.to(x.dtype))``, ``x @ w.float().T``, ``x @ (w * s).T``)
_WEIGHT_KEEPING = _CASTS | _COPIES | _VIEWS
#: elementwise products and quotients: the weight stays one when it is scaled by replicated
#: factors (a Python number, a replicated tensor); for a quotient, it must be the dividend
_WEIGHT_SCALING = _names(
    "mul", "mul_", "imul", "rmul", "multiply", "div", "div_", "truediv", "itruediv", "true_divide", "divide"
)
_WEIGHT_DIVIDING = _names("div", "div_", "truediv", "itruediv", "true_divide", "divide")
#: ops through which a replicated term added to a varying value stays an additive term
_LINEAR_CHAIN = _STRUCTURAL | _ADDITIVE
#: ops that put a replicated value beside per-rank ones as an element of its own
_STACKING = _names("cat", "concat", "concatenate", "stack", "hstack", "vstack")
#: elementwise maps and norms: a replicated *element* (stacked, not broadcast into every
#: element) stays one through them: the squares of stacked per-tensor norms, their norm
_ELEMENTWISE = _names(
    "pow",
    "pow_",
    "square",
    "square_",
    "abs",
    "abs_",
    "sqrt",
    "sqrt_",
    "float_power",
    "norm",
    "vector_norm",
    "linalg_vector_norm",
)
#: the reductions over the group (``op`` sum or avg), each list op's per element
_SUMMING = _names(
    "all_reduce", "parallel.reduce_from_region", "reduce_scatter", "parallel.reduce_scatter_to_sequence",
    "all_reduce_coalesced", "parallel.reduce_from_region_coalesced", "reduce_scatter_coalesced",
)  # fmt: skip
#: all_reduce and its list op: avg / max / min of equal values is an identity
_ALL_REDUCES = _names("all_reduce", "all_reduce_coalesced")
#: outputs depend only on the values' metadata (never a type error)
_NO_TYPING = _names("__get__", "__set__", "__delete__", "size", "dim", "numel", "is_floating_point")

_RANDOM = _names(
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "normal",
    "bernoulli",
    "multinomial",
    "uniform_",
    "normal_",
    "bernoulli_",
    "exponential_",
    "random_",
    "geometric_",
    "log_normal_",
    "cauchy_",
)
_DROPOUT = _names(
    "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"
)


#: how the default generator was last seeded inside the check (set by the installed
#: ``torch.manual_seed``): ``True`` from the rank (``torch.manual_seed(1 + dc.get_rank())``:
#: its draws are per rank), ``False`` from a value equal on every rank, ``None`` not seeded
#: inside the check (the evidence taken when the check was entered decides)
SEEDED_BY_RANK: list[bool | None] = [None]
# a rank's own in an in-process world (its ranks are threads of one process): one value for
# all of them typed a rank's draws by another rank's seeding (a verdict that differed by rank)
per_rank(SEEDED_BY_RANK)

#: the attribute a :class:`RankGenerator` seeded from the rank carries
_RANK_SEEDED = "_dc_spmd_rank_seeded"


class RankGenerator(torch.Generator):
    """``torch.Generator`` as a check installs it: it remembers whether it was seeded from
    the rank (``torch.Generator().manual_seed(seed + 100 * dc.get_rank())``) or with
    :meth:`seed` (a non-deterministic seed, different on every rank): draws on it are
    then per rank (varying). A generator made before the check, or seeded with a value
    equal on every rank, draws alike on every rank (replicated)."""

    def manual_seed(self, seed: Any) -> RankGenerator:
        setattr(self, _RANK_SEEDED, _rank_dependent((seed,)))
        super().manual_seed(seed)
        return self

    def seed(self) -> int:
        setattr(self, _RANK_SEEDED, True)
        return super().seed()


def _random_type(generator: Any = None, default_differs: bool = False, entry_seed: int | None = None) -> T:
    """Randomness from a forked named stream of diffcomm.rng is per rank (varying). An
    explicit ``generator=`` is varying when it was seeded from the rank inside the check
    (:class:`RankGenerator`), else replicated. The default generator is varying when it was
    last seeded from the rank inside the check, replicated when it was seeded from a value
    equal on every rank inside the check (also by a path the check does not see, such as
    :func:`diffcomm.rng.model_parallel_seed`: its initial seed is no longer
    ``entry_seed``), and otherwise as found when the check was entered
    (``default_differs``: its state differed between the ranks)."""
    if rng.get_tracker()._active:
        return V
    if generator is not None:
        return V if getattr(generator, _RANK_SEEDED, False) else R
    seeded = SEEDED_BY_RANK[0]
    if seeded is None:
        seeded = default_differs and (entry_seed is None or torch.initial_seed() == entry_seed)
    return V if seeded else R


class RankInt(int):
    """The rank, as ``dc.get_rank()`` returns it inside a check: an ``int`` whose arithmetic
    stays a ``RankInt``, so an index or a slice computed from the rank (``x[r * n:(r + 1) *
    n]``) marks the result varying. (Comparisons and ``float()`` give plain values.)"""

    def __reduce__(self) -> Any:  # crosses process boundaries as a plain int
        return (int, (int(self),))


def _rank_method(op: str) -> Any:
    base = getattr(int, op)

    def method(self: int, *a: Any) -> Any:
        out = base(self, *a)
        return RankInt(out) if type(out) is int else out

    method.__name__ = op
    return method


for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
            "__rfloordiv__", "__mod__", "__rmod__", "__neg__", "__pos__", "__abs__"):  # fmt: skip
    setattr(RankInt, _op, _rank_method(_op))


def _rank_dependent(args: Iterable[Any]) -> bool:
    for a in args:
        t = type(a)
        if t is RankInt:
            return True
        if t is slice:
            if type(a.start) is RankInt or type(a.stop) is RankInt:
                return True
        elif t is tuple or t is list:
            for b in a:
                if type(b) is RankInt or (
                    type(b) is slice and (type(b.start) is RankInt or type(b.stop) is RankInt)
                ):
                    return True
    return False


def _flat_tensors(args: Iterable[Any], out: list[Tensor]) -> list[Tensor]:
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            for b in a:
                if isinstance(b, Tensor):
                    out.append(b)
    return out


def _differentiable(t: Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _is_weight(r: Any, t: Tensor) -> bool:
    """A varying weight: a varying parameter, or a varying leaf that requires grad, or a
    view of one (``x @ w.T``: the transpose is no leaf, but the weight it shows is), or
    one seen through value-preserving ops (``r.weight``: ``w.float()``, ``w.to(x.dtype)``,
    ``(w * 0.5).T``; see ``_WEIGHT_KEEPING``)."""
    if r.t is not V:
        return False
    if r.param is not None or r.weight:
        return True
    if t.requires_grad and t.grad_fn is None:
        return True
    base = t._base  # (a view of a view has the root as its base)
    return base is not None and base.requires_grad and base.grad_fn is None


def _keeps_weight(name: str, args: Any, recs: list[Any], ins: list[Tensor]) -> bool:
    """Whether the varying output of op ``name`` is still a varying weight (``_is_weight``)
    of its inputs: a cast, copy or view of one (``_WEIGHT_KEEPING``), or one multiplied
    or divided by replicated factors (``_WEIGHT_SCALING``: Python numbers, replicated
    tensors). Anything else varying beside it (a per-rank mask) makes it per-rank data."""
    if name in _WEIGHT_KEEPING:
        return bool(recs) and _is_weight(recs[0], ins[0])
    if name not in _WEIGHT_SCALING:
        return False
    found = False
    for r, t in zip(recs, ins):
        if _is_weight(r, t):
            if name in _WEIGHT_DIVIDING and not (args and args[0] is t):
                return False  # ``s / w``: a reciprocal, not a scaled weight
            found = True
        elif r.t is not R:
            return False
    return found


#: the ops of ``_WEIGHT_KEEPING`` / ``_WEIGHT_SCALING`` that keep every element where it
#: was (a cast, a copy, an elementwise scaling): a weight's sharded dim stays its sharded dim
_SAME_PLACE = _WEIGHT_SCALING | _CASTS | _COPIES


def _weight_shard(name: str, args: Any, recs: list[Any], ins: list[Tensor], out: Tensor) -> int | None:
    """The sharded dim of a varying weight seen through op ``name`` (``_keeps_weight``), so
    that ``F.linear(a, row.weight.float())`` is a row-parallel product (partial) as
    ``F.linear(a, row.weight)`` is: kept by a cast, copy or scaling of the same shape, swapped
    by a transpose (``w.T``, ``w.t()``, ``w.mT``, ``w.transpose(0, 1)``); else ``None``."""
    i = next((i for i, (r, t) in enumerate(zip(recs, ins)) if _is_weight(r, t)), None)
    if i is None or recs[i].shard is None:
        return None
    w, shard = ins[i], recs[i].shard
    if name in _SAME_PLACE:
        return shard if tuple(out.shape) == tuple(w.shape) else None
    n = w.dim()
    if (name in ("t", "T") and n == 2) or (name == "mT" and n >= 2):
        pair = (n - 2, n - 1)
    elif name in ("transpose", "swapaxes", "swapdims") and len(args) >= 3 and _ints(args[1:3]):
        pair = (args[1] % n, args[2] % n)
    else:
        return None
    return pair[1] if shard == pair[0] else pair[0] if shard == pair[1] else shard


def _contracts_shard(name: str, args: Any, kwargs: Any, recs: list[Any], ins: list[Tensor]) -> bool:
    """Whether ``einsum`` / ``tensordot`` of a varying activation and a varying weight sums
    over the weight's sharded dim (``einsum("bf,hf->bh", a, row.weight)``,
    ``tensordot(a, row.weight, dims=([1], [1]))``): a row-parallel product, partial as
    ``F.linear(a, row.weight)`` is. Two operands only; anything unread is ``False``."""
    if len(ins) != 2 or not all(r.t is V for r in recs):
        return False
    w = next((i for i, r in enumerate(recs) if r.shard is not None), None)
    if w is None:
        return False
    n, shard = ins[w].dim(), recs[w].shard
    if name == "einsum":
        eq = args[0] if args and isinstance(args[0], str) else None
        if eq is None or "..." in eq:
            return False
        eq = eq.replace(" ", "")
        lhs, _, out = eq.partition("->")
        specs = lhs.split(",")
        if len(specs) != 2 or len(specs[w]) != n:
            return False
        if "->" not in eq:  # implicit output: the letters seen once
            out = "".join(c for c in lhs if c != "," and lhs.count(c) == 1)
        letter = specs[w][shard % n]
        return letter not in out and letter in specs[1 - w]
    dims = (kwargs or {}).get("dims", args[2] if len(args) > 2 else 2)
    if isinstance(dims, int):
        mine = list(range(n - dims, n)) if w == 0 else list(range(dims))
    elif isinstance(dims, list | tuple) and len(dims) == 2:
        mine = [dims[w]] if isinstance(dims[w], int) else list(dims[w])
    else:
        return False
    return _ints(mine) and shard % n in [d % n for d in mine]


def _view_shard(shard: int | None, view: Tensor, base: Tensor) -> int | None:
    """The sharded dim of a view made outside the check's mode (``w.T``, ``w.mT``: a
    property's getter) of a base sharded along ``shard``: swapped when the view is its
    base with the last two dims swapped (``a @ row.weight.T`` is a row-parallel product);
    otherwise the base's."""
    n = base.dim()
    if shard is None or n < 2 or view.dim() != n or shard < n - 2:
        return shard
    swap = list(range(n - 2)) + [n - 1, n - 2]
    if view.shape == base.shape and view.stride() == base.stride():
        return shard
    if list(view.shape) == [base.shape[i] for i in swap] and list(view.stride()) == [
        base.stride()[i] for i in swap
    ]:
        return 2 * n - 3 - shard
    return shard


def _ints(xs: Iterable[Any]) -> bool:
    return all(isinstance(x, int) for x in xs)


def _is_number(x: Any) -> bool:
    """``x`` is a Python number (an operand a torch op takes as a constant)."""
    return isinstance(x, bool | int | float | complex)


def _is_zero(x: Any, rec: Any = None) -> bool:
    """``x`` is a constant zero: a Python number equal to zero (a constant, as every Python
    number the check meets, except the rank: a :class:`RankInt` is per-rank data, zero on
    one rank only), or a tensor that needs no gradient and is zero by construction
    (``rec.zero``). Never read from a tensor's values: a per-rank value zero on some ranks
    only made the ranks' verdicts differ (one raised and left the block while the others
    waited in the next collective)."""
    if isinstance(x, bool | int | float | complex):
        return type(x) is not RankInt and x == 0
    return isinstance(x, Tensor) and rec is not None and rec.zero and not x.requires_grad


#: ops whose output is zeros whatever their inputs' values
_ZEROS = _names("zero_", "_foreach_zero_", "zeros", "zeros_like", "new_zeros")
#: ops filling their output with one value: (position, keyword) of that value
_FILLS = {
    "fill_": (1, "value"),
    "full": (1, "fill_value"),
    "full_like": (1, "fill_value"),
    "new_full": (2, "fill_value"),
    "tensor": (0, "data"),
    "scalar_tensor": (0, "s"),
    "as_tensor": (0, "data"),
}


def _makes_zero(name: str, args: Any, kwargs: Any, ins: list[Tensor], rec: Any) -> bool:
    """Whether op ``name``'s output is zero by construction (``_Rec.zero``): a zeroing op,
    a fill with a constant zero, or a value-preserving op (a cast, a copy, a view,
    ``copy_`` of its source) of inputs that are all zero. Decided from the op and its
    constant arguments (``ins``: the inputs that give the values; ``rec``: a tensor's record)."""
    if name in _ZEROS:
        return True
    if name in _FILLS:
        pos, kw = _FILLS[name]
        value = args[pos] if len(args) > pos else (kwargs or {}).get(kw)
        return _is_zero(value, rec(value) if isinstance(value, Tensor) else None)
    if name in _CASTS or name in _COPIES or name in _VIEWS or name == "copy_":
        return bool(ins) and all(rec(t).zero for t in ins)
    return False


def _default_rng_differs(pg: Any) -> bool:
    """Whether the default CPU generator's state differs between the ranks of ``pg`` (one
    small exchange of an 8-byte digest of it, when the check is entered): evidence, in the
    process, of how it was seeded. Equal states (``torch.manual_seed(0)`` on every rank,
    :func:`diffcomm.rng.model_parallel_seed`) draw alike (replicated); different states
    (unseeded processes, a per-rank seed) draw per-rank values (varying). Without an
    initialised torch.distributed the check keeps its assumption, seeded alike.

    The exchange goes through the backend adapter, as every communication diffcomm runs:
    queued behind the asynchronous ops still pending (a raw ``dist.all_gather`` overtook
    them, so a pending ``dc.all_gather(counts, async_op=True)`` of one int64 paired with
    the digest's on another rank and returned it as a count, silently), bounded by
    ``DIFFCOMM_TIMEOUT`` and recorded by the flight recorder."""
    import hashlib

    from ..backend import get_backend

    group = _several_ranks(pg)
    if group is None:
        return False
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).digest()
    mine = int.from_bytes(digest, "little", signed=True)
    return any(d != mine for d in get_backend().exchange_sizes(mine, group))


def _several_ranks(pg: Any) -> Any:
    """The group the check's exchanges run on (``pg``, or the default group), or ``None``
    where there is nothing to exchange: no initialised torch.distributed, or one rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    group = pg if pg is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _replicated_values_differ(pg: Any, losses: list[tuple[str, float]]) -> tuple[int, list[float]] | None:
    """The first of ``losses`` (``(the user's line, the loss's sum)``, one a backward of a
    replicated objective, in order) that differs between the ranks of ``pg`` where every
    rank took it at the same line, and every rank's value of it; or ``None``. Backwards
    taken at different lines (a pipeline's stages: a send token on one rank, the loss on
    another) are not compared. Two small exchanges through the backend adapter when the
    check is left (the number of losses, then each one's line digest and value bits), so a
    rank-dependent backward cannot hang one; a rank with fewer backwards compares the ones
    it has."""
    import hashlib
    import struct

    from ..backend import get_backend

    group = _several_ranks(pg)
    if group is None:
        return None
    backend = get_backend()
    n = min(backend.exchange_sizes(len(losses), group))
    if n == 0:
        return None
    mine: list[int] = []
    for site, value in losses[:n]:
        line = hashlib.blake2b(site.encode(), digest_size=8).digest()
        bits = struct.unpack("<q", struct.pack("<d", value))[0]
        mine += [int.from_bytes(line, "little", signed=True), bits]
    rows = backend.exchange_size_lists(mine, group)
    for i in range(n):
        if len({row[2 * i] for row in rows}) > 1:  # taken at different lines
            continue
        column = [struct.unpack("<d", struct.pack("<q", row[2 * i + 1]))[0] for row in rows]
        if not all(_close(v, column[0]) for v in column):
            return i, column
    return None


def _close(a: float, b: float) -> bool:
    """Equal up to rounding (a replicated loss computed alike on every rank is equal to the
    bit; the tolerance leaves room for a reduction whose order differs by rank)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= 1e-6 * max(abs(a), abs(b)) + 1e-12
