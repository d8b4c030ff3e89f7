"""Replication types: the check's verdict is the same on every rank. A rank that raises
leaves the block while the others wait in their next collective (a desync), so no rule may
be decided from a tensor's values (per-rank data: zero on one rank only) or from the rank
itself. A zeroed gradient and a zero operand are decided from the ops that made them zero
(``_Rec.zero``); these tests pin each value-based decision that made the ranks disagree
(each desynced before the change, in-process and on processes) and the correct programs
the type-based decision must still pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par

F64 = torch.float64
H = 4
_WORLDS = pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in_process"])


def _from_this_tree() -> None:
    """The ranks import the diffcomm under test (the same tree as the test process)."""
    import diffcomm

    assert diffcomm.__file__ == dc.__file__, diffcomm.__file__


@_WORLDS
def test_a_gradient_zero_on_one_rank_only_is_not_a_zeroed_gradient(
    local_worlds: Callable[..., dc.LocalWorld], in_process: bool
) -> None:
    """A varying loss whose gradient is zero on rank 0 (its data is zero there), then a
    replicated loss accumulated onto it: the gradient is still partial on every rank (each
    holds its share of the first loss's gradient). Whether the earlier gradient counted was
    read from its values (``g.any()``): rank 0 dropped it and passed, rank 1 raised at the
    gradient check, and rank 0 waited alone in the check's exit exchange (a desync)."""

    def body() -> str:
        _from_this_tree()
        try:
            with dc.spmd_check():
                w = nn.Parameter(torch.ones(H, dtype=F64))
                x = dc.spmd.varying(torch.full((3, H), float(dc.get_rank()), dtype=F64))  # rank 0: zeros
                (x @ w).sum().backward()  # a varying loss: w's gradient partial (zero on rank 0)
                (torch.ones(3, H, dtype=F64) @ w).sum().backward()  # replicated, accumulated onto it
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for msg in local_worlds(2, in_process=in_process).run(body):
        assert "is replicated, but its gradient is partial" in msg, msg


_ZEROINGS = (
    "zero_grad_foreach",
    "zero_grad_loop",
    "module_zero_grad",
    "grad_zero_",
    "grad_data_zero_",
    "grad_fill_0",
    "grad_zeros_like",
    "grad_new_zeros_float",
    "grad_set_to_none",
)


def _zeroing_steps(form: str) -> str | None:
    """Data parallel, the gradients summed after every step's backward and then zeroed
    (``form``), three steps: nothing reduced is left in a zeroed gradient, so each sum is
    the first (a gradient that still held the reduced one would be summed twice). A second
    model's loss is backpropagated between the zeroing and the next step: a zeroed gradient
    that backward does not reach stays zero."""
    _from_this_tree()
    torch.manual_seed(0)  # the models alike on every rank
    lin = nn.Linear(H, 1, dtype=F64)
    other = nn.Linear(H, 1, dtype=F64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, foreach=form == "zero_grad_foreach")
    try:
        with dc.spmd_check():
            for step in range(3):
                x = dc.spmd.varying(torch.full((3, H), float(dc.get_rank() + step), dtype=F64))
                lin(x).pow(2).mean().backward()
                for p in lin.parameters():
                    p.grad = dc.all_reduce(p.grad)
                opt.step()
                if form in ("zero_grad_foreach", "zero_grad_loop"):
                    opt.zero_grad(set_to_none=False)
                elif form == "module_zero_grad":
                    lin.zero_grad(set_to_none=False)
                for p in lin.parameters() if form.startswith("grad_") else ():
                    if form == "grad_zero_":
                        p.grad.zero_()
                    elif form == "grad_data_zero_":
                        p.grad.data.zero_()
                    elif form == "grad_fill_0":
                        p.grad.fill_(0)
                    elif form == "grad_zeros_like":
                        p.grad = torch.zeros_like(p)
                    elif form == "grad_new_zeros_float":
                        p.grad = p.new_zeros(p.shape).double()
                    else:
                        p.grad = None
                other(torch.ones(2, H, dtype=F64)).sum().backward()  # leaves lin's gradients alone
                for p in other.parameters():
                    p.grad = None
    except dc.SPMDTypeError as e:
        return str(e)
    return None


def test_zeroed_gradients_accumulate_afresh_in_every_form(world2: dc.LocalWorld) -> None:
    """Every way to zero the gradients (the optimizer's and the module's
    ``zero_grad(set_to_none=False)``, foreach or not; ``zero_``, ``.data.zero_()``,
    ``fill_(0)``, a new zero tensor, ``None``) marks them zero by the op: the next sum is
    no second reduction. (Decided by values before, which passed these by their zeros.)"""

    def body() -> list[str | None]:
        return [_zeroing_steps(form) for form in _ZEROINGS]

    for per_rank in world2.run(body):
        assert per_rank == [None] * len(_ZEROINGS), per_rank


def test_a_gradient_written_after_zeroing_holds_what_was_written(world2: dc.LocalWorld) -> None:
    """Zeroed, then a reduced gradient added in place (through ``.data`` too): no longer
    zero, so the next backward accumulates onto a reduced gradient and its sum is refused on
    every rank."""

    def body(through_data: bool) -> str:
        lin = nn.Linear(H, 1, bias=False, dtype=F64)
        try:
            with dc.spmd_check():
                x = dc.spmd.varying(torch.full((3, H), 1.0 + dc.get_rank(), dtype=F64))
                lin(x).sum().backward()
                g = lin.weight.grad
                reduced = dc.all_reduce(g.clone())
                g.zero_()
                (g.data if through_data else g).add_(reduced)
                lin(x).sum().backward()
                dc.all_reduce(lin.weight.grad)
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for through_data in (False, True):
        for msg in world2.run(body, through_data):
            assert "already holds a reduced gradient" in msg, (through_data, msg)


def _masked_partial(form: str) -> str:
    """A row-parallel product's partial sums masked with ``form``'s other operand, then
    reduced."""
    _from_this_tree()
    row = par.RowParallelLinear(8, H, input_is_parallel=True, seed=0, bias=False, dtype=F64)
    g = torch.Generator().manual_seed(1 + dc.get_rank())
    a = torch.randn(3, 8 // dc.get_world_size(), generator=g, dtype=F64)
    mask = torch.tensor([[True], [False], [True]])
    try:
        with dc.spmd_check():
            dc.spmd.module(row)
            p = F.linear(dc.spmd.varying(a), row.weight)
            r = dc.get_rank()
            if form == "varying_0d_zero_on_rank_0":
                out = torch.where(mask, p, dc.spmd.varying(torch.tensor(float(r), dtype=F64)))
            elif form == "rank_zero_on_rank_0":
                out = p.masked_fill(mask, r)
            elif form == "tensor_0":
                out = torch.where(mask, p, torch.tensor(0.0, dtype=F64))
            elif form == "zeros_0d":
                out = p.masked_fill(mask, torch.zeros((), dtype=F64))
            elif form == "zeros_like":
                out = torch.where(mask, torch.zeros_like(p), p)
            elif form == "full_0_plus":
                out = p + torch.full((), 0.0, dtype=F64)
            else:
                out = torch.where(mask, p, torch.tensor(1.0, dtype=F64))
            par.reduce_from_region(out).pow(2).mean().backward()
    except dc.SPMDTypeError as e:
        return str(e)
    return "no error"


@_WORLDS
@pytest.mark.parametrize("form", ["varying_0d_zero_on_rank_0", "rank_zero_on_rank_0"])
def test_a_masked_operand_zero_on_one_rank_only_is_an_error_on_every_rank(
    local_worlds: Callable[..., dc.LocalWorld], in_process: bool, form: str
) -> None:
    """A partial value masked with a per-rank operand (a varying 0-d tensor, the rank)
    that is zero on rank 0 only: an error on every rank (the other operand must be zero or
    partial, and a per-rank one is neither). Read from its value, rank 0 passed it and went
    on to the reduction while rank 1 raised (a desync)."""
    for msg in local_worlds(2, in_process=in_process).run(_masked_partial, form):
        assert "expected zero or partial" in msg, msg


@pytest.mark.parametrize("form", ["tensor_0", "zeros_0d", "zeros_like", "full_0_plus", "tensor_1"])
def test_a_masked_operand_zero_by_construction_passes(world2: dc.LocalWorld, form: str) -> None:
    """A zero made by a factory (``torch.tensor(0.0)``, ``zeros``, ``zeros_like``,
    ``full(.., 0.0)``) is zero by its op on every rank: masking or adding it passes; a
    nonzero constant is refused."""
    for msg in world2.run(_masked_partial, form):
        if form == "tensor_1":
            assert "expected zero or partial" in msg, msg
        else:
            assert msg == "no error", msg


@_WORLDS
def test_a_ranks_seeding_does_not_type_another_ranks_draws(
    local_worlds: Callable[..., dc.LocalWorld], in_process: bool
) -> None:
    """Draws on the default generator seeded alike (replicated), then the generator seeded
    from the rank, then alike again, a collective between: every draw seeded alike is
    replicated on every rank. How the generator was last seeded inside the check was one
    value for the process: in an in-process world (the ranks are threads) rank 1's seeding
    from the rank typed rank 0's next draw varying, rank 0 alone raised at copy_to_region,
    and the ranks desynced."""

    def body() -> list[str]:
        _from_this_tree()
        t = torch.ones(1)
        kinds = []
        with dc.spmd_check():
            torch.manual_seed(0)
            for _ in range(3):
                dc.all_reduce(t)
                x = torch.randn(3, H, requires_grad=True)
                kinds.append(dc.spmd.type_of(x).value)
                par.copy_to_region(x).sum()
                torch.manual_seed(1 + dc.get_rank())  # its draws are per rank (none is made)
                dc.all_reduce(t)
                torch.manual_seed(0)
        return kinds

    for kinds in local_worlds(2, in_process=in_process).run(body):
        assert kinds == ["replicated"] * 3, kinds


@_WORLDS
def test_a_seed_set_through_torch_random_is_seen(
    local_worlds: Callable[..., dc.LocalWorld], in_process: bool
) -> None:
    """The generator seeded per rank before the check (``torch.manual_seed(rank)``: a plain
    int), then alike inside it through ``torch.random.manual_seed(0)`` (the same function
    as ``torch.manual_seed``, under its other name): its draws are replicated on every rank.
    Unseen, the seeding was inferred by comparing the initial seed with this rank's own at
    the entry: rank 0's entry seed was 0, so rank 0 alone typed the draw varying and raised
    at copy_to_region (a desync)."""

    def body() -> str:
        _from_this_tree()
        torch.manual_seed(dc.get_rank())
        with dc.spmd_check():
            torch.random.manual_seed(0)
            x = torch.randn(3, H, requires_grad=True)
            par.copy_to_region(x).sum()
            return dc.spmd.type_of(x).value

    assert local_worlds(2, in_process=in_process).run(body) == ["replicated", "replicated"]
