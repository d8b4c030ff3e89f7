"""diffcomm.testing: the kit passes correct code and catches planted bugs.

Planted bugs: an all_gather whose backward keeps only its own chunk (wrong adjoint), a
copy_to_region whose backward is the identity (the classic missing all_reduce of
tensor parallelism), and backwards wrong only for a non-contiguous gradient or by a
factor of 2 (the latter hidden by an x or y of zeros).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _shared import outcomes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm.testing import Shard, assert_matches_serial, build, check_adjoint, gradcheck
from diffcomm.testing import strategies as dst

# The testing kit's checks need no real transport: this module's shared worlds are in-process (the
# same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a process per
# rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


F64 = torch.float64


def _rand(tag: int, *shape: int, rank: int | None = None) -> torch.Tensor:
    r = dc.get_rank() if rank is None else rank
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * tag + r), dtype=F64)


# ---- planted bugs ----------------------------------------------------------------------


class _Planted(torch.autograd.Function):
    """A planted-bug Function: forward and backward of its own, nothing saved for backward."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass


class _AllGatherOwnChunkBackward(_Planted):
    """all_gather along dim 0 whose backward forgets to sum over ranks (wrong adjoint)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x, 0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.n = inputs[0].shape[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        r = dc.get_rank()
        return g[r * ctx.n : (r + 1) * ctx.n]


class _AllGatherStridedBackward(_Planted):
    """all_gather along dim 0 whose backward is 2x too large only when the incoming
    gradient is not contiguous (right for every contiguous cotangent)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        out = dc.reduce_scatter(g.contiguous(), 0)
        return out if g.is_contiguous() else 2 * out


class _AllReduceDoubledBackward(_Planted):
    """all_reduce whose backward is 2x too large (wrong for every cotangent)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2 * dc.all_reduce(g)


class _DoubledIfStrided(_Planted):
    """The identity, whose backward doubles a non-contiguous gradient: after an op's output,
    that op's backward is wrong only for a strided gradient."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g if g.is_contiguous() else 2 * g


class _AllGatherDoubledIfStridedInput(_Planted):
    """all_gather along dim 0 whose backward is 2x too large only when the forward's input
    was not contiguous (right for every contiguous x, the only kind a test passes)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x, 0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.contiguous = inputs[0].is_contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        out = dc.reduce_scatter(g.contiguous(), 0)
        return out if ctx.contiguous else 2 * out


class _AllGatherWrongJvp(_Planted):
    """all_gather along dim 0, right forward and backward, whose forward-mode rule doubles."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return dc.reduce_scatter(g.contiguous(), 0)

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return 2 * dc.all_gather(t, 0)


class _AllGatherWrongDoubleBackward(_Planted):
    """all_gather along dim 0 whose backward has the right value but twice the right
    derivative in its incoming gradient (a double backward, e.g. a gradient penalty, is 2x)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2 * dc.reduce_scatter(g.contiguous(), 0) - dc.reduce_scatter(g.detach().contiguous(), 0)


class _AllGatherZeroingItsGradient(_Planted):
    """all_gather along dim 0 with the right backward, which then zeroes the gradient it
    was given (another backward handed the same tensor gets zeros)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return dc.all_gather(x, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        out = dc.reduce_scatter(g.clone(), 0)
        g.zero_()
        return out


class _AllGatherChangingItsInput(_Planted):
    """all_gather along dim 0 with the right value and backward, which adds 1 to its input
    in place (in forward: ``"forward"``; to the saved input in backward: ``"backward"``)."""

    @staticmethod
    def forward(x: torch.Tensor, when: str) -> torch.Tensor:
        out = dc.all_gather(x.clone(), 0)
        if when == "forward":
            x.add_(1.0)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.when = inputs[1]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.when == "backward":
            ctx.saved_tensors[0].add_(1.0)
        return dc.reduce_scatter(g.contiguous(), 0), None


class _CopyIdentityBackward(_Planted):
    """copy_to_region whose backward is the identity (should be an all_reduce)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class _HandTPMLP(P.ParallelModule):
    """A TP MLP built from the region mappings, with the entry mapping swappable."""

    def __init__(self, serial: P.MLP, enter: Any = P.copy_to_region) -> None:
        super().__init__()
        self.fc1 = P.ColumnParallelLinear.from_serial(serial.fc1)
        self.fc2 = P.RowParallelLinear.from_serial(serial.fc2, input_is_parallel=True)
        self.enter = enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.nn.functional.linear(self.enter(x), self.fc1.weight, self.fc1.bias))
        return P.reduce_from_region(torch.nn.functional.linear(h, self.fc2.weight)) + self.fc2.bias


class _IdentityChangingItsInput(_Planted):
    """The identity, which adds 1 to its input in place after copying it."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        x.add_(1.0)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.clone()


class _IdentityZeroingItsGradient(_Planted):
    """The identity, whose backward returns a copy of its gradient and zeroes the original."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        out = g.clone()
        g.zero_()
        return out


class _HandTPMLPThen(_HandTPMLP):
    """``_HandTPMLP`` with ``then`` applied to its output."""

    def __init__(self, serial: P.MLP, then: Any) -> None:
        super().__init__(serial)
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(super().forward(x))


class _ScaleWithRunningMean(torch.nn.Module):
    """``x * w`` over the last dim, keeping a running mean of ``x`` (a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(_rand(3, 4, rank=-1))
        self.register_buffer("running_mean", torch.zeros(4, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * x.reshape(-1, 4).mean(0))
        return x * self.w


class _SequenceParallelScale(P.ParallelModule):
    """``_ScaleWithRunningMean`` on a sequence shard; ``averaged=False`` plants the bug of
    a running mean of this rank's shard only (outputs and gradients still right)."""

    def __init__(self, serial: _ScaleWithRunningMean, averaged: bool = True) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(serial.w.detach().clone())
        self.register_buffer("running_mean", serial.running_mean.clone())
        self.averaged = averaged

    def partial_gradients(self) -> list[str]:
        return ["w"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            mean = x.reshape(-1, 4).mean(0)
            self.running_mean.mul_(0.9).add_(0.1 * (dc.all_reduce(mean, "avg") if self.averaged else mean))
        return x * self.w


def _serial_mlp() -> P.MLP:
    torch.manual_seed(0)
    return P.MLP(4, 8, activation="tanh", dtype=F64)


# ======================================================================================
# check_adjoint
# ======================================================================================

_PAIRS = {
    "all_reduce": (lambda x: dc.all_reduce(x), lambda y: dc.all_reduce(y), (2, 3), (2, 3)),
    "all_gather": (lambda x: dc.all_gather(x, 1), lambda y: dc.reduce_scatter(y, 1), (2, 3), "gathered"),
    "broadcast": (lambda x: dc.broadcast(x, 1), lambda y: dc.reduce(y, 1), (2, 3), (2, 3)),
    "gather": (lambda x: dc.gather(x, 0), lambda y: dc.scatter(y, 0), (2, 3), "gathered0"),
    "all_to_all": (lambda x: dc.all_to_all(x, 0, 1), lambda y: dc.all_to_all(y, 1, 0), "split0", "a2a"),
}


@pytest.mark.parametrize("name", list(_PAIRS))
def test_check_adjoint_passes_the_core_collectives(world3, name: str) -> None:
    def adjoint_case(name: str) -> tuple[float, float]:
        w = dc.get_world_size()
        op, dual, xs, ys = _PAIRS[name]
        xs = (2 * w, 3) if xs == "split0" else xs
        ys = {"gathered": (2, 3 * w), "gathered0": (2 * w, 3), "a2a": (2, 3 * w)}.get(ys, ys)
        x, y = _rand(1, *xs), _rand(2, *ys)
        return check_adjoint(op, x, y), check_adjoint(op, x, y, dual_op=dual)

    for by_autograd, by_dual in world3.run(adjoint_case, name):
        assert by_autograd < 1e-12 and by_dual < 1e-12


def test_check_adjoint_catches_a_wrong_adjoint(world2) -> None:
    def wrong_adjoint() -> dict[str, str]:
        x, y = _rand(1, 2, 3), _rand(2, 2 * dc.get_world_size(), 3)
        calls = {
            "autograd": lambda: check_adjoint(_AllGatherOwnChunkBackward.apply, x=x, y=y),
            "dual_op": lambda: check_adjoint(
                lambda t: dc.all_gather(t, 0), dual_op=lambda g: g[:2], x=x, y=y
            ),
        }
        return outcomes(calls, AssertionError)

    out = world2.run(wrong_adjoint)
    assert out[0] == out[1]  # every rank reaches the same verdict
    for key in ("autograd", "dual_op"):
        assert "sum_r <A x_r, y_r> = " in out[0][key] and "sum_r <x_r, A^T y_r> = " in out[0][key]
        assert "relative error" in out[0][key]


def test_check_adjoint_catches_a_backward_wrong_only_for_a_strided_gradient(world2) -> None:
    # with a contiguous y (what a test passes) the planted backward is right: check_adjoint
    # also applies A^T to the same y laid out non-contiguously
    def strided_bug() -> dict[str, str]:
        x, y = _rand(1, 2, 3), _rand(2, 2 * dc.get_world_size(), 3)
        calls = {
            "autograd": lambda: check_adjoint(_AllGatherStridedBackward.apply, x=x, y=y),
            "dual_op": lambda: check_adjoint(
                lambda t: dc.all_gather(t, 0),
                dual_op=lambda g: dc.reduce_scatter(g.contiguous(), 0) * (1 if g.is_contiguous() else 2),
                x=x,
                y=y,
            ),
        }
        return outcomes(calls, AssertionError)

    out = world2.run(strided_bug)
    assert out[0] == out[1]
    for key in ("autograd", "dual_op"):
        assert "with x and y non-contiguous" in out[0][key]


def test_run_case_catches_a_backward_wrong_only_for_a_strided_gradient(world2, monkeypatch) -> None:
    # `python -m diffcomm check`'s checker also differentiates with a non-contiguous input
    # and cotangent; the planted op stands in for all_gather through the module's `call`
    # (this module's worlds are in-process: the patch reaches every rank)
    from diffcomm.testing import cases as C

    monkeypatch.setattr(C, "call", lambda case, x: _AllGatherStridedBackward.apply(x))

    def run() -> tuple[float, bool]:
        res = C.run_case(C.Case("all_gather", 2, (2, 3)), double=False)
        return res.grad_err, res.ok

    for grad_err, ok in world2.run(run):
        assert grad_err > 0.5 and not ok


def test_run_case_catches_a_backward_that_zeroes_its_incoming_gradient(world2, monkeypatch) -> None:
    # the value of the planted backward is right (grad_err 0): the case passed
    from diffcomm.testing import cases as C

    monkeypatch.setattr(C, "call", lambda case, x: _AllGatherZeroingItsGradient.apply(x))

    def run() -> tuple[float, bool, bool]:
        res = C.run_case(C.Case("all_gather", 2, (2, 3)), double=False)
        return res.grad_err, res.grad_unchanged, res.ok

    for grad_err, unchanged, ok in world2.run(run):
        assert grad_err < 1e-12 and not unchanged and not ok


def test_check_adjoint_refuses_an_x_or_y_zero_on_every_rank(world2) -> None:
    # x (or y) zero on every rank makes both sides 0 whatever the backward: the planted
    # 2x backward passed. Refused on every rank alike (decided from the sums over ranks);
    # zero on one rank only is still a real test
    def zeros() -> dict[str, str]:
        x, y = _rand(1, 2, 3), _rand(2, 2, 3)
        zero_here = torch.zeros_like(x) if dc.get_rank() == 0 else x
        wrong = _AllReduceDoubledBackward.apply
        calls = {
            "x zero": lambda: check_adjoint(wrong, torch.zeros_like(x), y),
            "y zero": lambda: check_adjoint(wrong, x, torch.zeros_like(y)),
            "both zero": lambda: check_adjoint(dc.all_reduce, torch.zeros_like(x), torch.zeros_like(y)),
            "x zero, dual_op": lambda: check_adjoint(dc.all_reduce, torch.zeros_like(x), y, dual_op=wrong),
        }
        refused = outcomes(calls, ValueError)
        caught = outcomes({"wrong": lambda: check_adjoint(wrong, zero_here, y)}, AssertionError)
        return {**refused, **caught, "correct": check_adjoint(dc.all_reduce, zero_here, y)}

    out = world2.run(zeros)
    assert out[0] == out[1]  # every rank raises, with the same message
    vacuous = "diffcomm.testing.check_adjoint(): the dot-product test is vacuous: "
    assert out[0]["x zero"] == out[0]["x zero, dual_op"]
    assert out[0]["x zero"].startswith(vacuous + "`x` is zero on every rank"), out[0]
    assert out[0]["y zero"].startswith(vacuous + "`y` is zero on every rank"), out[0]
    assert out[0]["both zero"].startswith(vacuous + "`x` and `y` are zero on every rank"), out[0]
    assert out[0]["correct"] < 1e-12
    assert "relative error" in out[0]["wrong"], out[0]


def test_mapping_and_coalesced_runners_catch_a_backward_wrong_only_for_a_strided_gradient(
    world2, monkeypatch
) -> None:
    # `python -m diffcomm check`'s mapping and coalesced runners also differentiate with
    # the cotangents' values laid out non-contiguously. The bug is planted in the public
    # functions the runners look up (registry.public_fn), reduce_from_region's and
    # all_reduce_coalesced's; the runs before the patch are the control
    import sys

    from diffcomm.ops import registry
    from diffcomm.testing.cases import Case
    from diffcomm.testing.coalesced import CoalescedCase, run_coalesced_case
    from diffcomm.testing.mappings import run_mapping_case

    mapping = Case("reduce_from_region", 2, (2, 3))
    f64 = ((2, 3), "float64", True, True)
    coalesced = CoalescedCase("all_reduce_coalesced", 2, (f64, ((4,), "float64", True, True), f64))

    def run() -> list[tuple[float, bool]]:
        results = [
            run_mapping_case(mapping),
            run_coalesced_case(coalesced),
            run_coalesced_case(coalesced, False),
        ]
        return [(r.grad_err, r.ok) for r in results]

    for per_rank in world2.run(run):
        assert all(ok and err < 1e-12 for err, ok in per_rank), per_rank
    reduce_from_region = registry.public_fn(registry.REGISTRY["reduce_from_region"])
    all_reduce_coalesced = registry.public_fn(registry.REGISTRY["all_reduce_coalesced"])

    def reduce_from_region_bug(x: torch.Tensor, **kw: Any) -> torch.Tensor:
        return _DoubledIfStrided.apply(reduce_from_region(x, **kw))

    def all_reduce_coalesced_bug(xs: list[torch.Tensor], **kw: Any) -> list[torch.Tensor]:
        return [_DoubledIfStrided.apply(o) for o in all_reduce_coalesced(xs, **kw)]

    for name, bug in (
        ("reduce_from_region", reduce_from_region_bug),
        ("all_reduce_coalesced", all_reduce_coalesced_bug),
    ):
        monkeypatch.setattr(sys.modules[registry.REGISTRY[name].__module__], name, bug)
    for per_rank in world2.run(run):
        assert all(not ok and err > 0.5 for err, ok in per_rank), per_rank


def test_check_adjoint_catches_an_op_wrong_only_for_a_strided_input(world2) -> None:
    # a test's x is contiguous: check_adjoint also runs op on the same values strided
    def strided_input_bug() -> dict[str, str]:
        x, y = _rand(1, 2, 3), _rand(2, 2 * dc.get_world_size(), 3)
        calls = {
            "autograd": lambda: check_adjoint(_AllGatherDoubledIfStridedInput.apply, x=x, y=y),
            "dual_op": lambda: check_adjoint(
                lambda t: dc.all_gather(t, 0) * (1 if t.is_contiguous() else 2),
                dual_op=lambda g: dc.reduce_scatter(g.contiguous(), 0),
                x=x,
                y=y,
            ),
        }
        return outcomes(calls, AssertionError)

    out = world2.run(strided_input_bug)
    assert out[0] == out[1]
    assert "with x and y non-contiguous" in out[0]["autograd"], out[0]
    assert "op(x) itself differs for a strided x" in out[0]["dual_op"], out[0]


def test_check_adjoint_catches_an_op_or_backward_that_changes_its_input_in_place(world2) -> None:
    """An op whose value and backward are right but which changes its x in place passed
    (the kit ran it on a copy); a backward that zeroes its incoming gradient failed with
    "the dot-product test is vacuous: `y` is zero", which blamed the test's y."""

    def in_place() -> dict[str, str]:
        x, y = _rand(1, 2, 3), _rand(2, 2 * dc.get_world_size(), 3)
        gather = lambda t: dc.all_gather(t, 0)

        def dual_zeroing(g: torch.Tensor) -> torch.Tensor:
            out = dc.reduce_scatter(g.clone(), 0)
            g.zero_()
            return out

        calls = {
            "x in forward": lambda: check_adjoint(
                lambda t: _AllGatherChangingItsInput.apply(t, "forward"), x, y
            ),
            "y in backward": lambda: check_adjoint(_AllGatherZeroingItsGradient.apply, x, y),
            "y in dual_op": lambda: check_adjoint(gather, x, y, dual_op=dual_zeroing),
        }
        return outcomes(calls, AssertionError)

    out = world2.run(in_place)
    assert out[0] == out[1]
    assert "op modified its input x in place" in out[0]["x in forward"], out[0]
    assert "the backward of op modified y, its incoming gradient, in place" in out[0]["y in backward"]
    assert "dual_op modified its input y, its incoming gradient, in place" in out[0]["y in dual_op"]


def _wrong_jvp_or_double_backward() -> dict[str, str]:
    x, y = _rand(1, 2, 3), _rand(2, 2 * dc.get_world_size(), 3)
    calls = {
        "jvp": lambda: check_adjoint(_AllGatherWrongJvp.apply, x, y),
        "double backward": lambda: check_adjoint(_AllGatherWrongDoubleBackward.apply, x, y),
        "right": lambda: check_adjoint(lambda t: dc.all_gather(t, 0), x, y),
    }
    return outcomes(calls, AssertionError)


@pytest.mark.diffcomm_in_process(False)  # forward-mode AD needs a process per rank
def test_check_adjoint_catches_a_wrong_jvp_or_double_backward(world2) -> None:
    """A Function with the right forward and backward but a forward-mode rule (jvp, vmap of
    jvp, jacfwd) or a double backward off by 2x passed check_adjoint (relative error 1.7e-16),
    and gradcheck: in use jvp was off by 0.89 and the double backward by 2.18."""
    out = world2.run(_wrong_jvp_or_double_backward)
    assert out[0] == out[1]
    assert "the forward-mode (jvp) rule of op is wrong" in out[0]["jvp"], out[0]
    assert "the double backward of op is wrong" in out[0]["double backward"], out[0]
    assert out[0]["right"] == "no error", out[0]


def test_check_adjoint_catches_a_wrong_double_backward_in_process(world2) -> None:
    # an in-process world refuses forward mode (its levels are one stack per process): the
    # jvp rule is not tried there, the double backward is
    out = world2.run(_wrong_jvp_or_double_backward)
    assert out[0] == out[1]
    assert "the double backward of op is wrong" in out[0]["double backward"], out[0]
    assert out[0]["jvp"] == "no error", out[0]
    assert out[0]["right"] == "no error", out[0]


def test_check_adjoint_refuses_an_op_that_returns_no_single_tensor(world2) -> None:
    def tuple_op() -> dict[str, str]:
        """An op returning a tuple failed with "'tuple' object has no attribute 'shape'"."""
        x, y = _rand(1, 3), _rand(2, 3)
        calls = {
            "op": lambda: check_adjoint(lambda t: (dc.all_reduce(t),), x=x, y=y),
            "dual_op": lambda: check_adjoint(dc.all_reduce, x=x, y=y, dual_op=lambda g: [dc.all_reduce(g)]),
        }
        return outcomes(calls, TypeError)

    for out in world2.run(tuple_op):
        assert "`op` must be a function returning one tensor" in out["op"], out
        assert "got a function returning tuple" in out["op"], out
        assert "`dual_op` must be a function returning one tensor" in out["dual_op"], out


# ======================================================================================
# gradcheck
# ======================================================================================


def test_gradcheck_passes_correct_code(world2) -> None:
    def gradcheck_passes() -> list[bool]:
        x = _rand(1, 2, 3).requires_grad_()
        sum_objective = [
            gradcheck(lambda t: dc.all_gather(t, 1).pow(2), x),
            gradcheck(lambda t: dc.all_reduce(t.sin() + 2, "product"), (x,)),
            gradcheck(lambda t: dc.reduce_scatter(t.exp(), 1, split_sizes=[1, 2]), (x,)),
        ]
        # replicated objective: a functional TP MLP; x replicated, w1 / w2 this rank's shards
        xr = _rand(1, 2, 4, rank=-1).requires_grad_()
        w1, w2 = _rand(2, 3, 4).requires_grad_(), _rand(3, 4, 3).requires_grad_()

        def tp_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            return P.reduce_from_region(torch.tanh(P.copy_to_region(x) @ w1.T) @ w2.T)

        replicated = gradcheck(tp_mlp, (xr, w1, w2), objective="replicated", replicated=[0])
        # a replicated input under the sum objective: compared with sum_r grad_r
        summed = gradcheck(lambda t: dc.all_reduce(t * (dc.get_rank() + 1.0)).sin(), (xr,), replicated=[0])
        return [*sum_objective, replicated, summed]

    assert world2.run(gradcheck_passes) == [[True] * 5] * 2


def test_gradcheck_refuses_to_check_nothing(world2) -> None:
    """No input requiring grad, or only empty ones on every rank: nothing would be probed
    and ``True`` came back for any backward (a wrong one too). Refused on every rank alike,
    as ``torch.autograd.gradcheck`` refuses; one rank's non-empty input is a real check."""

    doubled = _AllReduceDoubledBackward.apply  # a backward wrong by a factor 2

    def nothing() -> dict[str, str]:
        x = _rand(1, 2, 3)
        out = {}
        cases = {
            "no requires_grad": (x,),
            "empty": (torch.zeros(0, 3, dtype=torch.float64, requires_grad=True),),
        }
        for name, args in cases.items():
            try:
                gradcheck(doubled, args)
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
        # empty on rank 0 only: rank 1's elements are probed, and the bug is found
        mine = torch.zeros(0 if dc.get_rank() == 0 else 2, dtype=torch.float64, requires_grad=True)
        try:
            gradcheck(lambda t: doubled(dc.all_gather(t, 0, split_sizes=[0, 2])), (mine,))
            out["one rank empty"] = "no error"
        except AssertionError:
            out["one rank empty"] = "caught"
        return out

    for out in world2.run(nothing):
        assert "at least one tensor with requires_grad=True" in out["no requires_grad"], out
        assert "with an element on some rank" in out["empty"], out
        assert out["one rank empty"] == "caught", out


# on processes: warnings.catch_warnings is one per process, which in-process ranks would share
@pytest.mark.diffcomm_in_process(False)
def test_gradcheck_warns_of_a_replicated_input_left_out_of_replicated(world2) -> None:
    def unlisted() -> list[str]:
        """x, the same on every rank, left out of ``replicated=``: checked as each rank's own
        variable, a correct TP program failed and one missing copy_to_region passed, with
        no word. Now a warning names the input; per-rank inputs (the shards) get none."""
        import warnings

        xr = _rand(1, 2, 4, rank=-1).requires_grad_()
        w1 = _rand(2, 3, 4).requires_grad_()

        def missing_copy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return P.reduce_from_region(torch.tanh(x @ w.T))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gradcheck(missing_copy, (xr, w1), objective="replicated")
        return [str(w.message) for w in caught if "gradcheck" in str(w.message)]

    for messages in world2.run(unlisted):
        assert len(messages) == 1, messages
        assert "inputs[0] is the same on every rank but not in `replicated`" in messages[0]
        assert "replicated=[0, ...]" in messages[0]


def test_gradcheck_catches_planted_bugs(world2) -> None:
    def gradcheck_failures() -> dict[str, str]:
        xr = _rand(1, 2, 4, rank=-1).requires_grad_()
        w1 = _rand(2, 3, 4).requires_grad_()
        cases = {
            # planted: copy_to_region with an identity backward
            "bad_copy": lambda: gradcheck(
                lambda x, w: P.reduce_from_region(torch.tanh(_CopyIdentityBackward.apply(x) @ w.T)),
                (xr, w1),
                objective="replicated",
                replicated=[0],
            ),
            # planted: wrong adjoint under the sum objective
            "bad_adjoint": lambda: gradcheck(lambda t: _AllGatherOwnChunkBackward.apply(t).sin(), (w1,)),
            # objective="replicated" with an output that is not replicated
            "not_replicated": lambda: gradcheck(lambda t: t.sum(), (w1,), objective="replicated"),
        }
        out = outcomes(cases, AssertionError)
        try:
            gradcheck(lambda t: t, (torch.ones(2, requires_grad=True),))
        except ValueError as exc:
            out["float32"] = str(exc)
        return out

    out = world2.run(gradcheck_failures)
    for key in ("bad_copy", "bad_adjoint", "not_replicated"):
        assert out[0][key] == out[1][key]  # the same verdict on every rank
    msg = out[0]["bad_copy"]
    assert "analytic and numerical gradients differ on rank(s) [0, 1]" in msg
    assert "rank 0:" in msg and "inputs[0][" in msg and "analytic" in msg and "numerical" in msg
    assert "differ on rank(s)" in out[0]["bad_adjoint"] and "inputs[0]" in out[0]["bad_adjoint"]
    assert "output 0 of fn should be the same on every rank" in out[0]["not_replicated"]
    assert "float64" in out[0]["float32"]


def test_gradcheck_catches_a_strided_input_bug_and_in_place_changes(world2) -> None:
    """Missed before: a backward wrong only for a non-contiguous input (gradcheck's inputs
    were contiguous copies), a backward that zeroes the gradient it was given (autograd may
    hand that tensor to another backward) and one that changes its saved input."""

    def planted() -> dict[str, str]:
        x = _rand(1, 2, 3).requires_grad_()
        calls = {
            "strided": lambda: gradcheck(lambda t: _AllGatherDoubledIfStridedInput.apply(t).sin(), (x,)),
            "gradient": lambda: gradcheck(lambda t: _AllGatherZeroingItsGradient.apply(t).sin(), (x,)),
            "input": lambda: gradcheck(lambda t: _AllGatherChangingItsInput.apply(t, "backward").sin(), (x,)),
        }
        return outcomes(calls, AssertionError)

    out = world2.run(planted)
    assert out[0] == out[1]
    assert "analytic (inputs and gradients non-contiguous" in out[0]["strided"], out[0]
    assert "a backward modified its incoming gradient in place on rank(s) [0, 1]" in out[0]["gradient"]
    assert "fn modified an input in place on rank(s) [0, 1]" in out[0]["input"]


# ======================================================================================
# assert_matches_serial
# ======================================================================================


def test_assert_matches_serial_inside_the_ranks(world2) -> None:
    def in_rank_pass() -> bool:
        serial = _serial_mlp()
        assert_matches_serial(
            P.ParallelMLP.from_serial(serial), serial, lambda: torch.randn(6, 2, 4, dtype=F64)
        )
        return True

    assert world2.run(in_rank_pass) == [True, True]


def test_assert_matches_serial_passes_a_hand_built_tp_mlp(world2) -> None:
    x = torch.randn(6, 2, 4, dtype=F64)
    assert_matches_serial(build(_HandTPMLP), _serial_mlp(), x, world=world2)


def test_assert_matches_serial_catches_a_wrong_backward(world2) -> None:
    x = torch.randn(6, 2, 4, dtype=F64)
    with pytest.raises(AssertionError, match=r"gradient of inputs\[0\]") as info:
        assert_matches_serial(
            build(lambda s: _HandTPMLP(s, enter=_CopyIdentityBackward.apply)), _serial_mlp(), x, world=world2
        )
    assert "on rank(s) [0, 1] of 2" in str(info.value)
    assert "rank 0: gradient of inputs[0]" in str(info.value) and "rank 1: gradient of inputs[0]" in str(
        info.value
    )


class _CopyOnFirstCallOnly:
    """A column-parallel linear (its weight a constant) whose input enters through
    copy_to_region on its first call only (a "done once" flag): from the second call on,
    each rank's input gradient is its own share, not their sum."""

    def __init__(self, serial: torch.nn.Linear) -> None:
        self.w = serial.weight.detach().clone().chunk(dc.get_world_size(), 0)[dc.get_rank()]
        self.first = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x, self.first = P.copy_to_region(x), False
        return P.gather_from_region(x @ self.w.T)


def test_assert_matches_serial_catches_a_program_wrong_from_its_second_call(world2) -> None:
    """assert_matches_serial called the parallel program once: this one passed, while its
    second call's input gradient was off by 0.53 (rank 0) and 0.70 (rank 1)."""
    torch.manual_seed(0)
    serial = torch.nn.Linear(4, 6, bias=False, dtype=F64)
    x = torch.randn(3, 4, dtype=F64)
    with pytest.raises(AssertionError, match=r"rank 0 \(second call\): gradient of inputs\[0\]") as info:
        assert_matches_serial(build(_CopyOnFirstCallOnly), serial, x, world=world2)
    assert "on rank(s) [0, 1] of 2" in str(info.value)


def test_assert_matches_serial_catches_a_wrong_shard_mapping(world2) -> None:
    x = torch.randn(6, 2, 4, dtype=F64)
    wrong = {"fc1.weight": ("fc1.weight", (slice(0, 4), slice(None)))}  # rank 1 holds rows 4:8
    with pytest.raises(AssertionError) as info:
        assert_matches_serial(
            build(P.ParallelMLP.from_serial), _serial_mlp(), x, world=world2, param_map=wrong
        )
    text = str(info.value)
    assert "rank(s) [1]" in text and "value of parameter 'fc1.weight' (serial 'fc1.weight'[0:4, :])" in text
    assert "rank 0" not in text


class _NormThenMLP(torch.nn.Module):
    """A LayerNorm (with or without its bias) before the serial MLP."""

    def __init__(self, bias: bool, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(4, bias=bias, dtype=F64)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln(x))


def _parallel_without_the_norms_bias(serial: _NormThenMLP) -> P.ParallelModule:
    class Model(P.ParallelModule):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(4, bias=False, dtype=F64)
            self.mlp = P.ParallelMLP.from_serial(serial.mlp)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.ln(x))

    return Model()


def test_assert_matches_serial_catches_a_serial_parameter_nothing_stands_for(world2) -> None:
    """The parallel model lacks the serial LayerNorm's bias, which starts at zero, so every
    value matched: the kit compared only the parallel model's parameters and passed, while
    the serial bias's gradient was never compared (the parallel model would not train it)."""
    x = torch.randn(6, 2, 4, dtype=F64)
    serial = _NormThenMLP(True, _serial_mlp())
    with pytest.raises(AssertionError, match=r"serial parameter 'ln.bias' has no parallel counterpart"):
        assert_matches_serial(build(_parallel_without_the_norms_bias), serial, x, world=world2)
    # the same parallel model against a serial one without the bias passes
    assert_matches_serial(
        build(_parallel_without_the_norms_bias), _NormThenMLP(False, _serial_mlp()), x, world=world2
    )


def test_assert_matches_serial_compares_a_frozen_parameter_by_value(world2) -> None:
    """A frozen parameter (``requires_grad=False``) failed with torch's "One of the
    differentiated Tensors does not require grad"; now its value is compared (a frozen
    parallel parameter whose serial twin trains is a gradient mismatch, named)."""
    x = torch.randn(6, 2, 4, dtype=F64)
    serial = _serial_mlp()
    serial.fc1.bias.requires_grad_(False)

    def frozen(s: P.MLP) -> P.ParallelMLP:
        m = P.ParallelMLP.from_serial(s)
        m.fc1.bias.requires_grad_(False)
        return m

    assert_matches_serial(build(frozen), serial, x, world=world2)
    with pytest.raises(AssertionError, match=r"gradient of parameter 'fc1.bias'"):
        assert_matches_serial(build(frozen), _serial_mlp(), x, world=world2)


def test_assert_matches_serial_catches_a_missing_sharded_output_spec(world2) -> None:
    x = torch.randn(6, 2, 4, dtype=F64)
    with pytest.raises(AssertionError, match=r"output 0 has shape \(3, 2, 4\), expected \(6, 2, 4\)"):
        assert_matches_serial(
            build(lambda s: P.ParallelMLP.from_serial(s, sequence_parallel=True)),
            _serial_mlp(),
            x,
            world=world2,
            input_specs=[Shard(0)],
        )


def test_assert_matches_serial_catches_planted_bugs_it_missed(world2) -> None:
    """Each passed before: a backward wrong only for a non-contiguous gradient (the kit's
    cotangents were contiguous), a forward that changes its input in place, a backward that
    zeroes the gradient it was given (values right), and a running statistic (a buffer)
    that drifts from the serial one (the kit compared parameters only)."""
    x = torch.randn(6, 2, 4, dtype=F64)
    planted = {
        r"gradient of inputs\[0\] \(with the cotangents non-contiguous": _DoubledIfStrided.apply,
        r"parallel_fn modified inputs\[0\] in place": None,
        r"a backward of parallel_fn modified a gradient it received": _IdentityZeroingItsGradient.apply,
    }
    for message, then in planted.items():
        if then is None:
            parallel = build(
                lambda s: _HandTPMLP(s, enter=lambda t: P.copy_to_region(_IdentityChangingItsInput.apply(t)))
            )
        else:
            parallel = build(lambda s, then=then: _HandTPMLPThen(s, then))
        with pytest.raises(AssertionError, match=message):
            assert_matches_serial(parallel, _serial_mlp(), x, world=world2)
    sp = {"input_specs": [Shard(0)], "output_specs": [Shard(0)]}
    assert_matches_serial(build(_SequenceParallelScale), _ScaleWithRunningMean(), x, world=world2, **sp)
    drift = build(lambda s: _SequenceParallelScale(s, averaged=False))
    with pytest.raises(
        AssertionError, match=r"rank 0: value of buffer 'running_mean' \(serial 'running_mean'\) after"
    ):
        assert_matches_serial(drift, _ScaleWithRunningMean(), x, world=world2, **sp)


def test_assert_matches_serial_rejects_inputs_that_differ_between_ranks(world2) -> None:
    def inputs_differ() -> str:
        serial = _serial_mlp()
        try:
            assert_matches_serial(serial, serial, torch.full((2, 4), float(dc.get_rank()), dtype=F64))
        except ValueError as exc:
            return str(exc)
        return "no error"

    msg = world2.run(inputs_differ)[0]
    assert "inputs[0] should be the same on every rank" in msg and "ranks [1] differ" in msg


# ======================================================================================
# strategies
# ======================================================================================


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_strategies_shapes_and_split_sizes(data: st.DataObject) -> None:
    world = data.draw(dst.world_sizes(1, 4))
    dim = data.draw(st.integers(-2, 1))
    shape = data.draw(dst.shapes_that_split(world, dim))
    assert shape[dim] % world == 0 and shape[dim] > 0
    total = data.draw(st.integers(0, 9))
    sizes = data.draw(dst.uneven_split_sizes(total, world))
    assert len(sizes) == world and sum(sizes) == total and min(sizes) >= 0
    positive = data.draw(dst.uneven_split_sizes(total + world, world, allow_zero=False))
    assert min(positive) >= 1 and sum(positive) == total + world


@settings(max_examples=20, deadline=None)
@given(
    op=dst.reduce_ops(include_nonlinear=False),
    any_op=dst.reduce_ops(),
    dtype=dst.dtypes(include_int=True, include_complex=True),
    fdtype=dst.float_dtypes(include_half=True),
    name=dst.collective_names(),
)
def test_strategies_ops_and_dtypes(
    op: str, any_op: str, dtype: torch.dtype, fdtype: torch.dtype, name: str
) -> None:
    assert op in ("sum", "avg") and any_op in ("sum", "avg", "max", "min", "product")
    assert dtype in (
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.complex64,
        torch.complex128,
    )
    assert fdtype.is_floating_point and name in dc.OPS


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=dst.uneven_split_sizes(5, 2))
def test_property_uneven_all_gather_is_adjoint_to_its_backward(world2, sizes: list[int]) -> None:
    def uneven_all_gather_adjoint(sizes: list[int]) -> float:
        r = dc.get_rank()
        x, y = _rand(1, sizes[r], 2), _rand(2, sum(sizes), 2, rank=-1)
        return check_adjoint(lambda t: dc.all_gather(t, 0), x, y)

    assert max(world2.run(uneven_all_gather_adjoint, sizes)) < 1e-12
