"""Stages wrapped in torch's ``DistributedDataParallel`` (data parallelism around a pipeline).

DDP reduces gradients from hooks armed by each forward for the backward that follows it.
A pipeline runs several micro-batches' forwards before their backwards (GPipe, 1F1B's
warm-up, the zero-bubble split), so DDP averaged the gradient of part of the micro-batches
and left the rest of each one's contribution unsynced: the stages' gradients were up to
0.13 off the serial model's with ``n_micro=2`` (1F1B, GPipe, ZB-H1 on a 2 x 2 mesh), with
no error. The runner therefore runs every forward of a DDP module under its ``no_sync()``
and averages the step's gradients over DDP's own group once, at the end of the step
(skipped while the step runs inside the user's ``no_sync()``: gradient accumulation, as
DDP does; the next synchronised step averages the accumulated ``.grad``).

A DDP whose group holds two ranks of the pipeline (``DDP(stage)`` with the default
group, the world) broadcast one stage's parameters over the others at construction (equal
shapes: silently) and would average different stages' gradients: refused by the runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import backend as B
from ..backend import args as A


def ddp_modules(chunks: Sequence[nn.Module]) -> list[DDP]:
    """Every ``DistributedDataParallel`` in ``chunks`` (the chunks themselves or inside)."""
    return [m for c in chunks for m in c.modules() if isinstance(m, DDP)]


def check_ddp_groups(ddps: Sequence[DDP], pg: object) -> None:
    """Raise ``ValueError`` when a DDP's group holds two ranks of the pipeline group ``pg``
    (no communication: each rank reads the groups' ranks)."""
    stages = set(dist.get_process_group_ranks(pg))  # type: ignore[arg-type]
    for ddp in ddps:
        dp = dist.get_process_group_ranks(ddp.process_group)
        both = sorted(stages & set(dp))
        if len(both) > 1:
            raise A.arg_error(
                "PipelineRunner",
                "stage",
                "a stage in DistributedDataParallel over the data-parallel group only (one rank "
                "of each pipeline: DDP(stage, process_group=mesh.get_group('dp')))",
                f"DDP over the ranks {sorted(dp)}, which hold the pipeline's stages on {both}: DDP "
                "broadcast one stage's parameters over the others at construction and would "
                "average different stages' gradients",
            )


@contextlib.contextmanager
def no_sync(ddps: Sequence[DDP]) -> Iterator[None]:
    """Every DDP in ``ddps`` under its ``no_sync()`` (its hooks reduce nothing)."""
    with contextlib.ExitStack() as stack:
        for ddp in ddps:
            stack.enter_context(ddp.no_sync())
        yield


@torch.no_grad()
def average_grads(ddps: Sequence[DDP]) -> None:
    """What DDP's reducer does for a synchronised backward, once for the whole step: each
    DDP's parameters' gradients averaged over its group (parameters it ignores left
    alone). A gradient ``None`` on some ranks counts as zeros there; ``None`` on every
    rank stays ``None``. One all_reduce per dtype and one of the flags, per DDP; none for
    a DDP inside the user's ``no_sync()`` (its ``.grad`` accumulates)."""
    be = B.get_backend()
    for ddp in ddps:
        if not ddp.require_backward_grad_sync:
            continue
        ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
        params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
        if not params:
            continue
        pg, size = ddp.process_group, dist.get_world_size(ddp.process_group)
        dev = be.comm_device(pg)
        have = torch.tensor([float(p.grad is not None) for p in params], device=dev)
        have = be.all_reduce(have, "sum", pg)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype if p.grad is None else p.grad.dtype, []).append(p)
        for dtype, ps in by_dtype.items():
            parts = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
            flat = torch.cat([g.reshape(-1).to(dev, dtype) for g in parts])
            flat = be.all_reduce(flat, "sum", pg).div_(size)
            offset = 0
            for p in ps:
                part = flat[offset : offset + p.numel()].view_as(p).to(p.device)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(part)
                elif have[params.index(p)] > 0:
                    p.grad = part.clone()
