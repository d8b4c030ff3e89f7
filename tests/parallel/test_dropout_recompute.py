"""Dropout where it meets recomputation: a checkpointed tensor-parallel layer must draw, in
its recomputation, the masks its forward drew (or the gradient is another function's).
Each against the same program without checkpointing, float64, in the in-process world."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm import rng

pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64
S, B, H = 6, 2, 8


def _grads(fn: object, x: torch.Tensor, params: list[torch.Tensor], wx: torch.Tensor) -> list[torch.Tensor]:
    """``[output, input grad, param grads...]`` of ``<fn(x), wx>``."""
    for p in params:
        p.grad = None
    xi = x.detach().clone().requires_grad_()
    out = fn(xi)  # type: ignore[operator]
    (out * wx).sum().backward()
    assert xi.grad is not None
    return [out.detach(), xi.grad] + [p.grad.clone() for p in params if p.grad is not None]


def _apart(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _recompute_all(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _through(h: torch.Tensor, layer: nn.Module, sp: bool, context_fn: object = None) -> torch.Tensor:
    """``layer(h)`` (under ``rng.checkpoint`` with ``context_fn`` when given), the sequence
    scattered to it and gathered from it when ``sp``."""
    h = par.scatter_to_sequence(h, 0) if sp else h
    y = layer(h) if context_fn is None else rng.checkpoint(layer, h, context_fn=context_fn)
    return par.gather_from_sequence(y, 0) if sp else y


def _selective_dropout_layers() -> dict[str, float]:
    """ParallelMLP (plain, sequence-parallel) and ParallelSelfAttention with dropout, under
    rng.checkpoint with selective checkpointing: against the layer without checkpointing."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    r, out = dc.get_rank(), {}
    gen = torch.Generator().manual_seed(2)
    x, wx = (torch.randn(S, B, H, dtype=F64, generator=gen) for _ in range(2))
    rng.model_parallel_seed(5, tp_rank=r)
    layers: list[tuple[str, nn.Module, bool]] = [
        ("mlp", par.ParallelMLP(H, 16, seed=0, dropout=0.5, dtype=F64), False),
        ("mlp sp", par.ParallelMLP(H, 16, seed=0, dropout=0.5, dtype=F64, sequence_parallel=True), True),
        ("attention", par.ParallelSelfAttention(H, 4, seed=0, attention_dropout=0.5, dtype=F64), False),
    ]
    for name, layer, sp in layers:
        for policy in (_recompute_all, _save_matmuls):
            sac = functools.partial(create_selective_checkpoint_contexts, policy)
            run = functools.partial(_through, layer=layer, sp=sp)
            states, cpu = rng.get_tracker().get_states(), torch.get_rng_state()
            params = list(layer.parameters())
            got = _grads(functools.partial(run, context_fn=sac), x, params, wx)
            rng.get_tracker().set_states(states)
            torch.set_rng_state(cpu)
            out[f"{name} {policy.__name__}"] = _apart(got, _grads(run, x, params, wx))
    return out


def test_selective_checkpointing_of_dropout_layers_replays_their_masks(inproc_world2: dc.LocalWorld) -> None:
    """The sequence-parallel MLP under rng.checkpoint with a selective policy raised
    ``aten.clone.default encountered during backward but not found in storage`` (the
    replay's copies of the stream states); see
    tests/test_rng.py::test_checkpoint_under_selective_checkpointing_gives_fns_gradient
    for the silent form of the same fault."""
    for res in inproc_world2.run(_selective_dropout_layers):
        assert max(res.values()) < 1e-13, res
