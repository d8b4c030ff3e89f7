"""Cross entropy over vocabulary-sharded logits, without gathering the full logits."""

from __future__ import annotations

from typing import Any

import torch
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from a vocabulary shard; saves the softmax shard for backward.

    Outputs: ``(loss, softmax_shard, local_target, target_here, valid)``; only the loss is
    differentiable, the others are what backward and jvp need.

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
        anchor: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        backend = B.get_backend()
        world = backend.world_size(pg)
        v_local = logits.shape[-1]
        vocab = v_local * world
        start = rank_start(pg, v_local, logits.device)  # (a tensor under LocalTensorMode)
        z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        with B.label(f"{_OP} (max)"):
            m = collectives.raw_all_reduce(z.amax(dim=-1), "max", pg)
        shifted = z - m.unsqueeze(-1)
        e = shifted.exp()
        here = (target >= start) & (target < start + v_local)
        local_t = (target - start).masked_fill(~here, 0)
        t_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        parts = [e.sum(-1), t_logit]
        if smoothing > 0.0:
            parts.append(shifted.sum(-1))
        with B.label(f"{_OP} (sums)"):
            stats = collectives.raw_all_reduce(torch.stack(parts, dim=-1), "sum", pg)
        lse = stats[..., 0].log()
        loss = lse - stats[..., 1]
        if smoothing > 0.0:
            loss = (1.0 - smoothing) * loss + smoothing * (lse - stats[..., 2] / vocab)
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0).to(logits.dtype)
        softmax = e.div_(stats[..., 0:1])
        return loss, softmax, local_t, here, valid

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        logits, _, _, smoothing, pg, debug, anchor = inputs
        _, softmax, local_t, here, valid = output
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(softmax, local_t, here, valid, anchor)
        ctx.save_for_forward(softmax, local_t, here, valid, anchor)
        ctx.smoothing, ctx.pg, ctx.debug = smoothing, pg, debug
        ctx.vocab = logits.shape[-1] * B.get_backend().world_size(pg)
        ctx.dtype = logits.dtype

    @staticmethod
    def _dloss_dlogits(ctx: Any, softmax: Tensor, local_t: Tensor, here: Tensor) -> Tensor:
        """``d loss_token / d z_j = p_j - (1 - eps) [j == target] - eps / V`` (this shard)."""
        grad = softmax.clone()
        grad.scatter_add_(
            -1, local_t.unsqueeze(-1), (-(1.0 - ctx.smoothing) * here.to(grad.dtype)).unsqueeze(-1)
        )
        if ctx.smoothing > 0.0:
            grad.sub_(ctx.smoothing / ctx.vocab)
        return grad

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        """A batch of losses is one loss over more tokens: the batch dim of the logits and
        the target first (the class dim stays last), one call (the same two all_reduces,
        over the whole batch); the anchor is not needed below the transform."""

        def first(t: Tensor, d: int | None) -> Tensor:
            return t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)

        logits, target = (first(t, d) for t, d in zip(args[:2], in_dims[:2], strict=True))
        return _VocabParallelCrossEntropy.apply(logits, target, *args[2:6]), (0, 0, 0, 0, 0)

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
        softmax, local_t, here, valid, _anchor = ctx.saved_tensors
        grad = _VocabParallelCrossEntropy._dloss_dlogits(ctx, softmax, local_t, here)
        # an ignored token's gradient is 0 whatever reaches it (``where``, not a product: a
        # mean over no counted token sends it inf, and torch's gradient there is 0, not NaN)
        scale = torch.where(valid, g_loss.to(grad.dtype), 0.0).unsqueeze(-1)
        grad = grad * scale if _torch.transforms_active() else grad.mul_(scale)  # (vmap: out of place)
        return grad.to(ctx.dtype), None, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t_logits: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        softmax, local_t, here, valid, _anchor = ctx.saved_tensors
        grad = _VocabParallelCrossEntropy._dloss_dlogits(ctx, softmax, local_t, here)
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
    group: A.GroupLike = None,
) -> Tensor:
    """Cross entropy of logits sharded along the vocabulary, as ``F.cross_entropy``.

    Rank ``r`` holds the logits of classes ``[r*v, (r+1)*v)`` (``v = logits.shape[-1]``,
    e.g. a ColumnParallelLinear LM head without ``gather_output``). Numerically stable
    (global max subtracted, log-sum-exp in at least float32); the forward communicates two
    small all_reduces per call (the max, then the stacked sums over ``B*S`` tokens), never
    the logits. The gradient is computed from the saved softmax shard, without any
    communication.

    Args:
        logits: ``(*, v)`` floating, this rank's vocabulary shard (the class dim is the
            last one, unlike ``F.cross_entropy``'s dim 1).
        target: ``(*)`` integer class ids in ``[0, v * world)`` or ``ignore_index``, the
            same on every rank.
        ignore_index: targets equal to it contribute zero loss and gradient and are not
            counted by ``"mean"``.
        label_smoothing: ``eps`` in ``[0, 1]``: the target distribution is
            ``(1 - eps) * onehot + eps / V`` over the full vocabulary ``V``.
        reduction: ``"mean"`` (over non-ignored tokens; NaN if all are ignored, as
            ``F.cross_entropy``), ``"sum"`` or ``"none"``.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.

    Returns:
        The loss, equal on every rank: a scalar, or ``(*)`` with ``reduction="none"``;
        dtype of ``logits`` (float32 for half-precision logits under ``torch.autocast``,
        as ``F.cross_entropy``'s there).

    Gradient:
        replicated objective: ``dL/dz_j = g * (softmax_j - (1-eps) [j == t] - eps / V)``
        for this rank's classes ``j``; no communication. Debug mode checks that the
        incoming loss gradient is equal on every rank. Once differentiable (double
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
    pg = A.resolve_group(group, _OP)
    vocab = logits.shape[-1] * B.get_backend().world_size(pg)
    # under vmap the ids' values are every batch entry's (their unwrapped tensor)
    ids = _torch.functorch_unwrapped(target) if _torch.transforms_active() else target
    bad = (ids != ignore_index) & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        first = ids[bad].reshape(-1)[0].item()
        raise A.arg_error(
            _OP, "target", f"class ids in [0, {vocab}) or ignore_index={ignore_index}", f"id {first}"
        )
    debug = bool(_config.DEBUG.get())
    if debug:
        B.get_backend().check_consistent(
            _OP, {"logits_shape": tuple(logits.shape), "dtype": logits.dtype}, pg
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
        logits, target, ignore_index, float(label_smoothing), pg, debug, anchor
    )[0]
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(loss.dtype)
