"""Tensor- and sequence-parallel layers, their serial references, and sharded init.

Layout: activations are ``[s, b, h]`` (sequence first, as Megatron-LM and
``nn.MultiheadAttention``'s default) or any ``(..., h)``; the hidden dimension is the last
one, and ``sequence_dim`` (default 0) names the sequence dimension for sequence
parallelism.

Every parallel layer here is a :class:`ParallelModule`: each of its parameters is a
shard (or a replica) of the parameter with the same name in a serial reference module
(``nn.Linear``, ``nn.Embedding``, :class:`MLP`, :class:`SelfAttention`). From that one
fact follow

* ``serial_slices()``: which part of each serial parameter this rank holds (what
  :func:`diffcomm.testing.assert_matches_serial` compares gradients against);
* ``from_serial(module)`` / ``load_serial_state_dict(sd)`` / ``to_serial_state_dict()``:
  load a parallel layer from a serial checkpoint and back;
* **initialisation equal to the serial layer's**: each layer draws the *full* weight on
  the CPU, in the serial layer's order (weight, then bias), with the serial layer's
  initialiser, and keeps its shard. ``ParallelMLP(h, f, seed=s)`` holds exactly the
  shards of ``torch.manual_seed(s); MLP(h, f)``; with ``seed=None`` the default CPU
  generator is used, which must then be in the same state on every rank of the group
  (:func:`diffcomm.rng.model_parallel_seed` seeds it that way).

Shards are even: a sharded dimension must divide by the group size (``ValueError``
otherwise; pad e.g. the vocabulary to a multiple of the group size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _args as A
from .. import _config, rng
from .. import backend as B
from .. import collectives as C
from . import overlap as O
from ._check import check_replicated
from .mappings import (
    all_gather_from_sequence,
    copy_to_region,
    copy_to_region_coalesced,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)

__all__ = [
    "ParallelModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "SequenceParallelLayerNorm",
    "ParallelMLP",
    "ParallelSelfAttention",
    "MLP",
    "SelfAttention",
]

Index = tuple[slice, ...]


# ======================================================================================
# helpers: validation, generators, activations
# ======================================================================================


def _positive(op: str, arg: str, value: Any) -> int:
    value = A.check_int(value, op, arg)
    if value < 1:
        raise A.arg_error(op, arg, "a positive int", value)
    return value


def _divisible(op: str, arg: str, value: int, world: int, what: str) -> int:
    if value % world != 0:
        raise A.arg_error(
            op,
            arg,
            f"divisible by the group size {world} ({what} are split evenly; pad it to a multiple of {world})",
            value,
        )
    return value // world


def _generator(op: str, seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
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


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
}


def _activation(op: str, activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    if callable(activation):
        return activation
    if isinstance(activation, str) and activation in _ACTIVATIONS:
        return _ACTIVATIONS[activation]
    raise A.arg_error(op, "activation", f"a callable or one of {sorted(_ACTIVATIONS)}", repr(activation))


def _model_parallel_stream() -> Any:
    """``with`` block drawing from the model-parallel RNG stream (different per TP rank)."""
    tracker = rng.get_tracker()
    if rng.MODEL_PARALLEL_RNG not in tracker:
        raise RuntimeError(
            "diffcomm.parallel: dropout on a tensor-parallel shard draws from the "
            f"{rng.MODEL_PARALLEL_RNG!r} RNG stream (different masks on every TP rank), which "
            "is not set up; call diffcomm.rng.model_parallel_seed(seed, tp_rank=...) first"
        )
    return tracker.fork()


def _dropout(x: Tensor, p: float, training: bool, sharded: bool) -> Tensor:
    """Dropout; on a tensor-parallel shard it draws from the model-parallel RNG stream."""
    if p == 0.0 or not training:
        return x
    if not sharded:
        return F.dropout(x, p, True)
    with _model_parallel_stream():
        return F.dropout(x, p, True)


def _full_linear_init(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype, gen: torch.Generator | None
) -> tuple[Tensor, Tensor | None]:
    """``nn.Linear``'s ``reset_parameters``, on the CPU, drawing from ``gen``."""
    w = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features, dtype=dtype)
        nn.init.uniform_(b, -bound, bound, generator=gen)
    return w, b


def _resolve(op: str, group: A.GroupLike) -> tuple[Any, int, int]:
    pg = A.resolve_group(group, op)
    backend = B.get_backend()
    return pg, backend.world_size(pg), backend.rank(pg)


# ======================================================================================
# the base class: parameters as shards of a serial module's
# ======================================================================================


def _enter_region(module: ParallelModule, args: Any) -> None:
    """Forward pre-hook of every ParallelModule; acts in the outermost one only: copies
    every partial-gradient replica of the module tree into the region at once (one
    coalesced reduction in backward per group; a lone tensor uses ``copy_to_region``)."""
    if module.__dict__.get("_region_copies") is not None:
        return  # inside an outer ParallelModule's forward: it made the copies
    members = [m for m in module.modules() if isinstance(m, ParallelModule)]
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
        outs = [copy_to_region(ps[0], pg)] if len(ps) == 1 else copy_to_region_coalesced(ps, pg)
        copies.update(zip((id(p) for p in ps), outs))
    for m in members:
        m.__dict__["_region_copies"] = copies
    module.__dict__["_region_root"] = True


def _leave_region(module: ParallelModule, args: Any, output: Any) -> None:
    """Forward hook (always called): the outermost module drops the copies again."""
    if module.__dict__.pop("_region_root", False):
        for m in module.modules():
            m.__dict__.pop("_region_copies", None)


class ParallelModule(nn.Module):
    """A module whose parameters are shards or replicas of a serial module's.

    Leaf layers declare ``_shard_dims = {param_name: dim or None}`` (``None``: replicated)
    and hold their process group in ``_pg``; parameters of submodules that declare
    nothing are replicated. Everything below is derived from that.
    """

    _shard_dims: dict[str, int | None] = {}
    _pg: Any = None

    def __init__(self) -> None:
        super().__init__()
        # one coalesced reduction per step for the partial-gradient replicas (see below)
        self.register_forward_pre_hook(_enter_region)
        self.register_forward_hook(_leave_region, always_call=True)

    def _partial_grad_params(self) -> tuple[str, ...]:
        """Names of this module's own parameters that are replicated but receive a
        **per-rank partial gradient** (they meet a rank-local sequence chunk): a
        sequence-parallel ``RowParallelLinear``'s bias, a sequence-parallel layer norm's
        weight and bias. Their gradients must be summed over the group."""
        return ()

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

    def _param_specs(self) -> dict[str, tuple[int | None, Any]]:
        """``{full param name: (shard dim or None, group)}`` over the whole module tree."""
        specs: dict[str, tuple[int | None, Any]] = {}
        for prefix, module in self.named_modules():
            dims = getattr(module, "_shard_dims", {}) if isinstance(module, ParallelModule) else {}
            for name, _ in module.named_parameters(recurse=False):
                full = f"{prefix}.{name}" if prefix else name
                specs[full] = (dims.get(name), getattr(module, "_pg", None))
        return specs

    def serial_slices(self) -> dict[str, Index]:
        """Which part of each serial parameter this rank's parameter is.

        Returns:
            ``{name: index}``: ``serial_param[index]`` has this rank's parameter's shape
            and values (a tuple of slices; full slices for replicated parameters).
        """
        backend = B.get_backend()
        out: dict[str, Index] = {}
        params = dict(self.named_parameters())
        for name, (dim, pg) in self._param_specs().items():
            p = params[name]
            index = [slice(None)] * p.dim()
            if dim is not None:
                n = p.shape[dim]
                r = backend.rank(pg)
                index[dim] = slice(r * n, (r + 1) * n)
            out[name] = tuple(index)
        return out

    @torch.no_grad()
    def to_serial_state_dict(self) -> dict[str, Tensor]:
        """The serial module's state dict (full parameters), on every rank.

        Communicates (one all_gather per sharded parameter, in the same order on every
        rank), so call it on every rank.

        Returns:
            ``{name: full tensor}``, loadable with ``serial.load_state_dict(...)``.
        """
        params = dict(self.named_parameters())
        out: dict[str, Tensor] = {}
        for name, (dim, pg) in self._param_specs().items():
            p = params[name].detach()
            if dim is None:
                out[name] = p.clone()
            else:
                world = B.get_backend().world_size(pg)
                out[name] = C.all_gather(p, dim, pg, split_sizes=[p.shape[dim]] * world)
        return out

    @torch.no_grad()
    def load_serial_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Copy this rank's shards out of a serial module's state dict (no communication).

        Args:
            state_dict: the serial module's ``state_dict()`` (full parameters).
            strict: raise ``KeyError`` for missing or unexpected keys.

        Raises:
            KeyError: with ``strict``, keys missing from or unknown to this module.
            ValueError: a serial tensor's shape does not fit this rank's shard.
        """
        params = dict(self.named_parameters())
        slices = self.serial_slices()
        missing = [k for k in params if k not in state_dict]
        unexpected = [k for k in state_dict if k not in params]
        if strict and (missing or unexpected):
            raise KeyError(
                f"{type(self).__name__}.load_serial_state_dict(): missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        for name, p in params.items():
            if name not in state_dict:
                continue
            src = state_dict[name][slices[name]]
            if src.shape != p.shape:
                raise ValueError(
                    f"{type(self).__name__}.load_serial_state_dict(): `{name}` of serial shape "
                    f"{tuple(state_dict[name].shape)} gives a shard of shape {tuple(src.shape)}, "
                    f"this rank's parameter has shape {tuple(p.shape)}"
                )
            p.copy_(src)


# ======================================================================================
# linear layers
# ======================================================================================


class _ParallelLinear(ParallelModule):
    """What the column- and row-parallel linears share: parameter creation, the serial
    ``nn.Linear`` init cut to this rank's shard, and ``from_serial``. The shard layout
    itself is ``_shard_dims``, read through :meth:`ParallelModule.load_serial_state_dict`."""

    in_features: int
    out_features: int

    def _make_params(
        self, weight_shape: tuple[int, int], bias_shape: tuple[int], bias: bool, dtype: Any, device: Any
    ) -> None:
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_shape, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``nn.Linear`` init on the CPU from ``generator``; keep this shard."""
        w, b = _full_linear_init(
            self.out_features, self.in_features, self.bias is not None, self.weight.dtype, generator
        )
        self.load_serial_state_dict({"weight": w} if b is None else {"weight": w, "bias": b})

    @classmethod
    def from_serial(cls: type[_L], linear: nn.Linear, group: A.GroupLike = None, **kwargs: Any) -> _L:
        """This rank's shard of the serial ``linear`` (no communication).

        Args:
            linear: the serial layer (same on every rank).
            group: the tensor-parallel group.
            **kwargs: the layer's own options (``gather_output`` / ``input_is_parallel``,
                ``sequence_parallel``, ``sequence_dim``).
        """
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group=group,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            _init=False,
            **kwargs,
        )
        layer.load_serial_state_dict(linear.state_dict())
        return layer


_L = TypeVar("_L", bound=_ParallelLinear)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` split by rows (output features) across the group.

    Rank ``r`` holds rows ``[r*o, (r+1)*o)`` of the serial ``nn.Linear(in, out)`` weight
    and bias (``o = out // world``) and computes those output features.

    Args:
        in_features: input size.
        out_features: output size; divisible by the group size.
        bias: whether to learn a bias (sharded like the weight).
        gather_output: all_gather the output features (``gather_from_region``), so every
            rank gets the full ``out_features``; else the output stays sharded.
        sequence_parallel: the input is sharded along ``sequence_dim`` and gathered
            (``all_gather_from_sequence``); else it is replicated (``copy_to_region``).
        sequence_dim: the sequence dimension of the input (default 0, ``[s, b, h]``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        overlap: hide communication behind computation (:mod:`diffcomm.parallel.overlap`,
            ``docs/async.md``): ``"comm"`` launches the input-gradient all_reduce /
            reduce_scatter before the weight-gradient matmul (bit-identical results);
            ``"ring"`` (sequence parallel) decomposes all_gather -> matmul into ring
            steps; ``True`` picks ``"ring"`` with sequence parallelism, else ``"comm"``;
            ``False`` (default) runs the blocking mappings.
        seed: draw the full initial weight from ``torch.Generator().manual_seed(seed)``.
        generator: or from this CPU generator (``None`` and no seed: the default one).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (the full weight is drawn on the CPU).

    Shapes:
        input ``(*, in)`` (``sequence_parallel``: the local sequence chunk); output
        ``(*, out // world)``, or ``(*, out)`` with ``gather_output``; with
        ``sequence_parallel`` the output covers the full sequence.

    Gradient:
        replicated objective. The input gradient is all-reduced (``copy_to_region``) or
        reduce-scattered (``all_gather_from_sequence``); weight and bias gradients are
        this rank's rows of the serial gradients.

    Example::

        def f():
            lin = ColumnParallelLinear(4, 6, gather_output=True, seed=0)
            return lin(torch.ones(3, 4)).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([3, 6]), torch.Size([3, 6])]
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: A.GroupLike = None,
        overlap: bool | str = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        op = "parallel.ColumnParallelLinear"
        self._pg, self.world_size, self.rank = _resolve(op, group)
        self.in_features = _positive(op, "in_features", in_features)
        self.out_features = _positive(op, "out_features", out_features)
        self.out_per_rank = _divisible(op, "out_features", out_features, self.world_size, "output features")
        if gather_output and sequence_parallel:
            raise A.arg_error(op, "gather_output", "False when sequence_parallel=True", gather_output)
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = A.check_int(sequence_dim, op, "sequence_dim")
        self.overlap = O.resolve_mode(op, overlap, self.sequence_parallel)
        self._make_params((self.out_per_rank, in_features), (self.out_per_rank,), bias, dtype, device)
        self._shard_dims = {"weight": 0, "bias": 0}
        gen = _generator(op, seed, generator)
        if _init:
            self.reset_parameters(gen)

    def forward(self, x: Tensor) -> Tensor:
        if self.overlap is not None:
            y = self._overlapped(x)
        elif self.sequence_parallel:
            x = all_gather_from_sequence(x, self.sequence_dim, self._pg)
            y = F.linear(x, self.weight, self.bias)
        else:
            x = copy_to_region(x, self._pg)
            y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_region(y, -1, self._pg)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_per_rank} per rank), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
            + (f", overlap={self.overlap!r}" if self.overlap else "")
        )

    def _overlapped(self, x: Tensor) -> Tensor:
        op = "parallel.ColumnParallelLinear"
        x = A.check_tensor(x, op, "x")
        sp_dim = None
        if self.sequence_parallel:
            sp_dim = A.check_dim(x, self.sequence_dim, op, "sequence_dim")
            if _config.DEBUG.get():
                B.get_backend().check_consistent(
                    op, {"shape": tuple(x.shape), "dtype": x.dtype}, self._pg
                )
        elif _config.DEBUG.get():
            check_replicated(x, op, "the input", "use sequence_parallel=True for a sharded input", self._pg)
        return O.column_linear(x, self.weight, self.bias, self.overlap, sp_dim, self._pg)  # type: ignore[arg-type]


class RowParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` split by columns (input features) across the group.

    Rank ``r`` holds columns ``[r*i, (r+1)*i)`` of the serial ``nn.Linear(in, out)``
    weight (``i = in // world``) and the whole bias (replicated; added once, after the
    reduction).

    Args:
        in_features: input size; divisible by the group size.
        out_features: output size.
        bias: whether to learn a bias.
        input_is_parallel: the input is already split along its last dim (e.g. a
            ColumnParallelLinear output); else it is replicated and this rank keeps its
            chunk (``scatter_to_region``). Must be ``True`` with ``sequence_parallel``.
        sequence_parallel: reduce-scatter the output along ``sequence_dim``
            (``reduce_scatter_to_sequence``) instead of all-reducing it
            (``reduce_from_region``).
        sequence_dim: the sequence dimension (default 0, ``[s, b, h]``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        overlap: with sequence parallelism, ``True`` or ``"ring"`` decomposes matmul ->
            reduce_scatter (and the backward all_gather -> matmul) into ring steps
            (:mod:`diffcomm.parallel.overlap`); ``"comm"`` and ``False`` run the blocking
            mappings (a row-parallel linear has no communication to move in ``"comm"``
            mode: its forward result is needed at once, its input gradient is local).
        seed, generator, dtype, device: as :class:`ColumnParallelLinear`.

    Shapes:
        input ``(*, in // world)`` (or ``(*, in)`` without ``input_is_parallel``); output
        ``(*, out)``, with ``sequence_parallel`` only this rank's sequence chunk.

    Gradient:
        replicated objective. The input gradient is this rank's columns
        (``reduce_from_region``'s identity) or comes from an all_gather
        (``reduce_scatter_to_sequence``). With ``sequence_parallel`` the bias meets a
        different sequence chunk on every rank, so it enters through ``copy_to_region``
        and its gradient is all-reduced (one all_reduce of ``out`` elements in backward)
        — the full serial bias gradient on every rank, no optimizer hook needed.

    Example::

        def f():
            lin = RowParallelLinear(4, 6, seed=0)      # input_is_parallel=False: scatters
            return lin(torch.ones(3, 4)).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([3, 6]), torch.Size([3, 6])]
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: A.GroupLike = None,
        overlap: bool | str = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        op = "parallel.RowParallelLinear"
        self._pg, self.world_size, self.rank = _resolve(op, group)
        self.in_features = _positive(op, "in_features", in_features)
        self.out_features = _positive(op, "out_features", out_features)
        self.in_per_rank = _divisible(op, "in_features", in_features, self.world_size, "input features")
        if sequence_parallel and not input_is_parallel:
            raise A.arg_error(op, "input_is_parallel", "True when sequence_parallel=True", input_is_parallel)
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = A.check_int(sequence_dim, op, "sequence_dim")
        self.overlap = O.resolve_mode(op, overlap, self.sequence_parallel)
        self._make_params((out_features, self.in_per_rank), (out_features,), bias, dtype, device)
        self._shard_dims = {"weight": 1, "bias": None}
        gen = _generator(op, seed, generator)
        if _init:
            self.reset_parameters(gen)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, -1, self._pg)
        if self.sequence_parallel and self.overlap == "ring":
            dim = A.check_dim(x, self.sequence_dim, "parallel.RowParallelLinear", "sequence_dim")
            if x.shape[dim] % self.world_size:
                reduce_scatter_to_sequence(x, dim, self._pg)  # raises the mapping's ValueError
            y = O.row_linear_sequence_ring(x, self.weight, dim, self._pg)
            if self.bias is not None:
                y = y + self._region_param("bias")
            return y
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.sequence_dim, self._pg)
            if self.bias is not None:
                y = y + self._region_param("bias")
        else:
            y = reduce_from_region(y, self._pg)
            if self.bias is not None:
                y = y + self.bias
        return y

    def _partial_grad_params(self) -> tuple[str, ...]:
        return ("bias",) if self.sequence_parallel and self.bias is not None else ()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_per_rank} per rank), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
            + (f", overlap={self.overlap!r}" if self.overlap else "")
        )


# ======================================================================================
# embedding
# ======================================================================================


class VocabParallelEmbedding(ParallelModule):
    """``nn.Embedding`` with the vocabulary split in contiguous ranges across the group.

    Rank ``r`` holds rows ``[r*v, (r+1)*v)`` of the serial weight (``v = num // world``),
    looks up the ids in its range, writes zeros for the others, and the partial results
    are summed (``reduce_from_region``), or reduce-scattered along ``sequence_dim``
    (``reduce_scatter_to_sequence``) with ``sequence_parallel``.

    Args:
        num_embeddings: vocabulary size; divisible by the group size (pad the vocabulary).
        embedding_dim: embedding size.
        sequence_parallel: give each rank only its sequence chunk of the output.
        sequence_dim: the sequence dimension of the ids (default 0, ``[s, b]``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        seed, generator, dtype, device: as :class:`ColumnParallelLinear` (init:
            ``nn.Embedding``'s ``normal_(0, 1)`` of the full table).

    Shapes:
        ids ``(*)`` integer, the same on every rank; output ``(*, embedding_dim)``
        (with ``sequence_parallel``: ``sequence_dim`` divided by the group size).

    Gradient:
        replicated objective: the weight gradient is this rank's rows of the serial one
        (ids outside the range contribute nothing). Debug mode checks the ids are equal on
        every rank.

    Example::

        def f():
            emb = VocabParallelEmbedding(8, 3, seed=0)
            return emb(torch.tensor([[0, 7]])).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([1, 2, 3]), torch.Size([1, 2, 3])]
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: A.GroupLike = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        op = "parallel.VocabParallelEmbedding"
        self._pg, self.world_size, self.rank = _resolve(op, group)
        self.num_embeddings = _positive(op, "num_embeddings", num_embeddings)
        self.embedding_dim = _positive(op, "embedding_dim", embedding_dim)
        self.per_rank = _divisible(op, "num_embeddings", num_embeddings, self.world_size, "vocabulary rows")
        self.vocab_start = self.rank * self.per_rank
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = A.check_int(sequence_dim, op, "sequence_dim")
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype, device=device))
        self._shard_dims = {"weight": 0}
        gen = _generator(op, seed, generator)
        if _init:
            self.reset_parameters(gen)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``nn.Embedding`` init (``normal_``) on the CPU; keep this shard."""
        w = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
        nn.init.normal_(w, generator=generator)
        self.weight.copy_(w[self.vocab_start : self.vocab_start + self.per_rank])

    @classmethod
    def from_serial(
        cls, embedding: nn.Embedding, group: A.GroupLike = None, **kwargs: Any
    ) -> VocabParallelEmbedding:
        """This rank's vocabulary shard of ``embedding`` (``padding_idx``, ``max_norm``
        are not supported)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise A.arg_error(
                "parallel.VocabParallelEmbedding.from_serial",
                "embedding",
                "an nn.Embedding without padding_idx / max_norm",
                embedding,
            )
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            group=group,
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
            _init=False,
            **kwargs,
        )
        layer.load_serial_state_dict(embedding.state_dict())
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        op = "parallel.VocabParallelEmbedding"
        ids = A.check_tensor(ids, op, "ids")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise A.arg_error(op, "ids", "an integer tensor", str(ids.dtype), TypeError)
        if _config.DEBUG.get():
            check_replicated(
                ids,
                f"{op} forward",
                "the token ids",
                "Every rank of the tensor-parallel group must look up the same ids.",
                self._pg,
            )
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.sequence_dim, self._pg)
        return reduce_from_region(out, self._pg)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} ({self.per_rank} per rank), {self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


# ======================================================================================
# worked examples: MLP and self-attention (serial references and parallel versions)
# ======================================================================================


class SequenceParallelLayerNorm(ParallelModule):
    """``nn.LayerNorm`` over the last dim of a sequence chunk (sequence parallelism).

    The weight and bias are replicated (each rank holds the whole serial parameters), but
    each rank normalises only its own chunk of the sequence, so each rank's gradient of
    them is a **partial** sum: they enter through the tensor-parallel region copy
    (:meth:`ParallelModule._region_param`), and their gradients are summed over the group
    in the step's one coalesced all_reduce — together with every other such parameter of
    the outermost :class:`ParallelModule` (e.g. the row-parallel biases of a block).

    Args:
        normalized_shape: the hidden size (an int; the last dimension).
        eps: as ``nn.LayerNorm``.
        elementwise_affine: learn a weight (and a bias, see ``bias``).
        bias: learn a bias (with ``elementwise_affine``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        dtype, device: of the parameters.

    Shapes:
        input and output ``(*, normalized_shape)``: this rank's sequence chunk.

    Gradient:
        replicated objective: the input gradient is this rank's chunk of the serial one;
        the weight and bias gradients are the serial ones (summed over the group).

    Example::

        def f():
            ln = SequenceParallelLayerNorm(4)
            return ln(torch.randn(3, 2, 4)).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([3, 2, 4]), torch.Size([3, 2, 4])]
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        group: A.GroupLike = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        op = "parallel.SequenceParallelLayerNorm"
        self._pg, self.world_size, self.rank = _resolve(op, group)
        self.normalized_shape = (_positive(op, "normalized_shape", normalized_shape),)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        kw = {"dtype": dtype, "device": device}
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **kw))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kw)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.bias = None
        if self.bias is None:
            self.register_parameter("bias", None)
        self._shard_dims = {"weight": None, "bias": None}

    @classmethod
    def from_serial(cls, layer_norm: nn.LayerNorm, group: A.GroupLike = None) -> SequenceParallelLayerNorm:
        """The same layer norm (its parameters copied) for sequence chunks."""
        (h,) = layer_norm.normalized_shape
        weight = layer_norm.weight
        layer = cls(
            h,
            layer_norm.eps,
            layer_norm.elementwise_affine,
            layer_norm.bias is not None,
            group=group,
            dtype=weight.dtype if weight is not None else None,
            device=weight.device if weight is not None else None,
        )
        layer.load_serial_state_dict(layer_norm.state_dict())
        return layer

    def _partial_grad_params(self) -> tuple[str, ...]:
        return tuple(n for n in ("weight", "bias") if getattr(self, n) is not None)

    def forward(self, x: Tensor) -> Tensor:
        w = self._region_param("weight") if self.weight is not None else None
        b = self._region_param("bias") if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class MLP(nn.Module):
    """The serial reference of :class:`ParallelMLP`: ``fc2(dropout(act(fc1(x))))``.

    Args:
        hidden_size: input and output size.
        ffn_hidden_size: inner size.
        bias: biases in both linears.
        activation: ``"gelu"``, ``"relu"``, ``"silu"``, ``"tanh"`` or a callable.
        dropout: dropout probability on the inner activation (training only).
        dtype, device: parameter dtype and device.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        dropout: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias, dtype=dtype, device=device)
        self.activation = activation
        self._act = _activation("parallel.MLP", activation)
        self.dropout = float(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(_dropout(self._act(self.fc1(x)), self.dropout, self.training, sharded=False))


class ParallelMLP(ParallelModule):
    """Tensor-parallel MLP: ``ColumnParallelLinear -> act -> dropout -> RowParallelLinear``.

    The inner activation stays sharded (``ffn_hidden_size / world`` features per rank),
    so a step communicates once forward and once backward: without sequence parallelism
    one all_reduce each way (in ``fc2`` forward, ``fc1`` backward); with it an all_gather
    and a reduce_scatter forward and the same pair backward (plus the small all_reduce of
    ``fc2``'s bias gradient, see :class:`RowParallelLinear`). Dropout on the sharded
    activation draws from the model-parallel RNG stream
    (``diffcomm.rng.get_tracker().fork()``), so every TP rank drops different units.

    Args:
        hidden_size: input and output size.
        ffn_hidden_size: inner size; divisible by the group size.
        bias: biases in both linears.
        activation: as :class:`MLP`.
        dropout: dropout probability on the (sharded) inner activation.
        sequence_parallel: input and output are sharded along ``sequence_dim``.
        sequence_dim: the sequence dimension (default 0, ``[s, b, h]``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        overlap: passed to both linears (see :class:`ColumnParallelLinear`): ``True``
            overlaps ``fc1``'s backward all_reduce with its weight gradient, or with
            sequence parallelism runs both linears' collectives as ring steps.
        seed: the parameters are this rank's shards of ``torch.manual_seed(seed);
            MLP(hidden_size, ffn_hidden_size, bias)``.
        generator, dtype, device: as :class:`ColumnParallelLinear`.

    Shapes:
        input and output ``(*, hidden_size)``, replicated; with ``sequence_parallel``
        this rank's chunk along ``sequence_dim``.

    Gradient:
        replicated objective: the input gradient equals the serial one (replicated, or
        this rank's sequence chunk); parameter gradients are this rank's shards of the
        serial ones.

    Example::

        def f():
            mlp = ParallelMLP(8, 32, seed=0)
            return mlp(torch.ones(5, 2, 8)).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([5, 2, 8]), torch.Size([5, 2, 8])]
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        group: A.GroupLike = None,
        overlap: bool | str = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        op = "parallel.ParallelMLP"
        gen = _generator(op, seed, generator)
        common = dict(
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            group=group,
            overlap=overlap,
            dtype=dtype,
            device=device,
            _init=_init,
        )
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, generator=gen, **common)
        self.fc2 = RowParallelLinear(
            ffn_hidden_size, hidden_size, bias, input_is_parallel=True, generator=gen, **common
        )
        self._pg = self.fc1._pg
        self.activation = activation
        self._act = _activation(op, activation)
        if not 0.0 <= float(dropout) < 1.0:
            raise A.arg_error(op, "dropout", "a probability in [0, 1)", dropout)
        self.dropout = float(dropout)
        self.sequence_parallel = bool(sequence_parallel)

    @classmethod
    def from_serial(cls, mlp: MLP, group: A.GroupLike = None, **kwargs: Any) -> ParallelMLP:
        """This rank's shards of the serial :class:`MLP` (same activation and dropout).

        Args:
            mlp: the serial MLP (same on every rank).
            group: the tensor-parallel group.
            **kwargs: ``sequence_parallel``, ``sequence_dim``.
        """
        layer = cls(
            mlp.fc1.in_features,
            mlp.fc1.out_features,
            mlp.fc1.bias is not None,
            activation=mlp.activation,
            dropout=mlp.dropout,
            group=group,
            dtype=mlp.fc1.weight.dtype,
            device=mlp.fc1.weight.device,
            _init=False,
            **kwargs,
        )
        layer.load_serial_state_dict(mlp.state_dict())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        h = self._act(self.fc1(x))
        h = _dropout(h, self.dropout, self.training, sharded=True)
        return self.fc2(h)


def _attention(
    qkv: Tensor, heads: int, causal: bool, dropout: float, training: bool, sharded: bool
) -> Tensor:
    """``qkv``: ``(s, b, heads * 3 * d)`` laid out per head as ``[q_h, k_h, v_h]``."""
    s, b, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.reshape(s, b, heads, 3, d).permute(3, 1, 2, 0, 4).unbind(0)  # (b, heads, s, d) each
    p = dropout if training else 0.0
    if p > 0.0 and sharded:
        with _model_parallel_stream():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
    else:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class SelfAttention(nn.Module):
    """The serial reference of :class:`ParallelSelfAttention`.

    ``qkv = nn.Linear(h, 3h)`` whose output is laid out **per head** as
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (Megatron's layout, so a contiguous block of
    output features is a set of whole heads), scaled dot-product attention, and
    ``proj = nn.Linear(h, h)``.

    Args:
        hidden_size: model size; divisible by ``num_heads``.
        num_heads: attention heads.
        bias: biases in both linears.
        causal: causal mask.
        attention_dropout: dropout on the attention probabilities (training only).
        dtype, device: parameter dtype and device.

    Shapes:
        input and output ``(s, b, hidden_size)``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        bias: bool = True,
        *,
        causal: bool = False,
        attention_dropout: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        op = "parallel.SelfAttention"
        _positive(op, "num_heads", num_heads)
        _divisible(op, "hidden_size", hidden_size, num_heads, "hidden features (per head)")
        self.num_heads = num_heads
        self.causal = bool(causal)
        self.attention_dropout = float(attention_dropout)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden_size, hidden_size, bias, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        y = _attention(self.qkv(x), self.num_heads, self.causal, self.attention_dropout, self.training, False)
        return self.proj(y)


class ParallelSelfAttention(ParallelModule):
    """Tensor-parallel self-attention: heads split across the group.

    ``qkv`` is a :class:`ColumnParallelLinear` (rank ``r`` holds the q/k/v projections of
    heads ``[r*n, (r+1)*n)``, ``n = num_heads // world``), attention runs locally on those
    heads, and ``proj`` is a :class:`RowParallelLinear` fed the local heads. Communication
    per step is as in :class:`ParallelMLP`.

    Args:
        hidden_size: model size; divisible by ``num_heads``.
        num_heads: attention heads; divisible by the group size.
        bias: biases in both linears.
        causal: causal mask.
        attention_dropout: dropout on the attention probabilities, drawn from the
            model-parallel RNG stream (heads differ per rank).
        sequence_parallel: input and output are sharded along the sequence (dim 0).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        seed: the parameters are this rank's shards of ``torch.manual_seed(seed);
            SelfAttention(hidden_size, num_heads, bias)``.
        generator, dtype, device: as :class:`ColumnParallelLinear`.

    Shapes:
        input and output ``(s, b, hidden_size)``; with ``sequence_parallel``
        ``(s // world, b, hidden_size)``.

    Gradient:
        replicated objective, as :class:`ParallelMLP`.

    Example::

        def f():
            attn = ParallelSelfAttention(8, num_heads=4, causal=True, seed=0)
            return attn(torch.ones(5, 2, 8)).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([5, 2, 8]), torch.Size([5, 2, 8])]
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        bias: bool = True,
        *,
        causal: bool = False,
        attention_dropout: float = 0.0,
        sequence_parallel: bool = False,
        group: A.GroupLike = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        op = "parallel.ParallelSelfAttention"
        pg, world, _ = _resolve(op, group)
        _positive(op, "num_heads", num_heads)
        _divisible(op, "hidden_size", hidden_size, num_heads, "hidden features (per head)")
        self.heads_per_rank = _divisible(op, "num_heads", num_heads, world, "heads")
        gen = _generator(op, seed, generator)
        common = dict(sequence_parallel=sequence_parallel, group=pg, dtype=dtype, device=device, _init=_init)
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, bias, generator=gen, **common)
        self.proj = RowParallelLinear(
            hidden_size, hidden_size, bias, input_is_parallel=True, generator=gen, **common
        )
        self._pg = pg
        self.num_heads = num_heads
        self.causal = bool(causal)
        self.attention_dropout = float(attention_dropout)
        self.sequence_parallel = bool(sequence_parallel)

    @classmethod
    def from_serial(
        cls, attention: SelfAttention, group: A.GroupLike = None, **kwargs: Any
    ) -> ParallelSelfAttention:
        """This rank's heads of the serial :class:`SelfAttention`.

        Args:
            attention: the serial module (same on every rank).
            group: the tensor-parallel group.
            **kwargs: ``sequence_parallel``.
        """
        layer = cls(
            attention.qkv.in_features,
            attention.num_heads,
            attention.qkv.bias is not None,
            causal=attention.causal,
            attention_dropout=attention.attention_dropout,
            group=group,
            dtype=attention.qkv.weight.dtype,
            device=attention.qkv.weight.device,
            _init=False,
            **kwargs,
        )
        layer.load_serial_state_dict(attention.state_dict())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        y = _attention(
            self.qkv(x), self.heads_per_rank, self.causal, self.attention_dropout, self.training, True
        )
        return self.proj(y)
