"""Where diffcomm's parallel layers meet the rest of torch's training stack: the checks
that turn a silent wrong model into an error (docs/parallel.md, "In a training stack").

- a sharded parameter replaced by a parametrization, ``weight_norm``/``spectral_norm``
  hooks or pruning (:func:`check_shards_plain`);
- torch's ``DistributedDataParallel`` over ranks holding different shards or experts
  (:func:`check_not_synced_by_ddp`);
- a step of torch's non-elementwise optimizers over a shard (a global optimizer step
  pre-hook, registered on import; shards noted by :func:`note_shards`).

None of them communicates. Private to :mod:`diffcomm.parallel`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._torch import active_ddp, run_eagerly_under_compile
from .._torch import compiling as _compiling


def _shard_dims(m: nn.Module) -> dict[str, int | None]:
    """A parallel layer's ``{parameter name: shard dim or None}`` (``ParallelModule``), or {}."""
    dims = getattr(m, "_shard_dims", None)
    return dims if isinstance(dims, dict) else {}


def check_shards_plain(root: nn.Module, op: str, *, note: bool = False) -> None:
    """Raise ``ValueError`` when a layer under ``root`` no longer holds one of its sharded
    parameters (or buffers) itself: ``torch.nn.utils.parametrize`` (``weight_norm``,
    ``spectral_norm``, ``orthogonal``, a user's parametrization), the older hook-based
    ``weight_norm`` / ``spectral_norm`` or ``torch.nn.utils.prune`` replaced it with a
    tensor computed from new parameters in every forward. That computation sees only this
    rank's shard: one that reduces over the split dimension (a norm over it, a largest
    singular value, an orthogonalisation, the smallest magnitudes) gives another weight
    than the serial model's, with no error; and the new parameters are not the serial
    ones this layer's bookkeeping knows (``serial_slices``, state dicts, ``grad_norm``
    would take a shard for a replica). With ``note``, also marks each sharded parameter
    for the optimizer check (:func:`note_shards`, in the same walk). No communication."""
    # Dynamo cannot trace a tensor's ``__dict__`` (torch.compile of any layer failed with an
    # InternalTorchDynamoError here): while compiling, the marks made when the layer
    # registered its parameters (ParallelModule.register_parameter) stand.
    note = note and not _compiling()
    for m in root.modules():  # (one walk per forward: the names only on the error path)
        for name, dim in _shard_dims(m).items():
            if dim is None:
                continue
            if name in m._parameters:
                p = m._parameters[name]
                if note and p is not None:  # (note_shards's work)
                    mark_shard(m, name, p)
                continue
            if name in m._buffers:
                continue
            prefix = next(n for n, sub in root.named_modules() if sub is m)
            full = f"{prefix}.{name}" if prefix else name
            how = "a parametrization" if parametrize.is_parametrized(m, name) else "a forward pre-hook"
            raise ValueError(
                f"diffcomm.{op}(): `{full}` is this rank's shard (dim {dim}) of the serial "
                f"`{name}`, but {type(m).__name__} no longer holds it as a parameter: {how} "
                "(torch.nn.utils.parametrize, weight_norm, spectral_norm, prune) computes it "
                "from other tensors in every forward, seeing only this rank's shard. One that "
                "reduces over the split dimension computes another weight than the serial "
                "model's, and the new parameters are unknown to the layer's shard bookkeeping "
                "(serial_slices, state dicts, grad_norm). Remove it (torch.nn.utils.parametrize."
                "remove_parametrizations, torch.nn.utils.remove_weight_norm, prune.remove), or "
                "compute the reparametrized weight over the whole weight yourself with "
                "diffcomm's collectives (docs/parallel.md: 'Parametrizations of a sharded weight')"
            )


def ranks_of(pg: Any) -> set[int]:
    """The global ranks of ``pg`` (``None``: the world)."""
    return set(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))


def check_not_synced_by_ddp(root: nn.Module, op: str, varying: Sequence[tuple[str, Tensor, Any]]) -> None:
    """Inside the forward of torch's ``DistributedDataParallel``: raise ``ValueError`` when
    DDP's group holds two ranks of the group of one of ``varying`` — ``(name, parameter,
    group)``, a parameter that differs between the ranks of ``group`` (a shard, an
    expert) — that DDP does not ignore. DDP over such ranks broadcast its rank 0's
    parameters at construction, overwriting the other ranks' shards with its own, and
    averages the gradients of different shards: a wrong model with no error (``DDP(model)``
    with the default group, the world, around a tensor-parallel model). Once per DDP
    module; no communication."""
    found = active_ddp()
    if found is None or not varying or _compiling():
        return
    ddp_module, ddp_pg, ignored = found
    seen = root.__dict__.get("_ddp_checked")
    if seen is not None and seen() is ddp_module:
        return
    names = {id(p): n for n, p in ddp_module.named_parameters(remove_duplicate=False)}
    ddp_ranks = ranks_of(ddp_pg)
    for name, p, pg in varying:
        if id(p) not in names or names[id(p)] in ignored:
            continue
        mine = ranks_of(pg)
        both = sorted(mine & ddp_ranks)
        if len(both) > 1:
            raise ValueError(
                f"diffcomm.{op}(): `{name}` differs between the ranks {sorted(mine)} (each holds its "
                f"own shard or experts), but torch's DistributedDataParallel around it runs over the "
                f"ranks {sorted(ddp_ranks)}, which include {both} of them: DDP broadcast its first "
                "rank's parameters over those at construction (overwriting the other ranks' shards) "
                "and averages different shards' gradients. Give DDP the data-parallel group only, "
                "one rank of each tensor/expert-parallel group: "
                "DistributedDataParallel(model, process_group=mesh.get_group('dp'))"
            )
    root.__dict__["_ddp_checked"] = weakref.ref(ddp_module)


#: torch's optimizers whose step is not elementwise: on a shard they compute another step
#: than on the serial weight. ``{class name: (what reduces, smallest ndim it reduces)}``.
_REDUCING_OPTIMIZERS = {
    "Adafactor": ("factors each matrix's second moment over its rows and columns", 2),
    "Muon": ("orthogonalises each matrix's update", 2),
    "LBFGS": ("takes dot products and norms over all its parameters together", 1),
}
#: the attribute naming the layer and parameter a shard belongs to (set by its forward)
_SHARD_NOTE = "_diffcomm_shard_of"


def mark_shard(m: nn.Module, name: str, p: Tensor) -> None:
    """Mark ``p``, layer ``m``'s sharded parameter ``name``, for
    :func:`_refuse_reducing_optimizer` (``_SHARD_NOTE``); once."""
    if _SHARD_NOTE not in p.__dict__:
        p.__dict__[_SHARD_NOTE] = f"{type(m).__name__}.{name}"


# (eager code inside a compiled function, after a graph break, ran this frame through
# dynamo, which cannot read a tensor's ``__dict__``: an InternalTorchDynamoError)
run_eagerly_under_compile(mark_shard.__code__)


def note_shards(root: nn.Module) -> None:
    """Mark every sharded parameter under ``root`` (``_SHARD_NOTE``) for
    :func:`_refuse_reducing_optimizer`: when a layer registers one, when a model is copied
    (a copy's parameters are new, unmarked) and in each eager forward."""
    for m in root.modules():
        for name, dim in _shard_dims(m).items():
            p = m._parameters.get(name)
            if dim is not None and p is not None:
                mark_shard(m, name, p)


def _refuse_reducing_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (every optimizer; a dict lookup for the others):
    refuse a step of an optimizer in :data:`_REDUCING_OPTIMIZERS` over a parallel
    layer's shard, before it changes anything: it would see only this rank's part of
    the serial weight and take another step than the serial model's optimizer."""
    how = _REDUCING_OPTIMIZERS.get(type(optimizer).__name__)
    if how is None or type(optimizer) is not getattr(torch.optim, type(optimizer).__name__, None):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            where = p.__dict__.get(_SHARD_NOTE)
            if where is not None and p.ndim >= how[1]:
                raise ValueError(
                    f"diffcomm.parallel: torch.optim.{type(optimizer).__name__} {how[0]}, but one of "
                    f"its parameters ({tuple(p.shape)}) is this rank's shard of the serial "
                    f"`{where}`: its step would see only the shard and differ from the serial "
                    "model's (no error otherwise). Use an elementwise optimizer (SGD, Adam, AdamW, "
                    "...) for the sharded parameters, e.g. a second optimizer over the others"
                )


def sharded_params(root: nn.Module) -> list[tuple[str, Tensor, Any]]:
    """``(name, parameter, group)`` of every sharded parameter of the layers under ``root``."""
    out: list[tuple[str, Tensor, Any]] = []
    for prefix, m in root.named_modules():
        for name, dim in _shard_dims(m).items():
            p = m._parameters.get(name)
            if dim is not None and p is not None:
                out.append((f"{prefix}.{name}" if prefix else name, p, getattr(m, "_pg", None)))
    return out


register_optimizer_step_pre_hook(_refuse_reducing_optimizer)
