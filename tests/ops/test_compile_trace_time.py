"""No collective runs while ``torch.compile`` traces, on real gloo processes.

FakeTensorMode propagates constants: a tensor of at most one element built from Python
values (``torch.tensor([n])``) is a constant, and an op whose inputs are all constants is
run **for real** at trace time — a functional collective too, once per trace (dynamo, then
twice more under AOTAutograd), on the compiling rank only. The compiled graph keeps the
collective (nothing is folded away), so when every rank compiles at once the extra ones
pair up among themselves. A compile on one rank alone — a guard failing there only (an
input of another shape, a rank-dependent Python int), or a frame compiled on one rank and
run eagerly on the other — ran them against the other ranks' next collectives: silently
wrong values on some ranks, then a timeout. The traceable backend now multiplies a
collective's input of at most one element by ``torch.ones(())`` (never a constant), so
tracing never communicates.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc

F64 = torch.float64


def _one_rank_compiles() -> list[float]:
    """A compiled function of collectives on trace-time constants; compiles that happen on
    one rank only; then eager collectives that would pair with any stray trace-time one."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    dc.all_reduce(torch.ones(1))  # settings read in eager code (no recompile for them)
    k = 1.0 if rank == 0 else 10.0

    def f(x: torch.Tensor, n: int) -> torch.Tensor:
        c = dc.all_reduce(torch.tensor([k], dtype=F64))  # a constant: run at trace time before
        g = dc.all_gather(torch.tensor([float(n)], dtype=F64), 0, split_sizes=[1, 1])
        return x.sum() + c + g.sum()

    compiled = torch.compile(f, backend="aot_eager")
    out = []
    # (x's length, n) per call on rank 0 / rank 1: both compile; rank 1 alone recompiles
    # (another shape); rank 1 alone recompiles (another Python int)
    for n0, n1 in (((4, 1), (4, 1)), ((4, 1), (5, 1)), ((4, 1), (5, 2))):
        length, n = n0 if rank == 0 else n1
        out.append(float(compiled(torch.ones(length, dtype=F64), n)))
    out.append(float(dc.all_reduce(torch.tensor([100.0 * (rank + 1)], dtype=F64))))
    # rank 0 compiles a fresh function, rank 1 runs it eagerly (no compile there at all)
    h = torch.compile(lambda: dc.all_reduce(torch.tensor([k], dtype=F64)), backend="eager")
    out.append(float(h() if rank == 0 else dc.all_reduce(torch.tensor([k], dtype=F64))))
    out.append(float(dc.all_reduce(torch.tensor([1000.0], dtype=F64))))
    return out


# without debug mode: its cross-rank check runs in eager code only (compiled code skips
# it, docs/transforms.md), so the frame compiled on rank 0 alone and run eagerly on rank 1
# desyncs at rank 1's check (a DesyncError naming "all_reduce (debug check)" after the
# collective timeout)
@pytest.mark.usefixtures("debug_off")
def test_a_compile_on_one_rank_runs_no_collective(world2: dc.LocalWorld) -> None:
    """Before: rank 1's recompile ran its trace-time all_reduce / all_gather against rank
    0's compiled ones and its eager all_reduce: rank 0 returned wrong sums, rank 1 ended in
    the collective timeout."""
    r0, r1 = world2.run(_one_rank_compiles)
    # x.sum() + (1 + 10) + gathered n's
    assert r0 == [4 + 11 + 2, 4 + 11 + 2, 4 + 11 + 3, 300.0, 11.0, 2000.0], r0
    assert r1 == [4 + 11 + 2, 5 + 11 + 2, 5 + 11 + 3, 300.0, 11.0, 2000.0], r1
