"""Hypothesis strategies for property tests of SPMD code.

Needs ``hypothesis`` (the ``test`` extra). Each function returns a strategy::

    from hypothesis import given
    from diffcomm.testing import strategies as dst

    @given(shape=dst.shapes_that_split(2, dim=1), op=dst.reduce_ops())
    def test_something(world2, shape, op): ...
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from ..ops import collectives as _collectives  # noqa: F401 - importing registers the collectives
from ..ops import registry

__all__ = [
    "world_sizes",
    "shapes_that_split",
    "uneven_split_sizes",
    "reduce_ops",
    "float_dtypes",
    "dtypes",
    "collective_names",
]

_LINEAR_OPS = ("sum", "avg")
_ALL_OPS = ("sum", "avg", "max", "min", "product")


def world_sizes(min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[int]:
    """Group sizes in ``[min_size, max_size]`` (keep it to the worlds your fixtures hold)."""
    if min_size < 1 or max_size < min_size:
        raise ValueError(f"world_sizes(): need 1 <= min_size <= max_size, got {min_size}, {max_size}")
    return st.integers(min_size, max_size)


def shapes_that_split(
    world: int,
    dim: int = 0,
    *,
    min_dims: int = 1,
    max_dims: int = 3,
    max_chunk: int = 3,
    max_side: int = 4,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes whose size along ``dim`` is a positive multiple of ``world`` (even shards).

    Args:
        world: the group size.
        dim: the split dimension (negative counts from the end).
        min_dims, max_dims: number of dimensions (raised to fit ``dim``).
        max_chunk: largest per-rank chunk along ``dim``.
        max_side: largest size of the other dimensions (>= 1).
    """
    if world < 1:
        raise ValueError(f"shapes_that_split(): world must be >= 1, got {world}")
    need = dim + 1 if dim >= 0 else -dim
    lo, hi = max(min_dims, need), max(max_dims, need)

    @st.composite
    def _shapes(draw: st.DrawFn) -> tuple[int, ...]:
        ndim = draw(st.integers(lo, hi))
        shape = [draw(st.integers(1, max_side)) for _ in range(ndim)]
        shape[dim] = world * draw(st.integers(1, max_chunk))
        return tuple(shape)

    return _shapes()


def uneven_split_sizes(total: int, world: int, *, allow_zero: bool = True) -> st.SearchStrategy[list[int]]:
    """``world`` non-negative sizes summing to ``total`` (zeros allowed unless told not).

    Args:
        total: the size being split.
        world: number of parts.
        allow_zero: allow empty parts (needs ``total >= world`` when ``False``).
    """
    if world < 1 or total < 0:
        raise ValueError(f"uneven_split_sizes(): need world >= 1 and total >= 0, got {total}, {world}")
    if not allow_zero and total < world:
        raise ValueError(f"uneven_split_sizes(): total={total} < world={world} needs allow_zero=True")

    @st.composite
    def _sizes(draw: st.DrawFn) -> list[int]:
        if world == 1:
            return [total]
        if allow_zero:
            cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
        else:
            cuts = sorted(
                draw(st.lists(st.integers(1, total - 1), min_size=world - 1, max_size=world - 1, unique=True))
            )
        bounds = [0, *cuts, total]
        return [b - a for a, b in zip(bounds, bounds[1:])]

    return _sizes()


def reduce_ops(include_nonlinear: bool = True) -> st.SearchStrategy[str]:
    """Reduce op names: ``sum``, ``avg`` and, unless told not, ``max``, ``min``, ``product``."""
    return st.sampled_from(_ALL_OPS if include_nonlinear else _LINEAR_OPS)


def float_dtypes(include_half: bool = False) -> st.SearchStrategy[torch.dtype]:
    """``float32``, ``float64`` (and ``float16``, ``bfloat16`` with ``include_half``)."""
    choices: Sequence[torch.dtype] = [torch.float32, torch.float64]
    if include_half:
        choices = [*choices, torch.float16, torch.bfloat16]
    return st.sampled_from(list(choices))


def dtypes(
    include_int: bool = False, include_complex: bool = False, include_half: bool = False
) -> st.SearchStrategy[torch.dtype]:
    """Floating dtypes, optionally with ``int32``/``int64`` and ``complex64``/``complex128``."""
    choices = [torch.float32, torch.float64]
    if include_half:
        choices += [torch.float16, torch.bfloat16]
    if include_int:
        choices += [torch.int32, torch.int64]
    if include_complex:
        choices += [torch.complex64, torch.complex128]
    return st.sampled_from(choices)


def collective_names() -> st.SearchStrategy[str]:
    """Names of diffcomm's own collectives (the registry's ``"collective"`` family, without
    the ops a user's module adds to ``diffcomm.OPS``)."""
    return st.sampled_from(sorted(registry.family("collective", ())))
