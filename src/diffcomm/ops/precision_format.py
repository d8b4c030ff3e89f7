"""The :class:`Precision` option of the low-precision collectives and its wire formats
(encode / decode / quantize, the validation of a ``precision=`` before any
communication), and the table through which an op with ``precision=`` reaches its
quantized form (:data:`QUANTIZED`, filled by :mod:`diffcomm.ops.precision` and
:mod:`diffcomm.parallel.precision` when they load, so the ops need not import them back:
no import cycle). See :mod:`diffcomm.ops.precision` for the semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import _torch

__all__ = [
    "Precision",
    "WIRE_DTYPES",
    "FP8_MAX",
    "unit_roundoff",
    "encode",
    "decode",
    "quantize",
    "check",
    "quantized",
]

#: name -> the quantized form of an op or mapping (``"all_gather"``, ``"mapping"`` ...),
#: registered by the modules that define them (both load with ``import diffcomm``)
QUANTIZED: dict[str, Callable[..., Any]] = {}


_EAGER: dict[str, Callable[..., Any]] = {}

_WHY_EAGER = (
    "diffcomm: a collective with precision= runs eagerly under torch.compile (its compiled "
    "fp8 path gave wrong values); fullgraph=True cannot hold it"
)


def quantized(name: str) -> Callable[..., Any]:
    """The quantized form registered as ``name`` (a ``precision=`` call's target). It runs
    eagerly under ``torch.compile`` (a graph break): traced, the fp8 encode / exchange /
    decode gave values far outside the bound (relative error 1.2-1.6 where eager is
    within 0.03), silently."""
    fn = _EAGER.get(name)
    if fn is None:
        fn = _EAGER[name] = _torch.compiler_disable(QUANTIZED[name], _WHY_EAGER)
    return fn


#: The largest finite value of each fp8 wire dtype (the scale maps a block's amax to it).
FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
}

#: The wire dtypes :class:`Precision` accepts.
WIRE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, *FP8_MAX)

_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def _dtype(value: Any, arg: str, legal: Sequence[torch.dtype]) -> torch.dtype:
    got = _ALIASES.get(value.lower()) if isinstance(value, str) else value
    if not isinstance(got, torch.dtype) or got not in legal:
        names = ", ".join(str(d).replace("torch.", "") for d in legal)
        raise ValueError(f"diffcomm.Precision: {arg}={value!r} is not supported; legal: {names}")
    return got


@dataclass(frozen=True)
class Precision:
    """How a collective's payload travels and is reduced (``precision=`` on the ops).

    Args:
        wire: the dtype on the wire: ``torch.bfloat16`` / ``"bf16"``, ``torch.float16`` /
            ``"fp16"``, ``torch.float8_e4m3fn`` / ``"fp8_e4m3"``, ``torch.float8_e5m2`` /
            ``"fp8_e5m2"``; ``None``: the payload's own dtype, exactly (no quantization:
            the op's plain path, e.g. an exact backward).
        accumulate: the dtype a reduction sums the dequantized contributions in (rank
            by rank, each addition rounded to it); ``None``: ``float32``, or the payload's
            dtype if wider (``float64``). A quantized ``wire`` only (``None`` runs the
            plain op, which reduces in the payload's dtype).
        block_size: fp8 only: elements per scale along the last dim (must divide it, and
            every chunk an op splits the last dim into); ``None``: one scale per row.
        backward: the settings of the backward (the gradient's collective); ``None``:
            the same ``wire`` / ``accumulate`` / ``block_size`` as the forward. The
            backward of the backward (double backward) uses this forward's settings, so
            its own ``backward`` must be ``None`` (or those settings).

    Example::

        p = dc.Precision("bf16", backward=dc.Precision(None))   # bf16 forward, exact grads
        y = dc.all_gather(x, precision=p)
    """

    wire: torch.dtype | str | None
    accumulate: torch.dtype | str | None = None
    block_size: int | None = None
    backward: Precision | None = None

    def __post_init__(self) -> None:
        if self.wire is not None:
            object.__setattr__(self, "wire", _dtype(self.wire, "wire", WIRE_DTYPES))
        if self.accumulate is not None:
            legal = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            object.__setattr__(self, "accumulate", _dtype(self.accumulate, "accumulate", legal))
        b = self.block_size
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"diffcomm.Precision: block_size={b!r} must be a positive int or None")
            if self.wire not in FP8_MAX:
                raise ValueError(
                    f"diffcomm.Precision: block_size={b} applies to fp8 wire dtypes only "
                    f"(wire={self.wire}: a plain cast, no scales)"
                )
        if self.wire is None and self.accumulate is not None:
            # (the plain op reduces in the payload's own dtype: it would be ignored, silently)
            raise ValueError(
                f"diffcomm.Precision: accumulate={self.accumulate} applies to a quantized wire "
                "only; wire=None runs the plain op, which reduces in the payload's own dtype "
                "(a bf16 payload summed in float32: Precision('bf16'))"
            )
        if self.backward is not None and not isinstance(self.backward, Precision):
            raise TypeError(
                "diffcomm.Precision: backward must be a Precision or None, got "
                f"{type(self.backward).__name__}"
            )
        back = self.backward
        if back is not None and back.backward is not None and back.backward != self.forward_only():
            # double backward uses this forward's settings (``transposed``), never back.backward
            raise ValueError(
                f"diffcomm.Precision: backward=Precision({back.tag}, backward="
                f"Precision({back.backward.tag})): that inner backward would be ignored, the "
                f"backward of the backward (double backward) uses the forward settings "
                f"({self.tag}); leave the backward's own backward None"
            )

    # -- the settings of each direction ------------------------------------------------
    def forward_only(self) -> Precision:
        """These settings without a separate backward."""
        return Precision(self.wire, self.accumulate, self.block_size)

    def transposed(self) -> Precision:
        """The settings of the backward op: its forward is this one's ``backward``, its
        own backward this one's forward (so double backward is defined)."""
        if self.backward is None:
            return self
        b = self.backward
        return Precision(b.wire, b.accumulate, b.block_size, backward=self.forward_only())

    def accumulate_for(self, dtype: torch.dtype) -> torch.dtype:
        """The accumulation dtype for a payload of ``dtype``."""
        if self.accumulate is not None:
            return self.accumulate  # type: ignore[return-value]
        return torch.promote_types(dtype, torch.float32)

    @property
    def tag(self) -> str:
        """A short name for labels: ``bf16``, ``e4m3/128``, ``exact``."""
        if self.wire is None:
            return "exact"
        names = {
            torch.bfloat16: "bf16",
            torch.float16: "fp16",
            torch.float8_e4m3fn: "e4m3",
            torch.float8_e5m2: "e5m2",
        }
        name = names[self.wire]  # type: ignore[index]
        return f"{name}/{self.block_size}" if self.block_size else name

    @property
    def key(self) -> str:
        """Every setting, both directions, compactly (``e4m3/128>bf16+float32``): what debug
        mode compares across ranks (its fields keep 64 bytes; a ``repr`` was cut there)."""
        sides = (self, self.transposed())
        acc = ["" if p.accumulate is None else "+" + str(p.accumulate).replace("torch.", "") for p in sides]
        return f"{sides[0].tag}{acc[0]}>{sides[1].tag}{acc[1]}"


# ------------------------------------------------------------------------------ codec


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = 2**-(mantissa bits + 1)``: the relative error of rounding to nearest."""
    return float(torch.finfo(dtype).eps) / 2


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block(p: Precision, n: int) -> int:
    """Elements per scale in a last dim of ``n``: never more than ``n`` (a 0-dim ``x``, a
    row of one, is the only one a ``block_size`` may exceed: :func:`check` refuses any
    other; an all_reduce of rows of one, as vmap batches 0-dim examples, must not join
    rows into one block)."""
    return min(p.block_size or n, n)


def encode(x: Tensor, p: Precision) -> tuple[Tensor, Tensor | None]:
    """``(payload, scales)``: ``x`` in the wire dtype (fp8: divided by its block scales,
    which are float32 of shape ``(*x.shape[:-1], n // block)``; bf16/fp16: no scales)."""
    wire: torch.dtype = p.wire  # type: ignore[assignment]
    if wire not in FP8_MAX:
        return x.to(wire), None
    if x.ndim == 0:
        q, s = encode(x.reshape(1), p)
        return q.reshape(()), s
    fmax = FP8_MAX[wire]
    n = x.shape[-1]
    b = _block(p, n)
    nb = n // b if b else 0
    xc = x.to(_compute_dtype(x.dtype))
    xr = xc.reshape(*x.shape[:-1], nb, b)
    if xr.numel() == 0:
        return x.to(wire), torch.ones((*x.shape[:-1], nb), dtype=torch.float32, device=x.device)
    scale = (xr.abs().amax(-1) / fmax).to(torch.float32)
    # scale 1 for an all-zero block, or a float64 one below float32's range (it rounds to 0)
    scale = torch.where(scale == 0, torch.ones((), device=x.device), scale)
    # a NaN scale (never 1: ``amax > 0`` is false for a NaN amax) for a block with a
    # non-finite value or a float64 amax beyond float32's range: all of it decodes to NaN,
    # never to a finite number
    scale = torch.where(scale.isinf(), torch.full((), torch.nan, device=x.device), scale)
    q = (xr / scale.unsqueeze(-1).to(xc.dtype)).clamp(-fmax, fmax).to(wire)
    return q.reshape(x.shape), scale


def decode(
    q: Tensor, scale: Tensor | None, dtype: torch.dtype, widths: Sequence[int] | None = None
) -> Tensor:
    """The values ``q`` (and its block ``scale``) stand for, in ``dtype``. ``widths``: the
    last-dim width of each scale's block where they differ (rows of different lengths
    joined along the last dim, one scale each: ``block_size=None``); else equal blocks."""
    if scale is None:
        return q.to(dtype)
    if q.ndim == 0:
        return decode(q.reshape(1), scale, dtype).reshape(())
    if widths is not None and len(set(widths)) > 1:
        c = _compute_dtype(dtype)
        reps = torch.tensor(list(widths), device=scale.device)
        return (q.to(c) * scale.to(c).repeat_interleave(reps, dim=-1)).to(dtype)
    n = q.shape[-1]
    nb = scale.shape[-1]
    b = n // nb if nb else 1
    c = _compute_dtype(dtype)
    y = q.to(c).reshape(*q.shape[:-1], nb, b) * scale.to(c).unsqueeze(-1)
    return y.reshape(q.shape).to(dtype)


def quantize(x: Tensor, p: Precision) -> Tensor:
    """``decode(encode(x))``: what one rank's ``x`` becomes on the wire (the tests' model)."""
    if p.wire is None:
        return x
    q, s = encode(x, p)
    return decode(q, s, x.dtype)


def block_widths(sizes: Sequence[int], dim: int, x: Tensor, p: Precision) -> list[int] | None:
    """The width of each received scale's block when pieces of ``sizes`` are joined along
    ``x``'s last dim with one scale per piece (``block_size=None``; rows of different
    lengths: :func:`decode` cannot assume equal blocks), else ``None``."""
    if dim != x.ndim - 1 or p.block_size:
        return None
    return [s for s in sizes if s]


def _scale_sizes(sizes: Sequence[int], dim: int, x: Tensor, p: Precision) -> tuple[int, ...]:
    """Split sizes of the scales along ``dim``: the same when ``dim`` is not last; else a
    piece of ``s`` elements carries ``s // block_size`` scales, or with ``block_size=None``
    one scale if it is not empty. (One scale per row: :func:`check` lets the last dim be
    split only into empty pieces and one whole row, so every nonempty piece is one
    sender's whole row, whatever its length — a length this rank may not share: its own
    row may be empty, or longer.)"""
    if dim != x.ndim - 1:
        return tuple(sizes)
    if p.block_size:
        return tuple(s // p.block_size for s in sizes)
    return tuple(1 if s else 0 for s in sizes)


# ----------------------------------------------------------------------- validation


Layout = tuple[int, Sequence[int] | None]


def check(
    x: Tensor,
    precision: Any,
    op: str,
    fwd: Layout | None = None,
    bwd: Layout | None = None,
    arg: str = "x",
    reduces: bool = False,
) -> Precision:
    """Validate ``precision`` for ``x`` before any communication — for the forward **and**
    the backward (a backward that cannot run must fail here, not after the forward): a
    :class:`Precision`, a floating (not complex) ``x``, and for fp8 a block size dividing
    the last dim of what is encoded and every chunk an op splits that dim into.

    ``fwd`` / ``bwd``: ``(last dim, chunks along it or None)`` of the tensor the forward /
    backward encodes (default: ``x``'s last dim, no split). ``arg``: the argument ``x``
    is, for the messages (a coalesced op's ``tensors[i]``). ``reduces``: the forward sums
    ``x`` over ranks, which an fp8 ``x`` cannot be (as without ``precision=``)."""
    if not isinstance(precision, Precision):
        raise TypeError(f"diffcomm.{op}(): precision must be a diffcomm.Precision or None, got {precision!r}")
    if precision.wire is not None and not x.is_floating_point():
        raise TypeError(
            f"diffcomm.{op}(): precision=Precision(wire={precision.tag}) needs a floating-point {arg} "
            f"(a float wire dtype cannot carry {x.dtype} exactly); got {arg} of dtype {x.dtype}"
        )
    if reduces and x.dtype in FP8_MAX:  # (torch cannot promote it to the accumulator)
        raise TypeError(
            f"diffcomm.{op}(): a {str(x.dtype).replace('torch.', '')} {arg} cannot be reduced, with "
            "precision= as without (torch has no sum in fp8); reduce a float tensor, with "
            "precision=diffcomm.Precision('fp8_e4m3') for an fp8 wire"
        )
    back = precision.transposed()
    if back.wire is not None and x.is_complex():  # its gradient is complex: a real wire
        raise TypeError(  # would drop the imaginary part, silently (integers have none)
            f"diffcomm.{op}(): precision=Precision(wire={precision.tag}, backward={back.tag}) sends the "
            f"gradient in a real float dtype, which cannot carry the complex gradient of {arg} "
            f"(dtype {x.dtype}); got {arg} of dtype {x.dtype}"
        )
    n = x.shape[-1] if x.ndim else 1
    for p, (last, chunks), where in (
        (precision, fwd or (n, None), "forward"),
        (precision.transposed(), bwd or (n, None), "backward"),
    ):
        if p.wire not in FP8_MAX or x.ndim == 0:
            continue
        b = p.block_size or last
        if p.block_size is not None and last % b:
            raise ValueError(
                f"diffcomm.{op}(): precision ({where}) block_size={b} does not divide the last dim "
                f"({last}) of what it encodes ({arg}.shape={tuple(x.shape)}); no padding is done: "
                "pick a divisor"
            )
        if chunks is not None and b and any(c % b for c in chunks):
            why = "" if p.block_size else " (block_size=None means one scale per whole row)"
            raise ValueError(
                f"diffcomm.{op}(): precision ({where}) block_size={p.block_size} must divide every "
                f"chunk {list(chunks)} the op splits the last dim of {arg} into{why} "
                f"({arg}.shape={tuple(x.shape)})"
            )
    return precision
