"""Where diffcomm's parallel layers meet the rest of torch's training stack: the checks
that turn a silent wrong model into an error (docs/parallel.md, "In a training stack").

- a sharded parameter replaced by a parametrization, ``weight_norm``/``spectral_norm``
  hooks or pruning (:func:`check_shards_plain`);
- torch's ``DistributedDataParallel`` over ranks holding different shards or experts
  (:func:`check_not_synced_by_ddp`);
- a step of torch's non-elementwise optimizers over a shard, and of torch's
  ``ZeroRedundancyOptimizer`` over ranks holding different shards or experts (a global
  optimizer step pre-hook, registered on import; shards noted by the layers' forward,
  :func:`check_shards_plain` and :func:`note_varying`).
- pickling a whole module that holds this rank's shards or group
  (:func:`pickle_or_refuse`, :func:`refuse_pickling`);
- a replicated gradient summed over its group again after a backward added onto the last
  sum (``ExpertParallelMoE.sync_replicated_grads`` per micro-batch: :func:`grads_to_sum`,
  :func:`note_summed`).

None of them communicates. Private to :mod:`diffcomm.parallel`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._torch import active_ddp, run_eagerly_under_compile
from .._torch import compiling as _compiling
from ..backend import args as A


def shard_dims(m: nn.Module) -> dict[str, int | None]:
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
        for name, dim in shard_dims(m).items():
            if dim is None:
                continue
            if name in m._parameters:
                p = m._parameters[name]
                if p is None:
                    continue
                want = m.__dict__.get(SHAPES_KEY, {}).get(name)
                if want is not None and p.shape != want:
                    raise _not_the_shard(root, m, op, name, dim, p, want)
                if note:  # (note_shards's work)
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


#: a ``ParallelModule``'s ``{parameter name: the shape it registered}`` (in its ``__dict__``)
SHAPES_KEY = "_diffcomm_param_shapes"


def _not_the_shard(
    root: nn.Module, m: nn.Module, op: str, name: str, dim: int, p: Tensor, want: Any
) -> ValueError:
    """The error for layer ``m``'s sharded parameter ``name`` found with a shape other than
    the shard's ``want``: a tensor swapped in by ``torch.func.functional_call`` (or
    ``stack_module_state`` + ``vmap``), most often the serial model's whole tensor. Run as
    it was, a column-parallel linear returned the whole output as "its shard" on every
    rank, a vocabulary-parallel embedding looked its own range's ids up in the first rows
    of the whole table (2.4 off the serial output), a row-parallel one failed inside
    torch's matmul."""
    from ..backend import get_backend

    prefix = next(n for n, sub in root.named_modules() if sub is m)
    full = f"{prefix}.{name}" if prefix else name
    world = get_backend().world_size(getattr(m, "_pg", None))
    serial = list(want)
    serial[dim] *= world
    whole = (
        f"; {tuple(p.shape)} is the whole serial tensor, not this rank's part"
        if tuple(p.shape) == tuple(serial)
        else ""
    )
    return ValueError(
        f"diffcomm.{op}(): `{full}` ({type(m).__name__}.{name}) has shape {tuple(p.shape)}, but "
        f"the layer holds this rank's shard {tuple(want)} of the serial {tuple(serial)} (split "
        f"along dim {dim} over {world} ranks){whole}. A tensor passed for it (torch.func."
        "functional_call, stack_module_state) must be this rank's shard: cut the serial one "
        "with the layer's serial_slices(), `{k: serial[k][i] for k, i in layer.serial_slices()"
        ".items()}`"
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
#: the attribute holding ``(name, global ranks)`` of a parameter that differs between those
#: ranks (a shard's group, an expert's), ranks ``None`` where they cannot be told (no
#: process group); set by the layers' forward, read by the ZeRO check. Plain data, so a
#: pickled parameter (``torch.save(model)``) still pickles.
VARIES_NOTE = "_diffcomm_varies_over"


def note_varying(p: Tensor, where: str, pg: Any) -> None:
    """Mark ``p`` as differing between the ranks of ``pg`` (a shard, an expert), once, for
    :func:`_refuse_zero_over_varying`. No communication."""
    if VARIES_NOTE in p.__dict__:
        return
    try:
        ranks: frozenset[int] | None = frozenset(ranks_of(pg))
    except (RuntimeError, ValueError):  # no process group: nothing a ZeRO could be over
        ranks = None
    p.__dict__[VARIES_NOTE] = (where, ranks)


def mark_shard(m: nn.Module, name: str, p: Tensor) -> None:
    """Mark ``p``, layer ``m``'s sharded parameter ``name``, for
    :func:`_refuse_reducing_optimizer` (``_SHARD_NOTE``) and, once the layer's group is
    set, for the ZeRO check (:func:`note_varying`); each once."""
    if _SHARD_NOTE not in p.__dict__:
        p.__dict__[_SHARD_NOTE] = f"{type(m).__name__}.{name}"
    if VARIES_NOTE not in p.__dict__ and "_pg" in m.__dict__:  # (the ZeRO check's; once its group is set)
        note_varying(p, p.__dict__[_SHARD_NOTE], m.__dict__["_pg"])


# (eager code inside a compiled function, after a graph break, ran this frame through
# dynamo, which cannot read a tensor's ``__dict__``: an InternalTorchDynamoError)
run_eagerly_under_compile(mark_shard.__code__)


def note_shards(root: nn.Module) -> None:
    """Mark every sharded parameter under ``root`` (``_SHARD_NOTE``) for
    :func:`_refuse_reducing_optimizer`: when a layer registers one, when a model is copied
    (a copy's parameters are new, unmarked) and in each eager forward."""
    for m in root.modules():
        for name, dim in shard_dims(m).items():
            p = m._parameters.get(name)
            if dim is not None and p is not None:
                mark_shard(m, name, p)


#: the marks above, which a parameter carries in its ``__dict__``
_MARKS = (_SHARD_NOTE, VARIES_NOTE)


def keeping_marks(root: nn.Module, apply: Callable[[], nn.Module]) -> nn.Module:
    """``apply()`` (a layer's ``nn.Module._apply``: ``.to``, ``.double()``, ``.half()``,
    ``.cuda()``, ``to_empty``, ...) with every parameter under ``root`` keeping the marks
    above. Under ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` a
    conversion makes new ``Parameter`` objects, and under
    ``set_swap_module_params_on_conversion(True)`` it swaps each one's ``__dict__`` with the
    converted tensor's: either way the marks were gone, and the first
    ``LBFGS.step(closure)`` (checked before its closure runs the forward that marks
    again) stepped a shard unrefused. No communication."""
    saved = [
        (m, name, {k: p.__dict__[k] for k in _MARKS if k in p.__dict__})
        for m in root.modules()
        for name, p in m._parameters.items()
        if p is not None
    ]
    out = apply()
    for m, name, marks in saved:
        p = m._parameters.get(name)
        if p is not None:
            for k, v in marks.items():
                p.__dict__.setdefault(k, v)
    return out


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


def _refuse_zero_over_varying(optimizer: Any) -> None:
    """Refuse a step of torch's ``ZeroRedundancyOptimizer`` whose group holds two ranks
    between which one of its parameters differs (a shard, an expert), before the step
    changes or sends anything. ZeRO assigns each parameter to one rank of its group by
    index, and after that rank's step broadcasts it over the group: the owner's shard
    overwrote the other ranks' different shards (a ``ParallelMLP`` over the ``tp`` axis of
    a 2 x 2 mesh, ZeRO over the world: 0.49-0.66 off the serial weights after one SGD
    step, with no error). Over the data-parallel group (ranks holding the same shard) it
    runs. Decided from each rank's own groups: alike on every rank of a ZeRO group that is
    a mesh axis (or the world) — a group cutting across mesh axes irregularly may be seen
    by some of its ranks only. No communication."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None or not isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return
    zero_ranks: set[int] | None = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            note = p.__dict__.get(VARIES_NOTE)
            if note is None or note[1] is None:
                continue
            if zero_ranks is None:
                zero_ranks = ranks_of(optimizer.process_group)
            both = sorted(note[1] & zero_ranks)
            if len(both) > 1:
                raise ValueError(
                    f"diffcomm.parallel: torch's ZeroRedundancyOptimizer runs over the ranks "
                    f"{sorted(zero_ranks)}, but its parameter {tuple(p.shape)} `{note[0]}` differs "
                    f"between the ranks {sorted(note[1])} (each holds its own shard or experts), "
                    f"{both} of them in the optimizer's group: ZeRO steps each parameter on one "
                    "rank and broadcasts it over its group, overwriting the other ranks' shards "
                    "(no error otherwise). Give ZeRO the data-parallel group only, one rank of each "
                    "tensor/expert-parallel group: ZeroRedundancyOptimizer(params, ..., "
                    "process_group=mesh.get_group('dp'))"
                )


def _check_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: :func:`_refuse_reducing_optimizer` and
    :func:`_refuse_zero_over_varying`."""
    _refuse_reducing_optimizer(optimizer, args, kwargs)
    _refuse_zero_over_varying(optimizer)


#: a replicated parameter's gradient as the last sum over its group left it:
#: ``(weakref to that .grad, its version, the backwards accumulated into the parameter so
#: far)``; and, as ``(weakref, version, backwards so far, holds)``, as a backward that added
#: onto such a gradient left it (``holds``: ``True``, or a 0-dim device tensor telling
#: whether the gradient still held anything when the backward added onto it, read only
#: when the next sum is asked for: no host synchronisation in backward)
_SUMMED = "_diffcomm_grad_summed"
_ADDED_ONTO_SUM = "_diffcomm_added_onto_sum"
#: how many backwards have accumulated into the parameter's ``.grad`` since it was watched
_ACCUMULATED = "_diffcomm_accumulated"


def _no_backward_since(p: Tensor, mark: tuple[Any, ...] | None) -> bool:
    """``p.grad`` is the tensor the last sum left (``mark``), and no backward has added
    to it since. Changed in place otherwise — scaled by ``GradScaler.unscale_`` or a
    clipping — it is still the sum: summing it again would multiply it by the group
    size (a version test took the scaling for new parts: sync, clip, sync doubled the
    router's gradient at world 2)."""
    return (
        mark is not None
        and p.grad is not None
        and p.grad is mark[0]()
        and p.__dict__.get(_ACCUMULATED, 0) == mark[2]
    )


def _holds_a_sum(p: Tensor) -> bool | Tensor:
    """Whether ``p.grad`` still holds (a part of) the last sum: the gradient the last sum
    left, or a backward added onto, with no backward since that did not add onto a sum.
    Changed in place since (the version counter moved), it is either scaled — a clipping's
    ``mul_``, still the sum — or zeroed (``zero_grad(set_to_none=False)``): the version
    cannot tell them apart, so the content does (``grad.any()``: a 0-dim tensor, read
    later; an all-zero gradient holds nothing that a second sum could count twice)."""
    d, g = p.__dict__, p.grad
    if g is None:
        return False
    count = d.get(_ACCUMULATED, 0)
    added, summed = d.get(_ADDED_ONTO_SUM), d.get(_SUMMED)
    if added is not None and g is added[0]() and count == added[2]:
        version, holds = added[1], added[3]
    elif summed is not None and g is summed[0]() and count == summed[2]:
        version, holds = summed[1], True
    else:
        return False
    if g._version == version:
        return holds
    nonzero = g.detach().any()  # (zeroed in place: nothing of a sum left, for good)
    return nonzero if holds is True else holds & nonzero


def _watch_accumulation(p: Tensor) -> None:
    """Hooks of a replicated parameter around each backward's accumulation into ``.grad``:
    before it, whether ``.grad`` still holds a sum (:func:`_holds_a_sum`); after it, that
    gradient is marked ``_ADDED_ONTO_SUM`` (the mark counts backwards, as the sum's does:
    the version counter moved under a clipping's in-place scaling as well, and sync, clip,
    backward, sync counted the first backward's part once per rank, with no error)."""
    ref = weakref.ref(p)

    def before(grad: Tensor) -> None:
        q = ref()
        if q is not None:
            q.__dict__["_diffcomm_onto_sum"] = _holds_a_sum(q)

    def after(q: Tensor) -> None:
        d = q.__dict__
        d[_ACCUMULATED] = d.get(_ACCUMULATED, 0) + 1
        holds = d.pop("_diffcomm_onto_sum", False)
        if holds is not False and q.grad is not None:
            d[_ADDED_ONTO_SUM] = (weakref.ref(q.grad), q.grad._version, d[_ACCUMULATED], holds)
        else:
            d.pop(_ADDED_ONTO_SUM, None)

    p.__dict__["_diffcomm_sum_hooks"] = (p.register_hook(before), p.register_post_accumulate_grad_hook(after))


def grads_to_sum(op: str, named: Sequence[tuple[str, Tensor]]) -> list[Tensor]:
    """Of replicated parameters whose (plain tensor) gradients ``op`` sums over a group:
    those still to sum — not one whose ``.grad`` the last sum left with no backward since
    (summing it again would multiply it by the group size; skipped: the call is
    idempotent, also after an in-place scaling). Raises ``ValueError``, before any
    communication, when a backward added onto a summed gradient since the last sum (a sum
    per micro-batch: the earlier micro-batches' parts, already summed, would count again:
    group size times), also when the sum was scaled in place (clipped) before that
    backward; not when it was zeroed in place."""
    added = [(name, p) for name, p in named if p.__dict__.get(_ADDED_ONTO_SUM) is not None]
    holds = [_holds_a_sum(p) for _, p in added]
    tensors = [h for h in holds if isinstance(h, Tensor)]
    read = iter(torch.stack([t.to(torch.bool) for t in tensors]).tolist() if tensors else [])
    for (name, _), h in zip(added, holds):
        if next(read) if isinstance(h, Tensor) else h:  # (one host read for all)
            raise ValueError(
                f"diffcomm.{op}(): `{name}`'s gradient was summed over the group by the last call, "
                "and a backward has added this rank's share onto it since (no zero_grad between): "
                "summing it again would count the earlier backward's part once per rank. Call it "
                "once per optimizer step, after the last accumulated backward (or zero the "
                "gradients after the call)"
            )
    out = []
    for _, p in named:
        if p.grad is None or _no_backward_since(p, p.__dict__.get(_SUMMED)) or _dtensor_as_summed(p):
            continue  # already the sum (scaled in place, perhaps): nothing new to add
        out.append(p)
    return out


#: a ``DTensor`` gradient (FSDP2's) as the last sum left it: ``(weakref, its local
#: shard's version)``. FSDP2 accumulates into the local shard in place, unseen by the
#: hooks of :func:`_watch_accumulation`: only an unchanged gradient is known to be the sum
_DTENSOR_SUMMED = "_diffcomm_dtensor_grad_summed"


def _local_version(g: Tensor) -> int:
    return int(g.to_local()._version)  # type: ignore[attr-defined]


def _dtensor_as_summed(p: Tensor) -> bool:
    """``p.grad`` is the ``DTensor`` the last sum left, its local shard unchanged since (a
    second sum with nothing between counted the router's gradient once per rank again:
    0.049 off serial under FSDP2 at 2 x 2). Changed in place since — FSDP2 accumulated a
    backward into it, or it was scaled or zeroed — it is summed again, the version cannot
    tell which."""
    mark = p.__dict__.get(_DTENSOR_SUMMED)
    g = p.grad
    return mark is not None and g is not None and g is mark[0]() and _local_version(g) == mark[1]


def note_summed(params: Sequence[Tensor]) -> None:
    """After ``params``' gradients were summed over their group: remember each ``.grad``
    as the sum left it, and watch the next backwards (:func:`_watch_accumulation`)."""
    for p in params:
        if p.grad is not None and A.is_dtensor(p.grad):  # (FSDP2's: it accumulates on its own)
            p.__dict__[_DTENSOR_SUMMED] = (weakref.ref(p.grad), _local_version(p.grad))
        if p.grad is None or A.is_dtensor(p.grad):
            continue
        p.__dict__.pop(_ADDED_ONTO_SUM, None)
        p.__dict__[_SUMMED] = (weakref.ref(p.grad), p.grad._version, p.__dict__.get(_ACCUMULATED, 0))
        if "_diffcomm_sum_hooks" not in p.__dict__:
            _watch_accumulation(p)


def holds_rank_state(root: nn.Module) -> bool:
    """Whether a module under ``root`` holds what belongs to this rank of a group: a
    process group, or a parameter it shards (a wrapper ``ParallelModule`` around serial
    modules holds neither, and pickles as any module: the testing kit ships such a serial
    reference to the ranks)."""
    return any(
        m.__dict__.get("_pg") is not None or any(d is not None for d in shard_dims(m).values())
        for m in root.modules()
    )


def pickle_or_refuse(module: nn.Module, protocol: Any) -> Any:
    """``module.__reduce_ex__``: refused (:func:`refuse_pickling`) when it holds this
    rank's state (:func:`holds_rank_state`), else ``nn.Module``'s own."""
    if holds_rank_state(module):
        raise refuse_pickling(module)
    return super(nn.Module, module).__reduce_ex__(protocol)


def refuse_pickling(module: nn.Module) -> TypeError:
    """The error of ``torch.save(model)`` / ``pickle`` of a whole parallel module: it holds
    this rank's shards with its group rank, size and process group, and a load on another
    rank or world size (or after the group is gone) would compute with another rank's
    shards as its own. It failed inside pickle (``Can't pickle local object``), naming
    neither the module nor the way out."""
    return TypeError(
        f"diffcomm.parallel: {type(module).__name__} cannot be pickled whole (torch.save(model), "
        "pickle, a model returned from a rank): it holds this rank's shards together with its "
        "group rank, size and process group, which another process, rank or world size cannot "
        "reuse. Save model.state_dict() per rank (checked on load), model.to_serial_state_dict() "
        "or parallel.dcp_state_dict(model), and rebuild the model before loading "
        "(docs/parallel.md: 'Saving, resharding and restoring')"
    )


def sharded_params(root: nn.Module) -> list[tuple[str, Tensor, Any]]:
    """``(name, parameter, group)`` of every sharded parameter of the layers under ``root``."""
    out: list[tuple[str, Tensor, Any]] = []
    for prefix, m in root.named_modules():
        for name, dim in shard_dims(m).items():
            p = m._parameters.get(name)
            if dim is not None and p is not None:
                out.append((f"{prefix}.{name}" if prefix else name, p, getattr(m, "_pg", None)))
    return out


register_optimizer_step_pre_hook(_check_optimizer_step)
