"""Drop-in replacement for ``torch.distributed.nn.functional`` with correct gradients.

Same names, signatures and return types as ``torch.distributed.nn.functional``
(``broadcast``, ``gather``, ``scatter``, ``reduce``, ``reduce_scatter``, ``all_gather``,
``_all_gather_base``, ``all_to_all``, ``all_to_all_single``, ``all_reduce``), built on the
diffcomm collectives, so:

* every reduce op is differentiable correctly (torch's ``all_reduce`` backward sums the
  gradients whatever the op, which is wrong for max/min/product/avg);
* every op works on gloo (no NCCL-only backward paths) and under ``torch.func``.

Differences from torch that a drop-in user should know (all deliberate):

* ``src``/``dst`` are **global** ranks here, exactly as in torch (the core ``diffcomm``
  ops take group-local ranks); they are translated with ``get_group_rank``.
* ``reduce`` returns zeros on non-destination ranks (torch returns unspecified data).
* On a group whose ranks are not its global ranks (``new_group([1, 2])``) torch's functions
  mix the two: ``broadcast``'s backward zeroes ``src``'s gradient, ``gather`` / ``scatter``
  refuse the root's list and ``all_to_all`` names a rank outside the group (torch 2.13);
  here every rank is translated once and the gradients are the adjoint's.
* A rank outside ``group`` (given ``GroupMember.NON_GROUP_MEMBER`` by ``dist.new_group``)
  gets a ``TypeError`` saying so; torch's skip the communication there (its ``all_reduce``
  returns a copy of the input).
* Out-parameters (``output``, ``output_tensor``, ``output_tensor_list``) give the result's
  shape and dtype (one that cannot hold the result is a ``ValueError``) and are **not
  written to**: the result is the returned tensor(s). Nothing is modified in place. torch
  differs: it also writes the result's values into them (``all_to_all`` returns the
  tensors of ``output_tensor_list`` themselves, carrying the gradient), so code that reads
  an out-parameter after the call instead of the returned tensor must be changed to read
  the returned one (``test_out_parameters_are_not_written_where_torch_writes_them``).

Example::

    import diffcomm.compat as dnn            # instead of torch.distributed.nn.functional
    y = dnn.all_reduce(x, op=dist.ReduceOp.MAX)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import _torch
from .backend import args as A
from .backend.local_tensor import group_copies
from .ops import collectives
from .ops.validation import rank as _group_rank

__all__ = [
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "all_gather",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "all_reduce",
]


def _local(group: Any, rank: int, op: str, arg: str) -> int:
    """Translate a global rank (torch's convention here) into a group-local one."""
    pg = A.resolve_group(group, op)
    rank = A.check_int(rank, op, arg)
    if pg is None:
        return rank
    if _torch.local_tensor_mode_on():  # the fake group is rank 0's: ask every copy of it
        copies = group_copies(pg, op)
        outside = [c for c in copies if rank not in c]
        if outside:  # as real ranks: the ranks of a copy without it raise
            want = f"a global rank that belongs to the group {outside[0]} (of every copy: {copies})"
            raise A.arg_error(op, arg, want, rank)
        return copies[0].index(rank)
    try:
        return dist.get_group_rank(pg, rank)
    except (ValueError, RuntimeError):
        raise A.arg_error(
            op, arg, f"a global rank that belongs to the group {dist.get_process_group_ranks(pg)}", rank
        ) from None


def _out(op: str, arg: str, out: Any, like: Tensor, numel: int, default: Any = None) -> Any:
    """The shape of the result, which ``out`` (torch's out-parameter) gives: it must be a
    tensor of the input's dtype holding ``numel`` elements, else the result would silently
    have another shape than the one torch returns (``out`` itself). Before any
    communication. ``None`` (not torch's API; accepted as before) gives ``default``."""
    if out is None:
        return default
    A.check_tensor(out, op, arg)
    if out.dtype != like.dtype or out.numel() != numel:
        want = f"a {like.dtype} tensor of {numel} elements (the result's), as torch requires"
        raise A.arg_error(op, arg, want, f"{out.dtype} {tuple(out.shape)}")
    return out.shape


def broadcast(tensor: Tensor, src: int, group: Any = None) -> Tensor:
    """``src``'s ``tensor`` on every rank. Gradient: reduce(sum) to ``src``."""
    return collectives.broadcast(tensor, _local(group, src, "compat.broadcast", "src"), _group(group))


def gather(tensor: Tensor, dst: int = 0, group: Any = None) -> tuple[Tensor, ...]:
    """Tuple of every rank's ``tensor`` on ``dst`` (zeros elsewhere). Gradient: scatter."""
    g = _group(group)
    world = dist.get_world_size(A.resolve_group(g, "compat.gather"))
    dst_local = _local(group, dst, "compat.gather", "dst")
    out = collectives.gather(tensor.unsqueeze(0), dst_local, 0, g, split_sizes=[1] * world)
    return tuple(out.unbind(0))


def scatter(tensors: list[Tensor] | tuple[Tensor, ...], src: int = 0, group: Any = None) -> Tensor:
    """Tensor ``tensors[rank]`` of ``src``. Gradient: gather to ``src``."""
    if not isinstance(tensors, list | tuple) or not tensors:
        raise A.arg_error(
            "compat.scatter", "tensors", "a non-empty list of tensors", type(tensors).__name__, TypeError
        )
    for t in tensors:
        A.check_tensor(t, "compat.scatter", "tensors")
    g = _group(group)
    stacked = torch.stack(list(tensors))
    out = collectives.scatter(stacked, _local(group, src, "compat.scatter", "src"), 0, g)
    return out.squeeze(0)


def reduce(tensor: Tensor, dst: int, op: Any = dist.ReduceOp.SUM, group: Any = None) -> Tensor:
    """Reduction on ``dst``, zeros elsewhere. Gradient: broadcast from ``dst`` (op-aware)."""
    return collectives.reduce(tensor, _local(group, dst, "compat.reduce", "dst"), op, _group(group))


def reduce_scatter(
    output: Tensor, input_list: list[Tensor], op: Any = dist.ReduceOp.SUM, group: Any = None
) -> Tensor:
    """Reduction of ``input_list[rank]`` over ranks. Gradient: all_gather."""
    if not isinstance(input_list, list | tuple) or not input_list:
        raise A.arg_error(
            "compat.reduce_scatter",
            "input_list",
            "a non-empty list of tensors",
            type(input_list).__name__,
            TypeError,
        )
    flat = torch.cat(
        [A.check_tensor(t, "compat.reduce_scatter", "input_list").reshape(-1) for t in input_list]
    )
    sizes = [t.numel() for t in input_list]
    if all(t.shape == input_list[0].shape for t in input_list):  # (no rank to read)
        mine = input_list[0].shape
    else:
        mine = input_list[_group_rank(A.resolve_group(_group(group), "compat.reduce_scatter"))].shape
    shape = _out("compat.reduce_scatter", "output", output, flat, math.prod(mine), mine)
    return collectives.reduce_scatter(flat, 0, op, _group(group), split_sizes=sizes).reshape(shape)


def all_gather(tensor: Tensor, group: Any = None) -> tuple[Tensor, ...]:
    """Tuple of every rank's ``tensor``. Gradient: reduce_scatter (one collective)."""
    g = _group(group)
    world = dist.get_world_size(A.resolve_group(g, "compat.all_gather"))
    out = collectives.all_gather(
        A.check_tensor(tensor, "compat.all_gather", "tensor").unsqueeze(0), 0, g, split_sizes=[1] * world
    )
    return tuple(out.unbind(0))


def _all_gather_base(output_tensor: Tensor, input_tensor: Tensor, group: Any = None) -> Tensor:
    """Concatenation along dim 0 of every rank's ``input_tensor``. Gradient: reduce_scatter."""
    g = _group(group)
    world = dist.get_world_size(A.resolve_group(g, "compat._all_gather_base"))
    A.check_tensor(input_tensor, "compat._all_gather_base", "input_tensor")
    numel = world * input_tensor.numel()
    shape = _out("compat._all_gather_base", "output_tensor", output_tensor, input_tensor, numel)
    y = collectives.all_gather(input_tensor, 0, g, split_sizes=[input_tensor.shape[0]] * world)
    return y if shape is None else y.reshape(shape)


def all_to_all(
    output_tensor_list: list[Tensor], input_tensor_list: list[Tensor], group: Any = None
) -> tuple[Tensor, ...]:
    """``input_tensor_list[j]`` goes to rank ``j``; returns what arrives, shaped like
    ``output_tensor_list``. Gradient: all_to_all back."""
    op = "compat.all_to_all"
    for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if not isinstance(lst, list | tuple) or not lst:
            raise A.arg_error(op, name, "a non-empty list of tensors", type(lst).__name__, TypeError)
    flat = torch.cat([A.check_tensor(t, op, "input_tensor_list").reshape(-1) for t in input_tensor_list])
    ins = [t.numel() for t in input_tensor_list]
    outs = [A.check_tensor(t, op, "output_tensor_list").numel() for t in output_tensor_list]
    y = collectives.all_to_all(flat, 0, 0, _group(group), ins, outs)
    return tuple(p.reshape(o.shape) for p, o in zip(y.split(outs), output_tensor_list))


def all_to_all_single(
    output: Tensor,
    input: Tensor,  # torch's name
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
) -> Tensor:
    """all_to_all along dim 0 with optional split sizes. Gradient: all_to_all with splits swapped."""
    if output_split_sizes is None and input_split_sizes is not None:
        world = dist.get_world_size(A.resolve_group(_group(group), "compat.all_to_all_single"))
        output_split_sizes = [output.shape[0] // world] * world if output.shape[0] % world == 0 else None
    op = "compat.all_to_all_single"
    A.check_tensor(input, op, "input")
    row = math.prod(input.shape[1:])
    rows = sum(output_split_sizes) if output_split_sizes is not None else None
    if rows is None and input_split_sizes is None:
        rows = input.shape[0]
    if rows is not None:
        _out(op, "output", output, input, rows * row)
    y = collectives.all_to_all(input, 0, 0, _group(group), input_split_sizes, output_split_sizes)
    return y.reshape(_out(op, "output", output, input, y.numel(), y.shape))


def all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> Tensor:
    """Reduction over ranks on every rank. Gradient: correct for every op (sum, avg,
    max/min to the arg-extreme ranks with ties split, zero-safe product)."""
    return collectives.all_reduce(tensor, op, _group(group))


def _group(group: Any) -> Any:
    """``None`` for the default group, however named (``group.WORLD``). The functions'
    default is ``None``, not torch's ``group.WORLD``: that is read once, when the module is
    imported, and imported after ``init_process_group`` it names a group that a later
    ``destroy_process_group`` / ``init_process_group`` leaves destroyed."""
    if group is dist.group.WORLD or group is None:
        return None
    return group
