"""Cross entropy over vocabulary-sharded logits, without gathering the full logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _config, _torch
from .. import backend as B
from .._replication import REPLICATED, P, R, Rule, V
from ..backend import args as A
from ..backend.args import PG
from ..ops import collectives
from ..ops.validation import rank_start
from ._autocast import autocast_dtype
from ._check import check_replicated
from ._once import first_order

__all__ = ["vocab_parallel_cross_entropy"]


_OP = "parallel.vocab_parallel_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
#: a shard size travels in the max all_reduce as two floats, ``hi * _SIZE_BASE + lo``: each
#: below 2**24, so exact in float32 (the logits' float dtype) up to 2**36 classes per shard
_SIZE_BASE = 4096

#: which of a shard's columns are real classes (not padding): ``None`` all of them, an int
#: ``k`` the first ``k`` (a view, no copy), or a bool ``(v,)`` mask (under torch's
#: ``LocalTensorMode``, where the shard's start is a per-rank tensor)
_Real = int | Tensor | None


def _real_columns(start: int | Tensor, v_local: int, vocab_size: int | None, device: torch.device) -> _Real:
    """This shard's real columns, when classes ``>= vocab_size`` are padding (see ``_Real``)."""
    if vocab_size is None:
        return None
    if isinstance(start, int):
        k = min(max(vocab_size - start, 0), v_local)
        return None if k == v_local else k
    return (start + torch.arange(v_local, device=device)) < vocab_size


def _local_max(z: Tensor, real: _Real) -> Tensor:
    """Per-token max over this shard's real columns (``-inf`` where there are none)."""
    if isinstance(real, Tensor):
        z = z.masked_fill(~real, float("-inf"))
    elif real is not None:
        z = z[..., :real]
    if not isinstance(z.shape[-1], int):
        # LocalTensorMode with shard sizes differing per simulated rank (a SymInt, whose
        # comparison is one answer for all): one -inf column makes an empty shard's max -inf
        return F.pad(z, (0, 1), value=float("-inf")).amax(dim=-1)
    if z.shape[-1] == 0:  # (an empty shard, or one holding only padding)
        return z.new_full(z.shape[:-1], float("-inf"))
    return z.amax(dim=-1)


def _target_logit(shifted: Tensor, local_t: Tensor, here: Tensor) -> Tensor:
    """Per-token ``shifted[..., local_t]`` where the target is in this shard, else 0."""
    if not isinstance(shifted.shape[-1], int):  # (as in ``_local_max``: a column to index)
        shifted = F.pad(shifted, (0, 1))
    elif shifted.shape[-1] == 0:  # an empty shard holds no target
        return shifted.new_zeros(local_t.shape)
    return shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)


def _real_sum(x: Tensor, real: _Real) -> Tensor:
    """Per-token sum over this shard's real columns."""
    if isinstance(real, Tensor):
        return x.masked_fill(~real, 0.0).sum(-1)
    return (x if real is None else x[..., :real]).sum(-1)


def _shard_sizes(z_max: Tensor, v_local: int, pg: PG) -> tuple[Tensor, Tensor]:
    """The max all_reduce, with every rank's shard size folded into it (no extra collective).

    Rank ``r`` appends a ``2 * world`` vector holding its ``v_local`` at position ``r`` (as
    ``hi, lo`` digits of ``_SIZE_BASE``, exact in float32) and 0 elsewhere, neutral for
    ``max`` since sizes are >= 0. Returns ``(global per-token max, every rank's shard size
    as an int64 (world,) tensor)``, equal on every rank."""
    world = B.get_backend().world_size(pg)
    rank = rank_start(pg, 1, z_max.device)  # (a per-rank tensor under LocalTensorMode)
    mine = (torch.arange(world, device=z_max.device) == rank).to(z_max.dtype)
    hi, lo = v_local // _SIZE_BASE, v_local % _SIZE_BASE  # (SymInts under LocalTensorMode: no divmod)
    flat = torch.cat([z_max.reshape(-1), mine * hi, mine * lo])
    with B.label(f"{_OP} (max, shard sizes)"):
        out = collectives.raw_all_reduce(flat, "max", pg)
    n = z_max.numel()
    digits = out[n:].to(torch.int64)
    return out[:n].reshape(z_max.shape), digits[:world] * _SIZE_BASE + digits[world:]


def _guess_missed(sizes: list[int], vocab_size: int) -> bool:
    """Whether the max's guess of the real columns (the even layout's: rank ``q`` starting at
    ``q * v_q``) was wrong for some rank's shard, given every shard size."""

    def real(start: int, v: int) -> int:
        return min(max(vocab_size - start, 0), v)

    return any(real(q * v, v) != real(sum(sizes[:q]), v) for q, v in enumerate(sizes))


def _own_start(sizes: Tensor, sizes_host: list[int], pg: PG) -> int | Tensor:
    """Where this rank's classes start: the sum of the lower ranks' shard sizes (the layout of
    ``dc.all_gather`` / ``dc.scatter`` with ``split_sizes``: contiguous, in rank order). An
    int; under ``LocalTensorMode`` a 0-dim tensor holding each simulated rank's own."""
    rank = rank_start(pg, 1, sizes.device)
    if isinstance(rank, int):
        return sum(sizes_host[:rank])
    return (sizes * (torch.arange(sizes.numel(), device=sizes.device) < rank)).sum()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from a vocabulary shard; saves the softmax shard for backward.

    Outputs: ``(loss, grad_shard, local_target, target_here, valid)``; only the loss is
    differentiable, the others are what backward and jvp need (``grad_shard`` is
    ``softmax - eps / V`` on the real classes, 0 on padding: the token's gradient but for
    the target's ``-(1 - eps)``).

    Not a :class:`~diffcomm.ops.base.CommOp`: that base derives backward, jvp and vmap from a
    **linear** op's transpose (the same op on the tangent). This Function is nonlinear
    (a log-sum-exp over the sharded vocabulary), has several outputs and an integer input,
    and its backward is local arithmetic on the saved softmax shard with no communication
    at all (the replicated objective makes the incoming gradient the same on every rank):
    there is no transpose to state. Its two forward all_reduces call the raw collective
    (the public function validated its arguments once).
    """

    spmd = Rule(
        {V: R},
        out_grad=REPLICATED,
        outputs=(R, V, V, V, V),
        backward="local: the loss gradient must be replicated",
        refuse={R: "the logits must be this rank's vocabulary shard", P: "reduce the logits first"},
    )

    @staticmethod
    def forward(
        logits: Tensor,
        target: Tensor,
        ignore_index: int,
        smoothing: float,
        pg: PG,
        debug: bool,
        top: int,
        vocab_size: int | None,
        anchor: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        v_local = logits.shape[-1]
        z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        # the max runs before the shard sizes are known: with padding, guess the even layout
        # (the usual reason to pad), exact then; an uneven padded layout redoes it below
        guess = _real_columns(rank_start(pg, v_local, z.device), v_local, vocab_size, z.device)
        m, sizes = _shard_sizes(_local_max(z, guess), v_local, pg)
        sizes_host = [int(s) for s in sizes.tolist()]  # (one host read, as the target check's)
        total = sum(sizes_host)
        if vocab_size is not None and vocab_size > total:
            raise A.arg_error(
                _OP,
                "vocab_size",
                f"at most the classes the shards hold ({total} = {' + '.join(map(str, sizes_host))})",
                vocab_size,
            )
        vocab = total if vocab_size is None else vocab_size
        if top >= vocab:
            raise A.arg_error(
                _OP, "target", f"class ids in [0, {vocab}) or ignore_index={ignore_index}", f"id {top}"
            )
        start = _own_start(sizes, sizes_host, pg)
        real = _real_columns(start, v_local, vocab_size, z.device)
        if vocab_size is not None and _guess_missed(sizes_host, vocab_size):
            # the guessed real columns were not this layout's on some rank (uneven shards
            # with padding): the max again, over the real ones (the same verdict on every
            # rank: the sizes are)
            with B.label(f"{_OP} (max, uneven padded)"):
                m = collectives.raw_all_reduce(_local_max(z, real), "max", pg)
        shifted = z - m.unsqueeze(-1)
        e = shifted.exp()
        if isinstance(real, Tensor):
            e.masked_fill_(~real, 0.0)
        elif real is not None:
            e[..., real:] = 0.0
        here = (target >= start) & (target < start + v_local)
        local_t = (target - start).masked_fill(~here, 0)
        t_logit = _target_logit(shifted, local_t, here)
        parts = [e.sum(-1), t_logit]
        if smoothing > 0.0:
            parts.append(_real_sum(shifted, real))
        with B.label(f"{_OP} (sums)"):
            stats = collectives.raw_all_reduce(torch.stack(parts, dim=-1), "sum", pg)
        lse = stats[..., 0].log()
        loss = lse - stats[..., 1]
        if smoothing > 0.0:
            loss = (1.0 - smoothing) * loss + smoothing * (lse - stats[..., 2] / vocab)
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0).to(logits.dtype)
        p = e.div_(stats[..., 0:1])
        if smoothing > 0.0:
            if isinstance(real, Tensor):
                p.sub_(real.to(p.dtype) * (smoothing / vocab))
            else:
                (p if real is None else p[..., :real]).sub_(smoothing / vocab)
        return loss, p, local_t, here, valid

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        logits, _, _, smoothing, pg, debug, _, _, anchor = inputs
        _, p, local_t, here, valid = output
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(p, local_t, here, valid, anchor)
        ctx.save_for_forward(p, local_t, here, valid, anchor)
        ctx.smoothing, ctx.pg, ctx.debug = smoothing, pg, debug
        ctx.dtype = logits.dtype

    @staticmethod
    def _dloss_dlogits(ctx: Any, p: Tensor, local_t: Tensor, here: Tensor) -> Tensor:
        """``d loss_token / d z_j = softmax_j - (1 - eps) [j == target] - eps / V`` (this
        shard; 0 on padding): ``p`` (the forward's ``softmax - eps / V``) and the target's term."""
        n = p.shape[-1]
        if isinstance(n, int) and n == 0:  # an empty shard
            return p.clone()
        # (as in ``_local_max``: under LocalTensorMode with sizes differing per rank, a
        # column to index, cut off after)
        grad = p.clone() if isinstance(n, int) else F.pad(p, (0, 1))
        grad.scatter_add_(
            -1, local_t.unsqueeze(-1), (-(1.0 - ctx.smoothing) * here.to(grad.dtype)).unsqueeze(-1)
        )
        return grad if isinstance(n, int) else grad.narrow(-1, 0, n)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        """A batch of losses is one loss over more tokens: the batch dim of the logits and
        the target first (the class dim stays last), one call (the same two all_reduces,
        over the whole batch); the anchor is not needed below the transform."""

        def first(t: Tensor, d: int | None) -> Tensor:
            return t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)

        logits, target = (first(t, d) for t, d in zip(args[:2], in_dims[:2], strict=True))
        return _VocabParallelCrossEntropy.apply(logits, target, *args[2:8]), (0, 0, 0, 0, 0)

    @staticmethod
    @first_order(_OP, anchor=lambda ctx: ctx.saved_tensors[4])
    def backward(ctx: Any, g_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        if ctx.debug or _config.DEBUG.get():
            check_replicated(
                g_loss,
                f"{_OP} backward",
                "the gradient of the per-token loss",
                "The vocab-parallel loss is replicated (the same on every rank), so it must be "
                "consumed identically on every rank (replicated objective).",
                ctx.pg,
            )
        p, local_t, here, valid, _anchor = ctx.saved_tensors
        grad = _VocabParallelCrossEntropy._dloss_dlogits(ctx, p, local_t, here)
        # an ignored token's gradient is 0 whatever reaches it (``where``, not a product: a
        # mean over no counted token sends it inf, and torch's gradient there is 0, not NaN)
        scale = torch.where(valid, g_loss.to(grad.dtype), 0.0).unsqueeze(-1)
        grad = grad * scale if _torch.transforms_active() else grad.mul_(scale)  # (vmap: out of place)
        return grad.to(ctx.dtype), *(None,) * 8

    @staticmethod
    def jvp(ctx: Any, t_logits: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        p, local_t, here, valid, _anchor = ctx.saved_tensors
        grad = _VocabParallelCrossEntropy._dloss_dlogits(ctx, p, local_t, here)
        partial = (grad * t_logits.to(grad.dtype)).sum(-1)
        with B.label(f"{_OP} jvp"):
            t_loss = collectives.all_reduce(partial, "sum", ctx.pg)
        return (t_loss * valid).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    vocab_size: int | None = None,
    group: A.GroupLike = None,
) -> Tensor:
    """Cross entropy of logits sharded along the vocabulary, as ``F.cross_entropy``.

    The shards are contiguous in rank order, of any sizes (the layout of ``dc.all_gather``
    / ``dc.scatter`` with ``split_sizes``): rank ``r`` holds the classes ``[s_r, s_r + v_r)``
    with ``v_r = logits.shape[-1]`` on rank ``r`` and ``s_r = v_0 + ... + v_{r-1}``, e.g. a
    ColumnParallelLinear LM head without ``gather_output`` (even shards: ``[r*v, (r+1)*v)``),
    or a head cut with ``torch.tensor_split`` (uneven; a shard may be empty). Each rank
    learns every shard size inside the max all_reduce the loss needs anyway.
    Numerically stable (global max subtracted, log-sum-exp in at least float32); the forward
    communicates two small all_reduces per call (the max with the shard sizes, then the
    stacked sums over ``B*S`` tokens), never the logits; a third (the max again) only for
    uneven shards with ``vocab_size`` padding. The gradient is computed from the saved
    softmax shard, without any communication.

    Args:
        logits: ``(*, v_r)`` floating, this rank's vocabulary shard (the class dim is the
            last one, unlike ``F.cross_entropy``'s dim 1); ``*`` the same on every rank.
        target: ``(*)`` integer class ids in ``[0, V)`` or ``ignore_index``, the same on
            every rank.
        ignore_index: targets equal to it contribute zero loss and gradient and are not
            counted by ``"mean"``.
        label_smoothing: ``eps`` in ``[0, 1]``: the target distribution is
            ``(1 - eps) * onehot + eps / V`` over the full vocabulary ``V``.
        reduction: ``"mean"`` (over non-ignored tokens; NaN if all are ignored, as
            ``F.cross_entropy``), ``"sum"`` or ``"none"``.
        vocab_size: the true vocabulary size ``V`` when the shards end in padding columns
            (a vocabulary padded to a multiple of the group size): the classes
            ``[vocab_size, v_0 + ... + v_{n-1})`` are left out of the softmax and the
            smoothing, and their logits get zero gradient. ``None`` (default): every column
            is a class, ``V = v_0 + ... + v_{n-1}``.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        The loss, equal on every rank: a scalar, or ``(*)`` with ``reduction="none"``;
        dtype of ``logits`` (float32 for half-precision logits under ``torch.autocast``,
        as ``F.cross_entropy``'s there).

    Raises:
        ValueError: a target outside ``[0, V)`` (not ``ignore_index``), or a ``vocab_size``
            above the classes the shards hold. Always checked (it reads the target's
            smallest and largest ids on the host, one sync per call, and the shard sizes
            after the max all_reduce): before any communication where one rank can tell
            (a negative id; any id with ``vocab_size``), else right after the first
            all_reduce, on every rank alike.

    Gradient:
        replicated objective: ``dL/dz_j = g * (softmax_j - (1-eps) [j == t] - eps / V)``
        for this rank's classes ``j`` (0 for padding); no communication. Debug mode checks
        that the incoming loss gradient is equal on every rank. Once differentiable (double
        backward raises, under ``torch.func`` too); forward mode (``torch.func.jvp``),
        ``torch.func.grad``, ``vmap`` and ``vmap(grad)`` work.

    Example::

        def f():
            full = torch.arange(8.0).reshape(2, 4)          # 2 tokens, vocabulary 4
            shard = full[:, 2 * dc.get_rank() : 2 * dc.get_rank() + 2]
            return parallel.vocab_parallel_cross_entropy(shard, torch.tensor([1, 3]))
        with dc.LocalWorld(2) as world:
            world.run(f)   # both: F.cross_entropy(full, torch.tensor([1, 3]))
    """
    logits = A.check_tensor(logits, _OP, "logits")
    target = A.check_tensor(target, _OP, "target")
    if not logits.is_floating_point():
        raise A.arg_error(_OP, "logits", "a floating-point tensor", str(logits.dtype), TypeError)
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise A.arg_error(_OP, "target", "an integer tensor of class ids", str(target.dtype), TypeError)
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise A.arg_error(
            _OP,
            "target",
            f"of shape logits.shape[:-1] = {tuple(logits.shape[:-1])}",
            f"shape {tuple(target.shape)}",
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, int | float):
        raise A.arg_error(_OP, "label_smoothing", "a float in [0, 1]", repr(label_smoothing), TypeError)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise A.arg_error(_OP, "label_smoothing", "a float in [0, 1]", label_smoothing)
    if reduction not in _REDUCTIONS:
        raise A.arg_error(_OP, "reduction", f"one of {_REDUCTIONS}", repr(reduction))
    ignore_index = A.check_int(ignore_index, _OP, "ignore_index")
    if vocab_size is not None:
        vocab_size = A.check_int(vocab_size, _OP, "vocab_size")
        if vocab_size < 1:
            raise A.arg_error(
                _OP, "vocab_size", "a positive int (the true vocabulary size) or None", vocab_size
            )
    pg = A.resolve_group(group, _OP)
    top = _check_target(target, ignore_index, vocab_size)
    debug = bool(_config.DEBUG.get())
    if debug:
        B.get_backend().check_consistent(
            _OP,
            {"tokens_shape": tuple(logits.shape[:-1]), "dtype": logits.dtype, "vocab_size": vocab_size},
            pg,
        )
        check_replicated(
            target,
            f"{_OP} forward",
            "the target",
            "Every rank of the tensor-parallel group must pass the same target ids.",
            pg,
        )
    if logits.dtype in (torch.float16, torch.bfloat16) and autocast_dtype(logits) is not None:
        # autocast runs torch's cross entropy in float32 (log_softmax, nll_loss: its float32
        # list), so the serial loss is float32: the same here, and the gradient returns to
        # the logits' dtype through the cast, as the serial one does
        logits = logits.float()
    # under a torch.func transform the first-order marker of the backward hangs on a scalar
    # that depends on the logits (parallel/_once.py), computed only then
    anchor = logits.sum() * 0 if _torch.transforms_active() else None
    loss = _VocabParallelCrossEntropy.apply(
        logits, target, ignore_index, float(label_smoothing), pg, debug, top, vocab_size, anchor
    )[0]
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(loss.dtype)


def _check_target(target: Tensor, ignore_index: int, vocab_size: int | None) -> int:
    """The largest class id of ``target`` (-1 if none), after refusing what one rank can
    tell is out of range (a negative id; with ``vocab_size``, any id >= it): one host read.
    The full vocabulary, hence the upper bound without ``vocab_size``, is known only after
    the shard sizes are exchanged (the forward checks it there)."""
    # under vmap the ids' values are every batch entry's (their unwrapped tensor)
    ids = _torch.functorch_unwrapped(target) if _torch.transforms_active() else target
    counted = ids != ignore_index
    if ids.numel() == 0:
        return -1
    low, top = (
        int(v)
        for v in torch.stack(
            [ids.masked_fill(~counted, 0).min(), ids.masked_fill(~counted, -1).max()]
        ).tolist()
    )
    if low >= 0 and (vocab_size is None or top < vocab_size):
        return top
    bad = counted & ((ids < 0) | (ids >= (vocab_size if vocab_size is not None else top + 1)))
    first = ids[bad].reshape(-1)[0].item()
    where = "[0, V)" if vocab_size is None else f"[0, {vocab_size})"
    raise A.arg_error(_OP, "target", f"class ids in {where} or ignore_index={ignore_index}", f"id {first}")
