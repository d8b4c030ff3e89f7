"""Tensor- and sequence-parallel layers and their sharded init.

Layout: activations are ``[s, b, h]`` (sequence first, as Megatron-LM and
``nn.MultiheadAttention``'s default) or any ``(..., h)``; the hidden dimension is the last
one, and ``sequence_dim`` (default 0) names the sequence dimension for sequence
parallelism.

Every parallel layer here is a :class:`ParallelModule`: each of its parameters is a
shard (or a replica) of the parameter with the same name in a serial reference module
(``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``; for the ready-made blocks of
:mod:`diffcomm.parallel.blocks`, :class:`~diffcomm.parallel.blocks.MLP` and
:class:`~diffcomm.parallel.blocks.SelfAttention`). From that one fact follow

* ``serial_slices()``: which part of each serial parameter this rank holds (what
  :func:`diffcomm.testing.assert_matches_serial` compares gradients against);
* ``from_serial(module)`` / ``load_serial_state_dict(sd)`` / ``to_serial_state_dict()``:
  load a parallel layer from a serial checkpoint and back;
* **initialisation equal to the serial layer's**: each layer draws the *full* weight on
  the CPU, in the serial layer's order (weight, then bias), with the serial layer's
  initialiser, and keeps its shard. ``ColumnParallelLinear(i, o, seed=s)`` holds exactly
  the shards of ``torch.manual_seed(s); nn.Linear(i, o)``; with ``seed=None`` the default CPU
  generator is used, which must then be in the same state on every rank of the group
  (:func:`diffcomm.rng.model_parallel_seed` seeds it that way).

Shards are even: a sharded dimension must divide by the group size (``ValueError``
otherwise; pad e.g. the vocabulary to a multiple of the group size).

:class:`ParallelModule` itself and the argument checks live in the private
``diffcomm.parallel._module``; ``MLP`` / ``ParallelMLP`` / ``SelfAttention`` /
``ParallelSelfAttention`` live in :mod:`diffcomm.parallel.blocks`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _config, _torch
from .. import backend as B
from .._replication import LayerRule, R, V
from .._torch import local_tensor_mode_off
from ..backend import args as A
from ..ops.validation import rank_start
from ._autocast import like_output
from ._check import check_replicated
from ._module import (
    ParallelModule,
    check_divisible,
    check_positive,
    init_generator,
    note_drawn,
    resolve_parallel_group,
    varying_with,
)
from .mappings import (
    all_gather_from_sequence,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)
from .overlap import column_linear, resolve_mode, row_linear_sequence_ring

__all__ = [
    "LayerOptions",
    "ParallelModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
]

# Size: ~820 lines, over the ~600 guideline on purpose: a third is the public docstrings
# (six layers, each with Args / Shapes / Gradient / Example); the column and row linears
# already share one constructor (``_ParallelLinear``), the blocks built from them live in
# ``blocks``, and ``ParallelModule`` with the argument checks in ``_module``; the options
# they all take are one ``LayerOptions``.

# ======================================================================================
# linear layers
# ======================================================================================


@dataclass(frozen=True)
class LayerOptions:
    """The options the layers and blocks of this package share (``ColumnParallelLinear``,
    ``RowParallelLinear``, ``VocabParallelEmbedding``, ``SequenceParallelLayerNorm``,
    ``ParallelMLP``, ``ParallelSelfAttention``, ``MoE``, ``ExpertParallelMoE``), stated
    once: pass them as keywords, as before (``ColumnParallelLinear(4, 6, seed=0,
    group=tp)``), or as one object (``options=LayerOptions(group=tp, seed=0)``; keywords
    given too override its fields). A layer reads the fields that apply to it and refuses
    the others set to other than their defaults.

    Args:
        sequence_parallel: activations are sharded along ``sequence_dim`` between the
            layers (Megatron's sequence parallelism).
        sequence_dim: the sequence dimension (default 0, ``[s, b, h]``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        overlap: hide communication behind computation (the linears and ``ParallelMLP``;
            see :class:`ColumnParallelLinear`).
        seed: draw the full initial parameters from ``torch.Generator().manual_seed(seed)``.
        generator: or from this CPU generator (``None`` and no seed: the default one).
        dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (the full parameters are drawn on the CPU).
    """

    sequence_parallel: bool = False
    sequence_dim: int = 0
    group: A.GroupLike = None
    overlap: bool | str = False
    seed: int | None = None
    generator: torch.Generator | None = None
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None

    @classmethod
    def of(
        cls, op: str, options: LayerOptions | None, keywords: Mapping[str, Any], takes: Collection[str] = ()
    ) -> LayerOptions:
        """``options`` (default: every field's default) with ``keywords`` applied, for layer
        ``op``. ``takes``: the fields the layer reads (all when empty); a keyword it does
        not take, or a field of ``options`` it would ignore set to other than the
        default, is a ``TypeError`` naming it."""
        if options is not None and not isinstance(options, cls):
            raise A.arg_error(op, "options", "a LayerOptions", options, TypeError)
        names = [f.name for f in fields(cls)]
        taken = set(takes or names)
        for k in keywords:
            if k not in taken:
                raise TypeError(f"diffcomm.{op}(): unexpected keyword argument {k!r}")
        merged = replace(options or cls(), **keywords)
        for f in fields(cls):
            if f.name not in taken and getattr(merged, f.name) != f.default:
                raise A.arg_error(
                    op,
                    f"options.{f.name}",
                    f"{f.default!r} (it does not take it)",
                    getattr(merged, f.name),
                    TypeError,
                )
        return merged


#: the options of a layer that has no communication to overlap
_NO_OVERLAP = ("sequence_parallel", "sequence_dim", "group", "seed", "generator", "dtype", "device")


def _full_linear_init(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype, gen: torch.Generator | None
) -> tuple[Tensor, Tensor | None]:
    """``nn.Linear``'s ``reset_parameters``, on the CPU, drawing from ``gen`` (the same
    full tensors on every rank; plain tensors under torch's ``LocalTensorMode``)."""
    with local_tensor_mode_off():
        w = torch.empty(out_features, in_features, dtype=dtype)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
        b = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            b = torch.empty(out_features, dtype=dtype)
            nn.init.uniform_(b, -bound, bound, generator=gen)
    return w, b


class _ParallelLinear(ParallelModule):
    """What the column- and row-parallel linears share: the constructor (argument checks,
    the parameter shards, the serial ``nn.Linear`` init cut to this rank's shard) and
    ``from_serial``. ``shard_dim`` is the weight dim split across the group: 0 (output
    features, the bias sharded alike) or 1 (input features, the bias replicated). The
    shard layout is ``_shard_dims``, read through
    :meth:`ParallelModule.load_serial_state_dict`."""

    in_features: int
    out_features: int
    #: ``(the layer's own keyword, default False; its value with sequence_parallel=True)``
    _sequence_parallel_needs: ClassVar[tuple[str, bool]]
    _shard_dim: ClassVar[int]  #: the weight dim split across the group (see above)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        options: LayerOptions | None = None,
        _init: bool = True,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = f"parallel.{type(self).__name__}"
        flag_name, needed = self._sequence_parallel_needs
        flag = keywords.pop(flag_name, False)
        options = LayerOptions.of(op, options, keywords)
        if options.sequence_parallel and bool(flag) != needed:
            raise A.arg_error(op, flag_name, f"{needed} when sequence_parallel=True", flag)
        setattr(self, flag_name, bool(flag))
        self._pg, self.world_size, self.rank = resolve_parallel_group(op, options.group)
        self.in_features = check_positive(op, "in_features", in_features)
        self.out_features = check_positive(op, "out_features", out_features)
        if self._shard_dim == 0:
            self.out_per_rank = check_divisible(
                op, "out_features", out_features, self.world_size, "output features"
            )
            shape, self._shard_dims = (self.out_per_rank, in_features), {"weight": 0, "bias": 0}
        else:
            self.in_per_rank = check_divisible(
                op, "in_features", in_features, self.world_size, "input features"
            )
            shape, self._shard_dims = (out_features, self.in_per_rank), {"weight": 1, "bias": None}
        self.sequence_parallel = bool(options.sequence_parallel)
        self.sequence_dim = A.check_int(options.sequence_dim, op, "sequence_dim")
        self.overlap = resolve_mode(op, options.overlap, self.sequence_parallel)
        dtype, device = options.dtype or torch.get_default_dtype(), options.device
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(shape[0], dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        gen = init_generator(op, options.seed, options.generator)
        if _init:
            self.reset_parameters(gen)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``nn.Linear`` init on the CPU from ``generator``; keep this shard.

        ``None`` draws from the global CPU generator, as ``nn.Linear.reset_parameters``
        does (not from the layer's ``seed``): seeded alike on every rank, the shards of the
        serial layer reset after the same seed. The replicated bias is then checked to
        agree across the group at the next forward (``CrossRankMismatchError``): reset
        after each rank had drawn its own numbers, it differed with no error."""
        w, b = _full_linear_init(
            self.out_features, self.in_features, self.bias is not None, self.weight.dtype, generator
        )
        self.load_serial_state_dict({"weight": w} if b is None else {"weight": w, "bias": b})
        note_drawn(self, generator)

    def extra_repr(self) -> str:
        """Sizes (the split one with its per-rank count), bias, the layer's own keyword,
        ``sequence_parallel`` and ``overlap`` when on."""
        sizes = [f"in_features={self.in_features}", f"out_features={self.out_features}"]
        sizes[1 - self._shard_dim] += f" ({self.weight.shape[self._shard_dim]} per rank)"
        flag = self._sequence_parallel_needs[0]
        return (
            f"{sizes[0]}, {sizes[1]}, bias={self.bias is not None}, "
            f"{flag}={getattr(self, flag)}, sequence_parallel={self.sequence_parallel}"
            + (f", overlap={self.overlap!r}" if self.overlap else "")
        )

    @classmethod
    def from_serial(  # type: ignore[override]  # a layer takes its serial twin, not any module
        cls: type[_L], linear: nn.Linear, group: A.GroupLike = None, **kwargs: Any
    ) -> _L:
        """This rank's shard of the serial ``linear`` (no communication).

        Args:
            linear: the serial layer (same on every rank).
            group: the tensor-parallel group.
            **kwargs: the layer's own options (``gather_output`` / ``input_is_parallel``,
                ``sequence_parallel``, ``sequence_dim``).
        """
        bias = linear.bias is not None
        return cls._from_serial(linear, linear.in_features, linear.out_features, bias, group=group, **kwargs)


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
        options: the options above as one :class:`LayerOptions` (keywords given too
            override its fields); every layer and block of this package takes it.

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

    spmd = varying_with("sequence_parallel", "this rank's sequence chunk")

    _sequence_parallel_needs = ("gather_output", False)
    _shard_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        keywords["gather_output"] = gather_output
        super().__init__(in_features, out_features, bias, options=options, **keywords)

    gather_output: bool

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

    def _overlapped(self, x: Tensor) -> Tensor:
        op = "parallel.ColumnParallelLinear"
        x = A.check_tensor(x, op, "x")
        sp_dim = None
        if self.sequence_parallel:
            sp_dim = A.check_dim(x, self.sequence_dim, op, "sequence_dim")
            if _config.DEBUG.get():
                B.get_backend().check_consistent(op, {"shape": tuple(x.shape), "dtype": x.dtype}, self._pg)
        elif _config.DEBUG.get():
            check_replicated(x, op, "the input", "use sequence_parallel=True for a sharded input", self._pg)
        return column_linear(x, self.weight, self.bias, self.overlap, sp_dim, self._pg)  # type: ignore[arg-type]


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

    spmd = varying_with("input_is_parallel", "this rank's feature shard")

    _sequence_parallel_needs = ("input_is_parallel", True)
    _shard_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        keywords["input_is_parallel"] = input_is_parallel
        super().__init__(in_features, out_features, bias, options=options, **keywords)

    input_is_parallel: bool

    def forward(self, x: Tensor) -> Tensor:
        self._check_features(x)
        if not self.input_is_parallel:
            x = scatter_to_region(x, -1, self._pg)
        if self.sequence_parallel and self.overlap == "ring":
            dim = A.check_dim(x, self.sequence_dim, "parallel.RowParallelLinear", "sequence_dim")
            if x.shape[dim] % self.world_size:
                reduce_scatter_to_sequence(x, dim, self._pg)  # raises the mapping's ValueError
            y = row_linear_sequence_ring(x, self.weight, dim, self._pg)
            if self.bias is not None:
                y = y + like_output(self._region_param("bias"), y)
            return y
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.sequence_dim, self._pg)
            if self.bias is not None:
                y = y + like_output(self._region_param("bias"), y)
        else:
            y = reduce_from_region(y, self._pg)
            if self.bias is not None:
                y = y + like_output(self.bias, y)
        return y

    def _check_features(self, x: Tensor) -> None:
        """``x``'s last dim against the layer (no communication): the usual slip, a
        ColumnParallelLinear's shard fed to a layer that expects the whole input, names
        ``input_is_parallel=True`` instead of torch's matmul shape error."""
        want = self.in_per_rank if self.input_is_parallel else self.in_features
        got = x.shape[-1] if x.dim() else None
        if got == want:
            return
        head = (
            f"diffcomm.parallel.RowParallelLinear(): `x` has x.shape[-1]={got} (x.shape "
            f"{tuple(x.shape)}), but this layer (in_features={self.in_features} over "
            f"{self.world_size} ranks, input_is_parallel={self.input_is_parallel}) expects "
        )
        if not self.input_is_parallel and got == self.in_per_rank:
            raise ValueError(
                head + f"the whole input ({self.in_features}); {got} is one rank's share. For an input "
                "already split along its last dim (a ColumnParallelLinear's output with "
                "gather_output=False), make the layer with input_is_parallel=True."
            )
        if self.input_is_parallel and got == self.in_features:
            raise ValueError(
                head + f"this rank's share ({self.in_per_rank}); {got} is the whole input. Make the "
                "layer with input_is_parallel=False (it then splits the input itself)."
            )
        raise ValueError(head + f"{want}.")

    def _partial_grad_params(self) -> tuple[str, ...]:
        return ("bias",) if self.sequence_parallel and self.bias is not None else ()


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
        sequence_dim: the sequence dimension of the ids (default 0, ``[s, b]``; a
            negative one counts from the ids' last, ``-1`` for ``[b, s]``).
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        seed, generator, dtype, device: as :class:`ColumnParallelLinear` (init:
            ``nn.Embedding``'s ``normal_(0, 1)`` of the full table).

    Shapes:
        ids ``(*)`` integer in ``[0, num_embeddings)``, the same on every rank (an id
        outside raises ``RuntimeError``, as ``nn.Embedding`` raises ``IndexError``; a
        device-side assert on an accelerator); output ``(*, embedding_dim)`` (with
        ``sequence_parallel``: ``sequence_dim`` divided by the group size).

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

    spmd = LayerRule(lambda m: R, why=lambda m: "the same ids on every rank", doc="replicated (the ids)")

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        options: LayerOptions | None = None,
        _init: bool = True,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = "parallel.VocabParallelEmbedding"
        opts = LayerOptions.of(op, options, keywords, _NO_OVERLAP)
        self._pg, self.world_size, self.rank = resolve_parallel_group(op, opts.group)
        self.num_embeddings = check_positive(op, "num_embeddings", num_embeddings)
        self.embedding_dim = check_positive(op, "embedding_dim", embedding_dim)
        self.per_rank = check_divisible(
            op, "num_embeddings", num_embeddings, self.world_size, "vocabulary rows"
        )
        self.vocab_start = self.rank * self.per_rank
        self.sequence_parallel = bool(opts.sequence_parallel)
        self.sequence_dim = A.check_int(opts.sequence_dim, op, "sequence_dim")
        dtype = opts.dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype, device=opts.device))
        self._shard_dims = {"weight": 0}
        self._range_message = (
            f"diffcomm.{op}(): every id must be in [0, {num_embeddings}) (the vocabulary "
            "size); an id outside it would be a row of zeros on every rank (nn.Embedding "
            "raises IndexError)"
        )
        gen = init_generator(op, opts.seed, opts.generator)
        if _init:
            self.reset_parameters(gen)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``nn.Embedding`` init (``normal_``) on the CPU; keep this shard."""
        with local_tensor_mode_off():  # (the same full table on every rank)
            w = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
            nn.init.normal_(w, generator=generator)
        self.load_serial_state_dict({"weight": w})
        note_drawn(self, generator)

    @classmethod
    def from_serial(  # type: ignore[override]  # a layer takes its serial twin, not any module
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
        dims = (embedding.num_embeddings, embedding.embedding_dim)
        return cls._from_serial(embedding, *dims, group=group, **kwargs)

    def forward(self, ids: Tensor) -> Tensor:
        op = "parallel.VocabParallelEmbedding"
        ids = A.check_tensor(ids, op, "ids")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise A.arg_error(op, "ids", "an integer tensor", str(ids.dtype), TypeError)
        seq_dim = None
        if self.sequence_parallel:  # a dim of the ids (the output has one more: hidden)
            if ids.ndim == 0:
                raise A.arg_error(op, "ids", "ids with a sequence dimension (sequence_parallel)", "0-dim ids")
            seq_dim = A.check_dim(ids, self.sequence_dim, op, "sequence_dim")
        # an id outside the vocabulary is an error, as in nn.Embedding: every rank would
        # take it for another rank's and the sum would be a row of zeros (no host sync on
        # an accelerator: a device-side assert there); a local check, so before debug mode's
        # cross-rank one
        # (under torch.func.vmap: every batch element's ids at once, on the plain tensor;
        # torch has no batching rule for the assert: a RuntimeError naming aten internals)
        every = (
            _torch.functorch_unwrapped(ids) if _torch.transforms_active() and not _torch.compiling() else ids
        )
        _torch.assert_async(((every >= 0) & (every < self.num_embeddings)).all(), self._range_message)
        if _config.DEBUG.get():
            check_replicated(
                ids,
                f"{op} forward",
                "the token ids",
                "Every rank of the tensor-parallel group must look up the same ids.",
                self._pg,
            )
        start = self.vocab_start
        if not isinstance(start, int):  # LocalTensorMode: one start per simulated rank
            start = rank_start(self._pg, self.per_rank, ids.device)
        outside = (ids < start) | (ids >= start + self.per_rank)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if seq_dim is not None:
            return reduce_scatter_to_sequence(out, seq_dim, self._pg)
        return reduce_from_region(out, self._pg)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} ({self.per_rank} per rank), {self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


# ======================================================================================
# sequence-parallel layer norm
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
        options: those three as one :class:`LayerOptions` (keywords given too override
            its fields; it always works on sequence chunks, so the sequence and
            initialisation fields keep their defaults).

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

    spmd = LayerRule(
        lambda m: V, why=lambda m: "this rank's sequence chunk", doc="varying (a sequence chunk)"
    )

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = "parallel.SequenceParallelLayerNorm"
        opts = LayerOptions.of(op, options, keywords, ("group", "dtype", "device"))
        self._pg, self.world_size, self.rank = resolve_parallel_group(op, opts.group)
        self.normalized_shape = (check_positive(op, "normalized_shape", normalized_shape),)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        kw: dict[str, Any] = {"dtype": opts.dtype, "device": opts.device}
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **kw))
        else:
            self.register_parameter("weight", None)
        if self.elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kw))
        else:  # (``self.bias = None`` first made register_parameter raise KeyError)
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

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Ones and zeros, as ``nn.LayerNorm.reset_parameters`` (the meta-device flow,
        ``to_empty`` then ``reset_parameters`` of every module that has one, left this
        layer's memory uninitialised, different on every rank, while the serial
        ``nn.LayerNorm`` was reset)."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _partial_grad_params(self) -> tuple[str, ...]:
        return tuple(n for n in ("weight", "bias") if getattr(self, n) is not None)

    def _on_sequence_chunks(self) -> bool:
        return True  # (by definition, with or without a weight)

    def forward(self, x: Tensor) -> Tensor:
        w = self._region_param("weight") if self.weight is not None else None
        b = self._region_param("bias") if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SequenceParallelRMSNorm(SequenceParallelLayerNorm):
    """``nn.RMSNorm`` over the last dim of a sequence chunk (sequence parallelism).

    As :class:`SequenceParallelLayerNorm`: the weight is replicated, each rank normalises
    only its own sequence chunk, so each rank's weight gradient is a partial sum; it enters
    through the region copy and is summed over the group in the step's one coalesced
    all_reduce. (A plain ``nn.RMSNorm`` on sequence chunks keeps each rank's partial
    gradient: its replicas drift apart from the first step, with no error; a
    :class:`ParallelModule` with sequence-parallel layers therefore refuses one.)

    Args:
        normalized_shape: the hidden size (an int; the last dimension).
        eps: as ``nn.RMSNorm`` (``None``: the dtype's machine epsilon).
        elementwise_affine: learn a weight.
        group, dtype, device, options: as :class:`SequenceParallelLayerNorm`.

    Shapes:
        input and output ``(*, normalized_shape)``: this rank's sequence chunk.

    Gradient:
        replicated objective: the input gradient is this rank's chunk of the serial one;
        the weight gradient is the serial one (summed over the group).

    Example::

        serial = nn.RMSNorm(4)
        def f():   # each rank normalises its chunk of the sequence (dim 0 here)
            chunk = torch.randn(6, 4).chunk(2)[dc.get_rank()]
            return SequenceParallelRMSNorm.from_serial(serial)(chunk).shape
        with dc.LocalWorld(2) as world:
            world.run(f)   # [torch.Size([3, 4]), torch.Size([3, 4])]
    """

    spmd = SequenceParallelLayerNorm.spmd

    def __init__(
        self,
        normalized_shape: int,
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__(normalized_shape, 0.0, elementwise_affine, False, options=options, **keywords)
        self.eps = None if eps is None else float(eps)  # type: ignore[assignment]

    @classmethod
    def from_serial(cls, rms_norm: nn.RMSNorm, group: A.GroupLike = None) -> SequenceParallelRMSNorm:  # type: ignore[override]
        """The same RMS norm (its weight copied) for sequence chunks."""
        (h,) = rms_norm.normalized_shape
        weight = rms_norm.weight
        layer = cls(
            h,
            rms_norm.eps,
            rms_norm.elementwise_affine,
            group=group,
            dtype=weight.dtype if weight is not None else None,
            device=weight.device if weight is not None else None,
        )
        layer.load_serial_state_dict(rms_norm.state_dict())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        w = self._region_param("weight") if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, w, self.eps)
