"""The planted-bug corpus of ``dc.spmd_check``: small SPMD programs, each with one classic
parallel-gradient bug, and the same program fixed.

Each entry is a program with its facts stated right above it, ``@_bug(name, kind,
*names)``, which adds ``Bug(name, kind, program, names)`` to :data:`BUGS` (in the file's
order). Each program takes ``fixed`` (``False``: the bug, ``True``: the fix) and runs on
every rank of a world of any size >= 2 (the tests run them under ``LocalWorld``;
``docs/spmd_types.md`` shows them). The check must raise
:class:`~diffcomm.SPMDTypeError` at the first wrong op, with a message containing every
string of ``names``; the fixed program must pass. :func:`run` returns what happened on
this rank (``None``, or the error's class name and message).
"""

from __future__ import annotations

# Size: ~1070 lines, over the ~600 guideline: a table of small programs (one function per
# bug, its facts in the @_bug line above it), read in order by the docs and the tests;
# nothing in it is logic to split.
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm import rng

__all__ = ["Bug", "BUGS", "CORRECT", "run", "run_correct"]

H = 4  # hidden size: a multiple of every world size the tests use (2, 4) ... and 12 for 3
F_ = 12  # the sharded (feature) size: divisible by 2, 3 and 4


@dataclass(frozen=True)
class Bug:
    """One planted bug: its name, its class (the issue's words), the program, and the
    strings the error message must contain (the op that breaks its rule, the fix)."""

    name: str
    kind: str
    program: Callable[[bool], None]
    names: tuple[str, ...]


#: the corpus, in the file's order: each entry is added by :func:`_bug` above its program
BUGS: list[Bug] = []


def _bug(name: str, kind: str, *names: str) -> Callable[[Callable[[bool], None]], Callable[[bool], None]]:
    """Add the program below to :data:`BUGS` as the bug ``name`` of class ``kind``; the
    check's error message must contain every string of ``names``."""

    def add(program: Callable[[bool], None]) -> Callable[[bool], None]:
        BUGS.append(Bug(name, kind, program, names))
        return program

    return add


def _x(*shape: int, grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)  # the same on every rank: replicated
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def _shard(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1 + dc.get_rank())  # different on every rank: varying
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _fs() -> int:
    """This rank's share of the sharded feature size."""
    return F_ // dc.get_world_size()


def _w(*shape: int, varying: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + (dc.get_rank() if varying else 0))
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` (after a backward that reached ``p``)."""
    assert p.grad is not None
    return p.grad


def _row(out: int = H) -> par.RowParallelLinear:
    """A row-parallel layer, its parameters typed (they are also used functionally)."""
    return dc.spmd.module(par.RowParallelLinear(F_, out, input_is_parallel=True, dtype=torch.float64, seed=0))


def _col(inp: int = H) -> par.ColumnParallelLinear:
    return dc.spmd.module(par.ColumnParallelLinear(inp, F_, dtype=torch.float64, seed=0))


def _mlp_by_hand(h: torch.Tensor) -> torch.Tensor:
    """The column->row MLP on ``h`` written with the layers' parameters (used
    functionally): column-parallel linear, GELU, row-parallel linear reduced, its bias."""
    col, row = _col(), _row()
    a = F.gelu(F.linear(h, col.weight, col.bias))
    return par.reduce_from_region(F.linear(a, row.weight)) + row.bias


def _partial_sums(reduced: bool = False) -> torch.Tensor:
    """A row-parallel matmul's output (this rank's feature shard times its rows of the
    weight): partial sums, or their sum over ranks when ``reduced`` (reduce_from_region)."""
    p = F.linear(dc.spmd.varying(_shard(3, _fs())), _row().weight)
    return par.reduce_from_region(p) if reduced else p


# ======================================================================================
# the programs
# ======================================================================================


@_bug(
    "all_reduce under a replicated objective",
    "all_reduce with the wrong backward under a replicated objective",
    "all_reduce",
    "reduce_from_region",
)
def all_reduce_under_replicated_objective(fixed: bool) -> None:
    """A row-parallel output reduced with the sum-convention all_reduce, then a replicated
    loss: its backward all-reduces the gradient again (world-size times too large)."""
    x, w = dc.spmd.varying(_shard(3, _fs())), _w(_fs(), H)
    p = x @ w  # each rank's partial product
    y = par.reduce_from_region(p) if fixed else dc.all_reduce(p)
    y.pow(2).mean().backward()


@_bug(
    "all_gather under a replicated objective",
    "sum-convention all_gather under a replicated objective",
    "all_gather",
    "gather_from_region",
)
def all_gather_under_replicated_objective(fixed: bool) -> None:
    """A shard gathered with the sum-convention all_gather feeding a replicated loss."""
    x = dc.spmd.varying(_shard(3, H)) @ _w(H, H)
    y = par.gather_from_region(x, dim=-1) if fixed else dc.all_gather(x, dim=-1)
    y.pow(2).mean().backward()


@_bug(
    "all_gather_from_sequence into a replicated loss",
    "sum-convention all_gather under a replicated objective",
    "all_gather_from_sequence",
    "gather_from_sequence",
)
def all_gather_from_sequence_under_replicated_objective(fixed: bool) -> None:
    """Sequence shards gathered with all_gather_from_sequence (its backward
    reduce-scatters: sums over ranks) straight into a replicated loss."""
    x = dc.spmd.varying(_shard(2, H)) @ _w(H, H)
    y = par.gather_from_sequence(x) if fixed else par.all_gather_from_sequence(x)
    y.pow(2).mean().backward()


@_bug("broadcast under a replicated objective", "sum-convention op under a replicated objective", "broadcast")
def broadcast_under_replicated_objective(fixed: bool) -> None:
    """A broadcast value consumed by a replicated loss: reduce(sum) in backward counts the
    loss once per rank."""
    y = dc.broadcast(dc.spmd.varying(_shard(3)) * _w(3), src=0)
    loss = y.pow(2).sum()
    if fixed:  # the objective counted once: only rank 0's copy of the loss
        loss = loss * dc.spmd.varying(torch.tensor(float(dc.get_rank() == 0), dtype=torch.float64))
    loss.backward()


@_bug(
    "missing copy_to_region",
    "missing copy_to_region before a column-parallel matmul",
    "LayerNorm.weight",
    "linear",
    "copy_to_region",
)
def missing_copy_to_region(fixed: bool) -> None:
    """A replicated activation (after a replicated LayerNorm) enters a column-parallel
    matmul without copy_to_region: the LayerNorm's gradient stays partial."""
    h = nn.LayerNorm(H, dtype=torch.float64)(_x(3, H))
    if fixed:
        h = par.copy_to_region(h)
    _mlp_by_hand(h).pow(2).mean().backward()


@_bug(
    "sequence-parallel LayerNorm not reduced",
    "sequence-parallel LayerNorm weights not reduced",
    "LayerNorm.weight",
    "layer_norm",
    "missing reduction",
)
def sequence_parallel_layernorm_not_reduced(fixed: bool) -> None:
    """A plain LayerNorm on sequence shards: each rank's weight gradient is a partial sum
    that nobody reduces (SequenceParallelLayerNorm reduces it)."""
    ln: nn.Module = nn.LayerNorm(H, dtype=torch.float64)
    if fixed:
        ln = par.SequenceParallelLayerNorm.from_serial(ln)  # type: ignore[arg-type]
    ln(dc.spmd.varying(_shard(2, H))).pow(2).sum().backward()


@_bug(
    "shared embedding/output weight not reduced",
    "shared embedding/output weight gradients not reduced",
    "parameter",
    "missing reduction",
)
def shared_embedding_not_reduced(fixed: bool) -> None:
    """A weight shared by an embedding (rank 0) and an output projection (the last rank),
    as between the first and the last pipeline stage: its gradient must be summed."""
    w = nn.Parameter(_x(6, H))
    ids = dc.spmd.varying(torch.tensor([dc.get_rank() % 6, 1]))
    h = dc.spmd.varying(_shard(2, H))
    out = F.embedding(ids, w) if dc.get_rank() == 0 else F.linear(h, w)
    out.pow(2).sum().backward()
    if fixed:
        assert w.grad is not None
        w.grad = dc.all_reduce(w.grad)


@_bug("reduce_from_region twice", "reduction done twice", "reduce_from_region", "twice")
def reduction_done_twice(fixed: bool) -> None:
    """A row-parallel layer's output (already reduced inside the layer) reduced again."""
    row = _row()
    y = row(dc.spmd.varying(_shard(3, _fs())))
    if not fixed:
        y = par.reduce_from_region(y)
    y.pow(2).mean().backward()


@_bug("all_reduce after a row-parallel layer", "reduction done twice", "all_reduce", "twice")
def all_reduce_after_row_parallel(fixed: bool) -> None:
    """dc.all_reduce on a RowParallelLinear's (already replicated) output."""
    y = _row()(dc.spmd.varying(_shard(3, _fs())))
    if not fixed:
        y = dc.all_reduce(y)
    y.pow(2).mean().backward()


@_bug("partial into GELU", "partial into nonlinearity", "gelu", "partial")
def partial_into_nonlinearity(fixed: bool) -> None:
    """A row-parallel matmul's partial sums fed to GELU before their reduction."""
    F.gelu(_partial_sums(reduced=fixed)).pow(2).mean().backward()


@_bug("bias added before the reduction", "partial + replicated", "linear", "bias")
def bias_before_reduction(fixed: bool) -> None:
    """The bias added inside the row-parallel matmul: added once per rank."""
    row = _row()
    x = dc.spmd.varying(_shard(3, _fs()))
    if fixed:
        y = par.reduce_from_region(F.linear(x, row.weight)) + row.bias
    else:
        y = par.reduce_from_region(F.linear(x, row.weight, row.bias))
    y.pow(2).mean().backward()


@_bug("residual added to a partial sum", "partial + replicated", "add", "partial")
def partial_plus_replicated_residual(fixed: bool) -> None:
    """The residual added to the partial output before the reduction."""
    x, p = _x(3, H, grad=True), _partial_sums()
    y = x + par.reduce_from_region(p) if fixed else par.reduce_from_region(x + p)
    y.pow(2).mean().backward()


@_bug("partial times partial", "partial into nonlinearity", "mul", "partial")
def partial_times_partial(fixed: bool) -> None:
    """The product of two partial sums is not the partial sum of the product."""
    p = _partial_sums(reduced=fixed)
    (p * p).sum()


@_bug("replicated term added to a partial loss", "partial + replicated", "add", "partial")
def replicated_term_added_to_partial_loss(fixed: bool) -> None:
    """A loss linear in a row-parallel matmul's partial output is itself partial (right: the
    sum of the ranks' shares is the loss), but a replicated regularizer added to it is
    counted once per rank."""
    x = _x(3, H, grad=True)
    share = _partial_sums().sum()
    loss = par.reduce_from_region(share) if fixed else share
    (loss + x.pow(2).sum()).backward()


@_bug(
    "gradient accumulation reduced every micro-batch",
    "a reduction of a gradient that already holds reduced parts",
    "all_reduce",
    "already holds a reduced gradient",
    "after the last micro-batch",
)
def grad_accumulation_reduced_every_micro_batch(fixed: bool) -> None:
    """Data parallel with gradient accumulation: the gradients summed over ranks after every
    micro-batch's backward: the second backward accumulates onto the already reduced first
    one, which the next sum multiplies by the world size (W*G1 + G2). op="avg" on every
    micro-batch is right (mean of G1 + mean of G2)."""
    lin = nn.Linear(H, 1, dtype=torch.float64)
    for step in range(2):
        x = dc.spmd.varying(_shard(3, H) + step)
        lin(x).pow(2).mean().backward()
        for p in lin.parameters():
            p.grad = dc.all_reduce(_grad(p), op="avg") if fixed else dc.all_reduce(_grad(p))


@_bug(
    "input gradient without copy_to_region",
    "missing copy_to_region before a column-parallel matmul (input gradient)",
    "backward",
    "insert parallel.copy_to_region before the linear at spmd_corpus.py:",
)
def input_gradient_without_copy_to_region(fixed: bool) -> None:
    """The column->row MLP on an input that requires grad, with no replicated parameter
    upstream: without copy_to_region only the input's gradient is wrong (each rank's share,
    different on every rank): caught when backward starts, at the linear."""
    x = _x(3, H, grad=True)
    h = par.copy_to_region(x) if fixed else x
    _mlp_by_hand(h).pow(2).mean().backward()


@_bug(
    "missing copy_to_region before an optimizer step",
    "missing copy_to_region before a column-parallel matmul",
    "LayerNorm.weight",
    "insert parallel.copy_to_region before the linear at spmd_corpus.py:",
)
def missing_copy_to_region_before_optimizer_step(fixed: bool) -> None:
    """A LayerNorm upstream of a column-parallel matmul without copy_to_region, and an
    optimizer step inside the block: caught before the step applies the partial gradient."""
    ln = nn.LayerNorm(H, dtype=torch.float64)
    opt = torch.optim.SGD(ln.parameters(), lr=0.1)
    h = ln(_x(3, H))
    if fixed:
        h = par.copy_to_region(h)
    _mlp_by_hand(h).pow(2).mean().backward()
    opt.step()


@_bug(
    "sequence-parallel LayerNorm gradients averaged",
    "sequence-parallel LayerNorm weights reduced wrongly",
    "all_reduce(op='avg')",
    "world-size times too small",
    "op='sum'",
)
def sequence_parallel_layernorm_grads_averaged(fixed: bool) -> None:
    """A plain LayerNorm on sequence shards under a replicated objective, its weight
    gradients reduced by hand with op="avg": the sum over ranks is the gradient, the
    average is world-size times too small."""
    ln = nn.LayerNorm(H, dtype=torch.float64)
    y = par.gather_from_sequence(ln(dc.spmd.varying(_shard(2, H))))
    y.pow(2).mean().backward()
    for p in ln.parameters():
        p.grad = dc.all_reduce(_grad(p), op="sum" if fixed else "avg")


@_bug(
    "clipping norm with the replicated parameters' squares all-reduced",
    "duplicated-parameter gradient norm",
    "all_reduce",
    "replicated term",
    "world-size times",
)
def clip_norm_all_reduces_replicated_squares(fixed: bool) -> None:
    """A clipping norm that all-reduces the squares of every gradient, the replicated
    parameters' too: those are counted world-size times (the duplicated-parameter norm)."""
    mlp = par.ParallelMLP(H, F_, dtype=torch.float64, seed=0)
    mlp(_x(3, H)).pow(2).mean().backward()
    sharded = [p for n, p in mlp.named_parameters() if n.endswith("weight") or n == "fc1.bias"]
    squares = [p.grad.pow(2).sum() for p in mlp.parameters() if p.grad is not None]
    if fixed:
        sq_shards = torch.stack([_grad(p).pow(2).sum() for p in sharded])
        whole = [_grad(p).pow(2).sum() for p in mlp.parameters() if all(p is not q for q in sharded)]
        sq = dc.all_reduce(sq_shards.sum()) + torch.stack(whole).sum()
    else:
        sq = dc.all_reduce(torch.stack(squares).sum())
    coef = (1e-3 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for p in mlp.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)


@_bug(
    "rank-sliced data to ColumnParallelLinear",
    "varying tensor where a layer expects replicated input",
    "ColumnParallelLinear",
    "`x` is varying",
    "computed from the rank",
)
def rank_sliced_data_to_column_parallel(fixed: bool) -> None:
    """Data sliced by the rank (this rank's rows of a batch) passed to a
    ColumnParallelLinear, which expects the whole (replicated) input."""
    r, n = dc.get_rank(), 3
    batch = _x(n * dc.get_world_size(), H)
    x = batch if fixed else batch[r * n : (r + 1) * n]
    _row()(F.gelu(_col()(x))).pow(2).mean().backward()


@_bug("copy_to_region twice", "copy_to_region applied twice", "copy_to_region")
def copy_to_region_twice(fixed: bool) -> None:
    """copy_to_region applied twice: the gradient is all-reduced twice."""
    x = _x(3, H, grad=True)
    h = par.copy_to_region(x)
    if not fixed:
        h = par.copy_to_region(h)
    col = _col()
    par.reduce_from_region(F.linear(F.linear(h, col.weight, col.bias), _row().weight)).sum().backward()


@_bug(
    "copy_to_region of a varying tensor",
    "varying tensor where replicated is expected",
    "copy_to_region",
    "`x` is varying",
)
def copy_to_region_of_varying(fixed: bool) -> None:
    """copy_to_region of per-rank data (its backward would sum different gradients)."""
    x = dc.spmd.varying(_shard(3, H).requires_grad_())
    h = x if fixed else par.copy_to_region(x)
    (h * _w(H)).sum().backward()


@_bug(
    "reduce_scatter whose gradient is expected replicated",
    "reduce-scatter whose gradient is expected replicated",
    "mul",
    "reduce_scatter",
    "reduce_from_region",
)
def reduce_scatter_gradient_expected_replicated(fixed: bool) -> None:
    """A reduce-scatter's (varying) output scaled by a replicated-objective value: that
    value's gradient is expected replicated but arrives different on every rank."""
    p = dc.spmd.varying(_shard(12, H)) @ _w(H, H)
    y = dc.reduce_scatter(p)
    scale = par.reduce_from_region(dc.spmd.varying(_shard(1)) * _w(1))
    if fixed:
        scale = dc.all_reduce(dc.spmd.varying(_shard(1)) * _w(1))
    (y * scale).sum().backward()


@_bug("reduce_scatter of a replicated tensor", "reduction done twice", "reduce_scatter", "twice")
def reduce_scatter_of_replicated(fixed: bool) -> None:
    """reduce_scatter of a replicated tensor: the reduction sums world copies."""
    x = _x(4 * dc.get_world_size(), H)
    y = dc.scatter(x) if fixed else dc.reduce_scatter(x)
    y.sum()


@_bug(
    "varying input to ColumnParallelLinear",
    "varying tensor where a layer expects replicated input",
    "ColumnParallelLinear",
    "`x` is varying",
    "expected replicated",
)
def varying_input_to_column_parallel(fixed: bool) -> None:
    """Per-rank data passed to a ColumnParallelLinear that expects a replicated input."""
    x = _x(3, H) if fixed else dc.spmd.varying(_shard(3, H))
    _row()(F.gelu(_col()(x))).pow(2).mean().backward()


@_bug(
    "replicated input to RowParallelLinear(input_is_parallel)",
    "replicated tensor where a layer expects a shard",
    "RowParallelLinear",
    "expected varying",
)
def replicated_input_to_row_parallel(fixed: bool) -> None:
    """A whole (replicated) input passed to RowParallelLinear(input_is_parallel=True)."""
    x = dc.spmd.varying(_shard(3, _fs())) if fixed else _x(3, _fs())
    _row()(x).pow(2).mean().backward()


@_bug(
    "replicated input to SequenceParallelLayerNorm",
    "sequence-parallel LayerNorm weights reduced wrongly",
    "SequenceParallelLayerNorm",
    "expected varying",
)
def replicated_input_to_sequence_parallel_layernorm(fixed: bool) -> None:
    """A replicated tensor fed to SequenceParallelLayerNorm: its weight gradient (summed
    over ranks) would be world-size times too large."""
    x = dc.spmd.varying(_shard(2, H)) if fixed else _x(2, H)
    par.SequenceParallelLayerNorm(H, dtype=torch.float64)(x).pow(2).sum().backward()


@_bug(
    "per-rank dropout on a replicated activation",
    "varying randomness on a replicated-objective value",
    "dropout",
    "replicated",
)
def per_rank_dropout_on_replicated(fixed: bool) -> None:
    """Dropout on the model-parallel (per-rank) RNG stream applied to a replicated
    activation: the masks differ by rank, so the replicated-objective gradient is wrong."""
    rng.model_parallel_seed(1234, tp_rank=dc.get_rank())
    y = par.reduce_from_region(dc.spmd.varying(_shard(3, H)) @ _w(H, H))
    if fixed:
        y = F.dropout(y, 0.5)
    else:
        with rng.get_tracker().fork():
            y = F.dropout(y, 0.5)
    y.pow(2).mean().backward()


@_bug("all_reduce(max) of partial sums", "partial into nonlinearity", "all_reduce", "max/min/product")
def max_of_partial(fixed: bool) -> None:
    """all_reduce(max) of partial sums: the max of the shares is not the max of the sum."""
    p = F.linear(dc.spmd.varying(_shard(3, _fs())), _row().weight)
    if fixed:
        p = par.reduce_from_region(p)
        p = p.amax()
    else:
        dc.all_reduce(p, "max")


@_bug(
    "vocab-parallel cross entropy on whole logits",
    "replicated tensor where a shard is expected",
    "vocab",
    "`logits` is replicated",
)
def vocab_parallel_cross_entropy_on_whole_logits(fixed: bool) -> None:
    """vocab_parallel_cross_entropy given the whole (replicated) logits, not the shard."""
    w = dc.get_world_size()
    logits = dc.spmd.varying(_shard(3, 2)) if fixed else _x(3, 2 * w)
    par.vocab_parallel_cross_entropy(logits.requires_grad_(), torch.tensor([0, 1, 2]))


@_bug(
    "gather_from_region of a replicated tensor",
    "replicated tensor where a shard is expected",
    "gather_from_region",
    "`x` is replicated",
)
def gather_from_region_of_replicated(fixed: bool) -> None:
    """gather_from_region of a value that is already whole on every rank."""
    x = dc.spmd.varying(_shard(3, H)) if fixed else _x(3, H)
    par.gather_from_region(x, dim=-1)


@_bug(
    "gradient clipping with a per-rank norm",
    "replicated parameter whose gradient is not replicated",
    "RowParallelLinear.bias",
    "varies by rank",
)
def clip_grad_norm_without_all_reduce(fixed: bool) -> None:
    """Gradient clipping with the norm of this rank's gradient shards only: the clipping
    factor differs by rank, so the replicated parameters' replicas drift apart."""
    mlp = par.ParallelMLP(H, F_, dtype=torch.float64, seed=0)
    mlp(_x(3, H)).pow(2).mean().backward()
    if not fixed:
        torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1e-3, foreach=False)
        return
    sharded = [p for n, p in mlp.named_parameters() if n.endswith("weight") or n == "fc1.bias"]
    whole = [p for p in mlp.parameters() if all(p is not q for q in sharded)]
    grads: list[Any] = [p.grad for p in mlp.parameters()]
    sq_shards = torch.stack(
        [g.pow(2).sum() for g, p in zip(grads, mlp.parameters()) if any(p is q for q in sharded)]
    )
    sq_whole = torch.stack([p.grad.pow(2).sum() for p in whole if p.grad is not None])
    sq = dc.all_reduce(sq_shards.sum()) + sq_whole.sum()
    coef = (1e-3 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)


@_bug(
    "clipping norm of the stacked per-tensor norms",
    "duplicated-parameter gradient norm",
    "all_reduce",
    "replicated term",
    "world-size times",
)
def clip_norm_of_stacked_norms(fixed: bool) -> None:
    """torch's clipping recipe (the norm of the stacked per-tensor norms) with every
    squared norm all-reduced, the replicated fc2.bias's too: counted world-size times (the
    replicated element survives the squares)."""
    mlp = par.ParallelMLP(H, F_, dtype=torch.float64, seed=0)
    mlp(_x(3, H)).pow(2).mean().backward()
    grads = {n: _grad(p) for n, p in mlp.named_parameters()}
    if fixed:
        sharded = torch.stack([g.norm(2) for n, g in grads.items() if n != "fc2.bias"])
        sq = dc.all_reduce(sharded.pow(2).sum()) + grads["fc2.bias"].pow(2).sum()
    else:
        sq = dc.all_reduce(torch.stack([g.norm(2) for g in grads.values()]).pow(2).sum())
    coef = (1e-3 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef)


@_bug(
    "sharded gradient reduced over its own group",
    "a varying parameter's gradient reduced over the group it varies on",
    "ColumnParallelLinear.weight is varying",
    "reduced over the group it varies on",
)
def sharded_gradient_reduced_over_its_group(fixed: bool) -> None:
    """The gradient of a tensor-parallel (sharded) weight averaged over the tensor-parallel
    group, as if it were the data-parallel one: it mixes the ranks' different shards."""
    mlp = par.ParallelMLP(H, F_, dtype=torch.float64, seed=0)
    mlp(_x(3, H)).pow(2).mean().backward()
    if not fixed:
        mlp.fc1.weight.grad = dc.all_reduce(_grad(mlp.fc1.weight), op="avg")


@_bug(
    "torch.distributed.all_reduce every micro-batch",
    "a reduction of a gradient that already holds reduced parts",
    "torch.distributed.all_reduce",
    "already holds a reduced gradient",
)
def raw_all_reduce_every_micro_batch(fixed: bool) -> None:
    """Gradient accumulation with ``torch.distributed.all_reduce(p.grad)`` (in place, not
    diffcomm's) after every micro-batch: W*G1 + G2; averaging every micro-batch is right."""
    import torch.distributed as dist

    lin = nn.Linear(H, 1, dtype=torch.float64)
    for step in range(2):
        lin(dc.spmd.varying(_shard(3, H) + step)).pow(2).mean().backward()
        for p in lin.parameters():
            dist.all_reduce(_grad(p), op=dist.ReduceOp.AVG if fixed else dist.ReduceOp.SUM)


@_bug(
    "all_gather of draws on a generator seeded alike, under a replicated objective",
    "sum-convention all_gather under a replicated objective",
    "all_gather",
    "gather_from_region",
)
def all_gather_of_draws_seeded_alike(fixed: bool) -> None:
    """Data drawn on the default generator seeded alike inside the block
    (``torch.manual_seed(0)`` on every rank) and on a ``torch.Generator`` seeded with a
    constant: replicated, even where the process's generator differed between the ranks
    when the check began; gathered with the sum-convention all_gather into a replicated
    loss (world-size times too large)."""
    torch.manual_seed(0)
    x = torch.randn(3, H, dtype=torch.float64)
    w = torch.randn(H, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    h = dc.spmd.varying(_shard(3, H)) @ w + x
    y = par.gather_from_region(h, dim=-1) if fixed else dc.all_gather(h, dim=-1)
    y.pow(2).mean().backward()


@_bug(
    "all_reduce after a row-parallel layer, without a gradient",
    "reduction done twice",
    "all_reduce",
    "reduce_from_region",
    "twice",
)
def all_reduce_after_row_parallel_without_grad(fixed: bool) -> None:
    """dc.all_reduce on a RowParallelLinear's output in evaluation (``torch.no_grad()``):
    no gradient flows, but the value was reduced inside the layer; summed again it is
    world-size times too large (a replicated value is summable without a gradient only when
    it holds no reduction)."""
    row = _row()
    with torch.no_grad():
        y = row(dc.spmd.varying(_shard(3, _fs())))
        if not fixed:
            y = dc.all_reduce(y)


@_bug(
    "all_reduce of a gathered norm, without a gradient",
    "reduction done twice",
    "all_reduce",
    "the result of all_gather",
    "twice",
)
def gathered_norm_all_reduced(fixed: bool) -> None:
    """A global norm made by gathering the ranks' squared norms and summing them (no
    gradient), then all-reduced as well: every rank's part counted world-size times."""
    total = dc.all_gather(dc.spmd.varying(_shard(1)).pow(2)).sum()
    if not fixed:
        total = dc.all_reduce(total)
    total.sqrt()


@_bug(
    "replicated-objective gradient all-reduced again",
    "reduction done twice",
    "all_reduce",
    "gradient of a replicated objective",
    "twice",
)
def replicated_gradient_reduced_again(fixed: bool) -> None:
    """A replicated parameter's gradient under a replicated objective (a RowParallelLinear's
    bias: whole on every rank, no gradient flows through its reduction) all-reduced over the
    tensor-parallel group after backward: world-size times too large."""
    row = _row()
    row(dc.spmd.varying(_shard(3, _fs()))).pow(2).mean().backward()
    if not fixed:
        row.bias.grad = dc.all_reduce(_grad(row.bias))


@_bug(
    "all_reduce of a replicated activation that requires grad",
    "reduction of a replicated value",
    "all_reduce",
    "`x` is replicated",
    "twice",
)
def replicated_activation_all_reduced(fixed: bool) -> None:
    """An activation every rank computes whole (a replicated LayerNorm's output, which
    requires grad) summed over the ranks as if it were partial: world-size times too large,
    forward and backward."""
    h = nn.LayerNorm(H, dtype=torch.float64)(_x(3, H))
    if not fixed:
        h = dc.all_reduce(h)
    h.pow(2).mean().backward()


@_bug(
    "all_gather in torch.autograd.grad with a replicated gradient argument",
    "sum-convention all_gather under a replicated objective",
    "all_gather",
    "gather_from_region",
)
def all_gather_with_a_replicated_cotangent(fixed: bool) -> None:
    """``torch.autograd.grad`` through a sum-convention all_gather with a gradient argument
    equal on every rank: the objective ``<y, c>`` is replicated (counted once), so the
    gradient is world-size times too large; a per-rank ``c`` would make it varying."""
    w = _w(H, H)
    y_in = dc.spmd.varying(_shard(3, H)) @ w
    y = par.gather_from_region(y_in, dim=-1) if fixed else dc.all_gather(y_in, dim=-1)
    c = _x(*y.shape)
    torch.autograd.grad(y, w, grad_outputs=c)


@_bug("constant added to a partial sum", "partial + replicated", "add", "1.0", "once per rank")
def constant_added_to_partial(fixed: bool) -> None:
    """A Python constant added to a row-parallel matmul's partial sums before their
    reduction (a shift, a ``+ 1`` of a gate): each rank adds it, so the sum holds it
    world-size times. A constant is replicated, as a replicated tensor is."""
    p = _partial_sums()
    y = par.reduce_from_region(p) + 1.0 if fixed else par.reduce_from_region(p + 1.0)
    y.pow(2).mean().backward()


@_bug("row-parallel einsum into GELU", "partial into nonlinearity", "gelu", "einsum")
def row_parallel_einsum_into_nonlinearity(fixed: bool) -> None:
    """A row-parallel matmul written as an einsum (this rank's feature shard contracted
    with its columns of the weight) is partial, as ``F.linear`` is: GELU before the
    reduction applies it to each rank's share."""
    row = _row()
    p = torch.einsum("bf,hf->bh", dc.spmd.varying(_shard(3, _fs())), row.weight)
    y = F.gelu(par.reduce_from_region(p)) if fixed else par.reduce_from_region(F.gelu(p))
    y.pow(2).mean().backward()


@_bug(
    "replicated weight pruned with a per-rank mask",
    "replicated parameter updated in place with per-rank data",
    "linear",
    "masked_fill_",
    "updated in place with per-rank data",
)
def replicated_weight_pruned_with_per_rank_mask(fixed: bool) -> None:
    """Data parallel: a replicated weight pruned under no_grad with a mask scored on this
    rank's own batch. Each rank zeroes different entries, so the replicas differ and every
    later step trains a different model on each rank; each rank's loss is its own (varying),
    so no replicated loss shows it. The score must be reduced over the ranks first."""
    w = nn.Parameter(_x(1, H))
    x = dc.spmd.varying(_shard(3, H))
    score = x.abs().mean(0, keepdim=True)  # this rank's batch
    if fixed:
        score = dc.all_reduce(score, op="avg")
    with torch.no_grad():
        w.masked_fill_(score < score.median(), 0.0)
    F.linear(x, w).pow(2).mean().backward()
    w.grad = dc.all_reduce(_grad(w), op="avg")


@_bug("partial sums read through .data", "partial into nonlinearity", "norm", "argument is partial")
def partial_read_through_data(fixed: bool) -> None:
    """A scale taken through ``.data`` (outside autograd, as a statistic) of a row-parallel
    matmul's partial sums: the norm of this rank's share is not the norm of the sum. The
    loss is per rank (data parallel), so no replicated loss shows it. ``t.data`` is typed
    as ``t``."""
    p = _partial_sums()
    s = (par.reduce_from_region(p).data if fixed else p.data).norm()  # e.g. a loss scale
    w = nn.Parameter(_x(H))
    (dc.spmd.varying(_shard(3, H)) @ w / s).pow(2).mean().backward()
    w.grad = dc.all_reduce(_grad(w), op="avg")


# ======================================================================================
# correct programs that an earlier checker refused (each must pass)
# ======================================================================================


def _vocab_embedding_by_hand(use_where: bool) -> None:
    """Megatron's vocab-parallel embedding written by hand: the rows this rank does not
    hold are looked up at row 0 and then masked out of the partial sums."""
    emb = dc.spmd.module(par.VocabParallelEmbedding(4 * dc.get_world_size(), H, dtype=torch.float64, seed=0))
    ids = torch.arange(2 * dc.get_world_size()).reshape(2, -1) * 2
    start = dc.get_rank() * emb.per_rank  # a RankInt inside the check: the mask is varying
    mask = (ids < start) | (ids >= start + emb.per_rank)
    local = ids - start
    local[mask] = 0
    out = F.embedding(local, emb.weight)
    if use_where:
        out = torch.where(mask.unsqueeze(-1), 0.0, out)
    else:
        out[mask, :] = 0.0
    par.reduce_from_region(out).pow(2).mean().backward()


def vocab_embedding_masked_assignment() -> None:
    """``out[mask, :] = 0.0`` on the partial lookups (linear in them, whatever the mask)."""
    _vocab_embedding_by_hand(use_where=False)


def vocab_embedding_where_zero() -> None:
    """``torch.where(mask, 0.0, out)`` on the partial lookups."""
    _vocab_embedding_by_hand(use_where=True)


def replicas_made_equal_by_a_broadcast() -> None:
    """A replicated weight updated in place with per-rank data (noise drawn per rank),
    then made equal again by copying in rank 0's copy: used afterwards, it is replicated."""
    lin = nn.Linear(H, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.add_(dc.spmd.varying(_shard(1, H)))
    lin.weight.data.copy_(dc.broadcast(lin.weight.detach(), src=0))
    lin(_x(3, H)).pow(2).mean().backward()


def all_reduce_avg_of_replicated() -> None:
    """all_reduce(op="avg") of a replicated value: an identity, its gradient averaged (right
    when the gradient is replicated: a replicated objective)."""
    x = _x(3, H, grad=True)
    dc.all_reduce(x * 2, op="avg").pow(2).mean().backward()


def all_reduce_max_of_replicated() -> None:
    """all_reduce(op="max") of a replicated value: every rank ties, so it is an identity
    whose backward splits the gradient evenly among the ranks (averages it), as op="avg"."""
    x = _x(3, H, grad=True)
    dc.all_reduce(x * 2, op="max").pow(2).mean().backward()


def loss_linear_in_a_partial_value() -> None:
    """A loss linear in a row-parallel matmul's partial output: the sum of the ranks'
    shares is the loss, and each rank's gradient is exact."""
    p = _partial_sums()
    (p * _x(3, H)).sum().backward()


def mean_loss_then_averaged_gradients() -> None:
    """Data parallel: backward through all_reduce(loss, op="avg"), then the gradients
    averaged over ranks (each rank backpropagates its own loss, as with a varying loss)."""
    lin = nn.Linear(H, 1, dtype=torch.float64)
    loss = dc.all_reduce(lin(dc.spmd.varying(_shard(3, H))).pow(2).mean(), op="avg")
    loss.backward()
    for p in lin.parameters():
        p.grad = dc.all_reduce(_grad(p), op="avg")


def grad_accumulation_reduced_once() -> None:
    """Data parallel with gradient accumulation, reduced once after the last micro-batch."""
    lin = nn.Linear(H, 1, dtype=torch.float64)
    for step in range(2):
        lin(dc.spmd.varying(_shard(3, H) + step)).pow(2).mean().backward()
    for p in lin.parameters():
        p.grad = dc.all_reduce(_grad(p))


def zeroed_gradients_accumulate_afresh() -> None:
    """Gradients reduced, zeroed in place (``zero_grad(set_to_none=False)``), then the next
    step's backward: nothing reduced is left in them."""
    lin = nn.Linear(H, 1, dtype=torch.float64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for step in range(2):
        lin(dc.spmd.varying(_shard(3, H) + step)).pow(2).mean().backward()
        for p in lin.parameters():
            assert p.grad is not None
            p.grad.copy_(dc.all_reduce(p.grad, op="avg"))
        opt.step()
        opt.zero_grad(set_to_none=False)


def torch_func_grad_of_a_parallel_mlp() -> None:
    """``torch.func.grad`` of a loss through ``functional_call`` of a ParallelMLP: not
    typed under the transform (it was refused: the functorch wrappers looked replicated)."""
    mlp = par.ParallelMLP(H, F_, dtype=torch.float64, seed=0)
    x = _x(3, H)

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(mlp, params, (x,)).pow(2).mean()

    torch.func.grad(loss)(dict(mlp.named_parameters()))


def gradients_reduced_with_torch_distributed() -> None:
    """Data parallel, the gradients summed with ``torch.distributed.all_reduce`` (in place)
    and divided by the world, then torch's ``clip_grad_norm_`` and an optimizer step (the
    raw reduction was not seen: the gradients stayed partial)."""
    import torch.distributed as dist

    lin = nn.Linear(H, 1, dtype=torch.float64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(dc.spmd.varying(_shard(3, H))).pow(2).mean().backward()
    for p in lin.parameters():
        dist.all_reduce(_grad(p))
        _grad(p).div_(dc.get_world_size())
    torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.5, foreach=False)
    opt.step()


def gradients_averaged_through_data() -> None:
    """``p.grad.data = dc.all_reduce(p.grad.data, op="avg")`` (older data-parallel code):
    the gradient takes the reduced value's type (``.data`` assignment was not typed)."""
    lin = nn.Linear(H, 1, dtype=torch.float64)
    lin(dc.spmd.varying(_shard(3, H))).pow(2).mean().backward()
    for p in lin.parameters():
        _grad(p).data = dc.all_reduce(_grad(p).data, op="avg")


def gradients_averaged_in_a_flat_bucket() -> None:
    """DDP's bucket: the gradients flattened, one all_reduce, each copied back with
    ``g.copy_(synced.view_as(g))`` (``view_as``'s template was typed as an operand)."""
    lin = nn.Linear(H, 1, dtype=torch.float64)
    lin(dc.spmd.varying(_shard(3, H))).pow(2).mean().backward()
    grads = [_grad(p) for p in lin.parameters()]
    flat = dc.all_reduce(torch.cat([g.reshape(-1) for g in grads]), op="avg")
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))


def per_rank_data_from_the_rank_summed() -> None:
    """Per-rank data made from a replicated tensor and a number computed from the rank (as
    notebook 01 makes it), summed over the ranks: not a replicated term summed W times."""
    x = torch.arange(4.0, dtype=torch.float64) + 10 * dc.get_rank()
    dc.all_reduce(x)


def default_generator_seeded_from_the_rank() -> None:
    """``torch.manual_seed(1 + rank)``, then a weight drawn on the default generator: a
    per-rank shard (docs/testing.md's gradcheck example); a draw on an explicit generator
    seeded alike stays replicated."""
    x = torch.randn(2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1 + dc.get_rank())
    w = torch.randn(3, H, dtype=torch.float64, requires_grad=True)
    par.reduce_from_region(torch.tanh(par.copy_to_region(x.requires_grad_()) @ w.T)).sum().backward()


def generator_seeded_from_the_rank_summed() -> None:
    """A ``torch.Generator`` made and seeded from the rank inside the block (notebook 01's
    dot-product test): its draws are per rank, and their sum over the ranks is arithmetic,
    not a replicated term summed W times."""
    gen = torch.Generator().manual_seed(100 * dc.get_rank())
    x = torch.randn(3, dtype=torch.float64, generator=gen)
    dc.all_reduce(x)


def default_generator_seeded_non_deterministically() -> None:
    """``torch.seed()`` (a non-deterministic seed: a different one on every rank, as an
    unseeded process has), then draws on the default generator gathered under the sum
    convention, times a per-rank weight: a per-rank loss (docs/async.md's program)."""
    torch.seed()
    x = torch.randn(3, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(H, 2, dtype=torch.float64)
    (dc.all_gather(x, dim=0) @ w).sum().backward()


def vjp_with_a_per_rank_cotangent() -> None:
    """The adjoint test of all_gather (docs/testing.md's ``check_adjoint``): autograd's vjp
    with a per-rank cotangent, ``<all_gather(x), y>`` summed over the ranks. The objective
    is varying (each rank's own inner product), so the sum-convention backward is right."""
    x = dc.spmd.varying(torch.randn(3, dtype=torch.float64)).requires_grad_()
    y = dc.spmd.varying(torch.randn(3 * dc.get_world_size(), dtype=torch.float64))
    torch.autograd.grad(dc.all_gather(x), x, grad_outputs=y)


def all_reduce_of_a_replicated_constant() -> None:
    """A sum of a value equal on every rank that nothing differentiates through and that
    holds no reduction (docs/install.md's ``dc.all_reduce(torch.ones(3))``, a count of the
    ranks): arithmetic, ``W * x``, replicated; max of equal values is the value."""
    n = dc.all_reduce(torch.ones((), dtype=torch.float64))
    assert n.item() == dc.get_world_size()
    assert torch.equal(dc.all_reduce(_x(3), "max"), _x(3))
    (n * _x(3, H, grad=True)).pow(2).sum().backward()


def forward_mode_through_a_collective() -> None:
    """``torch.func.jvp`` of an all_reduce at a per-rank point (docs/transforms.md): the
    forward-AD dual of a varying value is varying."""
    x = dc.spmd.varying(torch.randn(4, 3, dtype=torch.float64))
    t = dc.spmd.varying(torch.randn(4, 3, dtype=torch.float64))
    torch.func.jvp(lambda y: dc.all_reduce(y), (x,), (t,))


class _LayersUsedByTheirWeights(par.ParallelModule):
    """A ParallelModule whose forward uses its sub-layers' weights without calling them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = par.ColumnParallelLinear(H, 12, seed=0, dtype=torch.float64)  # (12: worlds 1-4)
        self.fc2 = par.RowParallelLinear(12, H, seed=1, input_is_parallel=True, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(par.copy_to_region(x), self.fc1.weight, self.fc1.bias))
        return par.reduce_from_region(F.linear(h, self.fc2.weight)) + self.fc2.bias


def sub_layer_weights_used_functionally() -> None:
    """``F.linear(x, self.fc1.weight)`` inside a ParallelModule's forward, no
    ``modules=``: the sub-layers were never called, so their shards stayed untyped
    (replicated) and the check asked to drop the ``reduce_from_region`` the program
    needs. A module's whole tree is typed at its first call now, as ``modules=`` does."""
    _LayersUsedByTheirWeights()(_x(3, H, grad=True)).sum().backward()


#: correct programs (each once refused by the checker, or a fix's neighbour): name -> program
CORRECT: dict[str, Callable[[], None]] = {
    "vocab embedding: masked assignment of a partial value": vocab_embedding_masked_assignment,
    "vocab embedding: where with a zero branch": vocab_embedding_where_zero,
    "all_reduce(avg) of a replicated value": all_reduce_avg_of_replicated,
    "all_reduce(max) of a replicated value": all_reduce_max_of_replicated,
    "a loss linear in a partial value": loss_linear_in_a_partial_value,
    "backward through all_reduce(loss, avg), gradients averaged": mean_loss_then_averaged_gradients,
    "gradient accumulation reduced once": grad_accumulation_reduced_once,
    "gradients zeroed in place between steps": zeroed_gradients_accumulate_afresh,
    "torch.func.grad of a ParallelMLP": torch_func_grad_of_a_parallel_mlp,
    "gradients reduced with torch.distributed.all_reduce": gradients_reduced_with_torch_distributed,
    "gradients averaged through .data": gradients_averaged_through_data,
    "gradients averaged in a flat bucket": gradients_averaged_in_a_flat_bucket,
    "per-rank data made from the rank, summed": per_rank_data_from_the_rank_summed,
    "the default generator seeded from the rank": default_generator_seeded_from_the_rank,
    "forward mode through a collective at a per-rank point": forward_mode_through_a_collective,
    "a torch.Generator seeded from the rank, summed": generator_seeded_from_the_rank_summed,
    "the default generator seeded non-deterministically": default_generator_seeded_non_deterministically,
    "a vjp with a per-rank cotangent": vjp_with_a_per_rank_cotangent,
    "all_reduce of a replicated constant (no gradient)": all_reduce_of_a_replicated_constant,
    "a parallel module using its sub-layers' weights uncalled": sub_layer_weights_used_functionally,
    "replicas made equal by a broadcast after a per-rank update": replicas_made_equal_by_a_broadcast,
}


def run_correct(name: str, group: Any = None) -> tuple[str, str] | None:
    """Run the correct program ``name`` under ``dc.spmd_check(group)``; ``None`` if it
    passed, else the error's class name and message."""
    try:
        with dc.spmd_check(group):
            CORRECT[name]()
    except TypeError as e:
        return type(e).__name__, str(e)
    return None


def run(name: str, fixed: bool, group: Any = None) -> tuple[str, str] | None:
    """Run the corpus program ``name`` (the bug, or its fix) under ``dc.spmd_check(group)``
    on this rank; ``None`` if the check passed, else the error's class name and message."""
    bug = next(b for b in BUGS if b.name == name)
    try:
        with dc.spmd_check(group):
            bug.program(fixed)
    except TypeError as e:
        return type(e).__name__, str(e)
    return None


def corpus_markdown() -> str:
    """The corpus as Markdown (``docs/spmd_types.md`` includes it): per bug, its class,
    the program (the bug and, under ``if fixed``, the fix) and what the error names."""
    import inspect

    out = []
    for i, b in enumerate(BUGS, 1):
        names = ", ".join(f"`{n}`" for n in b.names)
        src = inspect.getsource(b.program).rstrip()
        src = src[src.index("\ndef ") + 1 :]  # the program without its @_bug line (said above)
        out.append(f"### {i}. {b.name}\n\n*{b.kind}.* The error names {names}.\n\n```python\n{src}\n```\n")
    out.append("### Correct programs (each must pass)\n")
    for name, program in CORRECT.items():
        src = inspect.getsource(program).rstrip()
        out.append(f"#### {name}\n\n```python\n{src}\n```\n")
    return "\n".join(out)
