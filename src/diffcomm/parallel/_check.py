"""Debug-mode check that a tensor holds the same values on every rank of a group.

The replicated-objective mappings rest on one of two assumptions: a *copy forward*
(``copy_to_region``, ``scatter_to_region``) assumes its input is replicated, and an
*identity backward* (``reduce_from_region``, ``gather_from_region``, the vocab-parallel
cross entropy) assumes the incoming gradient is replicated. In debug mode each one calls
:func:`check_replicated` on that tensor.

The check is SPMD (every rank runs the same collectives and takes the same branch,
because every branch depends only on data all ranks received):

1. a fixed-length float64 **fingerprint** per rank — shape, number of elements, sum,
   sum of squares, a sum weighted by a fixed pseudo-random sequence, and a hash of the
   elements' bits — goes through one raw all_gather; if every rank's fingerprint is
   bitwise equal, the check passes. The float sums alone cannot be that test: one
   ``inf`` / ``NaN`` (a causal mask's ``-inf``) or one value 1e16 times the others makes
   every sum the same whatever the other elements hold, and a 2x passed unseen; the
   hash (the float64 bits times odd weights, summed in wrapping int64) changes with any
   one element;
2. otherwise (or when shapes differ) the **exact fallback** gathers the full tensors and
   groups the ranks into classes whose values agree **element by element**: elements
   ``a`` and ``b`` agree when ``|a - b| <= sqrt(eps) * (max(|a|, |b|) + m)``, with ``eps``
   of the tensor's dtype and ``m`` the median magnitude of the tensor (a floor for
   elements that cancel to about zero). Each element is judged at its own scale, so
   reduction-order noise passes while a 2x or a partial sum does not — also next to one
   huge channel in bfloat16, which a tolerance relative to the largest value would hide.
   More than one class raises
   :class:`~diffcomm.CrossRankMismatchError` naming the ranks of each class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _torch
from .. import backend as B
from .._errors import CrossRankMismatchError
from .._replication import spmd_types_untyped

#: (see _replication.spmd_types_checking)
_FUNCTION_ATTRS = torch.autograd.Function.__dict__

#: why a copy forward needs a replicated input (the message of its debug check)
COPY_HINT = (
    "A copy into a tensor-parallel region assumes a replicated input (e.g. the activations "
    "entering a ColumnParallelLinear). If each rank holds a different tensor here: a shard "
    "split along the last dim (e.g. a ColumnParallelLinear's output with "
    "gather_output=False) goes into a RowParallelLinear made with input_is_parallel=True "
    "(no mapping at all); a partial sum that still needs reducing, or a shard you want "
    "whole, needs reduce_from_region / gather_from_region first."
)
#: why an identity backward needs a replicated gradient ({name}, {instead}: the mapping, the
#: op to use instead)
IDENTITY_HINT = (
    "{name}'s identity backward assumes its output is consumed identically on every rank "
    "(replicated objective: the same loss on every rank), so the gradient arriving here "
    "must be replicated. If each rank consumes the output differently (e.g. feeds it into "
    "its own weight shard), the gradient is partial: use {instead} instead."
)


_MAX_DIMS = 8
_GOLDEN = 0.6180339887498949
#: odd int64 weights of the bit hash: element i's weight is (i * _MIX + _SALT) | 1
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (the golden ratio in 64 bits)
_SALT = 0x632BE59BD9B4E019


def plain(t: Tensor) -> Tensor:
    """``t`` without functorch wrappers (vmap/grad/jvp levels), detached."""
    return _torch.functorch_unwrapped(t).detach()


def _as_real64(t: Tensor) -> Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to(torch.float64)


def fingerprint(t: Tensor) -> Tensor:
    """A float64 vector summarising ``t``: shape, numel, sum, sum of squares, weighted sum,
    and a hash of the elements' bits (its int64 bits in a float64 slot: compared bitwise)."""
    x = _as_real64(t).reshape(-1)
    shape = list(t.shape)
    if len(shape) > _MAX_DIMS:
        shape = shape[: _MAX_DIMS - 1] + [math.prod(shape[_MAX_DIMS - 1 :])]
    dims = [float(s) for s in shape] + [-1.0] * (_MAX_DIMS - len(shape))
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    weights = torch.cos(index.to(torch.float64) * _GOLDEN)
    # a meta tensor has no values to differ: its shape is compared (the non-debug program
    # gives meta results of the right shapes; its sums raised "Cannot copy out of meta")
    has_values = x.numel() and not x.is_meta
    sums = torch.stack([x.sum(), (x * x).sum(), (x * weights).sum()]) if has_values else torch.zeros(3)
    # float64 holds every element exactly, so its bits are the element's; an odd weight
    # keeps any change of one element's bits a change of the (wrapping) sum
    if has_values:
        odd = (index * _MIX + _SALT) | 1
        bits = (x.view(torch.int64) * odd).sum().reshape(1).cpu().view(torch.float64)
    else:
        bits = torch.zeros(1, dtype=torch.float64)
    head = torch.tensor([float(t.dim()), float(t.numel()), *dims], dtype=torch.float64)
    return torch.cat([head, sums.to(device="cpu", dtype=torch.float64), bits])


def _tolerance(dtype: torch.dtype) -> float:
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype
        return math.sqrt(torch.finfo(real).eps)
    return 0.0


def check_replicated(t: Tensor, where: str, subject: str, hint: str, group: Any) -> None:
    """Raise :class:`~diffcomm.CrossRankMismatchError` unless ``t`` is equal on every rank.

    Must be called on every rank of ``group`` (it communicates).

    Args:
        t: the tensor that should be replicated.
        where: the op, for the message (e.g. ``"parallel.reduce_from_region backward"``).
        subject: what ``t`` is (e.g. ``"the incoming gradient"``).
        hint: why it must be replicated and what to do instead.
        group: the resolved process group (``None``: the default group).
    """
    if _torch.compiling():
        # skipped in compiled code, as the field check is (docs/transforms.md): it needs a
        # host read; traced, torch.func's switch below failed dynamo (fullgraph=True: a
        # copy_to_region or ColumnParallelLinear compiled only outside debug mode)
        return None
    # the check's arithmetic runs on the unwrapped values with torch.func's transforms
    # off: made at a transform's level (an op lifts even a plain tensor to it), the
    # fingerprint escaped that level through the gather (in a backward under grad(grad):
    # torch's INTERNAL ASSERT "escaped?" in place of the op's own error)
    # (and with spmd_types' checker paused: the check's arithmetic is not typed data)
    with _torch.functorch_off(), spmd_types_untyped(_FUNCTION_ATTRS):
        return _check_replicated(t, where, subject, hint, group)


def _check_replicated(t: Tensor, where: str, subject: str, hint: str, group: Any) -> None:
    backend = B.get_backend()
    world = backend.world_size(group)
    if world == 1:
        return
    x = plain(t)
    if not all(isinstance(s, int) for s in x.shape):
        # a size that differs per simulated rank (LocalTensorMode): not replicated, and
        # no fingerprint to make of it (float() raised torch's AttributeError); the op's
        # own refusal names it, as without debug mode
        return
    with torch.no_grad(), B.label(f"{where} (debug check)"):
        mine = fingerprint(x).to(B.get_backend().comm_device(group))
        table = backend.all_gather(mine.reshape(1, -1), group).cpu()
        bits = table.view(torch.int64)
        if bool((bits == bits[0]).all()):
            return
        shapes = [tuple(int(v) for v in row[2 : 2 + min(int(row[0]), _MAX_DIMS)].tolist()) for row in table]
        if any(s != shapes[0] or row[1] != table[0, 1] for s, row in zip(shapes, table)):
            per_rank = ", ".join(f"rank {r}: {tuple(s)}" for r, s in enumerate(shapes))
            raise CrossRankMismatchError(
                f"diffcomm.{where}: {subject} should be the same on every rank, but its shape "
                f"differs ({per_rank}). {hint}"
            )
        flat = _as_real64(x).reshape(1, -1).to(B.get_backend().comm_device(group))
        full = backend.all_gather(flat, group).cpu()
    classes = _classes(full, _tolerance(x.dtype))
    if len(classes) == 1:
        return
    ref = full[classes[0][0]]
    groups = []
    for members in classes[1:]:
        d = (full[members[0]] - ref).abs().nan_to_num(nan=math.inf).max().item()
        groups.append(f"ranks {members} (max abs diff {d:.3g})")
    scale = full.abs().nan_to_num(nan=0.0).max().item()
    raise CrossRankMismatchError(
        f"diffcomm.{where}: {subject} should be the same on every rank, but ranks "
        f"{[m for c in classes[1:] for m in c]} differ from ranks {classes[0]}: "
        + ", ".join(groups)
        + f" hold other values than ranks {classes[0]} (largest magnitude {scale:.3g}). {hint}"
    )


def _classes(full: Tensor, rtol: float) -> list[list[int]]:
    """Group the rows of ``full`` (one per rank) into classes of (nearly) equal rows.

    Element-wise: ``|a - b| <= rtol * (max(|a|, |b|) + median |full|)``.
    """
    mag = full.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    floor = mag.median().item() if full.numel() else 0.0
    reps: list[int] = []
    classes: list[list[int]] = []
    for r in range(full.shape[0]):
        for i, rep in enumerate(reps):
            a, b = full[r], full[rep]
            same_nan = torch.isnan(a) == torch.isnan(b)
            tol = rtol * (torch.maximum(mag[r], mag[rep]) + floor)
            close = ((a - b).abs() <= tol) | (a == b) | (torch.isnan(a) & torch.isnan(b))
            if bool(same_nan.all()) and bool(close.all()):
                classes[i].append(r)
                break
        else:
            reps.append(r)
            classes.append([r])
    return classes


#: why replicated parameters drawn from the global generator must agree (the message of
#: :func:`check_replicas_agree`)
UNSEEDED_HINT = (
    "They were drawn with seed=None from the global CPU generator, whose state differs "
    "between ranks unless every rank seeds it alike (each process starts from its own): "
    "pass seed= (or generator=) to the layer, seed every rank alike before building it "
    "(torch.manual_seed(s) or diffcomm.rng.model_parallel_seed), or load the weights "
    "from one checkpoint."
)


def check_replicas_agree(named: Sequence[tuple[str, Tensor]], where: str, group: Any) -> None:
    """Raise :class:`~diffcomm.CrossRankMismatchError` unless the replicated parameters
    ``named`` (``(name, parameter)``) are equal on every rank of ``group``: one fingerprint
    all_gather (:func:`check_replicated`). Skipped on meta tensors, while compiling and
    under torch's ``LocalTensorMode`` (one program draws for every simulated rank)."""
    named = [(n, p) for n, p in named if p.device.type != "meta"]
    if not named or _torch.compiling() or _torch.local_tensor_mode_on():
        return
    flat = torch.cat([_as_real64(plain(p)).reshape(-1) for _, p in named])
    names = ", ".join(n for n, _ in named)
    check_replicated(flat, where, f"the replicated parameters ({names})", UNSEEDED_HINT, group)
