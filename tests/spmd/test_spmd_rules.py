"""Replication types: the rules added after the first corpus (issue 45, items 7-11; issue 46,
item 4). Each miss is a corpus entry (``corpus.BUGS``, run by ``test_spmd.py`` with its fix);
each false positive a correct program (``corpus.CORRECT``) run here. These tests pin the
parts the corpus cannot: when the error is raised (before a wrong gradient is used), what
the messages leave out, and the annotations with the check off."""

from __future__ import annotations

import contextlib
from typing import Any

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

    for msg, _ in world2.run(_weight_program, form, weight, False):
        assert "backward at test_spmd_rules.py:" in msg and "input of shape (3, 4)" in msg, msg
        assert "insert parallel.copy_to_region before the" in msg, msg


def _to_dtype_of_x(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return F.linear(x, w.to(x.dtype))  # manual mixed precision


#: a weight reaching the matmul through a cast, a copy or a scaling (no view of the leaf)
_DERIVED_WEIGHT_FORMS = {
    "float": lambda x, w: F.linear(x.float(), w.float()),
    "to_dtype_of_x": _to_dtype_of_x,
    "float_then_T": lambda x, w: x.float() @ w.float().T,
    "bfloat16_then_t": lambda x, w: torch.mm(x.bfloat16(), w.bfloat16().t()),
    "half_and_back": lambda x, w: F.linear(x, w.half().double()),
    "to_device_copy": lambda x, w: F.linear(x, w.to("cpu", copy=True)),
    "contiguous_of_T": lambda x, w: x @ w.T.contiguous(),
    "clone": lambda x, w: F.linear(x, w.clone()),
    "times_one_then_T": lambda x, w: x @ (w * 1).T,
    "divided_by_two": lambda x, w: F.linear(x, w / 2),
    "times_replicated_scalar": lambda x, w: F.linear(x, w * torch.tensor(0.5, dtype=F64)),
}
_ALL_WEIGHT_FORMS = {**_WEIGHT_FORMS, **_DERIVED_WEIGHT_FORMS}


def _weight_program(form: str, weight: str, copy: bool) -> tuple[str, torch.Tensor | None]:
    """A column- then row-parallel pair whose first matmul meets the weight in ``form``
    (with ``copy_to_region`` before it or not): the check's message and ``x.grad``."""
    col = par.ColumnParallelLinear(4, 8, bias=False, dtype=F64, seed=0)
    row = par.RowParallelLinear(8, 4, input_is_parallel=True, dtype=F64, seed=0)
    x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = col.weight.detach().clone().requires_grad_()
    try:
        with dc.spmd_check(varying=[w] if weight == "varying_leaf" else ()):
            dc.spmd.module(col), dc.spmd.module(row)
            h = par.copy_to_region(x) if copy else x
            a = F.gelu(_ALL_WEIGHT_FORMS[form](h, col.weight if weight == "parameter" else w)).to(F64)
            par.reduce_from_region(F.linear(a, row.weight)).pow(2).mean().backward()
    except dc.SPMDTypeError as e:
        return str(e), x.grad
    return "no error", x.grad


@pytest.mark.parametrize("form", sorted(_DERIVED_WEIGHT_FORMS))
@pytest.mark.parametrize("weight", ["parameter", "varying_leaf"])
def test_input_gradient_error_for_a_weight_used_through_a_cast_or_scaling(
    world2: dc.LocalWorld, form: str, weight: str
) -> None:
    """``x @ w.float().T``, ``F.linear(x, w.to(x.dtype))``, ``x @ (w * 1).T``: the weight
    reaches the matmul through an op that is no view (a cast, a copy, a scaling by a
    replicated factor), so the matmul's operand was no weight to the check: the dropped
    copy_to_region was accepted and ``x.grad`` was each rank's share, silently."""
    for msg, grad in world2.run(_weight_program, form, weight, False):
        assert "backward at test_spmd_rules.py:" in msg and "input of shape (3, 4)" in msg, msg
        assert "insert parallel.copy_to_region before the" in msg, msg
        assert grad is None, msg  # raised before the backward ran


@pytest.mark.parametrize("form", sorted(_DERIVED_WEIGHT_FORMS))
@pytest.mark.parametrize("weight", ["parameter", "varying_leaf"])
def test_a_weight_used_through_a_cast_or_scaling_after_copy_to_region_passes(
    world2: dc.LocalWorld, form: str, weight: str
) -> None:
    """The same programs with copy_to_region before the matmul: no error, and ``x.grad``
    is whole (equal on every rank)."""
    (msg0, g0), (msg1, g1) = world2.run(_weight_program, form, weight, True)
    assert msg0 == msg1 == "no error", (msg0, msg1)
    assert g0 is not None and g1 is not None and torch.equal(g0, g1)


@pytest.mark.parametrize("copy", [False, True], ids=["no_copy", "copy_to_region"])
@pytest.mark.parametrize("weight", ["parameter", "varying_leaf"])
def test_input_gradient_rule_under_cpu_autocast(world2: dc.LocalWorld, weight: str, copy: bool) -> None:
    """Under ``torch.autocast`` the check sees the op as called (``linear(x, w)`` with the
    float32 weight; autocast casts below the torch-function layer): the missing
    copy_to_region is the input-gradient error; with it, and through the layers themselves,
    no error."""

    def body() -> str:
        col = par.ColumnParallelLinear(4, 8, bias=False, seed=0)
        row = par.RowParallelLinear(8, 4, input_is_parallel=True, seed=0)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        w = col.weight.detach().clone().requires_grad_()
        try:
            with dc.spmd_check(varying=[w] if weight == "varying_leaf" else ()):
                dc.spmd.module(col), dc.spmd.module(row)
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                    h = par.copy_to_region(x) if copy else x
                    y = F.linear(F.gelu(F.linear(h, col.weight if weight == "parameter" else w)), row.weight)
                    y = par.reduce_from_region(y)
                    assert y.dtype == torch.bfloat16
                    z = row(F.gelu(col(x2)))  # the layers: copy_to_region inside
                (y.float().pow(2).mean() + z.float().pow(2).mean()).backward()
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for msg in world2.run(body):
        if copy:
            assert msg == "no error", msg
        else:
            assert "input of shape (3, 4)" in msg and "insert parallel.copy_to_region before the" in msg, msg


_ROW_FORMS = {
    "float": lambda a, w: F.linear(a, w.double().float()),
    "times_half": lambda a, w: F.linear(a, w * 0.5),
    "T": lambda a, w: a @ w.T,
    "transpose": lambda a, w: torch.matmul(a, w.transpose(0, 1)),
    # the same product as an einsum or a tensordot (once typed varying: GELU passed)
    "einsum": lambda a, w: torch.einsum("bf,hf->bh", a, w),
    "einsum_implicit": lambda a, w: torch.einsum("bf,hf", a, w),
    "tensordot": lambda a, w: torch.tensordot(a, w, dims=([1], [1])),
    "tensordot_T": lambda a, w: torch.tensordot(a, w.T, dims=1),
}


@pytest.mark.parametrize("form", sorted(_ROW_FORMS))
def test_a_row_parallel_weight_through_a_cast_or_transpose_stays_row_parallel(
    world2: dc.LocalWorld, form: str
) -> None:
    """``F.linear(a, row.weight.float())`` and ``a @ row.weight.T`` are row-parallel
    products (partial) as ``F.linear(a, row.weight)`` is: the sharded dim goes through
    the cast (and is swapped by the transpose), so GELU of the partial sums before their
    reduction is an error, and the reduction first passes."""

    def body() -> list[str]:
        out = []
        for bug in (False, True):
            col = par.ColumnParallelLinear(4, 8, bias=False, seed=0)
            row = par.RowParallelLinear(8, 4, input_is_parallel=True, seed=0)
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
            try:
                with dc.spmd_check():
                    dc.spmd.module(col), dc.spmd.module(row)
                    a = F.gelu(F.linear(par.copy_to_region(x), col.weight))
                    y = _ROW_FORMS[form](a, row.weight)
                    out.append(dc.spmd.type_of(y).value)
                    y = F.gelu(y) if bug else F.gelu(par.reduce_from_region(y))
                    y.pow(2).mean().backward()
                out.append("no error")
            except dc.SPMDTypeError as e:
                out.append(str(e))
        return out

    for typ, fixed, typ_bug, bug in world2.run(body):
        assert typ == typ_bug == "partial", (typ, typ_bug)
        assert fixed == "no error", fixed
        assert "gelu" in bug and "partial" in bug, bug


#: a constant added to partial sums before their reduction (each rank adds it: world-size
#: times in the sum), as a Python number, through a reflected operator, in place, as an
#: integer tensor; ``None``: zero, which adds nothing (passes)
_CONSTANT_FORMS = {
    "add": (lambda p: p + 1.0, "add"),
    "rsub": (lambda p: 1.0 - p, "rsub"),
    "add_": (lambda p: p.add_(1.0), "add_"),
    "int_tensor": (lambda p: p + torch.tensor(1), "add"),
    "zero": (lambda p: p + 0.0, None),
}


@pytest.mark.parametrize("form", sorted(_CONSTANT_FORMS))
def test_a_constant_added_to_partial_sums_is_an_error(world2: dc.LocalWorld, form: str) -> None:
    """``reduce_from_region(p + 1.0)`` holds the constant world-size times (each rank's share
    has it); the check passed it, as a Python number is no tensor operand. ``1.0 - p`` (a
    ``Tensor.__rsub__`` torch defines in Python, which turns a ``TypeError`` into
    ``NotImplemented``) raised Python's "unsupported operand" instead of the check's error."""
    shift, op = _CONSTANT_FORMS[form]

    def body() -> str:
        row = par.RowParallelLinear(8, 4, input_is_parallel=True, seed=0, bias=False)
        g = torch.Generator().manual_seed(1 + dc.get_rank())
        a = torch.randn(3, 8 // dc.get_world_size(), generator=g)
        try:
            with dc.spmd_check():
                dc.spmd.module(row)
                p = F.linear(dc.spmd.varying(a), row.weight)
                par.reduce_from_region(shift(p)).pow(2).mean().backward()
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for msg in world2.run(body):
        if op is None:
            assert msg == "no error", msg
        else:
            assert f"{op} at" in msg and "once per rank" in msg, msg


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


#: in-place updates of a replicated weight with per-rank data (the op named in the message)
_DRIFT_FORMS = {
    "masked_fill_": lambda w, v: w.masked_fill_(v > 0, 0.0),
    "add_": lambda w, v: w.add_(v),
    "index_add_": lambda w, v: w.index_add_(1, torch.tensor([dc.get_rank()]), v[:, :1]),
    "setitem": lambda w, v: w.__setitem__((0, dc.get_rank()), 0.0),
    "copy_": lambda w, v: w.copy_(v),
    ".data =": lambda w, v: setattr(w, "data", v),
    ".data.copy_": lambda w, v: w.data.copy_(v),
}


@pytest.mark.parametrize("form", sorted(_DRIFT_FORMS))
def test_a_replicated_weight_updated_with_per_rank_data_is_an_error(world2: dc.LocalWorld, form: str) -> None:
    """A replicated parameter updated in place with per-rank data (a pruning mask, noise, a
    row picked by the rank, a per-rank value copied in) keeps its replicated type, so its
    replicas differed in silence where no replicated loss showed it (data parallel: each
    rank's loss is its own). Its next use is an error, naming the update."""

    def body() -> str:
        lin = nn.Linear(4, 1, bias=False, dtype=F64)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(1, 4, generator=torch.Generator().manual_seed(0), dtype=F64))
        try:
            with dc.spmd_check():
                g = torch.Generator().manual_seed(1 + dc.get_rank())  # per rank (inside the check)
                v, x = torch.randn(1, 4, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
                with torch.no_grad():
                    _DRIFT_FORMS[form](lin.weight, v)
                lin(x).pow(2).mean().backward()  # each rank's own loss (data parallel)
                assert lin.weight.grad is not None
                lin.weight.grad = dc.all_reduce(lin.weight.grad, op="avg")
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    op = {".data =": "copy_", ".data.copy_": "copy_"}.get(form, form)
    for msg in world2.run(body):
        assert "linear at" in msg and "updated in place with per-rank data" in msg and f"({op} at" in msg, msg


def _averaged_partial_sums(reduce: str, checked: bool) -> tuple[str | None, object, torch.Tensor]:
    """A row-parallel product's partial sums reduced by ``all_reduce(op="avg")`` scaled
    back by the world size (``"avg"``), or by ``reduce_from_region`` (``"fix"``), into a
    replicated loss: (the check's error or ``None``, this rank's weight gradient, the
    serial float64 reference of that weight's gradient)."""
    world, rank = dc.get_world_size(), dc.get_rank()
    g = torch.Generator().manual_seed(7)
    a_full = torch.randn(3, 4 * world, dtype=F64, generator=g)
    w_full = torch.randn(2, 4 * world, dtype=F64, generator=g)
    w_ref = w_full.clone().requires_grad_()
    F.linear(a_full, w_ref).pow(2).mean().backward()
    cols = slice(4 * rank, 4 * (rank + 1))
    row = par.RowParallelLinear(4 * world, 2, input_is_parallel=True, bias=False, dtype=F64, seed=0)
    with torch.no_grad():
        row.weight.copy_(w_full[:, cols])
    error = None
    try:
        with dc.spmd_check(modules=row) if checked else contextlib.nullcontext():
            p = F.linear(dc.spmd.varying(a_full[:, cols].clone()), row.weight)  # partial sums
            y = dc.all_reduce(p, op="avg") * world if reduce == "avg" else par.reduce_from_region(p)
            y.pow(2).mean().backward()
    except dc.SPMDTypeError as e:
        error = str(e)
    return error, row.weight.grad, w_ref.grad[:, cols]


def test_averaged_partial_sums_into_a_replicated_loss_is_an_error(world2: dc.LocalWorld) -> None:
    """all_reduce(op="avg") of partial sums is their sum over W, and its backward sums the
    gradient as the sum's does: under a replicated loss every gradient is world-size times
    too large. It was read as data parallel's mean loss (which averages per-rank losses,
    varying values) and passed; the mean of partial sums is no mean objective."""

    def body() -> list[tuple[str | None, object, torch.Tensor]]:
        return [_averaged_partial_sums(how, checked) for how in ("avg", "fix") for checked in (False, True)]

    for (_, g_bad, ref), (bad, _, _), (_, g_fix, _), (good, g_good, _) in world2.run(body):
        torch.testing.assert_close(g_bad, 2 * ref)  # the wrong number the check must stop
        assert bad is not None and "world-size times too large" in bad, bad
        torch.testing.assert_close(g_fix, ref)
        assert good is None, good
        torch.testing.assert_close(g_good, ref)


def test_reduce_scatter_avg_of_a_replicated_value_is_refused_at_the_op(world2: dc.LocalWorld) -> None:
    """reduce_scatter(op="avg") of a replicated value is this rank's chunk (per rank), not
    the identity all_reduce(op="avg") is: it was typed replicated, so its per-rank loss
    passed as a replicated objective until the block's end compared the losses' values.
    Refused at the op, as reduce_scatter of a replicated value is."""

    def body() -> str | None:
        try:
            with dc.spmd_check():
                x = torch.ones(3, 4, dtype=F64, requires_grad=True)
                dc.reduce_scatter(x * 2, dim=1, op="avg").pow(2).sum().backward()
        except dc.SPMDTypeError as e:
            return str(e)
        return None

    for msg in world2.run(body):
        assert msg is not None and "reduce_scatter at" in msg and "argument `x` is replicated" in msg, msg


_ACCUMULATE_FORMS = {  # (form, a partial share p, a replicated b and s) -> value; the error expected?
    "addcmul(b, p, s)": (lambda p, b, s: torch.addcmul(b, p, s), True),
    "addcmul(p, b, s)": (lambda p, b, s: torch.addcmul(p, b, s), True),
    "baddbmm(b, p, s)": (lambda p, b, s: torch.baddbmm(b[None], p[None], s.T[None])[0], True),
    "addcmul(zeros, p, s)": (lambda p, b, s: torch.addcmul(torch.zeros_like(b), p, s), False),
    "addcmul(p, p, s)": (lambda p, b, s: torch.addcmul(p, p, s), False),
    "baddbmm(zeros, p, s)": (
        lambda p, b, s: torch.baddbmm(torch.zeros(1, 3, 3, dtype=F64), p[None], s.T[None])[0],
        False,
    ),
    # beta=0 drops the term (a correct program, refused before)
    "baddbmm(b, p, s, beta=0)": (
        lambda p, b, s: torch.baddbmm(b[None], p[None], s.T[None], beta=0)[0],
        False,
    ),
    "baddbmm(b, p, s, beta=0.5)": (
        lambda p, b, s: torch.baddbmm(b[None], p[None], s.T[None], beta=0.5)[0],
        True,
    ),
}


def _accumulate(form: str) -> tuple[str | None, torch.Tensor, torch.Tensor]:
    """``form`` on a partial value (this rank's share of ``p_full``) and replicated ``b``,
    ``s``, reduced with reduce_from_region: (the check's error, the value, the serial one)."""
    fn = _ACCUMULATE_FORMS[form][0]
    world, rank = dc.get_world_size(), dc.get_rank()
    g = torch.Generator().manual_seed(11)
    shares = torch.randn(world, 3, 3, dtype=F64, generator=g)
    b, s = torch.randn(3, 3, dtype=F64, generator=g), torch.randn(3, 3, dtype=F64, generator=g)
    serial = fn(shares.sum(0), b, s)
    error, value = None, par.reduce_from_region(fn(shares[rank], b, s))
    try:
        with dc.spmd_check():
            par.reduce_from_region(fn(dc.spmd.partial(shares[rank].clone()), b, s))
    except dc.SPMDTypeError as e:
        error = str(e)
    return error, value, serial


@pytest.mark.parametrize("form", sorted(_ACCUMULATE_FORMS))
def test_a_replicated_term_accumulated_onto_partial_sums_is_an_error(
    world2: dc.LocalWorld, form: str
) -> None:
    """addcmul / baddbmm add their first argument to a product: with a partial operand the
    replicated term was counted once per rank (the value off by (W-1) * b) and passed, as a
    product with one partial factor; now the term must be partial or zero too."""
    wrong = _ACCUMULATE_FORMS[form][1]
    for error, value, serial in world2.run(_accumulate, form):
        if wrong:
            assert not torch.allclose(value, serial)  # the wrong number the check must stop
            assert error is not None and "added once per rank" in error, error
        else:
            torch.testing.assert_close(value, serial)
            assert error is None, error


@pytest.mark.parametrize("value", [1.0, 0.0])
def test_partial_sums_padded_with_a_constant(world2: dc.LocalWorld, value: float) -> None:
    """F.pad of a partial value fills the padding on every rank: a non-zero fill is summed
    W times by the reduction (the reduced padding is W * value, not value). It passed as a
    shape op; a zero fill stays linear."""

    def body() -> tuple[str | None, torch.Tensor]:
        p = torch.full((2, 3), 0.5, dtype=F64)
        error = None
        try:
            with dc.spmd_check():
                par.reduce_from_region(F.pad(dc.spmd.partial(p.clone()), (1, 1), value=value))
        except dc.SPMDTypeError as e:
            error = str(e)
        return error, par.reduce_from_region(F.pad(p, (1, 1), value=value))

    for error, reduced in world2.run(body):
        serial = F.pad(torch.full((2, 3), 1.0, dtype=F64), (1, 1), value=value)  # the shares' sum, padded
        if value:
            assert not torch.equal(reduced, serial)  # the padding counted twice
            assert error is not None and "padded with value=1.0" in error, error
        else:
            torch.testing.assert_close(reduced, serial)
            assert error is None, error


def _dp_rows_by_torch_rank(
    reduce: bool, read: str = "dist.get_rank()"
) -> tuple[str | None, torch.Tensor, torch.Tensor]:
    """Data parallel, each rank's rows sliced with the rank ``read`` gives (default
    ``torch.distributed.get_rank()``): (the check's error, this rank's weight gradient,
    the serial gradient of the mean loss)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))

    data = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    w0 = torch.randn(1, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    w_ref = w0.clone().requires_grad_()
    torch.stack([F.linear(data[2 * r : 2 * r + 2], w_ref).pow(2).mean() for r in range(2)]).mean().backward()
    w, error = nn.Parameter(w0.clone()), None
    try:
        with dc.spmd_check():
            r = eval(read, {"dist": dist, "c10d": c10d, "mesh": mesh})
            dc.all_reduce(F.linear(data[2 * r : 2 * r + 2], w).pow(2).mean(), op="avg").backward()
            if reduce:
                w.grad = dc.all_reduce(w.grad, op="avg")
    except dc.SPMDTypeError as e:
        error = str(e)
    return error, w.grad, w_ref.grad


def test_rows_sliced_with_torch_distributed_get_rank_are_per_rank(world2: dc.LocalWorld) -> None:
    """``torch.distributed.get_rank()`` inside the check is the rank as ``dc.get_rank()`` is:
    rows sliced with it were replicated to the check, so a data-parallel step that never
    averaged its gradients passed, each rank holding its own (the replicas drift)."""
    for (missing, g_bad, ref), (fixed, g_good, _) in world2.run(
        lambda: (_dp_rows_by_torch_rank(False), _dp_rows_by_torch_rank(True))
    ):
        assert not torch.allclose(g_bad, ref)  # the wrong number the check must stop
        assert missing is not None and "missing reduction" in missing, missing
        assert fixed is None, fixed
        torch.testing.assert_close(g_good, ref)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_partial_sums_cast_to_an_integer_dtype(world2: dc.LocalWorld, dtype: torch.dtype) -> None:
    """``p.to(torch.int64)`` rounds each rank's share on its own: shares 0.6 and 0.6 reduce
    to 0, the serial int(1.2) is 1. It passed as a value-preserving cast; a float cast is."""

    def body() -> tuple[str | None, torch.Tensor]:
        p = torch.full((3,), 0.6, dtype=F64)
        error = None
        try:
            with dc.spmd_check():
                dc.all_reduce(dc.spmd.partial(p.clone()).to(dtype))
        except dc.SPMDTypeError as e:
            error = str(e)
        return error, dc.all_reduce(p.to(dtype))

    for error, reduced in world2.run(body):
        serial = torch.full((3,), 1.2, dtype=F64).to(dtype)
        if dtype.is_floating_point:
            torch.testing.assert_close(reduced, serial)
            assert error is None, error
        else:
            assert not torch.equal(reduced, serial)  # the wrong number the check must stop
            assert error is not None and "cast to torch.int64" in error, error


_RANK_READS = [
    "dist.group.WORLD.rank()",
    "dist.get_rank(dist.group.WORLD)",
    "c10d.get_rank()",
    "mesh.get_rank()",
    "mesh.get_local_rank()",
    "mesh.get_coordinate()[0]",
]


@pytest.mark.parametrize("read", _RANK_READS)
def test_rows_sliced_with_any_public_rank_read_are_per_rank(world2: dc.LocalWorld, read: str) -> None:
    """``ProcessGroup.rank()``, ``distributed_c10d.get_rank`` (imported by name) and
    ``DeviceMesh.get_rank`` / ``get_local_rank`` / ``get_coordinate`` inside the check read
    the rank as ``dc.get_rank()`` does (plain ints again after it): rows sliced with them
    were replicated to the check, so a data-parallel step that never averaged its gradients
    passed (weight gradient: this rank's own, not the serial mean's)."""

    def body() -> tuple[object, ...]:
        import torch.distributed as dist

        bad, good = _dp_rows_by_torch_rank(False, read), _dp_rows_by_torch_rank(True, read)
        return bad, good, type(dist.group.WORLD.rank()), type(dist.get_rank())

    for (missing, g_bad, ref), (fixed, g_good, _), *after in world2.run(body):
        assert not torch.allclose(g_bad, ref)  # the wrong number the check must stop
        assert missing is not None and "missing reduction" in missing, missing
        assert fixed is None, fixed
        torch.testing.assert_close(g_good, ref)
        assert after == [int, int]


def _coalesced_programs() -> dict[str, tuple[str | None, bool]]:
    """Each program with its reduction done by ``dc.all_reduce_coalesced``: (the check's
    error, whether its value / weight gradient equals the float64 serial one)."""
    data = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    w0 = torch.randn(1, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    c = torch.randn(3, dtype=F64, generator=torch.Generator().manual_seed(2))
    w_ref = w0.clone().requires_grad_()
    torch.stack([F.linear(data[2 * r : 2 * r + 2], w_ref).pow(2).mean() for r in range(2)]).mean().backward()
    w_acc = w0.clone().requires_grad_()
    sum(F.linear(data[i : i + 1], w_acc).pow(2).sum() for i in range(4)).backward()
    out: dict[str, tuple[str | None, bool]] = {}

    def run(name: str, body: Any) -> None:
        error, right = None, False
        try:
            with dc.spmd_check():
                right = bool(body(dc.get_rank()))
        except dc.SPMDTypeError as e:
            error = str(e)
        out[name] = (error, right)

    def mean_loss(r: int) -> bool:  # the data-parallel mean loss, gradients averaged
        w = nn.Parameter(w0.clone())
        loss = F.linear(data[2 * r : 2 * r + 2], w).pow(2).mean()
        dc.all_reduce_coalesced([loss, loss.detach()], op="avg")[0].backward()
        w.grad = dc.all_reduce_coalesced([w.grad], op="avg")[0]
        return torch.allclose(w.grad, w_ref.grad)

    def accumulated(r: int) -> bool:  # the first micro-batch's gradient reduced twice
        w = nn.Parameter(w0.clone())
        F.linear(data[r : r + 1], w).pow(2).sum().backward()
        w.grad = dc.all_reduce(w.grad)
        F.linear(data[2 + r : 3 + r], w).pow(2).sum().backward()
        w.grad = dc.all_reduce_coalesced([w.grad])[0]
        return torch.allclose(w.grad, w_acc.grad)

    def replicated_term(r: int) -> bool:  # c's squares counted W times
        total = dc.all_reduce_coalesced([data[r].pow(2).sum() + c.pow(2).sum()])[0]
        return torch.allclose(total, data[:2].pow(2).sum() + c.pow(2).sum())

    def mean_of_equal(r: int) -> bool:  # avg of a replicated value: an identity
        w = nn.Parameter(c.clone())
        dc.all_reduce_coalesced([w * 2], op="avg")[0].pow(2).sum().backward()
        return torch.allclose(w.grad, 8 * c)

    for name, body in [
        ("mean_loss", mean_loss),
        ("accumulated", accumulated),
        ("replicated_term", replicated_term),
        ("mean_of_equal", mean_of_equal),
    ]:
        run(name, body)
    return out


def test_all_reduce_coalesced_reduces_as_all_reduce(world2: dc.LocalWorld) -> None:
    """``all_reduce_coalesced`` is ``all_reduce`` per element to the check: its ``op='avg'``
    of per-rank losses is the data-parallel mean loss and of a replicated value an identity
    (both refused before, correct programs), and a gradient already holding a reduced part
    (W*G1 + G2) or a per-rank value holding a replicated term (its squares counted W times)
    summed by it is refused (both passed before, with the wrong numbers)."""
    for out in world2.run(_coalesced_programs):
        assert out["mean_loss"] == (None, True), out["mean_loss"]
        assert out["mean_of_equal"] == (None, True), out["mean_of_equal"]
        error, _ = out["accumulated"]
        assert error is not None and "already holds a reduced gradient" in error, error
        error, _ = out["replicated_term"]
        assert error is not None and "holds a replicated term" in error, error
