"""The base of the tensor-parallel layers: :class:`ParallelModule` (parameters as shards
of a serial module's), the region copy of partial-gradient replicas, and the argument
checks every layer and block shares.

Public through :mod:`diffcomm.parallel.layers` and :mod:`diffcomm.parallel` (this module is
private).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .. import _config
from .. import backend as B
from .._errors import CrossRankMismatchError
from .._replication import LayerRule, R, V, annotate_params_for_spmd_types, spmd_types_checking
from .._torch import IncompatibleKeys, active_ddp, compiler_disable, every_rank
from .._torch import compiling as _compiling
from ..backend import args as A
from ..ops import collectives
from ..ops.validation import rank_index
from ._check import check_replicas_agree
from ._seams import (
    SHAPES_KEY,
    check_not_synced_by_ddp,
    check_shards_plain,
    keeping_marks,
    mark_shard,
    note_shards,
    pickle_or_refuse,
    sharded_params,
)
from .mappings import copy_replica_to_region, copy_to_region, copy_to_region_coalesced

__all__ = ["ParallelModule"]

# Size: ~710 lines, just over the ~600 guideline: the base class, its region copy and the
# forward checks it runs (unseeded replicas, debug-mode requires_grad agreement, plain
# norms in a sequence-parallel model) are
# one data flow, the outermost forward's; the shard bookkeeping already lives in ``_seams``
# and the value check in ``_check``.

Index = tuple[slice, ...]
_FUNCTION_ATTRS = torch.autograd.Function.__dict__  # (see _replication.spmd_types_checking)


# ======================================================================================
# argument checks shared by the layers and blocks
# ======================================================================================


def varying_with(flag: str, part: str) -> LayerRule:
    """The typing rule of a layer whose input is replicated, or varying (``part``, this
    rank's part of it) when the layer's attribute ``flag`` is true."""
    return LayerRule(
        lambda m: V if getattr(m, flag) else R,
        why=lambda m: f"{part} ({flag}=True)" if getattr(m, flag) else "the whole input",
        doc=f"replicated; varying ({part}) with {flag}",
    )


def check_positive(op: str, arg: str, value: Any) -> int:
    value = A.check_int(value, op, arg)
    if value < 1:
        raise A.arg_error(op, arg, "a positive int", value)
    return value


def check_divisible(op: str, arg: str, value: int, world: int, what: str) -> int:
    if value % world != 0:
        raise A.arg_error(
            op,
            arg,
            f"divisible by the group size {world} ({what} are split evenly; pad it to a multiple of {world})",
            value,
        )
    return value // world


def init_generator(op: str, seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    """The CPU generator the full weights are drawn from (``None``: the default one)."""
    if seed is not None and generator is not None:
        raise A.arg_error(op, "seed", "None when `generator` is given (pass one of them)", seed)
    if generator is not None:
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise A.arg_error(op, "generator", "a CPU torch.Generator", generator, TypeError)
        return generator
    if seed is not None:
        return torch.Generator().manual_seed(A.check_int(seed, op, "seed"))
    return None


def resolve_parallel_group(op: str, group: A.GroupLike) -> tuple[Any, int, int]:
    """``(process group, its size, this rank in it)``. The rank is
    :func:`~diffcomm.ops.validation.rank_index`'s: under torch's ``LocalTensorMode`` an
    int holding each simulated rank's own, to slice shards with (never to compare)."""
    pg = A.resolve_group(group, op)
    return pg, B.get_backend().world_size(pg), rank_index(pg)


# ======================================================================================
# the base class: parameters as shards of a serial module's
# ======================================================================================


def _enter_region(module: ParallelModule, args: Any) -> None:
    """Forward pre-hook of every ParallelModule; acts in the outermost one only: copies
    every partial-gradient replica of the module tree into the region at once (one
    coalesced reduction in backward per group; a lone tensor uses ``copy_to_region``, its
    ``requires_grad`` compared by name after the forward: :func:`_after_forward`).
    First, before any communication, it refuses a sharded parameter replaced by a
    parametrization (:func:`check_shards_plain`)."""
    if module.__dict__.get("_region_copies") is not None:
        return  # inside an outer ParallelModule's forward: it made the copies
    check_shards_plain(module, f"parallel.{type(module).__name__}", note=True)
    if active_ddp() is not None:
        check_not_synced_by_ddp(module, f"parallel.{type(module).__name__}", sharded_params(module))
    if spmd_types_checking(_FUNCTION_ATTRS):
        annotate_params_for_spmd_types(module)
    members: list[ParallelModule] = []
    norms: list[nn.Module] = []  # plain norms (refused below in a sequence-parallel model)
    for m in module.modules():  # one walk of the tree (its names only to refuse)
        if isinstance(m, ParallelModule):
            members.append(m)
        elif isinstance(m, _PLAIN_NORM_TYPES):
            norms.append(m)
    if norms and any(m._on_sequence_chunks() for m in members):
        _refuse_plain_norms(module)
    if any(m.__dict__.get("_replicas_unchecked") for m in members):
        (_check_unseeded_eagerly if _compiling() else _check_unseeded)(module)
    groups: list[tuple[Any, list[Tensor]]] = []
    seen: set[int] = set()
    for m in members:
        for name in m._partial_grad_params():
            p = getattr(m, name, None)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            for pg, ps in groups:
                if pg is m._pg:
                    ps.append(p)
                    break
            else:
                groups.append((m._pg, [p]))
    copies: dict[int, Tensor] = {}
    for pg, ps in groups:
        outs = [copy_replica_to_region(ps[0], pg)] if len(ps) == 1 else copy_to_region_coalesced(ps, pg)
        copies.update(zip((id(p) for p in ps), outs))
    for m in members:
        m.__dict__["_region_copies"] = copies
    module.__dict__["_region_root"] = True


#: plain norms refused inside a sequence-parallel model, with the layer to use instead
_PLAIN_NORMS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.LayerNorm, "SequenceParallelLayerNorm"),
    (nn.RMSNorm, "SequenceParallelRMSNorm"),
)
_PLAIN_NORM_TYPES = tuple(kind for kind, _ in _PLAIN_NORMS)


def _refuse_plain_norms(root: nn.Module) -> None:
    """Refuse, before any communication, a plain ``nn.LayerNorm`` / ``nn.RMSNorm`` with a
    trainable parameter inside a model that has sequence-parallel layers.

    Such a norm sees this rank's sequence chunk, so each rank's gradient of its replicated
    weight is a partial sum that nothing reduces: an SP ``ParallelMLP`` after an
    ``nn.RMSNorm`` at world 3 gave norm-weight gradients 1.3-1.7 off the serial ones, a
    different one on every rank (replicas drifting apart from the first step), with no
    error, also in debug mode."""
    for name, sub in root.named_modules():
        if isinstance(sub, ParallelModule):
            continue
        for kind, instead in _PLAIN_NORMS:
            if isinstance(sub, kind) and any(p.requires_grad for p in sub.parameters(recurse=False)):
                raise ValueError(
                    f"diffcomm.parallel.{type(root).__name__}(): `{name}` is a plain "
                    f"nn.{kind.__name__} in a model with sequence-parallel layers. On a sequence "
                    "chunk each rank's gradient of its replicated weight is a partial sum, "
                    "and nothing sums it over the group (a silently wrong step). Use "
                    f"diffcomm.parallel.{instead}.from_serial(norm, group=...), which sums it. "
                    "A norm of the whole (gathered, replicated) sequence is right as a plain "
                    "module: apply it outside the sequence-parallel model's forward."
                )


#: why every rank must agree on ``requires_grad`` (the hint of :func:`_check_requires_grad`)
REQUIRES_GRAD_HINT = (
    "A parameter frozen (requires_grad_(False)) on some ranks only trains inconsistently: a "
    "replica keeps its value on one rank while the others update theirs, and a shard's "
    "gradient reductions are skipped on one rank only (a desync in backward). Freeze or "
    "unfreeze it on every rank of the group."
)


def _check_requires_grad(root: ParallelModule) -> None:
    """Debug mode: every parameter under ``root`` has the same ``requires_grad`` on every
    rank of its layer's group (one :meth:`check_consistent` per group, the way the blocks'
    dropout check compares ``train()`` / ``eval()``). A parameter frozen on one rank only
    trained silently inconsistently: a replicated bias kept its initial value on that rank
    while the other ranks trained theirs, and under sequence parallelism the skipped
    gradient reduction ended in a desync blaming the loss. A parameter belongs to the
    nearest ParallelModule holding it (a plain submodule's to its ParallelModule parent)."""
    groups: dict[int, tuple[Any, dict[str, Any]]] = {}

    def walk(m: nn.Module, prefix: str, owner: ParallelModule) -> None:
        if isinstance(m, ParallelModule):
            owner = m
        fields = groups.setdefault(id(owner._pg), (owner._pg, {}))[1]
        for name, p in m.named_parameters(recurse=False):
            fields[f"requires_grad of `{prefix}{name}`"] = repr(bool(p.requires_grad))
        for child_name, child in m.named_children():
            walk(child, f"{prefix}{child_name}.", owner)

    walk(root, "", root)
    op = f"parallel.{type(root).__name__}"
    for pg, fields in groups.values():
        if not fields:
            continue
        try:
            B.get_backend().check_consistent(op, fields, pg)
        except CrossRankMismatchError as exc:
            raise CrossRankMismatchError(f"{exc}. {REQUIRES_GRAD_HINT}") from None


def note_drawn(module: nn.Module, generator: torch.Generator | None) -> None:
    """After ``module`` drew its initial weights from ``generator``: with ``None`` (the
    global generator) its replicated parameters are checked to agree across its group at
    its first forward (:func:`_check_unseeded`)."""
    if generator is None:
        module.__dict__["_replicas_unchecked"] = True


def _check_unseeded(root: nn.Module) -> None:
    """The first-forward check of every ParallelModule under ``root`` whose weights were
    drawn from the global generator: its replicated parameters (bias of a row-parallel
    linear, ...) agree on every rank of its group (one fingerprint all_gather per group),
    else :class:`~diffcomm.CrossRankMismatchError` before the forward runs. Once."""
    groups: dict[int, tuple[Any, list[tuple[str, Tensor]]]] = {}
    for prefix, m in root.named_modules():
        if not (isinstance(m, ParallelModule) and m.__dict__.pop("_replicas_unchecked", False)):
            continue
        dims = m._shard_dims
        for name, p in m.named_parameters(recurse=False):
            if dims.get(name) is None:
                full = f"{prefix}.{name}" if prefix else name
                groups.setdefault(id(m._pg), (m._pg, []))[1].append((full, p))
    for pg, named in groups.values():
        check_replicas_agree(named, f"{type(root).__name__} (first forward)", pg)


#: :func:`_check_unseeded` run eagerly from a compiled forward (a graph break, taken while
#: the flags stand: the first call). Skipped while compiling, as it was, a compiled-only
#: model never checked its replicas: ranks that drew different full weights (unseeded)
#: trained a model that is no serial model's shards, with no error.
_check_unseeded_eagerly = compiler_disable(
    _check_unseeded,
    reason=(
        "diffcomm.parallel: the first forward of a layer drawn from the global generator (no "
        "seed=) checks that its replicated parameters agree across ranks, which communicates "
        "outside the graph: give the layer seed= (or generator=), load it from_serial, or "
        "run one forward eagerly before compiling with fullgraph=True"
    ),
)


def deepcopy_sharing_groups(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module)`` whose layers keep their process groups (``_pg``): a
    ``ProcessGroup`` cannot be copied (torch's pickling refuses it), and a copy of a
    parallel model (an EMA, ``torch.optim.swa_utils.AveragedModel``, a frozen reference)
    communicates over the same ranks. Parameters and buffers are copied as usual.

    A tensor a forward leaves on a layer with its graph (the attributes its class names in
    ``FORWARD_RESULTS``: ``ExpertParallelMoE.aux_loss`` after a training step) is copied
    without it (``detach().clone()``): torch's deepcopy refuses a non-leaf tensor ("Only
    Tensors created explicitly by the user ... support the deepcopy protocol"), so an EMA
    copy made after the first step failed. Any other tensor with a graph (a view of a
    parameter cached in ``__init__``) is left to torch's refusal: a detached copy of it
    would silently stop following the copy's parameter."""
    for m in module.modules():
        pg = m.__dict__.get("_pg")
        if pg is not None:
            memo.setdefault(id(pg), pg)
        for name in getattr(type(m), "FORWARD_RESULTS", ()):
            value = m.__dict__.get(name)
            if isinstance(value, Tensor) and value.grad_fn is not None and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    new = type(module).__new__(type(module))
    memo[id(module)] = new
    new.__setstate__(copy.deepcopy(module.__dict__, memo))
    note_shards(new)  # (a copied parameter is new, without the optimizer check's mark)
    return new


#: the key of a sharded module's state-dict metadata (``state_dict()._metadata[prefix]``,
#: which ``torch.save`` keeps): the group rank and size whose shards the state dict holds
SHARD_KEY = "diffcomm_shard"


def _group_position(pg: Any) -> tuple[int, int] | None:
    """``(group rank, group size)`` of this process in ``pg``; ``None`` where it cannot be
    told (no process group any more, or all ranks in one program under LocalTensorMode)."""
    try:
        backend = B.get_backend()
        rank, world = backend.rank(pg), backend.world_size(pg)
    except Exception:
        return None
    return (rank, world) if isinstance(rank, int) and isinstance(world, int) else None


def guard_shard_loading(module: nn.Module, position: Callable[[Any], tuple[int, int] | None]) -> None:
    """Make ``module``'s ``state_dict()`` note whose shards it holds (``position(module)``:
    this process's ``(group rank, group size)``, ``None`` for a module holding no shard), and its
    ``load_state_dict`` refuse another rank's: with even splits every shard has the same
    shape, so rank 1's state dict loaded on rank 0 went in without an error and computed
    no serial model's output. A state dict without the note (saved before it existed, or
    through a format that drops torch's metadata) loads as before."""

    def note(m: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any]) -> None:
        where = position(m)
        if where is not None:
            local_metadata[SHARD_KEY] = where

    def check(
        m: nn.Module,
        state_dict: Any,
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing: list[str],
        unexpected: list[str],
        errors: list[str],
    ) -> None:
        saved, here = local_metadata.get(SHARD_KEY), position(m)
        if saved is None or here is None or tuple(saved) == here:
            return
        name = prefix.rstrip(".") or type(m).__name__
        errors.append(
            f"diffcomm: `{name}` ({type(m).__name__}) holds the shards of group rank "
            f"{saved[0]} of {saved[1]} in this state dict, but this is group rank {here[0]} of "
            f"{here[1]}: load the state dict this rank saved, or reshard through the serial one "
            "(to_serial_state_dict / load_serial_state_dict)."
        )

    module.register_state_dict_post_hook(note)
    module.register_load_state_dict_pre_hook(check)


def _sharded_position(module: ParallelModule) -> tuple[int, int] | None:
    """This process's place in a leaf layer's group, if the layer holds a shard."""
    if not any(d is not None for d in module._shard_dims.values()):
        return None
    return _group_position(module._pg)


def check_serial_value(op: str, name: str, value: Any) -> None:
    """A serial state dict's ``value`` for ``name`` is a plain tensor, before anything is
    copied: a ``DTensor`` (a state dict of torch's tensor parallelism, or DCP's
    ``get_model_state_dict`` of one) failed inside ``copy_`` with torch's "mixed
    torch.Tensor and DTensor", naming neither the key nor the way out."""
    if isinstance(value, Tensor) and type(value) is not Tensor and A.is_dtensor(value):
        raise A.arg_error(
            op,
            f"state_dict[{name!r}]",
            "a full (serial) tensor: a DTensor's global value needs communication; pass "
            "`{k: v.full_tensor() for k, v in sd.items()}` (on every rank), or load a DCP "
            "checkpoint with `dcp.load(parallel.dcp_state_dict(model), ...)`",
            f"a DTensor with placements {tuple(getattr(value, 'placements', ()))}",
            TypeError,
        )


def _after_forward(module: ParallelModule, args: Any, output: Any) -> None:
    """Forward hook (only after a forward that returned): in debug mode the outermost
    module checks that the parameters' ``requires_grad`` agree across the ranks
    (:func:`_check_requires_grad`). After the forward, so the layers' local argument
    checks still raise before any communication; before any backward, which a mismatch
    would desync."""
    if module.__dict__.get("_region_root") and _config.DEBUG.get():
        _check_requires_grad(module)


def _leave_region(module: ParallelModule, args: Any, output: Any) -> None:
    """Forward hook (always called): the outermost module drops the copies again."""
    if module.__dict__.pop("_region_root", False):
        for m in module.modules():
            m.__dict__.pop("_region_copies", None)


class ParallelModule(nn.Module):
    """A module whose parameters are shards or replicas of a serial module's.

    Leaf layers declare ``_shard_dims = {param_name: dim or None}`` (``None``: replicated;
    a persistent buffer may be declared the same way) and hold their process group in
    ``_pg``; parameters and buffers of submodules that declare nothing are replicated.
    Everything below is derived from that.
    """

    _shard_dims: dict[str, int | None] = {}
    _pg: Any = None

    def __init__(self) -> None:
        super().__init__()
        # one coalesced reduction per step for the partial-gradient replicas (see below)
        self.register_forward_pre_hook(_enter_region)
        self.register_forward_hook(_after_forward)  # (before _leave_region: the root is known)
        self.register_forward_hook(_leave_region, always_call=True)
        # a state dict of shards remembers whose they are; another rank's is refused
        guard_shard_loading(self, _sharded_position)

    def __deepcopy__(self, memo: dict[int, Any]) -> ParallelModule:
        return deepcopy_sharing_groups(self, memo)  # type: ignore[return-value]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickle_or_refuse(self, protocol)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> ParallelModule:
        """``nn.Module._apply`` (``.to``, ``.double()``, ``to_empty``, ...), the shards
        keeping their marks for torch's optimizers (``_seams.keeping_marks``)."""
        return keeping_marks(self, lambda: super(ParallelModule, self)._apply(fn, recurse))  # type: ignore[return-value]

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """``nn.Module.register_parameter``, marking a sharded parameter for the check of
        torch's non-elementwise optimizers (``_seams``) at once: a model only ever run
        under ``torch.compile`` is never marked by its forward (dynamo cannot trace it)."""
        super().register_parameter(name, param)
        if param is not None:
            # the shape this layer holds (a shard's: checked in every forward, see
            # check_shards_plain; a parameter swapped in by torch.func.functional_call is
            # not registered, so the layer's own shape stands)
            self.__dict__.setdefault(SHAPES_KEY, {})[name] = param.shape
            if self._shard_dims.get(name) is not None:
                mark_shard(self, name, param)

    def _partial_grad_params(self) -> tuple[str, ...]:
        """Names of this module's own parameters that are replicated but receive a
        **per-rank partial gradient** (they meet a rank-local sequence chunk): a
        sequence-parallel ``RowParallelLinear``'s bias, a sequence-parallel layer norm's
        weight and bias. Their gradients must be summed over the group."""
        return ()

    def _on_sequence_chunks(self) -> bool:
        """Whether this layer works on this rank's sequence chunk: ``sequence_parallel``
        set (a linear layer, an embedding, a block), or always (the sequence-parallel
        norms override it). A plain trainable norm in a tree holding one is refused
        (:func:`_refuse_plain_norms`): it would see the same chunks."""
        return getattr(self, "sequence_parallel", False) is True

    def _region_param(self, name: str) -> Tensor:
        """Parameter ``name`` as the forward must use it (one of :meth:`_partial_grad_params`).

        Inside the forward of the outermost :class:`ParallelModule` it is that module's
        copy of the parameter into the tensor-parallel region, made for **all** such
        parameters of the module tree at once (``copy_to_region_coalesced``), so a step
        sums all their gradients in one coalesced all_reduce (one communication per
        dtype) instead of one all_reduce each. Outside one it is ``copy_to_region(p)``.
        """
        p = getattr(self, name)
        copies = self.__dict__.get("_region_copies")
        if copies is not None and id(p) in copies:
            return copies[id(p)]
        return copy_to_region(p, self._pg)

    def _serial_specs(self, op: str, buffers: bool) -> dict[str, tuple[Tensor, int | None, Any]]:
        """``{full name: (tensor, shard dim or None, group)}`` over the whole module tree,
        with the names and in the order of ``state_dict()``: every parameter and (with
        ``buffers``) every persistent buffer, under **each** name it is reachable by (a
        tied parameter, ``head.weight = emb.weight``, or a module held twice, appears
        under both, as in torch's state dict).

        A tensor's spec is its layer's ``_shard_dims`` entry (parameters and buffers
        alike) and ``_pg``; a tensor the layer does not declare, or of a module that is no
        :class:`ParallelModule`, is replicated.

        Raises:
            ValueError: one tensor reachable under two names with different specs.
        """
        check_shards_plain(self, f"parallel.{type(self).__name__}.{op}")
        specs: dict[str, tuple[Tensor, int | None, Any]] = {}
        first: dict[int, str] = {}  # id(tensor) -> the first name it was met under
        mapped = tuple(_mapped_subtrees(self))  # (their own mapping: not replicas)
        for prefix, module in self.named_modules(remove_duplicate=False):
            if f"{prefix}.".startswith(mapped):
                continue
            dims = getattr(module, "_shard_dims", {}) if isinstance(module, ParallelModule) else {}
            pg = getattr(module, "_pg", None)
            own = [(n, t) for n, t in module._parameters.items() if t is not None]
            if buffers:
                skip = module._non_persistent_buffers_set
                own += [(n, t) for n, t in module._buffers.items() if t is not None and n not in skip]
            for name, t in own:
                full = f"{prefix}.{name}" if prefix else name
                spec = (t, dims.get(name), pg if dims.get(name) is not None else None)
                seen = first.setdefault(id(t), full)
                if seen != full and not _same_spec(specs[seen], spec):
                    raise ValueError(
                        f"{type(self).__name__}.{op}(): `{seen}` and `{full}` are one tied tensor "
                        f"with different shard specs ({_describe(specs[seen])} vs "
                        f"{_describe(spec)}); tie only tensors sharded alike (the same dim "
                        "and group), or replicated in both layers"
                    )
                specs[full] = spec
        return specs

    def serial_slices(self) -> dict[str, Index]:
        """Which part of each serial parameter this rank's parameter is (shards are even:
        rank ``r``'s ``k`` entries along the shard dim are ``[r*k, (r+1)*k)``).

        Returns:
            ``{name: index}``: ``serial_param[index]`` has this rank's parameter's shape
            and values (a tuple of slices; full slices for replicated parameters). A tied
            parameter appears under each of its names, as in ``state_dict()``.

        Raises:
            ValueError: a tied parameter's names have different shard specs.
        """
        specs = self._serial_specs("serial_slices", buffers=False)
        out = {name: _index(t, dim, pg) for name, (t, dim, pg) in specs.items()}
        for prefix, sub in _mapped_subtrees(self).items():  # (under its local names)
            out.update({prefix + k: v for k, v in sub.serial_slices().items()})
        return out

    @torch.no_grad()
    def to_serial_state_dict(self) -> dict[str, Tensor]:
        """The serial module's state dict (full parameters and persistent buffers), on
        every rank.

        Communicates (one all_gather per sharded tensor, in the same order on every
        rank), so call it on every rank. Buffers a layer does not declare sharded are
        replicas and are copied; a tied tensor is gathered once and appears under each of
        its names (one tensor, as in the tied serial module's ``state_dict()``).

        Returns:
            ``{name: full tensor}``, loadable with ``serial.load_state_dict(...)``.

        Raises:
            ValueError: a tied tensor's names have different shard specs.
        """
        out: dict[str, Tensor] = {}
        done: dict[int, Tensor] = {}
        for name, (t, dim, pg) in self._serial_specs("to_serial_state_dict", buffers=True).items():
            if id(t) not in done:
                local = t.detach()
                if dim is None:
                    done[id(t)] = local.clone()
                else:
                    world = B.get_backend().world_size(pg)
                    done[id(t)] = collectives.all_gather(
                        local, dim, pg, split_sizes=[local.shape[dim]] * world
                    )
            out[name] = done[id(t)]
        for prefix, sub in _mapped_subtrees(self).items():  # an ExpertParallelMoE: all its experts
            out.update({prefix + k: v for k, v in sub.to_serial_state_dict().items()})
        return out

    @torch.no_grad()
    def load_serial_state_dict(
        self, state_dict: Mapping[str, Tensor], strict: bool = True
    ) -> IncompatibleKeys:
        """Copy this rank's shards out of a serial module's state dict (no communication).

        Parameters and persistent buffers are loaded alike (a buffer a layer does not
        declare sharded is a replica: copied whole); a tied parameter is expected under
        each of its names, as ``nn.Module.load_state_dict`` expects it.

        Args:
            state_dict: the serial module's ``state_dict()`` (full parameters and buffers).
            strict: raise ``KeyError`` for missing or unexpected keys.

        Returns:
            ``(missing_keys, unexpected_keys)`` (serial names), as
            ``nn.Module.load_state_dict`` returns them: what ``strict=False`` skipped.

        Raises:
            KeyError: with ``strict``, keys missing from or unknown to this module.
            ValueError: a serial tensor's shape is not the serial shape this module
                shards (checked for every key before any is copied); a tied tensor's names
                have different shard specs.
            TypeError: a value is a ``DTensor`` (pass its ``full_tensor()``).
        """
        specs = self._serial_specs("load_serial_state_dict", buffers=True)
        subs = _mapped_subtrees(self)
        missing = [k for k in specs if k not in state_dict]
        unexpected = [k for k in state_dict if k not in specs and not k.startswith(tuple(subs))]
        if strict and (missing or unexpected):
            raise KeyError(
                f"{type(self).__name__}.load_serial_state_dict(): missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        op = f"{type(self).__name__}.load_serial_state_dict"
        for name, (t, dim, pg) in specs.items():  # every key checked before any is copied
            if name not in state_dict:
                continue
            check_serial_value(op, name, state_dict[name])
            serial = serial_shape(t, dim, pg)
            if tuple(state_dict[name].shape) != serial:
                # The whole serial shape, not only this rank's cut: a larger serial tensor (a
                # padded vocabulary) gave every rank a shard that fits, silently dropping its
                # tail; a smaller one failed on the last ranks only.
                raise ValueError(
                    f"{op}(): `{name}` of serial shape {tuple(state_dict[name].shape)} does not "
                    f"fit: this layer holds shards of a serial tensor of shape {tuple(serial)} "
                    f"({tuple(t.shape)} on each rank"
                    + ("" if dim is None else f", split along dim {dim}")
                    + ")"
                    + _uneven_note(state_dict[name], t, dim, pg)
                )
        # an ExpertParallelMoE inside loads its own (serial experts.{rank * E / W + i} as its
        # experts.i; as replicas, every rank took the serial experts 0.. for its own), checking
        # its keys before it copies; then this module's
        for prefix, sub in subs.items():
            skipped = sub.load_serial_state_dict(
                {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}, strict=strict
            )
            missing += [prefix + k for k in skipped.missing_keys]
            unexpected += [prefix + k for k in skipped.unexpected_keys]
        for name, (t, dim, pg) in specs.items():
            if name in state_dict:
                t.copy_(_cut(state_dict[name], _index(t, dim, pg)))
        return IncompatibleKeys(missing, unexpected)

    @classmethod
    def from_serial(cls: type[_M], serial: Any, *args: Any, **kwargs: Any) -> _M:
        """This rank's shards of ``serial``: ``cls(*args, **kwargs)``, then
        :meth:`load_serial_state_dict` of ``serial.state_dict()`` (no communication).

        For a model of your own that subclasses ``ParallelModule``: ``args`` and
        ``kwargs`` are its constructor's (the parallel layers override this with their
        own signature, e.g. ``ColumnParallelLinear.from_serial(linear, group)``).

        Example::

            serial = Model(512)                       # nn.Linear / nn.Embedding / ... inside
            model = ParallelModel.from_serial(serial, 512)   # ParallelModel(512) + shards
        """
        module = cls(*args, **kwargs)
        module.load_serial_state_dict(serial.state_dict())
        return module

    @classmethod
    def _from_serial(cls: type[_M], serial: nn.Module, *args: Any, **kwargs: Any) -> _M:
        """``cls(*args, **kwargs)`` with the dtype and device of ``serial``'s first
        parameter, not initialised, then loaded with this rank's shards of ``serial``'s
        state dict (no communication): the body of every ``from_serial``."""
        like = next(serial.parameters())
        make: Callable[..., _M] = cls  # a subclass's constructor (ParallelModule's takes none)
        layer = make(*args, dtype=like.dtype, device=like.device, _init=False, **kwargs)
        layer.load_serial_state_dict(serial.state_dict())
        return layer


_M = TypeVar("_M", bound=ParallelModule)


def _mapped_subtrees(root: nn.Module) -> dict[str, Any]:
    """``{prefix + ".": module}`` of the modules inside ``root`` that map themselves to
    their serial twin with names of their own (``serial_names()``: an ExpertParallelMoE,
    whose local ``experts.i`` is the serial ``experts.{rank * E / W + i}``), outermost only;
    their tensors are theirs to gather and load."""
    out: dict[str, Any] = {}
    for prefix, m in root.named_modules(remove_duplicate=False):
        if m is root or isinstance(m, ParallelModule) or f"{prefix}.".startswith(tuple(out)):
            continue
        if callable(getattr(m, "serial_names", None)) and callable(
            getattr(m, "load_serial_state_dict", None)
        ):
            out[f"{prefix}."] = m
    return out


def serial_shape(t: Tensor, dim: int | None, pg: Any) -> tuple[int, ...]:
    """The serial tensor's shape of ``t``, sharded evenly along ``dim`` over ``pg`` (or
    replicated)."""
    shape = list(t.shape)
    if dim is not None:
        shape[dim] *= B.get_backend().world_size(pg)
    return tuple(shape)


def _same_spec(a: tuple[Tensor, int | None, Any], b: tuple[Tensor, int | None, Any]) -> bool:
    return a[1] == b[1] and a[2] is b[2]


def _describe(spec: tuple[Tensor, int | None, Any]) -> str:
    _, dim, pg = spec
    if dim is None:
        return "replicated"
    return f"sharded along dim {dim} over {'the default group' if pg is None else f'group {pg!r}'}"


def _index(t: Tensor, dim: int | None, pg: Any) -> Index:
    """The part of the serial tensor that ``t`` (sharded along ``dim`` over ``pg``, or
    replicated) is on this rank."""
    index = [slice(None)] * t.dim()
    if dim is not None:
        n = t.shape[dim]
        r = rank_index(pg)  # (per simulated rank under LocalTensorMode)
        index[dim] = slice(r * n, (r + 1) * n)
    return tuple(index)


def _uneven_note(full: Tensor, t: Tensor, dim: int | None, pg: Any) -> str:
    """What a serial size along the split ``dim`` other than ``n * world`` means: a
    ParallelModule's shards are even (rank ``r`` holds ``[r*n, (r+1)*n)``, what
    :func:`_index` cuts). Uneven shards of a layer of one's own would else load other ranks'
    rows: ``[4, 3, 3]`` of 10 rows gave rank 1 rows 3-5 for 4-6. Empty where even."""
    if dim is None or full.dim() <= dim:
        return ""
    n, world = t.shape[dim], B.get_backend().world_size(pg)
    if not isinstance(n, int) or full.shape[dim] == n * world:
        return ""
    return (
        f"; {n} * {world} = {n * world} != {full.shape[dim]}: a ParallelModule's shards are "
        f"even (rank r holds [r*{n}, (r+1)*{n})): pad the serial dimension to a multiple of {world}"
    )


def _cut(full: Tensor, index: Index) -> Tensor:
    """``full[index]`` for :meth:`ParallelModule.serial_slices`'s index, by ``narrow``
    (under torch's ``LocalTensorMode`` a slice's bounds hold one int per simulated rank,
    which ``narrow`` takes and tuple indexing does not)."""
    for dim, part in enumerate(index):
        if part.start is not None:
            if not isinstance(part.start, int):
                full = every_rank(full)
            full = full.narrow(dim, part.start, part.stop - part.start)
    return full
