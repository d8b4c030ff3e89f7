"""Every diffcomm op under torch's ``LocalTensorMode``: equal to the in-process world, or a
clear error (docs/in_process.md, "Under torch's LocalTensorMode": each row of its table is
a case here).

One program runs both ways: in ``LocalWorld(n, in_process=True)`` (each rank a thread
with its own ``dist.get_rank()``: the reference, itself equal to gloo processes, see
tests/runtime/test_in_process.py) and once under ``LocalTensorMode(n)`` with torch's fake
process group, where every tensor holds all ranks' values. Inputs are made per rank with
torch's ``rank_map`` (``cb(dist.get_rank())`` in a rank, one ``LocalTensor`` under the
mode), so the program is the same code in both. Values and gradients must agree to 1e-12
in float64.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _shared import COPY_FORWARDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm._errors import CrossRankMismatchError, RankError
from diffcomm.backend.local_tensor import LocalTensorModeError
from diffcomm.parallel import routing as _routing_module
from diffcomm.parallel.context import ring as _ring_module

_REDUCE_OPS = ("sum", "avg", "max", "min", "product")

# ---- running one program both ways -----------------------------------------------------


def run_under_local_tensor_mode(n: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args)`` under ``LocalTensorMode(n)`` (torch's fake process group); the result
    split into each rank's (a plain tensor is every rank's)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        with LocalTensorMode(n):
            got = fn(*args)
        return [_on_rank(got, r) for r in range(n)]
    finally:
        dist.destroy_process_group()


def _on_rank(obj: Any, r: int) -> Any:
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensors", None)
        return (local[r] if local is not None else obj).detach()
    if isinstance(obj, list | tuple):
        return [_on_rank(o, r) for o in obj]
    return obj


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def assert_equal_both_ways(inproc_world: Any, n: int, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` under ``LocalTensorMode(n)`` == in ``inproc_world`` (an n-rank
    in-process ``LocalWorld``), rank by rank."""
    here = run_under_local_tensor_mode(n, fn, *args)
    want = inproc_world.run(fn, *args)
    for r in range(n):
        assert _close(here[r], want[r]), (r, here[r], want[r])


def per_rank(
    seed: int, *shape: int, rows: Callable[[int], int] | None = None, same: bool = False
) -> torch.Tensor:
    """A float64 input that requires grad, different on every rank (``rows(r)``: rank
    ``r``'s length along dim 0 instead of ``shape[0]``; ``same``: equal on every rank)."""
    from torch.distributed._local_tensor import rank_map

    def make(r: int) -> torch.Tensor:
        dims = (rows(r), *shape[1:]) if rows is not None else shape
        g = torch.Generator().manual_seed(seed * 1000 + (0 if same else r))
        return torch.randn(*dims, dtype=torch.float64, generator=g)

    return rank_map(make).requires_grad_(True)


def outs_and_grads(outs: list[torch.Tensor], ins: list[torch.Tensor]) -> tuple:
    """The outputs and the gradients of every input of a loss weighting each output
    differently (a per-rank loss: the sum convention)."""
    loss = sum(((o * (i + 1)) ** 2).sum() for i, o in enumerate(outs))
    grads = torch.autograd.grad(loss, ins, allow_unused=True)
    return [o.detach() for o in outs], [g if g is None else g.detach() for g in grads]


# ---- the table's rows: one program per op ------------------------------------------------


def _one(op: Callable[[torch.Tensor], Any], *shape: int) -> Callable[[], tuple]:
    def program() -> tuple:
        x = per_rank(1, *shape)
        y = op(x)
        return outs_and_grads(list(y) if isinstance(y, list | tuple) else [y], [x])

    return program


def _ragged(op: Callable[[torch.Tensor], Any]) -> Callable[[], tuple]:
    def program() -> tuple:
        x = per_rank(2, 0, 3, rows=lambda r: r + 1)  # rank r holds r + 1 rows
        y = op(x)
        return outs_and_grads(list(y) if isinstance(y, list | tuple) else [y], [x])

    return program


def _coalesced(op: Callable[[list[torch.Tensor]], Any]) -> Callable[[], tuple]:
    def program() -> tuple:
        x, y = per_rank(3, 6, 4), per_rank(4, 3)
        return outs_and_grads(list(op([x, y])), [x, y])

    return program


def _layer(make: Callable[[], torch.nn.Module], ids: bool = False, **shape: int) -> Callable[[], tuple]:
    """A TP layer or block made on every rank from one seed (its serial twin's shards),
    run forward and backward on a replicated input (``ids``: token ids) or, with
    ``shape['chunk']`` rows, on this rank's sequence chunk."""

    def program() -> tuple:
        torch.manual_seed(0)
        layer = make()
        params = list(layer.parameters())
        if ids:
            x = torch.tensor([[0, 7, 3], [5, 2, 4]])
            return outs_and_grads([layer(x)], params)
        rows = shape.get("chunk", 6)
        x = per_rank(18, rows, 2, shape["h"], same="chunk" not in shape)
        return outs_and_grads([layer(x)], [x, *params])

    return program


def _tp(name: str) -> Callable[[], tuple]:
    f64 = {"dtype": torch.float64}
    makes: dict[str, Callable[[], tuple]] = {
        "ColumnParallelLinear": _layer(lambda: P.ColumnParallelLinear(8, 6, seed=3, **f64), h=8),
        "ColumnParallelLinear[gather_output]": _layer(
            lambda: P.ColumnParallelLinear(8, 6, gather_output=True, seed=3, **f64), h=8
        ),
        "ColumnParallelLinear[sequence_parallel]": _layer(
            lambda: P.ColumnParallelLinear(8, 6, sequence_parallel=True, seed=3, **f64), h=8, chunk=2
        ),
        "RowParallelLinear": _layer(lambda: P.RowParallelLinear(8, 6, seed=3, **f64), h=8),
        "RowParallelLinear[sequence_parallel]": _layer(
            lambda: P.RowParallelLinear(8, 6, input_is_parallel=True, sequence_parallel=True, seed=3, **f64),
            h=4,
        ),
        "VocabParallelEmbedding": _layer(lambda: P.VocabParallelEmbedding(8, 3, seed=3, **f64), ids=True),
        "VocabParallelEmbedding[sequence_parallel]": _layer(
            lambda: P.VocabParallelEmbedding(8, 3, sequence_parallel=True, seed=3, **f64), ids=True
        ),
        "SequenceParallelLayerNorm": _layer(
            lambda: P.SequenceParallelLayerNorm.from_serial(torch.nn.LayerNorm(8, dtype=torch.float64)),
            h=8,
            chunk=3,
        ),
        "ParallelMLP": _layer(lambda: P.ParallelMLP.from_serial(P.MLP(8, 32, dtype=torch.float64)), h=8),
        "ParallelMLP[sequence_parallel]": _layer(
            lambda: P.ParallelMLP(8, 32, sequence_parallel=True, seed=4, **f64), h=8, chunk=3
        ),
        # overlap=: the blocking mappings under the mode (as under torch.func), against the
        # fused ring / comm Functions in the in-process world (the ring re-associates sums)
        "ParallelMLP[sequence_parallel, overlap='ring']": _layer(
            lambda: P.ParallelMLP(8, 32, sequence_parallel=True, overlap="ring", seed=4, **f64), h=8, chunk=3
        ),
        "ParallelMLP[overlap='comm']": _layer(
            lambda: P.ParallelMLP(8, 32, overlap="comm", seed=4, **f64), h=8
        ),
        "ParallelSelfAttention": _layer(
            lambda: P.ParallelSelfAttention.from_serial(
                P.SelfAttention(8, 4, causal=True, dtype=torch.float64)
            ),
            h=8,
        ),
    }
    return makes[name]


_TP_ROWS = (
    "ColumnParallelLinear",
    "ColumnParallelLinear[gather_output]",
    "ColumnParallelLinear[sequence_parallel]",
    "RowParallelLinear",
    "RowParallelLinear[sequence_parallel]",
    "VocabParallelEmbedding",
    "VocabParallelEmbedding[sequence_parallel]",
    "SequenceParallelLayerNorm",
    "ParallelMLP",
    "ParallelMLP[sequence_parallel]",
    "ParallelMLP[sequence_parallel, overlap='ring']",
    "ParallelMLP[overlap='comm']",
    "ParallelSelfAttention",
)


def _cross_entropy(**kw: Any) -> Callable[[], tuple]:
    def program() -> tuple:
        logits = per_rank(19, 5, 4)  # this rank's 4 of the vocabulary's 4 * world classes
        target = torch.tensor([0, 3, 6, 7, -100])
        return outs_and_grads([P.vocab_parallel_cross_entropy(logits, target, **kw)], [logits])

    return program


def _cross_entropy_uneven(sizes: list[int], **kw: Any) -> Callable[[], tuple]:
    """Vocabulary shards of ``sizes`` (contiguous in rank order; one may be empty): the
    logits' last dim differs per simulated rank."""

    def program() -> tuple:
        from torch.distributed._local_tensor import rank_map

        full = torch.randn(5, sum(sizes), generator=torch.Generator().manual_seed(23), dtype=torch.float64)
        starts = [sum(sizes[:r]) for r in range(len(sizes))]
        logits = rank_map(lambda r: full[:, starts[r] : starts[r] + sizes[r]].clone()).requires_grad_(True)
        target = torch.tensor([0, 3, 6, 7, -100])
        return outs_and_grads([P.vocab_parallel_cross_entropy(logits, target, **kw)], [logits])

    return program


def _attention(name: str) -> Callable[[], tuple]:
    def program() -> tuple:
        q, k, v = (per_rank(s, 1, 4, 3, 8) for s in (6, 7, 8))
        return outs_and_grads([getattr(P, name)(q, k, v, causal=True)], [q, k, v])

    return program


def _ulysses_gqa(heads: int, kv_heads: int) -> Callable[[], tuple]:
    def program() -> tuple:
        q = per_rank(6, 1, heads, 3, 8)
        k, v = (per_rank(s, 1, kv_heads, 3, 8) for s in (7, 8))
        return outs_and_grads([P.ulysses_attention(q, k, v, causal=True)], [q, k, v])

    return program


def _ring(
    rows: int,
    heads: int = 4,
    kv_heads: int = 4,
    mask: str | None = None,
    key_padding: bool = False,
    **kw: Any,
) -> Callable[[], tuple]:
    """``ring_attention`` on this rank's ``rows`` of q, k, v (``mask``: an additive float
    or a bool ``attn_mask`` of this rank's rows, all global columns; ``key_padding``: one
    row ``(batch, 1, 1, S)`` for all) with ``kw``."""

    def program() -> tuple:
        q = per_rank(6, 2, heads, rows, 4)
        k, v = (per_rank(s, 2, kv_heads, rows, 4) for s in (7, 8))
        ins, call = [q, k, v], dict(kw)
        if mask is not None:
            total = kw.get("seq_len") or (
                kw["cu_seqlens"][-1] if "cu_seqlens" in kw else rows * dc.get_world_size()
            )
            m = per_rank(5, 2, 1, 1, total) if key_padding else per_rank(5, 1, heads, rows, total)
            if mask == "bool":
                call["attn_mask"] = m.detach() > -1.0  # about 1 in 6 pairs masked
            else:
                call["attn_mask"] = m
                ins.append(m)
        return outs_and_grads([P.ring_attention(q, k, v, **call)], ins)

    return program


def _usp(
    layout: str, causal: bool, heads: int = 4, mesh_shape: tuple[int, int] = (2, 2)
) -> Callable[[], tuple]:
    """``usp_attention`` on a ``mesh_shape`` mesh (Ulysses x ring), q, k, v taken from one
    whole sequence with ``shard`` (each simulated rank its own piece) and put back with
    ``unshard``."""

    def program() -> tuple:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ulysses", "ring"))
        ug, rg = (mesh, "ulysses"), (mesh, "ring")
        full = [per_rank(s, 1, heads, 8, 4, same=True).detach() for s in (21, 22, 23)]  # the whole sequence
        q, k, v = (P.shard(t, 2, rg, layout=layout, ulysses_group=ug).requires_grad_() for t in full)
        out = P.usp_attention(q, k, v, ug, rg, causal=causal)
        return outs_and_grads([out, P.unshard(out, 2, rg, ulysses_group=ug)], [q, k, v])

    return program


def _shard_unshard(layout: str, **kw: Any) -> Callable[[], tuple]:
    def program() -> tuple:
        x = torch.arange(2.0 * 11, dtype=torch.float64).view(2, 11).requires_grad_()
        part = P.shard(x, 1, layout=layout, **kw)
        # `part * part` carries no placement: the padded length is given (or in cu_seqlens)
        length = {} if "cu_seqlens" in kw else {"seq_len": 11}
        return outs_and_grads([part, P.unshard(part * part, 1, layout=layout, **kw, **length)], [x])

    return program


def _zigzag_cu() -> dict[str, Any]:
    return {"layout": "zigzag", "cu_seqlens": [0, 3, 11]}


def _moe() -> tuple:
    x = per_rank(9, 4, 6)
    gate, idx, _ = P.route(per_rank(10, 4, 6).detach(), 2)
    h, plan = P.dispatch(x, idx, 6)
    return outs_and_grads([h, P.combine(h * 2.0, gate, plan)], [x])


def _moe_program(
    tokens: list[int], e: int, k: int, capacity_factor: float | None, seed: int, positions: bool = False
) -> tuple:
    """MoE routing, dispatch, a nonlinear expert and combine, forward and backward (the
    router's gradient too) on ``tokens[r]`` tokens of rank ``r`` (the same code both
    ways); ``positions``: the drops by a random permutation of the tokens' positions."""
    from torch.distributed._local_tensor import rank_map

    x = per_rank(seed, 0, 3, rows=lambda r: tokens[r])
    logits = per_rank(seed + 1, 0, e, rows=lambda r: tokens[r])
    gate, idx, _ = P.route(logits, k)
    perm = random.Random(seed).sample(range(sum(tokens)), sum(tokens))  # (host: alike both ways)
    pos = None
    if positions:
        starts = [sum(tokens[:r]) for r in range(len(tokens) + 1)]
        pos = rank_map(lambda r: torch.tensor(perm[starts[r] : starts[r + 1]], dtype=torch.int64))
    h, plan = P.dispatch(x, idx, e, capacity_factor=capacity_factor, positions=pos)
    y = P.combine(torch.tanh(h) * 2.0, gate, plan)
    return outs_and_grads([h, y], [x, logits])


def _route() -> tuple:
    logits = per_rank(10, 4, 6)
    gate, idx, probs = P.route(logits, 2)
    outs, grads = outs_and_grads([gate, probs], [logits])
    return [*outs, idx], grads


def _expert_parallel_moe(world: int = 2, from_serial: bool = False, **kw: Any) -> Callable[[], tuple]:
    """An ``ExpertParallelMoE`` (seeded: each rank its experts of one full init; or
    ``from_serial`` of a serial ``MoE``), forward and backward on per-rank tokens, with
    the gradients of the tokens and every parameter (this rank's experts, the replicas'
    shares) and the aux loss."""

    def program() -> tuple:
        if from_serial:
            torch.manual_seed(0)
            layer = P.ExpertParallelMoE.from_serial(P.MoE(6, 8, 2 * world, dtype=torch.float64, **kw))
        else:
            layer = P.ExpertParallelMoE(6, 8, 2 * world, seed=0, dtype=torch.float64, **kw)
        x = per_rank(20, 0, 6, rows=lambda r: 5 - r % 3)
        y = layer(x)
        return outs_and_grads([y, layer.aux_loss], [x, *layer.parameters()])

    return program


def _pipeline() -> tuple:
    from torch import nn

    from diffcomm.pipeline import PipelineRunner, partition

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    stage = partition(model, dc.get_world_size())[dc.get_rank()]
    runner = PipelineRunner(stage, "1f1b", loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    return runner.step(x, y, n_micro=2)


def _gradcheck() -> Any:
    from diffcomm.testing import gradcheck

    return gradcheck(dc.all_gather, per_rank(1, 3))


def _send_recv() -> Any:
    x = per_rank(11, 3)
    return dc.send(x, 1)


def _sendrecv() -> Any:
    return dc.sendrecv(per_rank(12, 3), dst=1, src=1)


def _tp_mlp_by_mappings() -> tuple:
    """A Megatron MLP written with the mappings: column shard, tanh, row shard."""
    x = per_rank(14, 6, 8, same=True)  # replicated input
    w1, w2 = per_rank(15, 8, 4), per_rank(16, 4, 8)  # each rank's shards
    y = P.reduce_from_region(torch.tanh(P.copy_to_region(x) @ w1) @ w2)
    return outs_and_grads([y], [x, w1, w2])


def _compat(name: str) -> Callable[[], tuple]:
    from diffcomm import compat as C

    calls: dict[str, Callable[[torch.Tensor], Any]] = {
        "all_reduce": lambda x: C.all_reduce(x, op=dist.ReduceOp.MAX),
        "broadcast": lambda x: C.broadcast(x, src=1),
        "reduce": lambda x: C.reduce(x, dst=1),
        "all_gather": C.all_gather,
        "gather": lambda x: C.gather(x, dst=1),
        "scatter": lambda x: C.scatter(list(x.unbind(0)), src=1),
        "reduce_scatter": lambda x: C.reduce_scatter(x[0], list(x.unbind(0))),
        "_all_gather_base": lambda x: C._all_gather_base(None, x),  # type: ignore[arg-type]
        "all_to_all": lambda x: C.all_to_all(list(x.unbind(0)), list(x.unbind(0))),
        "all_to_all_single": lambda x: C.all_to_all_single(torch.empty_like(x), x),
    }
    return _one(calls[name], 3, 4)


def _a2a_per_rank_splits() -> tuple:
    """An uneven all_to_all whose split sizes differ per rank (under the mode: ints each
    simulated rank holds its own of, from ``tolist()`` of a per-rank tensor), output
    sizes exchanged."""
    from torch.distributed._local_tensor import rank_map

    x = per_rank(24, 0, 2, rows=lambda r: 2 * r + 1)  # 1, 3, 5 rows
    ins = rank_map(lambda r: torch.tensor([[1, 0, 0], [0, 2, 1], [3, 0, 2]][r])).tolist()
    return outs_and_grads([dc.all_to_all(x, input_split_sizes=ins)], [x])


def _mapping(name: str) -> Callable[[], tuple]:
    if name == "all_to_all_region":
        return _one(lambda x: P.all_to_all_region(x, 0, 1), 4, 4)
    return _one(getattr(P, name), 4, 4)


#: row -> (program, world): equal under LocalTensorMode and in the in-process world
EQUAL: dict[str, tuple[Callable[[], Any], int]] = {
    **{f"all_reduce[{o}]": (_one(lambda x, o=o: dc.all_reduce(x, op=o), 4, 3), 3) for o in _REDUCE_OPS},
    "all_gather": (_one(dc.all_gather, 2, 3), 3),
    "all_gather[dim=1]": (_one(lambda x: dc.all_gather(x, dim=1), 2, 3), 3),
    "all_gather[uneven]": (_ragged(dc.all_gather), 3),
    "all_gather[split_sizes]": (_ragged(lambda x: dc.all_gather(x, split_sizes=[1, 2, 3])), 3),
    **{
        f"reduce_scatter[{o}]": (_one(lambda x, o=o: dc.reduce_scatter(x, op=o), 6, 2), 3)
        for o in _REDUCE_OPS
    },
    "reduce_scatter[split_sizes]": (_one(lambda x: dc.reduce_scatter(x, split_sizes=[1, 0, 5]), 6, 2), 3),
    "broadcast": (_one(lambda x: dc.broadcast(x, src=2), 2, 3), 3),
    **{f"reduce[{o}]": (_one(lambda x, o=o: dc.reduce(x, dst=1, op=o), 2, 3), 3) for o in _REDUCE_OPS},
    "gather": (_one(lambda x: dc.gather(x, dst=1), 2, 3), 3),
    "gather[uneven]": (_ragged(lambda x: dc.gather(x, dst=2)), 3),
    "scatter": (_one(lambda x: dc.scatter(x, src=1), 6, 2), 3),
    "scatter[split_sizes]": (_one(lambda x: dc.scatter(x, src=2, split_sizes=[2, 4, 0]), 6, 2), 3),
    "all_to_all": (_one(dc.all_to_all, 6, 2), 3),
    "all_to_all[split_dim=1]": (_one(lambda x: dc.all_to_all(x, split_dim=1, concat_dim=0), 2, 6), 3),
    "all_to_all[input_split_sizes]": (_one(lambda x: dc.all_to_all(x, input_split_sizes=[1, 3]), 4, 2), 2),
    "all_to_all[split sizes differing per rank]": (_a2a_per_rank_splits, 3),
    "shift[+1]": (_one(lambda x: dc.shift(x, 1), 2, 3), 3),
    "shift[-2]": (_one(lambda x: dc.shift(x, -2), 2, 3), 4),
    "ppermute": (_one(lambda x: dc.ppermute(x, [(0, 2), (2, 1)]), 2, 3), 3),
    "all_reduce_coalesced": (_coalesced(lambda xs: dc.all_reduce_coalesced(xs, op="max")), 3),
    "all_gather_coalesced": (_coalesced(dc.all_gather_coalesced), 3),
    "reduce_scatter_coalesced": (_coalesced(dc.reduce_scatter_coalesced), 3),
    "reduce_scatter_coalesced[product]": (
        _coalesced(lambda xs: dc.reduce_scatter_coalesced(xs, op="product")),
        3,
    ),
    "broadcast_coalesced": (_coalesced(lambda xs: dc.broadcast_coalesced(xs, src=2)), 3),
    "reduce_coalesced": (_coalesced(lambda xs: dc.reduce_coalesced(xs, dst=1)), 3),
    **{name: (_mapping(name), 2) for name in P.MAPPINGS},
    "TP MLP by the mappings": (_tp_mlp_by_mappings, 2),
    **{f"parallel.{name}": (_tp(name), 2) for name in _TP_ROWS},
    "ParallelMLP[world=4]": (_tp("ParallelMLP"), 4),
    "ulysses_attention": (_attention("ulysses_attention"), 2),
    "ulysses_attention[world=4]": (_attention("ulysses_attention"), 4),
    "ulysses_attention[gqa]": (_ulysses_gqa(4, 2), 2),
    "ring_attention": (_attention("ring_attention"), 2),
    "ring_attention[world=1]": (_ring(3, causal=True), 1),
    "ring_attention[not causal, world=3]": (_ring(3), 3),
    "ring_attention[zigzag, world=4]": (_ring(4, causal=True, layout="zigzag"), 4),
    "ring_attention[gqa, zigzag]": (_ring(4, 4, 2, causal=True, layout="zigzag"), 3),
    "ring_attention[padded: seq_len]": (_ring(3, causal=True, seq_len=7), 3),
    "ring_attention[cu_seqlens, zigzag]": (
        _ring(6, 2, 1, causal=True, layout="zigzag", cu_seqlens=[0, 3, 8]),
        2,
    ),
    "ring_attention[attn_mask]": (_ring(3, causal=True, mask="float"), 3),
    "ring_attention[attn_mask bool, zigzag]": (_ring(4, mask="bool", layout="zigzag"), 2),
    "ring_attention[key-padding mask, zigzag]": (
        _ring(4, 4, 2, mask="float", key_padding=True, causal=True, layout="zigzag"),
        3,
    ),
    "ring_attention[dropout, zigzag]": (
        _ring(4, causal=True, layout="zigzag", dropout_p=0.3, dropout_seed=5),
        3,
    ),
    "usp_attention": (_usp("contiguous", True), 4),
    "usp_attention[zigzag]": (_usp("zigzag", True), 4),
    "usp_attention[zigzag, 4 x 1 mesh: Ulysses only]": (_usp("zigzag", True, mesh_shape=(4, 1)), 4),
    "usp_attention[zigzag, 1 x 4 mesh: ring only]": (_usp("zigzag", True, mesh_shape=(1, 4)), 4),
    "usp_attention[not causal, 1 x 2 mesh]": (_usp("contiguous", False, mesh_shape=(1, 2)), 2),
    "testing.check_adjoint[world=3]": (lambda: _adjoint_test(False, 3), 3),
    "testing.check_adjoint[world=4]": (lambda: _adjoint_test(False, 4), 4),
    "shard / unshard": (_shard_unshard("contiguous"), 3),
    "shard / unshard[zigzag, cu_seqlens]": (_shard_unshard(**_zigzag_cu()), 3),
    "moe route": (_route, 2),
    "moe dispatch / combine": (_moe, 2),
    "ExpertParallelMoE": (_expert_parallel_moe(), 2),
    "ExpertParallelMoE[world=4, k=1, capacity_factor, shared expert]": (
        _expert_parallel_moe(4, k=1, capacity_factor=0.9, shared_expert_size=4),
        4,
    ),
    "ExpertParallelMoE.from_serial": (_expert_parallel_moe(3, from_serial=True), 3),
    "moe dispatch / combine[tokens differing per rank, capacity_factor, world=3]": (
        lambda: _moe_program([5, 0, 3], 6, 2, 0.8, 30),
        3,
    ),
    "moe dispatch / combine[positions, tokens differing per rank, capacity_factor, world=3]": (
        lambda: _moe_program([5, 0, 3], 6, 2, 0.8, 32, positions=True),
        3,
    ),
    "moe dispatch / combine[one expert per rank, world=4]": (
        lambda: _moe_program([3, 4, 2, 3], 4, 1, None, 31),
        4,
    ),
    "vocab_parallel_cross_entropy": (_cross_entropy(), 2),
    "vocab_parallel_cross_entropy[smoothing, sum]": (
        _cross_entropy(label_smoothing=0.1, reduction="sum"),
        2,
    ),
    "vocab_parallel_cross_entropy[uneven shards]": (_cross_entropy_uneven([4, 3, 3]), 3),
    "vocab_parallel_cross_entropy[uneven shards, an empty one, smoothing]": (
        _cross_entropy_uneven([4, 0, 6], label_smoothing=0.1),
        3,
    ),
    "vocab_parallel_cross_entropy[vocab_size: padding]": (
        _cross_entropy_uneven([3, 3, 3], label_smoothing=0.1, vocab_size=8),
        3,
    ),
    "vocab_parallel_cross_entropy[vocab_size: uneven shards with padding]": (
        _cross_entropy_uneven([4, 3, 2], label_smoothing=0.1, vocab_size=8),
        3,
    ),
    **{
        f"compat.{name}": (_compat(name), 3)
        for name in (
            "all_reduce",
            "broadcast",
            "reduce",
            "all_gather",
            "gather",
            "scatter",
            "reduce_scatter",
            "_all_gather_base",
            "all_to_all",
            "all_to_all_single",
        )
    },
}

#: row -> (program, world, the words the error must contain)
REFUSED: dict[str, tuple[Callable[[], Any], int, str]] = {
    "send / recv": (_send_recv, 2, r"`send` .*its peers are per-rank Python ints"),
    "sendrecv": (_sendrecv, 2, r"`sendrecv` .*its peers are per-rank Python ints"),
    "get_rank": (lambda: dc.get_rank(), 2, r"`get_rank` .*reads this rank as a Python int"),
    "all_reduce(async_op=True)": (
        _one(lambda x: dc.all_reduce(x, async_op=True), 2, 3),
        2,
        r"`all_reduce\(async_op=True\)` .*communication thread",
    ),
    "reduce_scatter_coalesced(async_op=True)": (
        _coalesced(lambda xs: dc.reduce_scatter_coalesced(xs, async_op=True)),
        3,
        r"async_op=True\)` .*communication thread",
    ),
    "all_to_all[output_split_sizes contradicting what arrives]": (
        _one(lambda x: dc.all_to_all(x, input_split_sizes=[1, 3], output_split_sizes=[1, 3]), 4, 2),
        2,
        r"`all_to_all` .*output_split_sizes \[1, 3\] disagree with the sizes the ranks send it \[1, 1\]",
    ),
    "all_gather_coalesced[uneven]": (_ragged(lambda x: dc.all_gather_coalesced([x])), 2, r"reads this rank"),
    "ulysses_attention[3 heads over 2 ranks]": (
        _ulysses_gqa(3, 3),
        2,
        r"`parallel.ulysses_attention` .*reads this rank.*query heads \[2, 1\] differ",
    ),
    "ulysses_attention[gqa, KV heads differing per rank]": (
        _ulysses_gqa(6, 3),  # rank 0's query heads use KV heads (0, 0, 1), rank 1's (1, 2, 2)
        2,
        r"`parallel.ulysses_attention` .*reads this rank",
    ),
    "usp_attention[3 heads over a Ulysses group of 2]": (
        _usp("contiguous", True, heads=3),
        4,
        r"`parallel.usp_attention` .*reads this rank.*query heads \[2, 1\] differ",
    ),
    "ExpertParallelMoE.serial_names": (
        lambda: P.ExpertParallelMoE(6, 8, 4, seed=0).serial_names(),
        2,
        r"`parallel.ExpertParallelMoE.serial_names` .*reads this rank",
    ),
    "ExpertParallelMoE(experts=...)": (
        lambda: P.ExpertParallelMoE(6, 8, 4, experts=[P.MLP(6, 8) for _ in range(2)]),
        2,
        r"`parallel.ExpertParallelMoE\(experts=...\)` .*reads this rank",
    ),
    "pipeline (PipelineRunner)": (_pipeline, 2, r"`get_rank` .*reads this rank"),
    "testing.gradcheck": (
        _gradcheck,
        2,
        r"`testing.gradcheck` .*each probe moves one element of one rank's input",
    ),
    "all_reduce(precision=bf16)": (
        _one(lambda x: dc.all_reduce(x, precision=dc.Precision("bf16")), 2, 3),
        2,
        r"`all_reduce\(precision=...\)` .*quantized wire reads this rank",
    ),
    "reduce_from_region(precision=bf16)": (
        _one(lambda x: P.reduce_from_region(x, precision=dc.Precision("bf16")), 2, 3),
        2,
        r"`parallel.reduce_from_region\(precision=...\)` .*quantized wire reads this rank",
    ),
}


@pytest.mark.parametrize("row", list(EQUAL))
def test_equal_under_local_tensor_mode(row: str, inproc_worlds: Callable[[int], Any]) -> None:
    program, n = EQUAL[row]
    # a copy forward's per-rank input is refused in debug mode (its premise: replicated)
    with dc.debug(False) if row in COPY_FORWARDS else nullcontext():
        assert_equal_both_ways(inproc_worlds(n), n, program)


@pytest.mark.parametrize("row", list(REFUSED))
@pytest.mark.usefixtures("debug_off")
def test_refused_under_local_tensor_mode_naming_the_op(row: str) -> None:
    program, n, words = REFUSED[row]
    with pytest.raises(LocalTensorModeError, match=words + r".*in_process=True"):
        run_under_local_tensor_mode(n, program)


def test_debug_mode_under_local_tensor_mode_refuses_as_without() -> None:
    """Debug mode's coalesced list check encoded each tensor's shape as ints; under
    LocalTensorMode an uneven shape holds one size per rank, and it failed with torch's
    AttributeError ('LocalIntNode' object has no attribute 'guard_int'). It is skipped
    there, as the field check is: the op's own refusal names it."""
    program, n, words = REFUSED["all_gather_coalesced[uneven]"]
    with dc.debug(True), pytest.raises(LocalTensorModeError, match=words + r".*in_process=True"):
        run_under_local_tensor_mode(n, program)


#: case -> (op, each rank's rows, the raw op named): real ranks' buffers must agree
_SHAPES_DIFFER: dict[str, tuple[Callable[[torch.Tensor], Any], list[int], str]] = {
    "all_reduce": (dc.all_reduce, [1, 2], "all_reduce"),  # (was: rank 0's row broadcast)
    "reduce": (lambda x: dc.reduce(x, dst=0, op="max"), [1, 2], "all_reduce"),
    "broadcast": (lambda x: dc.broadcast(x, src=1), [2, 4], "broadcast"),
    "all_to_all": (dc.all_to_all, [2, 4], "all_to_all"),
    "shift": (lambda x: dc.shift(x, 1), [2, 2, 4], "ppermute"),
    "gather_from_region": (P.gather_from_region, [1, 2, 2], "all_gather"),  # (no size exchange)
    "all_gather_from_sequence": (P.all_gather_from_sequence, [2, 4], "all_gather"),
}


@pytest.mark.parametrize("case", list(_SHAPES_DIFFER))
@pytest.mark.usefixtures("debug_off")
def test_shapes_that_differ_per_rank_where_the_op_needs_one_are_an_error(
    case: str, inproc_worlds: Callable[[int], Any]
) -> None:
    """A tensor whose shape differs between the simulated ranks, given to an op whose
    ranks must agree (no size exchange): real and in-process ranks fail; under the mode
    the per-rank result was computed anyway — all_reduce broadcast a one-row tensor,
    broadcast gave every rank the root's shape, all_gather / shift joined any lengths — a
    value no real run gives, with no error."""
    fn, rows, raw = _SHAPES_DIFFER[case]

    def program() -> Any:
        return fn(per_rank(5, 0, 2, rows=lambda r: rows[r]))

    with pytest.raises(RankError):
        inproc_worlds(len(rows)).run(program)
    with pytest.raises(RuntimeError, match=rf"LocalTensorMode: {raw}: the simulated ranks hold tensors of "):
        run_under_local_tensor_mode(len(rows), program)


#: case -> (op, each rank's rows, the error's words): a size that differs per rank where
#: the op sizes its buffers from this rank's x (the ragged cases an earlier probe found)
_SIZES_DIFFER: dict[str, tuple[Callable[[torch.Tensor], Any], list[int], str]] = {
    # (was torch's "unhashable type: non-nested SymInt")
    "all_to_all_region": (
        lambda x: P.all_to_all_region(x, 0, 1),
        [2, 4],
        r"parallel.all_to_all_region\(\): `x` must be of one size along dim 0 on every rank.*"
        r"\(rank 0: 2, rank 1: 4\)",
    ),
    # (was torch's "SymIntArrayRef expected to contain only concrete integers")
    "scatter": (
        lambda x: dc.scatter(x, src=1),
        [3, 3, 6],
        r"diffcomm.scatter\(\): `x` must be of one size along the split dim on every rank.*rank 2: 6\)$",
    ),
    "reduce_scatter": (dc.reduce_scatter, [2, 4], r"diffcomm.reduce_scatter\(\): `x` must be of one size"),
    # the backward's all_gather: the raw op's per-rank check
    "scatter_to_region (backward)": (
        P.scatter_to_region,
        [2, 4],
        r"LocalTensorMode: all_gather: the simulated",
    ),
    "scatter_to_sequence (backward)": (
        P.scatter_to_sequence,
        [2, 4],
        r"LocalTensorMode: all_gather: the simulated",
    ),
    "broadcast_coalesced": (
        lambda x: dc.broadcast_coalesced([x], src=1),
        [2, 4],
        r"LocalTensorMode: broadcast: the simulated ranks hold",
    ),
}


@pytest.mark.parametrize("case", list(_SIZES_DIFFER))
def test_sizes_that_differ_per_rank_are_a_diffcomm_error_naming_the_op(
    case: str, inproc_worlds: Callable[[int], Any]
) -> None:
    """Ragged inputs (rank ``r``'s rows differ) to ops whose ranks must agree on a size:
    the in-process world's ranks fail at the exchange ("called it with different shapes");
    under the mode the error is diffcomm's, naming the op and each rank's size, before
    any exchange where the op reads its sizes from ``x`` (all_to_all_region and scatter
    failed inside torch: "unhashable type: non-nested SymInt", "SymIntArrayRef expected
    to contain only concrete integers"). The same in debug mode: its replicated check of
    scatter_to_region's input failed on the per-rank size (torch's AttributeError
    "'LocalIntNode' object has no attribute 'int_'")."""
    fn, rows, words = _SIZES_DIFFER[case]

    def program() -> Any:
        x = per_rank(5, 0, 4, rows=lambda r: rows[r])
        return outs_and_grads([fn(x)], [x])

    with pytest.raises(RankError):
        inproc_worlds(len(rows)).run(program)
    for debug in (False, True):
        with dc.debug(debug), pytest.raises((ValueError, RuntimeError), match=words):
            run_under_local_tensor_mode(len(rows), program)


def _compat_broadcast_from_global_rank_2() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm import compat

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return compat.broadcast(torch.ones(2), src=2, group=mesh.get_group("dp"))


def test_a_compat_global_rank_outside_a_copy_of_the_group_raises_as_on_real_ranks(inproc_world4) -> None:
    """``compat.broadcast(x, src=2, group=<dp axis>)`` on a 2 x 2 mesh: rank 2 is in the dp
    group {0, 2}, not in {1, 3}, so ranks 1 and 3 raise ValueError. Under LocalTensorMode
    the global rank was translated with the fake group (rank 0's) for every copy, and
    ranks 1 and 3 silently took rank 3's tensor."""
    with pytest.raises(RankError) as real:
        inproc_world4.run(_compat_broadcast_from_global_rank_2)
    assert sorted(real.value.failures) == [1, 3], real.value.failures
    with pytest.raises(ValueError, match=r"`src` must be a global rank that belongs to the group \[1, 3\]"):
        run_under_local_tensor_mode(4, _compat_broadcast_from_global_rank_2)


def _on_my_part_of_a_partition() -> tuple:
    """Every rank makes both parts of the partition {0, 2} {1, 3} and works on its own
    (under the mode ``dist.get_rank()`` is the fake group's 0: rank 0's part stands for
    each rank's copy)."""
    parts = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = parts[dist.get_rank() % 2]
    x = per_rank(14, 4, 3)
    outs = [dc.all_reduce(x, group=g), dc.all_gather(x, group=g), dc.reduce_scatter(x, group=g)]
    return outs_and_grads([*outs, dc.broadcast(x, src=1, group=g)], [x])


def test_a_partition_made_with_new_group_runs_per_copy_as_on_real_ranks(inproc_world4) -> None:
    """A group made with ``dist.new_group`` whose copies tile the ranks (each rank makes
    every part and uses its own): values and gradients equal the in-process world's."""
    assert_equal_both_ways(inproc_world4, 4, _on_my_part_of_a_partition)


def _all_reduce_on(ranks: list[int]) -> torch.Tensor:
    x = per_rank(15, 2)
    return dc.all_reduce(x, group=dist.new_group(ranks)).detach() * 1


@pytest.mark.parametrize(
    ("n", "ranks", "laid_out"),
    [
        # copies that overlap (was: a member's value wrong)
        (8, [0, 1, 2, 4], r"\[\[0, 1, 2, 4\], \[2, 3, 4, 6\]\]"),
        # ranks 2 and 5 in no copy (was: no value for them)
        (6, [0, 1, 3, 4], r"\[\[0, 1, 3, 4\]\]"),
        # a copy beyond the world
        (4, [0, 1, 2], r"\[\[0, 1, 2\], \[3, 4, 5\]\]"),
        # no regular grid (was torch's AssertionError)
        (4, [0, 1, 3], "of itself;"),
    ],
)
def test_a_group_whose_copies_do_not_tile_the_ranks_is_refused_naming_the_op(
    n: int, ranks: list[int], laid_out: str
) -> None:
    """Under the mode the fake group (rank 0's) stands for one group per copy of its
    layout. ``new_group([0, 1, 2, 4])`` at world 8 is laid out by torch as the copies
    [0, 1, 2, 4] and [2, 3, 4, 6]: ``all_reduce`` gave ranks 2 and 4, members of the
    group, the second copy's sum (1011100 for inputs 10**r, where real ranks get 10111),
    silently; ranks in no copy got no value, a layout that is no regular grid failed inside
    torch. Each is now refused naming the op, the group and its copies."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    want = (
        rf"`all_reduce` under torch's LocalTensorMode .*group of ranks {re.escape(str(ranks))} does not tile"
    )
    with pytest.raises(LocalTensorModeError, match=want) as got:
        run_under_local_tensor_mode(n, _all_reduce_on, ranks)
    assert re.search(laid_out, str(got.value)), str(got.value)
    # compat's global-rank translation asks the same copies
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        with LocalTensorMode(n), pytest.raises(LocalTensorModeError, match="`compat.broadcast` under"):
            from diffcomm import compat

            compat.broadcast(torch.ones(2), src=0, group=dist.new_group(ranks))
    finally:
        dist.destroy_process_group()


class _GatherWithAWrongBackward(torch.autograd.Function):
    """all_gather whose backward keeps the first rows of its own gradient (not the adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x.detach())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g[: g.shape[0] // 2].clone()


def _adjoint_test(wrong: bool, n: int = 2) -> float:
    from diffcomm.testing import check_adjoint

    x, y = per_rank(1, 3), per_rank(2, 3 * n)
    op = _GatherWithAWrongBackward.apply if wrong else dc.all_gather
    return check_adjoint(op, x, y)


def test_check_adjoint_under_local_tensor_mode_equals_in_process(inproc_world2) -> None:
    """``testing.check_adjoint`` under LocalTensorMode read each rank's inner product with
    ``.item()`` and failed inside torch ("Non Tensor or int rank results must be equal for
    all ranks"); it sums them as a tensor first now: the same error as in-process ranks,
    and the same failure for a wrong backward."""
    here = run_under_local_tensor_mode(2, _adjoint_test, False)
    assert here[0] == pytest.approx(inproc_world2.run(_adjoint_test, False)[0], abs=1e-15) and here[0] < 1e-12
    wrong = r"check_adjoint: sum_r <A x_r, y_r> = .* but sum_r <x_r, A\^T y_r>"
    with pytest.raises(AssertionError, match=wrong):
        run_under_local_tensor_mode(2, _adjoint_test, True)
    with pytest.raises(RankError, match=r"check_adjoint: sum_r <A x_r, y_r>"):
        inproc_world2.run(_adjoint_test, True)


def _adjoint_test_x_zero_on(ranks: tuple[int, ...]) -> float:
    from torch.distributed._local_tensor import rank_map

    from diffcomm.testing import check_adjoint

    x = rank_map(
        lambda r: torch.zeros(3, dtype=torch.float64) if r in ranks else torch.ones(3, dtype=torch.float64)
    )
    return check_adjoint(dc.all_gather, x, per_rank(2, 6))


def test_check_adjoint_refuses_an_x_zero_on_every_rank_under_local_tensor_mode(inproc_world2) -> None:
    """The vacuity check reads only the sums over ranks (a per-rank value cannot be read
    under LocalTensorMode): x zero on every rank is refused as in-process, zero on one
    rank is a real test."""
    vacuous = r"check_adjoint\(\): the dot-product test is vacuous: `x` is zero on every rank"
    with pytest.raises(ValueError, match=vacuous):
        run_under_local_tensor_mode(2, _adjoint_test_x_zero_on, (0, 1))
    with pytest.raises(RankError, match=vacuous):
        inproc_world2.run(_adjoint_test_x_zero_on, (0, 1))
    assert run_under_local_tensor_mode(2, _adjoint_test_x_zero_on, (0,))[0] < 1e-12


def _forward_mode(op: str, how: str) -> list[torch.Tensor]:
    """``reduce(x, dst=1, op=op)``'s value and tangent by forward-mode AD (``how``: torch's
    ``forward_ad`` dual tensors or ``torch.func.jvp``)."""
    import torch.autograd.forward_ad as fwAD

    x, t = per_rank(26, 2, 3).detach(), per_rank(27, 2, 3).detach()
    if how == "func":
        return list(torch.func.jvp(lambda u: dc.reduce(u, dst=1, op=op), (x,), (t,)))
    with fwAD.dual_level():
        return list(fwAD.unpack_dual(dc.reduce(fwAD.make_dual(x, t), dst=1, op=op)))


@pytest.mark.parametrize("how", ["forward_ad", "func"])
@pytest.mark.parametrize("op", ["min", "max", "product", "sum"])
def test_forward_mode_of_reduce_under_local_tensor_mode_equals_real_processes(
    op: str, how: str, world3: Any
) -> None:
    """``jvp`` of ``reduce`` (the in-process world refuses forward-mode AD: compared with
    real processes). max/min/product keep the root's value by a per-rank mask; that was
    ``torch.where``, whose forward-mode rule crashes under the mode (a segfault, or
    "Cannot access data pointer of Tensor that doesn't have storage")."""
    here = run_under_local_tensor_mode(3, _forward_mode, op, how)
    want = world3.run(_forward_mode, op, how)
    for r in range(3):
        assert _close(here[r], want[r]), (r, here[r], want[r])


# ---- hypothesis: ops x shapes x split sizes x worlds 1-4 ---------------------------------

_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter"]
_OPS += ["all_to_all", "shift", "ppermute", "all_gather_uneven", "scatter_to_region"]


def _program(op: str, n: int, rows: int, rest: list[int], splits: list[int] | None, kw: dict) -> tuple:
    """One op forward and backward on per-rank inputs (the same code both ways)."""
    if op == "all_gather_uneven":
        assert splits is not None
        x = per_rank(kw["seed"], 0, *rest, rows=lambda r: splits[r])
        return outs_and_grads([dc.all_gather(x, dim=0)], [x])
    x = per_rank(kw["seed"], rows, *rest)
    root = kw["root"] % n
    if op == "all_reduce":
        y = dc.all_reduce(x, op=kw["op"])
    elif op == "all_gather":
        y = dc.all_gather(x, dim=len(rest))
    elif op == "reduce_scatter":
        y = dc.reduce_scatter(x, op=kw["op"], split_sizes=splits)
    elif op == "broadcast":
        y = dc.broadcast(x, src=root)
    elif op == "reduce":
        y = dc.reduce(x, dst=root, op=kw["op"])
    elif op == "gather":
        y = dc.gather(x, dst=root)
    elif op == "scatter":
        y = dc.scatter(x, src=root, split_sizes=splits)
    elif op == "all_to_all":
        y = dc.all_to_all(x)
    elif op == "shift":
        y = dc.shift(x, kw["root"] - 2)
    elif op == "ppermute":
        y = dc.ppermute(x, [(r, (r + kw["root"]) % n) for r in range(n - 1)])
    else:
        y = P.scatter_to_region(x, dim=0)
    return outs_and_grads([y], [x])


@st.composite
def _cases(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 4))
    op = draw(st.sampled_from(_OPS))
    rest = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    rows = n * draw(st.integers(0, 2))
    splits = None
    if op in ("reduce_scatter", "scatter", "all_gather_uneven") and (
        op == "all_gather_uneven" or draw(st.booleans())
    ):
        splits = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        rows = sum(splits)
    kw = {"op": draw(st.sampled_from(list(_REDUCE_OPS))), "root": draw(st.integers(0, 4))}
    kw["seed"] = draw(st.integers(0, 999))
    if op == "reduce_scatter" and splits is not None:
        kw["op"] = draw(st.sampled_from(["sum", "avg"]))  # (nonlinear uneven: see the table)
    return op, n, rows, rest, splits, kw


def test_property_local_tensor_mode_equals_in_process_world(inproc_worlds: Callable[[int], Any]) -> None:
    """Hypothesis: op x shape x split sizes x reduce op x root x world 1-4."""

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_cases())
    def check(case: tuple) -> None:
        op, n, *rest = case
        # a copy forward's per-rank input is refused in debug mode (its premise: replicated)
        with dc.debug(False) if op in COPY_FORWARDS else nullcontext():
            assert_equal_both_ways(inproc_worlds(n), n, _program, op, n, *rest)

    check()


def test_a_plain_tensor_is_every_ranks_and_groups_of_a_mesh_run_per_copy(
    inproc_worlds: Callable[[int], Any],
) -> None:
    """A tensor made outside ``rank_map`` holds the same values on every rank; a subgroup
    (each copy of a 2 x 2 mesh's axis) reduces within its own copy."""

    def program() -> tuple:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = per_rank(13, 4, 2)
        same = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)
        return outs_and_grads(
            [dc.all_reduce(x, group=(mesh, "tp")), dc.reduce_scatter(x, group=(mesh, "dp")) + same[:2]], [x]
        )

    assert_equal_both_ways(inproc_worlds(4), 4, program)


_OF_ONE = {
    "all_reduce": lambda x, g: dc.all_reduce(x, group=g),
    "all_reduce[max]": lambda x, g: dc.all_reduce(x, op="max", group=g),
    "all_reduce[product]": lambda x, g: dc.all_reduce(x, op="product", group=g),
    "reduce": lambda x, g: dc.reduce(x, dst=0, group=g),
    "reduce_scatter[max]": lambda x, g: dc.reduce_scatter(x, op="max", group=g),
    "reduce_from_region": lambda x, g: P.reduce_from_region(x, g),
}


def _halved_in_place(op: str, axis: bool) -> list[torch.Tensor]:
    """``op`` over a group of one rank (the world of 1, or the size-1 axis of a 2 x 1
    mesh), its result then halved in place; the input read after."""
    from torch.distributed.device_mesh import init_device_mesh

    group = (init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b")), "b") if axis else None
    x = per_rank(16, 2, 3).detach()
    y = _OF_ONE[op](x, group)
    y.mul_(0.5)
    return [x + y, x]


@pytest.mark.parametrize("axis", [False, True], ids=["world of 1", "size-1 mesh axis"])
@pytest.mark.parametrize("op", list(_OF_ONE))
def test_a_group_of_one_gives_a_new_tensor_as_on_real_ranks(
    inproc_worlds: Callable[[int], Any], op: str, axis: bool
) -> None:
    """Over a group of one rank the per-rank reduction returned the rank's own input tensor:
    ``y.mul_(0.5)`` halved ``x`` too, and ``x + y`` gave x where real ranks give 1.5 x."""
    n = 2 if axis else 1
    assert_equal_both_ways(inproc_worlds(n), n, _halved_in_place, op, axis)


def _narrow_reductions(name: str) -> list[torch.Tensor | str]:
    """Reductions of a dtype torch has no arithmetic in (or none exact: fp8), each rank's
    values near the dtype's top; each result's bytes, or the error's first words."""
    from torch.distributed._local_tensor import rank_map

    dtype = getattr(torch, name)
    top = {"uint16": 2**16 - 1, "uint32": 2**32 - 1, "uint64": -1, "int16": 2**15 - 1}.get(name, 1)

    def values(r: int) -> torch.Tensor:
        v = torch.tensor([top - 5 * r, 3 + r, top // 2 + r, 1])  # (uint64: -1 is its top)
        return v.view(dtype) if name == "uint64" else v.to(dtype)

    x = rank_map(values)
    out: list[torch.Tensor | str] = []
    for fn in (
        lambda: dc.all_reduce(x, "sum"),
        lambda: dc.all_reduce(x, "max"),
        lambda: dc.reduce(x, dst=1, op="min"),
        lambda: dc.reduce_scatter(x, op="product"),
    ):
        try:
            out.append(fn().view(torch.uint8))
        except TypeError as err:
            out.append(str(err)[:60])
    return out


@pytest.mark.parametrize("name", ["uint16", "uint32", "uint64", "int16", "float8_e4m3fn"])
def test_reductions_of_dtypes_torch_cannot_add_equal_real_ranks(name: str, inproc_worlds: Any) -> None:
    """uint16 / uint32 / uint64 reduce in a wider dtype on real ranks; under LocalTensorMode
    the per-rank reduction added them with torch ("maximum_cpu" / "add_stub" not
    implemented for 'UInt32'), and an fp8 one raised torch's error, not the op's."""
    if not hasattr(torch, name):
        pytest.skip(f"torch has no {name}")
    assert_equal_both_ways(inproc_worlds(2), 2, _narrow_reductions, name)


def test_split_sizes_are_checked_on_every_simulated_rank() -> None:
    """A ``split_sizes`` that one simulated rank's length contradicts is the ValueError
    real processes give (naming the argument), not rank 0's check alone."""

    def program() -> Any:
        x = per_rank(17, 0, 3, rows=lambda r: r + 1)  # 1, 2, 3 rows
        return dc.all_gather(x, split_sizes=[1, 2, 2])  # rank 2 holds 3 rows

    with pytest.raises(
        ValueError, match=r"`split_sizes` must be to list x.shape\[0\]=.*at this rank's position"
    ):
        run_under_local_tensor_mode(3, program)


def test_split_sizes_differing_per_rank_are_a_type_error_outside_all_to_all() -> None:
    """Only ``all_to_all`` takes split sizes that differ between the simulated ranks (each
    rank's own); where every rank must pass the same sizes (``reduce_scatter``,
    ``scatter``) they are a ``TypeError`` naming the argument, never rank 0's read for all."""
    from torch.distributed._local_tensor import rank_map

    def program(op: str) -> Any:
        x = per_rank(25, 4, 2)
        sizes = rank_map(lambda r: torch.tensor([[1, 3], [2, 2]][r])).tolist()
        return getattr(dc, op)(x, split_sizes=sizes)

    for op in ("reduce_scatter", "scatter"):
        with pytest.raises(TypeError, match=r"`split_sizes` must be an int"):
            run_under_local_tensor_mode(2, program, op)


# ---- planted bugs: the layer rows catch a rank read as rank 0's, or an init drawn per rank


def _rank_zero(*args: Any) -> int:
    return 0  # what torch's fake process group says on every simulated rank


def _start_of_rank_zero(sizes: torch.Tensor, *args: Any) -> torch.Tensor:
    return sizes[:0].sum()  # rank 0's first class (0), as the 0-dim tensor the mode's start is


def _row_zero(table: torch.Tensor, *args: Any) -> torch.Tensor:
    return table[0]  # rank 0's row of a layout table standing for every simulated rank's


class _ReversedHopPlan(_ring_module._LocalPlan):
    """The ring's plan under the mode with its hop the wrong way round (to rank-1)."""

    def hop(self, x: torch.Tensor, name: str, j: int | None) -> torch.Tensor:
        w = self.world
        return self.every.ppermute(x, [(r, (r - 1) % w) for r in range(w)], self.pg)


def _experts_of_rank_zero(full: Any, per_rank: int, pg: Any) -> list:
    return list(full.experts)[:per_rank]  # rank 0's experts standing for every rank's


_RANK_PART = _routing_module._rank_part  # (the real one, before a test patches it)


def _rank_part_of_rank_zero(rank: int, *args: Any) -> tuple:
    return _RANK_PART(0, *args)  # every rank's plan made as rank 0's


#: (row, module, attribute, planted replacement): each makes the row's program wrong under
#: LocalTensorMode only (the reference is run first, unpatched: its ranks share the module)
_PLANTED: list[tuple[str, str, str, Any]] = [
    ("parallel.ColumnParallelLinear", "diffcomm.parallel._module", "rank_index", _rank_zero),
    ("parallel.RowParallelLinear", "diffcomm.parallel._module", "rank_index", _rank_zero),
    ("parallel.ParallelMLP", "diffcomm.parallel._module", "rank_index", _rank_zero),
    ("parallel.ParallelSelfAttention", "diffcomm.parallel._module", "rank_index", _rank_zero),
    ("parallel.VocabParallelEmbedding", "diffcomm.parallel.layers", "rank_start", _rank_zero),
    ("vocab_parallel_cross_entropy", "diffcomm.parallel.loss", "rank_start", _rank_zero),
    # every simulated rank's classes taken to start where rank 0's do
    (
        "vocab_parallel_cross_entropy[uneven shards]",
        "diffcomm.parallel.loss",
        "_own_start",
        _start_of_rank_zero,
    ),
    # Ulysses whose ranks map query to KV heads differently, rank 0's map standing for all
    (
        "ulysses_attention[gqa, KV heads differing per rank]",
        "diffcomm.parallel.context.ulysses",
        "_rank_for_all",
        _rank_zero,
    ),
    # the ring's positions (its causal masks, padding, documents, dropout) read as rank 0's
    ("ring_attention[zigzag, world=4]", "diffcomm.parallel.context.ring", "rank_positions", _row_zero),
    ("ring_attention[padded: seq_len]", "diffcomm.parallel.context.ring", "rank_positions", _row_zero),
    ("ring_attention[dropout, zigzag]", "diffcomm.parallel.context.ring", "rank_positions", _row_zero),
    ("usp_attention[zigzag]", "diffcomm.parallel.context.ring", "rank_positions", _row_zero),
    # the hop the wrong way round: each rank then masks a block as another rank's (causal:
    # a non-causal ring without a mask sums the same blocks in any order, to rounding)
    ("ring_attention[padded: seq_len]", "diffcomm.parallel.context.ring", "_LocalPlan", _ReversedHopPlan),
    ("ring_attention[attn_mask]", "diffcomm.parallel.context.ring", "_LocalPlan", _ReversedHopPlan),
    ("shard / unshard[zigzag, cu_seqlens]", "diffcomm.parallel.context.layout", "rank_positions", _row_zero),
    # ExpertParallelMoE: every simulated rank holding rank 0's experts
    ("ExpertParallelMoE", "diffcomm.parallel.moe", "_experts_per_rank", _experts_of_rank_zero),
    ("ExpertParallelMoE.from_serial", "diffcomm.parallel.moe", "_experts_per_rank", _experts_of_rank_zero),
    ("parallel.ColumnParallelLinear", "diffcomm.parallel.layers", "local_tensor_mode_off", nullcontext),
    ("parallel.VocabParallelEmbedding", "diffcomm.parallel.layers", "local_tensor_mode_off", nullcontext),
]


#: planted rows whose bug ends in a ``ValueError`` (matching this) instead of other values:
#: the vocab-parallel loss learns every shard's size from each rank's own position in the max
#: all_reduce, so every rank read as rank 0 leaves the other positions empty, and the
#: target ids past that too-small vocabulary are refused on every rank
_PLANTED_REFUSED = {("vocab_parallel_cross_entropy", "rank_start"): r"class ids in \[0, 4\).*got id 7"}


@pytest.mark.parametrize(("row", "module", "attr", "bug"), _PLANTED, ids=lambda v: getattr(v, "__name__", v))
def test_a_layer_row_fails_under_a_planted_bug(
    row: str, module: str, attr: str, bug: Any, inproc_worlds: Callable[[int], Any], monkeypatch: Any
) -> None:
    """The row's check (:func:`assert_equal_both_ways`) fails when the layer reads the
    rank as rank 0's (the fake group's answer) or draws its seeded full init per simulated
    rank (each rank then gets the generator's next values); Ulysses whose ranks
    map query heads to KV heads differently gives wrong values if rank 0's map stands for
    every rank unchecked (so it is refused)."""
    import importlib

    program, n = EQUAL[row] if row in EQUAL else REFUSED[row][:2]
    want = inproc_worlds(n).run(program)
    monkeypatch.setattr(importlib.import_module(module), attr, bug)
    refused = _PLANTED_REFUSED.get((row, attr))
    if refused is not None:  # the planted bug is an error (louder than a wrong value)
        with pytest.raises(ValueError, match=refused):
            run_under_local_tensor_mode(n, program)
        return
    here = run_under_local_tensor_mode(n, program)
    assert not all(_close(here[r], want[r]) for r in range(n))


# ---- hypothesis: uneven all_to_all, split sizes differing per rank x worlds 1-4 ----------


def _uneven_all_to_all_program(table: list[list[int]], rest: list[int], given: bool, seed: int) -> tuple:
    """Rank ``r`` sends ``table[r][j]`` rows to rank ``j`` (its sizes, one list per rank:
    under the mode ints each simulated rank holds its own of); the output sizes given
    (each rank's column of the table) or exchanged."""
    from torch.distributed._local_tensor import rank_map

    n = len(table)
    x = per_rank(seed, 0, *rest, rows=lambda r: sum(table[r]))
    ins = rank_map(lambda r: torch.tensor(table[r])).tolist()
    outs = rank_map(lambda r: torch.tensor([table[s][r] for s in range(n)])).tolist() if given else None
    return outs_and_grads([dc.all_to_all(x, input_split_sizes=ins, output_split_sizes=outs)], [x])


def test_property_uneven_all_to_all_under_local_tensor_mode_equals_in_process_world(
    inproc_worlds: Callable[[int], Any],
) -> None:
    """Hypothesis: a table of split sizes (each rank's own sizes, differing per rank) x
    trailing shape x output sizes given or exchanged x world 1-4."""

    @st.composite
    def cases(draw: st.DrawFn) -> tuple:
        n = draw(st.integers(1, 4))
        row = st.lists(st.integers(0, 3), min_size=n, max_size=n)
        return (
            draw(st.lists(row, min_size=n, max_size=n)),
            draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)),
            draw(st.booleans()),
            draw(st.integers(0, 999)),
        )

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    def check(case: tuple) -> None:
        n = len(case[0])
        assert_equal_both_ways(inproc_worlds(n), n, _uneven_all_to_all_program, *case)

    check()


# ---- hypothesis: ring attention x layouts x shapes x masks x worlds 1-4 -------------------


def _ring_program(
    n: int,
    layout: str,
    causal: bool,
    hk: int,
    g: int,
    total: int,
    cut: int | None,
    mask: str,
    p: float,
    seed: int,
) -> tuple:
    """``ring_attention`` forward and backward on each rank's rows of a sequence of
    ``total`` positions (padded shards; ``cut``: two packed documents), the same code both
    ways."""
    cu = None if cut is None else [0, cut, total]
    rows = P.layout_index(total, n, layout=layout, cu_seqlens=cu).shape[1]
    q = per_rank(seed, 1, hk * g, rows, 3)
    k, v = (per_rank(seed + i, 1, hk, rows, 3) for i in (1, 2))
    ins = [q, k, v]
    kw: dict[str, Any] = {"causal": causal, "layout": layout, "seq_len": total, "cu_seqlens": cu}
    if mask != "none":
        m = per_rank(seed + 3, 1, 1, rows, total)
        kw["attn_mask"] = m.detach() > -0.5 if mask == "bool" else m
        if mask == "float":
            ins.append(m)
    if p > 0:
        kw.update(dropout_p=p, dropout_seed=seed)
    return outs_and_grads([P.ring_attention(q, k, v, **kw)], ins)


def test_property_ring_attention_under_local_tensor_mode_equals_in_process_world(
    inproc_worlds: Callable[[int], Any],
) -> None:
    """Hypothesis: layout (contiguous, zigzag) x causal x GQA x padded length x packed
    documents x attn_mask (none, additive, bool) x dropout x world 1-4; the output and
    the q, k, v (and additive mask) gradients equal the in-process world's."""

    @st.composite
    def cases(draw: st.DrawFn) -> tuple:
        n = draw(st.integers(1, 4))
        total = draw(st.integers(1, 3 * n))
        cut = draw(st.one_of(st.none(), st.integers(1, total))) if total > 1 else None
        return (
            n,
            draw(st.sampled_from(["contiguous", "zigzag"])),
            draw(st.booleans()),
            draw(st.integers(1, 2)),
            draw(st.integers(1, 2)),
            total,
            None if cut == total else cut,
            draw(st.sampled_from(["none", "float", "bool"])),
            draw(st.sampled_from([0.0, 0.0, 0.3])),
            draw(st.integers(0, 999)),
        )

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    def check(case: tuple) -> None:
        assert_equal_both_ways(inproc_worlds(case[0]), case[0], _ring_program, *case)

    check()


# ---- hypothesis: MoE dispatch / combine x tokens x experts x k x capacity x worlds 1-4 ----


def test_property_moe_dispatch_combine_under_local_tensor_mode_equals_in_process_world(
    inproc_worlds: Callable[[int], Any],
) -> None:
    """Hypothesis: tokens per rank (0-5, differing), experts per rank, k, capacity factor
    (dropless or dropping), world 1-4: the dispatched rows, the combined output and the
    gradients of the tokens and the router's logits equal the in-process world's."""

    @st.composite
    def cases(draw: st.DrawFn) -> tuple:
        n = draw(st.integers(1, 4))
        e = n * draw(st.integers(1, 3))
        return (
            draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)),
            e,
            draw(st.integers(1, min(e, 3))),
            draw(st.sampled_from([None, None, 0.5, 1.0, 1.5])),
            draw(st.integers(0, 999)),
        )

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    def check(case: tuple) -> None:
        n = len(case[0])
        assert_equal_both_ways(inproc_worlds(n), n, _moe_program, *case)

    check()


def test_the_moe_row_fails_when_every_rank_plans_as_rank_0(
    inproc_worlds: Callable[[int], Any], monkeypatch: Any
) -> None:
    """Every simulated rank's routing plan made as rank 0's (from its own routing): its
    split sizes then contradict its rows or what arrives, and the all_to_all's per-rank
    checks say so (an error naming the op and argument, not a wrong value); in debug mode
    its cross-rank size check says so where the sizes fit the rows."""
    for row in ("moe dispatch / combine", "moe dispatch / combine[one expert per rank, world=4]"):
        program, n = EQUAL[row]
        inproc_worlds(n).run(program)
        monkeypatch.setattr(_routing_module, "_rank_part", _rank_part_of_rank_zero)
        refused = r"all_to_all.*(output|input)_split_sizes"
        with dc.debug(False), pytest.raises((LocalTensorModeError, ValueError), match=refused):
            run_under_local_tensor_mode(n, program)
        either = (CrossRankMismatchError, LocalTensorModeError, ValueError)
        with dc.debug(True), pytest.raises(either, match=rf"{refused}|all_to_all.*inconsistent split sizes"):
            run_under_local_tensor_mode(n, program)
        monkeypatch.undo()


# ---- hypothesis: the TP layers and the vocab-parallel loss x sizes x worlds 1-4 ---------


def _layer_program(kind: str, n: int, h: int, o: int, rows: int, seed: int) -> tuple:
    """One TP layer (seeded: each rank its shard of one full init) or the vocab-parallel
    loss, forward and backward on a replicated input (the same code both ways)."""
    f64 = {"dtype": torch.float64, "seed": seed}
    if kind == "cross_entropy":
        logits = per_rank(seed, rows, o)
        target = torch.arange(rows) * 7 % (o * n)
        return outs_and_grads([P.vocab_parallel_cross_entropy(logits, target)], [logits])
    if kind == "embedding":
        layer: torch.nn.Module = P.VocabParallelEmbedding(o * n, h, **f64)
        return outs_and_grads([layer(torch.arange(rows) * 5 % (o * n))], list(layer.parameters()))
    if kind == "column":
        layer = P.ColumnParallelLinear(h, o * n, gather_output=True, **f64)
    elif kind == "row":
        layer = P.RowParallelLinear(h * n, o, **f64)
    else:
        layer = P.ParallelMLP(h, o * n, **f64)
    x = per_rank(seed, rows, layer.in_features if kind == "row" else h, same=True)  # type: ignore[arg-type]
    return outs_and_grads([layer(x)], [x, *layer.parameters()])


def test_property_tp_layers_under_local_tensor_mode_equal_in_process_world(
    inproc_worlds: Callable[[int], Any],
) -> None:
    """Hypothesis: layer (column, row, MLP, embedding, vocab-parallel loss) x sizes x
    world 1-4; every value and gradient equal to the in-process world's."""

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(["column", "row", "mlp", "embedding", "cross_entropy"]),
        st.integers(1, 4),
        st.integers(1, 5),
        st.integers(1, 3),
        st.integers(1, 4),
        st.integers(0, 999),
    )
    def check(kind: str, n: int, h: int, o: int, rows: int, seed: int) -> None:
        assert_equal_both_ways(inproc_worlds(n), n, _layer_program, kind, n, h, o, rows, seed)

    check()


# ---- named RNG streams ------------------------------------------------------------------


def test_named_rng_streams_under_local_tensor_mode_are_refused() -> None:
    """Under ``LocalTensorMode`` each simulated rank draws from a generator state of its
    own, which the process's default generator does not reach: ``model_parallel_seed``
    seeded nothing the ranks draw from and ``tracker.fork()`` swapped the stream into a
    generator nobody read, so ``model_parallel_seed(7, tp_rank=1)``, then ``torch.rand(4)``
    in ``fork()`` and one after it, drew neither the stream's nor seed 7's numbers
    (0.1041 where a process draws 0.7210; 0.4974 where it draws 0.5349), the same on
    every simulated rank, with no error; ``ParallelMLP(dropout=...)`` then gave every TP
    rank the same mask where real processes draw different ones. Both are refused, naming
    the call; a layer without dropout (or in eval) still runs."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from diffcomm import rng

    saved = rng.get_tracker().get_states()
    x = torch.ones(3, 2, 8, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        rng.model_parallel_seed(7, tp_rank=1)  # outside the mode: as before
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            with LocalTensorMode(2):
                with pytest.raises(LocalTensorModeError, match=r"`rng.model_parallel_seed` under torch's"):
                    rng.model_parallel_seed(7, tp_rank=1)
                with pytest.raises(LocalTensorModeError, match=r"RNGStatesTracker.fork\('model-parallel'\)"):
                    with rng.get_tracker().fork():
                        pass
                mlp = P.ParallelMLP(8, 32, dropout=0.5, seed=4, dtype=torch.float64)
                with pytest.raises(LocalTensorModeError, match=r"generator state of\s+its own"):
                    mlp(x)
                mlp.eval()
                assert mlp(x).shape == x.shape
        finally:
            dist.destroy_process_group()
            rng.get_tracker().set_states(saved)
