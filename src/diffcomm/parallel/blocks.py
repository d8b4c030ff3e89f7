"""Ready-made tensor-parallel blocks and their serial references: :class:`MLP` /
:class:`ParallelMLP` and :class:`SelfAttention` / :class:`ParallelSelfAttention`.

Each parallel block is built from the layers of :mod:`diffcomm.parallel.layers` (a
column-parallel linear, a local computation on the shard, a row-parallel linear), so a
step communicates once forward and once backward, and is a
:class:`~diffcomm.parallel.layers.ParallelModule` whose parameters are this rank's shards
of the serial block's: ``ParallelMLP(h, f, seed=s)`` holds exactly the shards of
``torch.manual_seed(s); MLP(h, f)``, ``from_serial`` / ``load_serial_state_dict`` load
them from a serial checkpoint. Dropout on a shard draws from the model-parallel RNG
stream of :mod:`diffcomm.rng`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _config, rng
from .. import backend as B
from ..backend import args as A
from ._module import (
    ParallelModule,
    check_divisible,
    check_positive,
    init_generator,
    resolve_parallel_group,
    varying_with,
)
from .layers import ColumnParallelLinear, LayerOptions, RowParallelLinear

__all__ = ["MLP", "ParallelMLP", "SelfAttention", "ParallelSelfAttention"]

#: the options self-attention reads (no sequence_dim: ``[s, b, h]``; no overlap)
_ATTENTION_TAKES = ("sequence_parallel", "group", "seed", "generator", "dtype", "device")


# ======================================================================================
# activations and dropout on shards
# ======================================================================================


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


def _check_dropout_agrees(op: str, p: float, training: bool, pg: Any) -> None:
    """Debug mode: the dropout in effect (``p`` in ``train()``, 0 in ``eval()``) is the same
    on every rank of the block's group. A rank left in another mode (``model.eval()`` on
    one rank only) masks its shard while the others do not: no collective notices, and the
    block computes no serial model's output, silently."""
    if _config.DEBUG.get():
        field = "dropout in effect (p in train(), 0 in eval())"
        B.get_backend().check_consistent(op, {field: repr(p if training else 0.0)}, pg)


def _dropout(x: Tensor, p: float, training: bool, sharded: bool) -> Tensor:
    """Dropout; on a tensor-parallel shard it draws from the model-parallel RNG stream."""
    if p == 0.0 or not training:
        return x
    if not sharded:
        return F.dropout(x, p, True)
    with _model_parallel_stream():
        return F.dropout(x, p, True)


class _Block(ParallelModule):
    """What the tensor-parallel blocks share: a column-parallel linear, local work on its
    output features' shards, a row-parallel linear fed those shards (built by
    :meth:`_linears`), and ``from_serial`` from the serial twin (``_serial_args``: its
    size arguments; ``_serial_keywords``: its attributes that are the block's own
    keywords, such as the activation)."""

    _serial_keywords: ClassVar[tuple[str, ...]]

    def _linears(
        self, op: str, opts: LayerOptions, size: int, column_out: int, row_in: int, bias: bool, _init: bool
    ) -> tuple[ColumnParallelLinear, RowParallelLinear]:
        """The two linears, ``size -> column_out`` (column-parallel) and ``row_in -> size``
        (row-parallel), with the block's options; both draw from one generator (seeded
        from ``opts.seed``), the column's parameters first. Sets the block's ``_pg`` and
        ``sequence_parallel``."""
        linears = replace(opts, seed=None, generator=init_generator(op, opts.seed, opts.generator))
        column = ColumnParallelLinear(size, column_out, bias, options=linears, _init=_init)
        row = RowParallelLinear(row_in, size, bias, input_is_parallel=True, options=linears, _init=_init)
        self._pg = column._pg
        self.sequence_parallel = bool(opts.sequence_parallel)
        return column, row

    @staticmethod
    def _serial_args(serial: Any) -> tuple[int, int, bool]:  # pragma: no cover - per block
        raise NotImplementedError

    @classmethod
    def from_serial(  # a block takes its serial twin, not any module
        cls: type[_B], serial: nn.Module, group: A.GroupLike = None, **kwargs: Any
    ) -> _B:
        """This rank's shards of the serial block (:class:`MLP` for :class:`ParallelMLP`,
        :class:`SelfAttention` for :class:`ParallelSelfAttention`; same activation and
        dropout, or the same causal mask and attention dropout).

        Args:
            serial: the serial block (same on every rank).
            group: the tensor-parallel group.
            **kwargs: ``sequence_parallel`` (and ``sequence_dim`` for the MLP).
        """
        own = {k: getattr(serial, k) for k in cls._serial_keywords}
        return cls._from_serial(serial, *cls._serial_args(serial), group=group, **own, **kwargs)


_B = TypeVar("_B", bound=_Block)


# ======================================================================================
# MLP
# ======================================================================================


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


class ParallelMLP(_Block):
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

    spmd = varying_with("sequence_parallel", "a sequence chunk")
    _serial_keywords = ("activation", "dropout")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        dropout: float = 0.0,
        options: LayerOptions | None = None,
        _init: bool = True,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = "parallel.ParallelMLP"
        opts = LayerOptions.of(op, options, keywords)
        self.fc1, self.fc2 = self._linears(
            op, opts, hidden_size, ffn_hidden_size, ffn_hidden_size, bias, _init
        )
        self.activation = activation
        self._act = _activation(op, activation)
        if not 0.0 <= float(dropout) < 1.0:
            raise A.arg_error(op, "dropout", "a probability in [0, 1)", dropout)
        self.dropout = float(dropout)

    @staticmethod
    def _serial_args(mlp: MLP) -> tuple[int, int, bool]:
        return mlp.fc1.in_features, mlp.fc1.out_features, mlp.fc1.bias is not None

    def forward(self, x: Tensor) -> Tensor:
        _check_dropout_agrees("parallel.ParallelMLP", self.dropout, self.training, self._pg)
        h = self._act(self.fc1(x))
        h = _dropout(h, self.dropout, self.training, sharded=True)
        return self.fc2(h)


# ======================================================================================
# self-attention
# ======================================================================================


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
        check_positive(op, "num_heads", num_heads)
        check_divisible(op, "hidden_size", hidden_size, num_heads, "hidden features (per head)")
        self.num_heads = num_heads
        self.causal = bool(causal)
        self.attention_dropout = float(attention_dropout)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden_size, hidden_size, bias, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        y = _attention(self.qkv(x), self.num_heads, self.causal, self.attention_dropout, self.training, False)
        return self.proj(y)


class ParallelSelfAttention(_Block):
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

    spmd = varying_with("sequence_parallel", "a sequence chunk")
    _serial_keywords = ("causal", "attention_dropout")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        bias: bool = True,
        *,
        causal: bool = False,
        attention_dropout: float = 0.0,
        options: LayerOptions | None = None,
        _init: bool = True,
        **keywords: Any,
    ) -> None:
        super().__init__()
        op = "parallel.ParallelSelfAttention"
        opts = LayerOptions.of(op, options, keywords, _ATTENTION_TAKES)
        pg, world, _ = resolve_parallel_group(op, opts.group)
        check_positive(op, "num_heads", num_heads)
        check_divisible(op, "hidden_size", hidden_size, num_heads, "hidden features (per head)")
        self.heads_per_rank = check_divisible(op, "num_heads", num_heads, world, "heads")
        opts = replace(opts, group=pg)
        self.qkv, self.proj = self._linears(op, opts, hidden_size, 3 * hidden_size, hidden_size, bias, _init)
        self.num_heads = num_heads
        self.causal = bool(causal)
        self.attention_dropout = float(attention_dropout)

    @staticmethod
    def _serial_args(attention: SelfAttention) -> tuple[int, int, bool]:
        return attention.qkv.in_features, attention.num_heads, attention.qkv.bias is not None

    def forward(self, x: Tensor) -> Tensor:
        _check_dropout_agrees(
            "parallel.ParallelSelfAttention", self.attention_dropout, self.training, self._pg
        )
        y = _attention(
            self.qkv(x), self.heads_per_rank, self.causal, self.attention_dropout, self.training, True
        )
        return self.proj(y)
