"""Replication types: the rules added after the first corpus (issue 45, items 7-11; issue 46,
item 4). Each miss is a corpus entry (``corpus.BUGS``, run by ``test_spmd.py`` with its fix);
each false positive a correct program (``corpus.CORRECT``) run here. These tests pin the
parts the corpus cannot: when the error is raised (before a wrong gradient is used), what
the messages leave out, and the annotations with the check off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm.testing import spmd_corpus as corpus

F64 = torch.float64


@pytest.mark.parametrize("name", sorted(corpus.CORRECT))
def test_correct_program_passes(world2: dc.LocalWorld, name: str) -> None:
    """Masked assignment / where with a zero branch on a partial value, all_reduce(avg) of
    a replicated value, a loss linear in a partial value, the mean loss with averaged
    gradients, accumulation reduced once or averaged: no error."""
    assert world2.run(corpus.run_correct, name) == [None, None]


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug_mode"])
def test_correct_programs_on_three_ranks(world3: dc.LocalWorld, debug: bool) -> None:
    """Also in debug mode: its cross-rank checks must pass every correct program (the
    suite under DIFFCOMM_DEBUG=1 found false positives: all_to_all across two dims, the
    replication check under spmd_types, compile and LocalTensorMode)."""

    def body() -> list[object]:
        return [corpus.run_correct(n) for n in corpus.CORRECT]

    with dc.debug(debug):
        per_ranks = world3.run(body)
    for per_rank in per_ranks:
        assert per_rank == [None] * len(corpus.CORRECT), per_rank


def test_no_wrong_gradient_reaches_an_optimizer_step(world2: dc.LocalWorld) -> None:
    """A missing copy_to_region with a LayerNorm upstream: the optimizer step inside the
    block raises before it changes a parameter; the message names the linear's line and
    no private name, and does not suggest reducing the parameter's gradient (which would
    leave everything upstream wrong)."""

    def body() -> tuple[str, bool, bool]:
        ln = nn.LayerNorm(4, dtype=F64)
        col = par.ColumnParallelLinear(4, 8, dtype=F64, seed=0)
        row = par.RowParallelLinear(8, 4, input_is_parallel=True, dtype=F64, seed=0)
        opt = torch.optim.SGD(ln.parameters(), lr=0.1)
        before = ln.weight.detach().clone()
        stepped = False
        try:
            with dc.spmd_check():
                dc.spmd.module(col), dc.spmd.module(row)
                h = ln(torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0)))
                a = F.gelu(F.linear(h, col.weight, col.bias))
                par.reduce_from_region(F.linear(a, row.weight)).pow(2).mean().backward()
                opt.step()
                stepped = True
        except dc.SPMDTypeError as e:
            return str(e), stepped, bool(torch.equal(ln.weight.detach(), before))
        return "no error", stepped, True

    for msg, stepped, unchanged in world2.run(body):
        assert not stepped and unchanged, msg
        assert "insert parallel.copy_to_region before the linear at test_spmd_rules.py:" in msg, msg
        assert "_region_param" not in msg and "all_reduce(p.grad)" not in msg, msg


def test_input_gradient_error_comes_before_backward(world2: dc.LocalWorld) -> None:
    """The dropped copy_to_region that only corrupts the input's gradient is raised when
    backward starts: no gradient is computed."""

    def body() -> tuple[str, bool]:
        col = par.ColumnParallelLinear(4, 8, dtype=F64, seed=0)
        row = par.RowParallelLinear(8, 4, input_is_parallel=True, dtype=F64, seed=0)
        x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        try:
            with dc.spmd_check():
                dc.spmd.module(col), dc.spmd.module(row)
                a = F.gelu(F.linear(x, col.weight, col.bias))
                par.reduce_from_region(F.linear(a, row.weight)).pow(2).mean().backward()
        except dc.SPMDTypeError as e:
            return str(e), x.grad is None and col.weight.grad is None
        return "no error", False

    for msg, no_grads in world2.run(body):
        assert no_grads, msg
        assert "backward at test_spmd_rules.py:" in msg and "input of shape (3, 4)" in msg, msg
        assert "insert parallel.copy_to_region before the linear at test_spmd_rules.py:" in msg, msg
        assert "_region_param" not in msg, msg


_WEIGHT_FORMS = {
    "linear": lambda x, w: F.linear(x, w),
    "matmul_of_T": lambda x, w: x @ w.T,
    "mm_of_t": lambda x, w: torch.mm(x, w.t()),
    "matmul_of_transpose": lambda x, w: torch.matmul(x, w.transpose(0, 1)),
}


@pytest.mark.parametrize("form", sorted(_WEIGHT_FORMS))
@pytest.mark.parametrize("weight", ["parameter", "varying_leaf"])
def test_input_gradient_error_for_a_weight_used_through_a_view(
    world2: dc.LocalWorld, form: str, weight: str
) -> None:
    """``x @ w.T`` meets the weight through a view (the transpose is no leaf): the dropped
    copy_to_region was accepted and ``x.grad`` was each rank's share, silently."""

    def body() -> str:
        col = par.ColumnParallelLinear(4, 8, bias=False, dtype=F64, seed=0)
        row = par.RowParallelLinear(8, 4, input_is_parallel=True, dtype=F64, seed=0)
        x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        w = col.weight.detach().clone().requires_grad_()
        try:
            with dc.spmd_check(varying=[w] if weight == "varying_leaf" else ()):
                dc.spmd.module(col), dc.spmd.module(row)
                a = F.gelu(_WEIGHT_FORMS[form](x, col.weight if weight == "parameter" else w))
                par.reduce_from_region(F.linear(a, row.weight)).pow(2).mean().backward()
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for msg in world2.run(body):
        assert "backward at test_spmd_rules.py:" in msg and "input of shape (3, 4)" in msg, msg
        assert "insert parallel.copy_to_region before the" in msg, msg


def test_rank_slice_message_names_the_rank_not_a_random_draw(world2: dc.LocalWorld) -> None:
    def body() -> object:
        return corpus.run("rank-sliced data to ColumnParallelLinear", False)

    for bad in world2.run(body):
        assert bad is not None and "computed from the rank" in bad[1], bad
        assert "random" not in bad[1], bad


def test_accumulation_messages_and_avg_loop(world2: dc.LocalWorld) -> None:
    """The sum-reduced accumulation names the micro-batch fix; the same loop with op="avg"
    passes (the corpus entry's fix); a masked assignment of a non-zero value is still an
    error (the linearity table knows zero, not any constant)."""

    def body() -> tuple[object, object, object]:
        def nonzero_fill() -> None:
            p = dc.spmd.partial(torch.ones(3, 4, dtype=F64))
            p[torch.tensor([True, False, True])] = 1.0

        try:
            with dc.spmd_check():
                nonzero_fill()
            fill = None
        except dc.SPMDTypeError as e:
            fill = str(e)
        name = "gradient accumulation reduced every micro-batch"
        return corpus.run(name, False), corpus.run(name, True), fill

    for bad, good, fill in world2.run(body):
        assert bad is not None and "already holds a reduced gradient" in bad[1], bad
        assert good is None, good
        assert fill is not None and "setitem" in fill and "expected zero or partial" in fill, fill


def test_annotations_are_no_ops_outside_a_check() -> None:
    """dc.spmd.varying / replicated / partial / module return their input with no check
    active (annotated code runs unchanged in production); type_of still needs a check."""
    x = torch.ones(2)
    m = nn.Linear(2, 2)
    assert dc.spmd.varying(x) is x and dc.spmd.replicated(x) is x and dc.spmd.partial(x) is x
    assert dc.spmd.module(m) is m
    assert "_dc_spmd" not in str(list(x.__dict__))
    with pytest.raises(RuntimeError, match="no active spmd_check"):
        dc.spmd.type_of(x)


def test_optimizer_hook_and_apply_patch_removed_on_exit(world2: dc.LocalWorld) -> None:
    """The optimizer step pre-hook and the user-Function ``apply`` exist only inside."""

    def body() -> tuple[int, int, int, bool, bool]:
        from torch.optim import optimizer as O

        apply = torch.autograd.Function.__dict__["apply"]
        before = len(O._global_optimizer_pre_hooks)
        with dc.spmd_check():
            inside = len(O._global_optimizer_pre_hooks)
            patched = torch.autograd.Function.__dict__["apply"] is not apply
        restored = torch.autograd.Function.__dict__["apply"] is apply
        return before, inside, len(O._global_optimizer_pre_hooks), patched, restored

    for before, inside, after, patched, restored in world2.run(body):
        assert inside == before + 1 and after == before
        assert patched and restored


def _index_demo(objective: str) -> tuple[str | None, bool]:
    """docs/index.md's program (a per-rank x gathered, a replicated loss ``(y ** 2).sum()``)
    under ``dc.spmd_check(objective=...)``: the error, and whether ``x.grad`` is the sum
    convention's gradient ``2 * W * x`` (the objective summed over the ranks' copies)."""
    gen = torch.Generator().manual_seed(5 + dc.get_rank())
    x = torch.randn(4, dtype=F64, generator=gen, requires_grad=True)
    try:
        with dc.spmd_check(objective=objective):
            dc.spmd.varying(x)
            y = dc.all_gather(x)
            (y**2).sum().backward()
    except dc.SPMDTypeError as e:
        return str(e), False
    assert x.grad is not None
    return None, bool(torch.allclose(x.grad, 2 * dc.get_world_size() * x.detach()))


def test_objective_sum_reads_a_replicated_loss_as_the_sum_convention(world2: dc.LocalWorld) -> None:
    """The same program is the contract's sum-convention demo and Megatron's 2x bug (corpus:
    "all_gather under a replicated objective"); the check cannot tell them apart, so by
    default a replicated loss is a replicated objective (refused here), and
    ``objective="sum"`` says the sum convention is meant: it passes, with the gradient the
    sum convention defines."""
    for default, summed in world2.run(lambda: (_index_demo("loss"), _index_demo("sum"))):
        assert default[0] is not None and "the loss is replicated" in default[0], default
        assert summed == (None, True), summed
    assert world2.run(corpus.run, "all_gather under a replicated objective", False)[0] is not None


def test_objective_sum_refuses_the_replicated_objective_mappings(world2: dc.LocalWorld) -> None:
    """Under ``objective="sum"`` a replicated loss is the sum of the ranks' copies: a value
    whose backward passes its gradient on unchanged (a ParallelMLP's reduce_from_region)
    would give world-size times too small gradients (an error before backward), and a
    replicated parameter's gradient is partial (each rank's own contribution): it must be
    summed over the ranks, or the block's exit refuses it."""

    def body() -> list[str | None]:
        out: list[str | None] = []
        try:
            with dc.spmd_check(objective="sum"):
                par.ParallelMLP(4, 8, dtype=F64, seed=0)(torch.ones(3, 4, dtype=F64)).sum().backward()
            out.append(None)
        except dc.SPMDTypeError as e:
            out.append(str(e))
        for fixed in (False, True):
            try:
                with dc.spmd_check(objective="sum"):
                    lin = nn.Linear(4 * dc.get_world_size(), 1, dtype=F64)
                    x = dc.spmd.varying(torch.full((4,), 1.0 + dc.get_rank(), dtype=F64))
                    lin(dc.all_gather(x)).sum().backward()
                    if fixed:
                        for p in lin.parameters():
                            assert p.grad is not None
                            p.grad = dc.all_reduce(p.grad)
                out.append(None)
            except dc.SPMDTypeError as e:
                out.append(str(e))
        return out

    for mapping, param, fixed in world2.run(body):
        assert mapping is not None and "objective='sum'" in mapping, mapping
        assert "world-size times too small" in mapping and "reduce_from_region" in mapping, mapping
        assert param is not None and "missing reduction" in param and "Linear.weight" in param, param
        assert fixed is None, fixed


def test_objective_is_validated_before_anything() -> None:
    with pytest.raises(ValueError, match="`objective`.*'loss', 'sum'.*'mean'"):
        dc.spmd_check(objective="mean")
