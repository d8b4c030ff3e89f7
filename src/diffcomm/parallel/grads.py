"""Before the optimizer step of a parallel model: the serial model's gradient norm,
clipping by it, and a ``GradScaler``'s skip decision taken alike on every rank.

``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel model sees only this rank's
shards: the norm it computes is no rank's serial norm, each rank computes a different one,
and so each rank scales its **replicated** parameters (a row-parallel bias, a layer norm,
an expert-parallel router) by a different factor — their replicas silently drift apart.
:func:`grad_norm` and :func:`clip_grad_norm_` read each parameter's layout from the layers
themselves (the facts ``serial_slices()`` and the replication typing rest on: a
:class:`~diffcomm.parallel.ParallelModule`'s ``_shard_dims``, a layer's ``spmd`` rule),
sum the sharded parameters' part over the group (one scalar all_reduce) and count every
replicated parameter once: the serial model's norm, the same on every rank.

``torch.amp.GradScaler`` decides per rank too: an overflow in one rank's gradient shard
makes that rank skip the step and halve its scale while the others step —
:func:`sync_found_inf` makes the decision the serial model's (skip if any rank overflowed).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _config, _torch
from .. import backend as B
from .._replication import LayerRule, V
from ..backend import args as A
from ..ops import collectives
from ._check import check_replicated
from ._seams import ranks_of

__all__ = ["grad_norm", "clip_grad_norm_", "sync_found_inf"]

#: why a replicated parameter's gradient must be equal on every rank (debug mode's check)
_REPLICATED_HINT = (
    "A replicated parameter's gradient must be equal on every rank before its norm is taken "
    "(it is counted once). An ExpertParallelMoE's router and shared expert hold each rank's "
    "share until sync_replicated_grads() sums them: call it before the norm. A plain module "
    "fed each rank's own chunk (a sequence shard) gets a partial gradient: use the parallel "
    "layer (e.g. SequenceParallelLayerNorm) or sum the gradient over the group first."
)


def _same_group(a: Any, b: Any) -> bool:
    world = dist.group.WORLD
    return (world if a is None else a) is (world if b is None else b)


def _layout(op: str, module: Any, group: Any) -> tuple[Any, list[nn.Parameter], list[nn.Parameter]]:
    """``(group, sharded, replicated)`` of ``module``'s parameters, no communication.

    Each parameter's layout is decided by the innermost layer that states one (a
    ``_shard_dims`` entry that is not ``None``, or the ``V`` of its ``spmd`` rule's
    ``params``: a part that differs by rank — a shard, an expert — summed over the layer's
    group); the parameters no layer declares sharded are replicated (counted once).

    Raises:
        TypeError: ``module`` is no ``nn.Module`` (a parameter list does not say which
            parameters are shards).
        ValueError: layers over different groups, or a layer's group is not ``group``.
    """
    if not isinstance(module, nn.Module):
        raise A.arg_error(
            op,
            "module",
            "the model, an nn.Module (a list of parameters does not say which are shards: pass "
            "the module whose layers hold them, e.g. `model` instead of `model.parameters()`)",
            type(module).__name__,
            TypeError,
        )
    pg = A.resolve_group(group, op) if group is not None else None
    owner: dict[int, tuple[bool, Any, str]] = {}  # id(param) -> (varying, group, layer)
    # (layer, group) of every layer deciding a sharded parameter (the group a replica's
    # layer names does not matter: it is counted once; a container's may be unset)
    layers: list[tuple[str, Any]] = []
    params = dict(module.named_parameters())
    for prefix, m in reversed(list(module.named_modules())):  # the innermost layer decides
        rule = getattr(type(m), "spmd", None)
        if not isinstance(rule, LayerRule) and not hasattr(m, "_shard_dims"):
            continue
        m_pg = rule.group(m) if isinstance(rule, LayerRule) else getattr(m, "_pg", None)
        declared = rule.params(m) if isinstance(rule, LayerRule) and rule.params is not None else {}
        dims = getattr(m, "_shard_dims", None) or {}
        name = prefix or type(m).__name__
        decided = False
        for pname, p in m.named_parameters():
            varying = declared.get(pname) is V or dims.get(pname) is not None
            inner = owner.get(id(p))
            if inner is None:
                owner[id(p)] = (varying, m_pg, name)
                decided = decided or varying
            elif varying and not (inner[0] and _same_group(inner[1], m_pg)):
                raise A.arg_error(
                    op,
                    "module",
                    "a model whose parameters are each split over one group",
                    f"`{prefix + '.' if prefix else ''}{pname}` split by `{inner[2]}` and again by "
                    f"`{name}` over another "
                    "group (nested parallel layers; sum their norms by hand)",
                )
        if decided:
            layers.append((name, m_pg))
    if group is not None:
        wrong = [(n, g) for n, g in layers if not _same_group(g, pg)]
        if wrong:
            raise A.arg_error(
                op, "group", f"the group of every parallel layer in `module` ({wrong[0][0]}'s)", group
            )
    elif layers:
        pg = layers[0][1]
        wrong = [(n, g) for n, g in layers if not _same_group(g, pg)]
        if wrong:
            raise A.arg_error(
                op,
                "module",
                "a model whose parallel layers share one group",
                f"`{layers[0][0]}` and `{wrong[0][0]}` over different groups",
            )
    sharded = [p for p in params.values() if owner.get(id(p), (False,))[0]]
    replicated = [p for p in params.values() if not owner.get(id(p), (False,))[0]]
    return pg, sharded, replicated


def _tied_counted_elsewhere(module: nn.Module) -> set[int]:
    """``id`` of every parameter of ``module`` that :func:`diffcomm.pipeline.partition`
    recorded as used by several stages (``partition_ties``: ``(tie, stages, name)``) and
    that this rank does not count: after ``PipelineRunner.step`` every copy of it holds its
    whole gradient, counted once, by the copy in the chunk at ``stages[0]`` (on the rank
    holding that stage; the chunks in ``module``, by their ``partition_position``). A copy
    in another chunk is the same parameter (counted by ``parameters()`` once), or one the
    chunks were copied apart into (``copy.deepcopy`` of each chunk): not counted again.
    (Read off the chunks' attributes: this layer does not import the pipeline.)"""
    tied: set[int] = set()
    counted: set[int] = set()
    for m in module.modules():
        if "partition_ties" not in m.__dict__:
            continue
        pos = m.__dict__.get("partition_position")
        for _, stages, name in m.__dict__["partition_ties"]:
            key = id(m.get_parameter(name))
            tied.add(key)
            if pos is not None and pos[0] == stages[0]:
                counted.add(key)
    return tied - counted


def _check_whole_pipeline(op: str, module: nn.Module) -> None:
    """Raise ``ValueError`` when ``module`` holds some, not all, stages cut by
    :func:`diffcomm.pipeline.partition` (``partition_position``: ``(s, n_stages)``) and no
    ``pipeline_group`` was given: its norm is one stage's, not the model's, and clipping by
    it scales each stage by its own factor (no communication; alike on every stage)."""
    held: dict[int, set[int]] = {}
    for m in module.modules():
        pos = m.__dict__.get("partition_position")
        if pos is not None:
            held.setdefault(pos[1], set()).add(pos[0])
    for n, stages in held.items():
        if stages != set(range(n)):
            raise A.arg_error(
                op,
                "pipeline_group",
                "the group over the pipeline's stages (e.g. (mesh, 'pp')) for a pipeline stage "
                "(the whole model's norm; for this stage's own, torch.nn.utils.get_total_norm)",
                f"None for partition's stage(s) {sorted(stages)} of {n}",
            )


def _wide(device: torch.device) -> torch.dtype:
    """The dtype the stages' parts of a norm are summed in: float64 (exact for every
    floating dtype's part), float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _local(g: Tensor) -> Tensor:
    """This rank's part of a gradient: a ``DTensor``'s (FSDP2's ``fully_shard`` over a
    data-parallel mesh axis holds each gradient as one) local shard, which in-place ops
    on it write through (under ``no_grad``); a plain tensor itself."""
    return cast(Any, g).to_local() if A.is_dtensor(g) else g


def _whole(n: Tensor) -> Tensor:
    """A per-parameter norm as a plain tensor: a ``DTensor`` gradient's norm is a
    ``DTensor`` over its mesh (torch reduces its shards' parts), the same on every rank
    of that mesh; its value is the norm of the whole gradient."""
    return cast(Any, n).full_tensor() if A.is_dtensor(n) else n


def _norm_type(op: str, norm_type: Any) -> float:
    """``norm_type`` as torch reads it (``float(norm_type)``: ``"inf"`` too), positive."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = None
    if p is None or isinstance(norm_type, bool):
        raise A.arg_error(op, "norm_type", "a positive float or inf", repr(norm_type), TypeError)
    if not p > 0:
        raise A.arg_error(op, "norm_type", "a positive float or inf", norm_type)
    return p


def _check_dtensor_meshes(op: str, module: nn.Module, sharded: list[nn.Parameter], pg: Any) -> None:
    """Raise ``ValueError`` when a sharded parameter's gradient is a ``DTensor`` (FSDP2's
    ``fully_shard``) over a mesh holding two ranks of the layers' group: FSDP2 over ranks
    with different shards assembled each weight from different ranks' shards in every
    forward (a wrong model; diffcomm's layers only see the assembled plain tensor). No
    communication."""
    found = [p for p in sharded if p.grad is not None and A.is_dtensor(p.grad)]
    if not found:
        return
    mine = ranks_of(pg)
    names = {id(p): n for n, p in module.named_parameters()}
    for p in found:
        mesh = set(cast(Any, p.grad).device_mesh.mesh.flatten().tolist())
        both = sorted(mine & mesh)
        if len(both) > 1:
            raise A.arg_error(
                op,
                "module",
                "a model sharded by FSDP2 over the data-parallel axis only (one rank of each "
                "tensor-parallel group: fully_shard(model, mesh=mesh['dp']))",
                f"`{names.get(id(p), '?')}`, this rank's shard over the ranks {sorted(mine)}, with a "
                f"gradient over the FSDP mesh of ranks {sorted(mesh)}, which include {both}: FSDP "
                "assembled each weight from different ranks' shards",
            )


@torch.no_grad()
def _total_norm(op: str, module: Any, norm_type: Any, group: Any, pipeline_group: Any) -> Tensor:
    p_norm = _norm_type(op, norm_type)
    pg, sharded, replicated = _layout(op, module, group)
    if pipeline_group is None:
        _check_whole_pipeline(op, module)
    stages = None
    if pipeline_group is not None:
        stages = A.resolve_group(pipeline_group, op)
        if sharded and _same_group(stages, pg):
            raise A.arg_error(
                op,
                "pipeline_group",
                "the group over the pipeline's stages, not the layers' own (their shards are "
                "summed over that one already; summed twice, they would count twice)",
                pipeline_group,
            )
        # a weight tied across stages (pipeline.partition's ties): the runner left the
        # whole gradient on every rank holding it; counted by the one with its first stage
        elsewhere = _tied_counted_elsewhere(module)
        sharded = [p for p in sharded if id(p) not in elsewhere]
        replicated = [p for p in replicated if id(p) not in elsewhere]
    _check_dtensor_meshes(op, module, sharded, pg)
    grads = [[p.grad for p in ps if p.grad is not None] for ps in (sharded, replicated)]
    # the dtype of every gradient here, the tied ones counted elsewhere too (a stage whose
    # only parameter is one: its zero part in its dtype, as the rank counting it)
    every = [p.grad for p in module.parameters() if p.grad is not None]
    dtype = every[0].dtype if every else torch.get_default_dtype()
    for g in every[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    device = every[0].device if every else torch.device("cpu")
    if stages is not None and not every:
        # a stage without gradients (no parameters, or frozen) knows neither the other
        # stages' dtype nor their device: its zero part goes to the sum below in the
        # stages' common dtype, on the group's device, and it returns that sum (it computed
        # float32 zeros on the CPU: gloo aborted the process, a float32 among float64s;
        # in one process it returned a float32 norm)
        device = B.get_backend().comm_device(stages)
        dtype = _wide(device)
    # (with pipeline_group and no layers' group, the replicated parameters are this stage's
    # own: replicas over no group; compared over the world, every pipeline failed the check)
    replicas_over = stages is None or (pg is not None and not _same_group(pg, stages))
    if grads[1] and _config.DEBUG.get() and replicas_over:
        flat = torch.cat([_local(g).detach().reshape(-1).to(torch.float64) for g in grads[1]])
        check_replicated(flat, op, "the replicated parameters' gradients", _REPLICATED_HINT, pg)
    inf = math.isinf(p_norm)
    # the parts are raised to p, summed and communicated in float64 (float32 on MPS), as
    # torch's vector_norm accumulates a half-precision norm in float32: in float16 the
    # squares of a norm above 256 overflowed (inf for the serial 312.75, clipping every
    # gradient to 0); the result in the gradients' dtype, as torch's
    wide = _wide(device)

    def part(gs: list[Tensor]) -> Tensor:
        norms = [_whole(torch.linalg.vector_norm(g, p_norm)).to(dtype=wide, device=device) for g in gs]
        if not norms:
            return torch.zeros((), dtype=wide, device=device)
        stacked = torch.stack(norms)
        return stacked.max() if inf else stacked.pow(p_norm).sum()

    total_sharded, total_replicated = part(grads[0]), part(grads[1])
    if sharded:  # (the layout is the same on every rank: all of them communicate, or none)
        total_sharded = _reduce_parts(op, total_sharded, inf, pg)
    total = torch.maximum(total_sharded, total_replicated) if inf else total_sharded + total_replicated
    if stages is not None:  # every stage's part: the whole model's (each stage holds its own)
        total = _reduce_parts(op, total, inf, stages)
    return (total if inf else total.pow(1.0 / p_norm)).to(dtype)


def _reduce_parts(op: str, part: Tensor, inf: bool, group: Any) -> Tensor:
    """The sum (``inf``: the maximum) of every rank's 0-dim ``part`` over ``group``, nan
    when any rank's is nan, as torch's ``max`` of the serial model's norms (the backend's
    max keeps a NaN from any rank: ``Capabilities.nan_extrema``). One all_reduce."""
    with B.label(op):
        return collectives.all_reduce(part, "max" if inf else "sum", group)


def grad_norm(
    module: nn.Module,
    norm_type: float = 2.0,
    group: A.GroupLike = None,
    *,
    pipeline_group: A.GroupLike = None,
) -> Tensor:
    """The norm of the serial model's gradient, from a parallel model's shards.

    What ``torch.nn.utils.get_total_norm`` of the serial model's gradients would return:
    every sharded parameter's (a ``_shard_dims`` shard, an expert) part summed over the
    group, every replicated one's (a row-parallel bias, a layer norm, a router) counted
    once. Call it on every rank of the group: one scalar all_reduce (none when the model
    holds no sharded parameter). Parameters without a gradient are skipped, as by torch.

    Args:
        module: the model (an ``nn.Module``, e.g. a :class:`ParallelMLP`, a model made of
            parallel layers, an :class:`ExpertParallelMoE`, or one of them wrapped in
            ``DistributedDataParallel`` or sharded by FSDP2's ``fully_shard`` over another
            mesh axis: a ``DTensor`` gradient's norm is its whole tensor's, torch reducing
            over its mesh). Parameters of plain modules are replicas.
        norm_type: ``p`` of the p-norm, a positive float or ``inf`` (or ``"inf"``, as torch).
        group: ``None`` (the group of the model's parallel layers) or that group; a layer
            over another group is a ``ValueError`` (before any communication).
        pipeline_group: with pipeline parallelism, ``module`` is this rank's stage and the
            model's norm takes every stage's part: the group over the stages (one rank per
            stage, e.g. a mesh's ``pp`` axis), over which the stage's part is summed (one
            more scalar all_reduce). ``None``: ``module`` is the whole model. Without it,
            each stage would clip by its own norm, no serial clipping. A weight tied
            between stages (recorded by :func:`diffcomm.pipeline.partition`, whose
            ``PipelineRunner`` leaves its whole gradient on every rank holding it) is
            counted once, by the rank holding its first stage.

    Returns:
        0-dim tensor, the same on every rank, in the promoted dtype of the gradients.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (a parameter list does not say which
            parameters are shards); ``norm_type`` is not a number.
        ValueError: ``norm_type`` not positive; the model's layers over different groups, or
            not over ``group``; parallel layers nested over two groups; ``pipeline_group``
            the layers' own group.

    An :class:`ExpertParallelMoE`'s replicated parameters (router, shared expert) hold
    each rank's share of their gradient until ``sync_replicated_grads()``: call that first.
    Debug mode checks that the replicated parameters' gradients agree on every rank.

    Gradient:
        none (computed under ``torch.no_grad``).

    Example::

        def f():
            mlp = dc.parallel.ParallelMLP(8, 32, seed=0)
            mlp(torch.ones(5, 8)).sum().backward()
            return dc.parallel.grad_norm(mlp)
        with dc.LocalWorld(2) as world:
            world.run(f)   # equal on both ranks: the serial MLP's gradient norm
    """
    return _total_norm("parallel.grad_norm", module, norm_type, group, pipeline_group)


def clip_grad_norm_(
    module: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    group: A.GroupLike = None,
    error_if_nonfinite: bool = False,
    *,
    pipeline_group: A.GroupLike = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the serial model, on a parallel model.

    Scales every gradient of ``module`` in place by ``min(1, max_norm / (total + 1e-6))``,
    ``total`` being :func:`grad_norm` — the serial model's norm — so every rank scales by
    the same factor the serial clipping does, and replicated parameters stay replicas.

    Args:
        module: the model, as :func:`grad_norm`.
        max_norm: the largest norm allowed.
        norm_type: as :func:`grad_norm`.
        group: as :func:`grad_norm`.
        pipeline_group: as :func:`grad_norm`.
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is nan or inf (on
            every rank alike: the norm is the same everywhere).

    Returns:
        The total norm before clipping (0-dim, the same on every rank), as torch's.

    Raises:
        as :func:`grad_norm`; ``TypeError`` for a ``max_norm`` that is not a number.

    Gradient:
        none (modifies ``.grad`` in place, under ``torch.no_grad``).

    Example::

        def f():
            mlp = dc.parallel.ParallelMLP(8, 32, seed=0)
            mlp(torch.ones(5, 8)).sum().backward()
            return dc.parallel.clip_grad_norm_(mlp, 0.5)
        with dc.LocalWorld(2) as world:
            world.run(f)   # the serial norm on both ranks; gradients clipped alike
    """
    op = "parallel.clip_grad_norm_"
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | Tensor):
        raise A.arg_error(op, "max_norm", "a float", repr(max_norm), TypeError)
    total = _total_norm(op, module, norm_type, group, pipeline_group)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"diffcomm.{op}(): the total norm of order {float(norm_type)} of the gradients is "
            f"{float(total)}; pass error_if_nonfinite=False to clip anyway"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                _local(p.grad).mul_(coef.to(p.grad.device))
    return total


def sync_found_inf(scaler: Any, optimizer: torch.optim.Optimizer, group: A.GroupLike = None) -> bool:
    """Make a ``torch.amp.GradScaler``'s skip decision the same on every rank.

    ``scaler.unscale_(optimizer)`` checks this rank's gradients for inf/nan only; on a
    parallel model an overflow in one rank's shard makes that rank skip the step (and lower
    its scale) while the others step: the replicated parameters and the scales silently
    drift apart. Called after ``unscale_`` and before ``scaler.step``, this takes the
    maximum of every rank's flag (one scalar all_reduce), so every rank skips when the
    serial model's gradient holds an inf or nan, and steps otherwise::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        dc.parallel.sync_found_inf(scaler, optimizer)      # (clip_grad_norm_ here if wanted)
        scaler.step(optimizer)
        scaler.update()

    Args:
        scaler: the ``torch.amp.GradScaler`` (a disabled one: nothing to do, no communication).
        optimizer: the optimizer ``scaler.unscale_`` was called with.
        group: the ranks whose decision must agree: ``None`` (the world: right for any
            mix of tensor, expert and data parallelism), or a ``ProcessGroup`` /
            ``(DeviceMesh, axis)``.

    Returns:
        Whether the step will be skipped (the same on every rank).

    Raises:
        TypeError: ``scaler`` is not a ``GradScaler``.
        ValueError: ``scaler.unscale_(optimizer)`` has not run since the last ``update()``
            (before any communication).

    Gradient:
        none.
    """
    op = "parallel.sync_found_inf"
    if not isinstance(scaler, torch.amp.GradScaler):
        raise A.arg_error(op, "scaler", "a torch.amp.GradScaler", type(scaler).__name__, TypeError)
    if not scaler.is_enabled():
        return False
    unscaled = _torch.grad_scaler_found_inf(scaler, optimizer)
    if unscaled is None:
        raise A.arg_error(
            op,
            "optimizer",
            "an optimizer scaler.unscale_() ran for since the last update() (call "
            "scaler.unscale_(optimizer) first)",
            type(optimizer).__name__,
        )
    pg = A.resolve_group(group, op)
    found, device = unscaled
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for v in found.values():
        flag = torch.maximum(flag, v.to(flag.device, torch.float32))
    with torch.no_grad(), B.label(op):
        flag = collectives.all_reduce(flag, "max", pg)
    if not found:  # a rank with no gradients: the flag still decides its step
        found[flag.device] = flag.clone()
    for v in found.values():
        v.copy_(flag)
    return bool(flag > 0)
