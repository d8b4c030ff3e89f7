"""diffcomm.parallel: the region mappings against their definitions, their debug checks,
vocab-parallel cross entropy and embedding.

Every rank can build every other rank's data (``_data(tag, rank)`` is seeded), so the
definitions are evaluated locally and compared with what the mappings communicate.
Gradients follow the replicated objective: a replicated output gets the same cotangent on
every rank, a sharded / per-rank output its own.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _shared import outcomes
from torch.testing import assert_close

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm.backend import log_comms
from diffcomm.parallel import MAPPINGS
from diffcomm.testing import Shard, assert_matches_serial, build

# The mappings' and layers' values and gradients need no real transport: this module's shared worlds
# are in-process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that
# needs a process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


F64 = torch.float64


def _data(tag: int, rank: int, *shape: int) -> torch.Tensor:
    """Seeded data; ``rank=-1`` for a tensor that is the same on every rank."""
    g = torch.Generator().manual_seed(1000 * tag + rank + 1)
    return torch.randn(tuple(shape), generator=g, dtype=F64)


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, local_worlds: Callable[..., dc.LocalWorld]) -> dc.LocalWorld:
    return local_worlds(request.param)


# ======================================================================================
# each mapping against its definition (forward value and replicated-objective backward)
# ======================================================================================


def _case(name: str) -> tuple:
    """(fn, x, cotangent, expected y, expected grad) on this rank, from the definitions."""
    r, w = dc.get_rank(), dc.get_world_size()
    own = [_data(1, q, 2, 3 * w) for q in range(w)]  # every rank's per-rank input
    rep = _data(1, -1, 2, 3 * w)  # a replicated input
    if name == "copy_to_region":  # identity; grad = sum of every rank's (partial) cotangent
        cots = [_data(2, q, 2, 3 * w) for q in range(w)]
        return P.copy_to_region, rep, cots[r], rep, sum(cots)
    if name == "reduce_from_region":  # sum; replicated cotangent passes through
        cot = _data(2, -1, 2, 3 * w)
        return P.reduce_from_region, own[r], cot, sum(own), cot
    if name == "scatter_to_region":  # own chunk of the last dim; grad = all chunks' cotangents
        cots = [_data(2, q, 2, 3) for q in range(w)]
        return P.scatter_to_region, rep, cots[r], rep.chunk(w, -1)[r], torch.cat(cots, -1)
    if name == "gather_from_region":  # concat along the last dim; grad = own chunk
        cot = _data(2, -1, 2, 3 * w * w)
        return P.gather_from_region, own[r], cot, torch.cat(own, -1), cot.chunk(w, -1)[r]
    if name == "scatter_to_sequence":  # own dim-0 chunk; grad = all chunks' cotangents
        rep0 = _data(1, -1, 2 * w, 3)
        cots = [_data(2, q, 2, 3) for q in range(w)]
        return P.scatter_to_sequence, rep0, cots[r], rep0.chunk(w, 0)[r], torch.cat(cots, 0)
    if name == "gather_from_sequence":  # concat along dim 0; grad = own chunk (replicated)
        x = [_data(1, q, 2, 3) for q in range(w)]
        cot = _data(2, -1, 2 * w, 3)
        return P.gather_from_sequence, x[r], cot, torch.cat(x, 0), cot.chunk(w, 0)[r]
    if name == "reduce_scatter_to_sequence":  # own dim-0 chunk of the sum; grad = all chunks
        x = [_data(1, q, 2 * w, 3) for q in range(w)]
        cots = [_data(2, q, 2, 3) for q in range(w)]
        return P.reduce_scatter_to_sequence, x[r], cots[r], sum(x).chunk(w, 0)[r], torch.cat(cots, 0)
    if name == "all_gather_from_sequence":  # concat along dim 0; grad = own chunk of the sum
        x = [_data(1, q, 2, 3) for q in range(w)]
        cots = [_data(2, q, 2 * w, 3) for q in range(w)]
        return P.all_gather_from_sequence, x[r], cots[r], torch.cat(x, 0), sum(cots).chunk(w, 0)[r]
    if name == "all_to_all_region":  # split dim 0, concat dim 1 (heads <-> sequence)
        x = [_data(1, q, 2 * w, 3) for q in range(w)]
        cots = [_data(2, q, 2, 3 * w) for q in range(w)]
        y = torch.cat([x[j].chunk(w, 0)[r] for j in range(w)], 1)
        g = torch.cat([cots[j].chunk(w, 1)[r] for j in range(w)], 0)
        return lambda t: P.all_to_all_region(t, 0, 1), x[r], cots[r], y, g
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_mapping_matches_its_definition(world, name: str) -> None:
    def check_definition(name: str) -> bool:
        fn, x, cot, y_expected, g_expected = _case(name)
        x = x.clone().requires_grad_()
        y = fn(x)
        (g,) = torch.autograd.grad(y, x, cot)
        assert_close(y, y_expected, rtol=1e-12, atol=1e-12)
        assert_close(g, g_expected, rtol=1e-12, atol=1e-12)
        return True

    assert world.run(check_definition, name) == [True] * world.world_size


@pytest.mark.parametrize("name", list(MAPPINGS))
# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
def test_mapping_jvp_and_vmap(world2, name: str) -> None:
    def check_transforms(name: str) -> dict[str, int]:
        """jvp = the forward map on the tangent; vmap = per-sample results with one collective."""
        fn, x, cot, _, _ = _case(name)
        t = _data(3, dc.get_rank(), *x.shape)
        y, ty = torch.func.jvp(fn, (x,), (t,))
        assert_close(ty, fn(t), rtol=1e-12, atol=1e-12)
        batch = torch.stack([x, t, 2 * x])
        with log_comms() as one:
            fn(x)
        with log_comms() as batched:
            out = torch.func.vmap(fn)(batch)
        assert_close(out, torch.stack([fn(b) for b in batch]), rtol=1e-12, atol=1e-12)
        # vjp under vmap (jacrev-style): every cotangent in the batch at once
        _, vjp = torch.func.vjp(fn, x)
        (gs,) = torch.func.vmap(vjp)(torch.stack([cot, 3 * cot]))
        (g1,) = vjp(cot)
        assert_close(gs[1], 3 * g1, rtol=1e-12, atol=1e-12)
        return {"one": one.count(), "batched": batched.count()}

    def check_transforms_debug(name: str) -> str:
        """Debug mode checks the primal, the value the mapping rests on: a replicated x
        with a tangent of each rank's own passes under jvp, a replicated batch under vmap;
        the tangent called directly (not replicated) is refused by a copy forward."""
        fn, x, _, _, _ = _case(name)
        t = _data(3, dc.get_rank(), *x.shape)
        with dc.debug(True):
            _, ty = torch.func.jvp(fn, (x,), (t,))
            out = torch.func.vmap(fn)(torch.stack([x, 2 * x]))
            with dc.debug(False):
                assert_close(ty, fn(t), rtol=1e-12, atol=1e-12)
                assert_close(out, torch.stack([fn(x), fn(2 * x)]), rtol=1e-12, atol=1e-12)
            return _expect_mismatch(lambda: fn(t))

    # the tangent and the batch differ between the ranks (a stronger check of the rules):
    # debug mode, whose copy forwards refuse such an input, pinned off (the suite also runs
    # under DIFFCOMM_DEBUG=1); what it does under the transforms is checked apart
    with dc.debug(False):
        counts = world2.run(check_transforms, name)
    assert counts[0]["batched"] == counts[0]["one"], counts  # one collective for the whole batch
    refused = world2.run(check_transforms_debug, name)
    if _REPLICATED_SIDE.get(name) == "in":  # a copy forward: its input must be replicated
        assert all("should be the same on every rank" in m for m in refused), refused
    else:
        assert all(m == "no error" for m in refused), refused


# ======================================================================================
# the registry's "mapping" family: each mapping and its dual are adjoint under the
# replicated convention
# ======================================================================================

#: which side of a mapping is replicated (one variable, the same on every rank)
_REPLICATED_SIDE = {
    "copy_to_region": "in",
    "reduce_from_region": "out",
    "scatter_to_region": "in",
    "gather_from_region": "out",
    "scatter_to_sequence": "in",
    "gather_from_sequence": "out",
}


def _inner(a: torch.Tensor, b: torch.Tensor, replicated: bool) -> float:
    """The replicated convention's inner product of two SPMD tensors: per-rank tensors
    count on every rank (sum over ranks); a replicated tensor is one variable and counts
    once (the per-rank sum divided by the world size)."""
    total = dc.all_reduce((a * b).sum().reshape(1))[0].item()
    return total / dc.get_world_size() if replicated else total


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_mapping_and_its_dual_are_adjoint_under_the_replicated_convention(world, name: str) -> None:
    """The dot-product test of each mapping against its registered dual.

    Replicated objective: one loss ``L``, the same on every rank; a replicated tensor (the
    input of ``copy_to_region`` / ``scatter_to_region`` / ``scatter_to_sequence``, the
    output of ``reduce_from_region`` / ``gather_from_region`` / ``gather_from_sequence``)
    is **one** variable, so its inner
    product counts once, while a per-rank tensor (a shard, a partial sum, a sequence
    chunk) counts on every rank. Under that inner product ``<A x, y> == <x, A' y>`` with
    ``A'`` the dual the registry names, called directly. Under the sum-of-objectives inner
    product (the testing kit's for the core ops; a mapping's class states which of its
    sides is replicated, ``replicated``, and the kit's mapping checker uses it) the six
    mappings with a replicated side are off by exactly ``world``; the reduce-scatter /
    all-gather sequence pair and
    ``all_to_all_region`` have none, so both conventions agree for them.
    """

    def check_adjoint(name: str) -> dict[str, float]:
        """``<A x, y>_out == <x, A' y>_in`` with ``A'`` the registered dual called directly."""
        fn, x, y, _, _ = _case(name)  # x and the cotangent y live in A's input / output space
        dual = MAPPINGS[MAPPINGS[name].dual].fn
        aty = dual(y, 1, 0) if name == "all_to_all_region" else dual(y)
        side = _REPLICATED_SIDE.get(name)
        lhs = _inner(fn(x), y, side == "out")
        rhs = _inner(x, aty, side == "in")
        # the sum-of-objectives inner product (the testing kit's): off by `world` on a replicated side
        sum_lhs, sum_rhs = _inner(fn(x), y, False), _inner(x, aty, False)
        return {"lhs": lhs, "rhs": rhs, "sum_lhs": sum_lhs, "sum_rhs": sum_rhs}

    out = world.run(check_adjoint, name)[0]
    w = world.world_size
    assert out["lhs"] == pytest.approx(out["rhs"], rel=1e-12, abs=1e-12), out
    side = _REPLICATED_SIDE.get(name)
    if side is None:
        assert out["sum_lhs"] == pytest.approx(out["sum_rhs"], rel=1e-12, abs=1e-12), out
    else:  # the replicated side is summed `world` times under the sum convention
        over, under = ("sum_rhs", "sum_lhs") if side == "in" else ("sum_lhs", "sum_rhs")
        assert out[over] == pytest.approx(w * out[under], rel=1e-12, abs=1e-12), out


def test_mappings_are_the_registry_mapping_family() -> None:
    """``parallel.MAPPINGS`` is a view of the one registry; duals close in the family;
    the docs' table is generated from it."""
    from diffcomm.ops import registry as R

    assert set(MAPPINGS) == set(R.family("mapping"))
    pairs = {
        "copy_to_region": "reduce_from_region",
        "scatter_to_region": "gather_from_region",
        "scatter_to_sequence": "gather_from_sequence",
        "reduce_scatter_to_sequence": "all_gather_from_sequence",
        "all_to_all_region": "all_to_all_region",
    }
    assert set(MAPPINGS) == set(pairs) | set(pairs.values())  # the nine mappings, no more
    for a, b in pairs.items():
        assert R.dual(a) == b and R.dual(b) == a
    for name, spec in MAPPINGS.items():
        assert spec.fn is getattr(P, name) and spec.family == "mapping"
        # not in the sum-of-objectives kit (see the adjoint test above): its sides are stated
        assert name not in R.with_reference() and spec.op.replicated is not None
        rep_in, rep_out = spec.op.replicated
        side = _REPLICATED_SIDE.get(name)
        assert (rep_in, rep_out) == (side == "in", side == "out"), name
        assert f"| `{name}` | {spec.forward} | `{spec.dual}` | {spec.backward} |" in R.markdown("mapping")


# ======================================================================================
# double backward: a gradient penalty through the mappings equals the serial one
# ======================================================================================


class _Penalty(P.ParallelModule):
    """``||d<module(x), w>/dx||^2`` — differentiating it runs double backward."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _data(9, -1, *x.shape[:-1], 4)
        (gx,) = torch.autograd.grad((self.module(x) * w).sum(), x, create_graph=True)
        return gx.pow(2).sum()


class _SPPenalty(_Penalty):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is this rank's sequence chunk: so are w and the input gradient; the penalty
        # sums the chunks' squares over ranks (a replicated scalar)
        r, n = dc.get_rank(), x.shape[0]
        w = _data(9, -1, n * dc.get_world_size(), *x.shape[1:-1], 4)[r * n : (r + 1) * n]
        (gx,) = torch.autograd.grad((self.module(x) * w).sum(), x, create_graph=True)
        return P.reduce_from_region(gx.pow(2).sum())


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_double_backward_gradient_penalty_matches_serial(world2, sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    serial = _Penalty(P.MLP(4, 8, activation="tanh", dtype=F64))
    x = torch.randn(4, 2, 4, dtype=F64)
    wrap = _SPPenalty if sequence_parallel else _Penalty
    parallel = build(lambda s: wrap(P.ParallelMLP.from_serial(s.module, sequence_parallel=sequence_parallel)))
    specs = [Shard(0)] if sequence_parallel else None
    assert_matches_serial(parallel, serial, x, world=world2, input_specs=specs)


# ======================================================================================
# debug mode: every mapping checks the assumption it rests on
# ======================================================================================


def _expect_mismatch(fn: Callable[[], object]) -> str:
    try:
        with dc.debug(True):
            fn()
    except dc.CrossRankMismatchError as exc:
        return str(exc)
    return "no error"


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_copy_forwards_check_the_input_is_replicated(world3) -> None:
    def debug_forwards() -> dict[str, str]:
        differs = torch.full((2, 6), float(dc.get_rank() == 1))  # rank 1 differs from the others
        same = torch.ones(2, 6)
        out = {
            "copy": _expect_mismatch(lambda: P.copy_to_region(differs)),
            "scatter": _expect_mismatch(lambda: P.scatter_to_region(differs)),
            "scatter_seq": _expect_mismatch(lambda: P.scatter_to_sequence(differs.t())),
        }
        with dc.debug(True):  # replicated inputs pass
            P.copy_to_region(same)
            P.scatter_to_region(same)
            P.scatter_to_sequence(same.t())
        return out

    out = world3.run(debug_forwards)[0]
    assert "parallel.copy_to_region" in out["copy"] and "ranks [1] differ from ranks [0, 2]" in out["copy"]
    assert "parallel.scatter_to_region" in out["scatter"] and "ranks [1]" in out["scatter"]
    assert "parallel.scatter_to_sequence" in out["scatter_seq"] and "ranks [1]" in out["scatter_seq"]


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_identity_backwards_check_the_gradient_is_replicated(world3) -> None:
    def debug_backwards() -> dict[str, str]:
        r, w = dc.get_rank(), dc.get_world_size()
        differs = torch.full((2, 6), float(r == 1))  # rank 1 differs from the others
        same = torch.ones(2, 6)

        def reduce_backward(grad: torch.Tensor) -> None:
            P.reduce_from_region(torch.ones(2, 6, requires_grad=True)).backward(grad)

        def gather_backward(grad: torch.Tensor) -> None:
            P.gather_from_region(torch.ones(2, 2, requires_grad=True)).backward(grad)

        def gather_seq_backward(grad: torch.Tensor) -> None:
            P.gather_from_sequence(torch.ones(2, 2, requires_grad=True)).backward(grad)

        out = {
            "reduce": _expect_mismatch(lambda: reduce_backward(differs)),
            "gather": _expect_mismatch(lambda: gather_backward(torch.full((2, 2 * w), float(r == 1)))),
            "gather_seq": _expect_mismatch(
                lambda: gather_seq_backward(torch.full((2 * w, 2), float(r == 1)))
            ),
        }
        with dc.debug(True):  # replicated gradients pass
            reduce_backward(same)
            gather_backward(torch.ones(2, 2 * w))
            gather_seq_backward(torch.ones(2 * w, 2))
        return out

    out = world3.run(debug_backwards)[0]
    assert "reduce_from_region backward" in out["reduce"] and "ranks [1] differ" in out["reduce"]
    assert "incoming gradient" in out["reduce"] and "use diffcomm.all_reduce" in out["reduce"]
    assert "gather_from_region backward" in out["gather"] and "ranks [1] differ" in out["gather"]
    assert "gather_from_sequence backward" in out["gather_seq"] and "ranks [1] differ" in out["gather_seq"]


def _mapping_dims_differ(name: str) -> str:
    """Rank 1 calls mapping ``name`` on a square ``x`` with other dims than the others: the
    same bytes travel, so without the check the values (and gradients) were silently
    wrong in debug mode too."""
    odd, w = dc.get_rank() == 1, dc.get_world_size()
    x = torch.ones(2 * w, 2 * w)
    calls = {
        "gather_from_region": lambda: P.gather_from_region(x, dim=0 if odd else -1),
        "gather_from_sequence": lambda: P.gather_from_sequence(x, dim=1 if odd else 0),
        "all_gather_from_sequence": lambda: P.all_gather_from_sequence(x, dim=1 if odd else 0),
        "reduce_scatter_to_sequence": lambda: P.reduce_scatter_to_sequence(x, dim=1 if odd else 0),
        "scatter_to_region": lambda: P.scatter_to_region(x, dim=0 if odd else 1),
        "scatter_to_sequence": lambda: P.scatter_to_sequence(x, dim=1 if odd else 0),
        "all_to_all_region": lambda: P.all_to_all_region(x, *((1, 0) if odd else (0, 1))),
        "gather_bf16": lambda: P.gather_from_region(
            x, dim=0 if odd else 1, precision=dc.Precision(wire=torch.bfloat16)
        ),
    }
    return _expect_mismatch(calls[name])


# on processes: a cross-rank diagnosis (debug mode) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_names_ranks_whose_mapping_dims_differ(world3) -> None:
    for name in (
        "gather_from_region",
        "gather_from_sequence",
        "all_gather_from_sequence",
        "reduce_scatter_to_sequence",
        "scatter_to_region",
        "scatter_to_sequence",
        "all_to_all_region",
        "gather_bf16",
    ):
        for msg in world3.run(_mapping_dims_differ, name):
            assert "dim differs (rank 0: " in msg and "rank 1: " in msg, (name, msg)


def test_debug_names_ranks_with_different_shapes(world2) -> None:
    def debug_shape_mismatch() -> str:
        x = torch.ones(2, 1 + dc.get_rank())
        return _expect_mismatch(lambda: P.reduce_from_region(x))

    msg = world2.run(debug_shape_mismatch)[0]
    assert "rank 0: (2, 1)" in msg and "rank 1: (2, 2)" in msg


def _grad_on_rank_0(name: str) -> str:
    """``name``'s debug-mode error for an ``x`` that requires grad on rank 0 only."""
    x = torch.ones(4, 4, dtype=torch.float64, requires_grad=dc.get_rank() == 0)
    call = MAPPINGS[name].fn
    return _expect_mismatch(lambda: call(x, 0, 1) if name == "all_to_all_region" else call(x))


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_debug_names_ranks_whose_input_requires_grad_differs(world2, name: str) -> None:
    """Rank 0's ``x`` requires grad, rank 1's not: rank 0 runs the mapping's backward (a
    communication, or in debug mode an identity backward's check) alone. It ended in a
    desync at the timeout, in debug mode too; now the forward names the flag and the ranks.
    (A ParallelModule's own copies of its parameters leave the flag to its check by name,
    after the forward: test_a_parameter_frozen_on_one_rank_is_named_in_debug_mode.)"""
    for msg in world2.run(_grad_on_rank_0, name):
        assert f"{name}()" in msg, msg
        assert "torch.is_grad_enabled() and x.requires_grad differs (rank 0: 1, rank 1: 0)" in msg, msg


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_tolerates_rounding_noise(world2) -> None:
    def debug_rounding_noise_passes() -> bool:
        x = torch.ones(4, dtype=torch.float32) + dc.get_rank() * 1e-7  # reduction-order noise
        with dc.debug(True):
            P.copy_to_region(x)
        return True

    assert world2.run(debug_rounding_noise_passes) == [True, True]


# A TP MLP with a planted wrong mapping: debug mode turns the silent error into a raise.


class _HandTPMLP(torch.nn.Module):
    """fc1 column-parallel, fc2 row-parallel, with configurable entry/exit mappings."""

    def __init__(
        self, serial: P.MLP, enter: Callable[..., torch.Tensor], leave: Callable[..., torch.Tensor]
    ) -> None:
        super().__init__()
        self.fc1 = P.ColumnParallelLinear.from_serial(serial.fc1)
        self.fc2 = P.RowParallelLinear.from_serial(serial.fc2, input_is_parallel=True)
        self.enter, self.leave = enter, leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(self.enter(x), self.fc1.weight, self.fc1.bias))
        return self.leave(F.linear(h, self.fc2.weight)) + self.fc2.bias


@pytest.mark.parametrize("which", ["reduce_at_entry", "copy_at_exit"])
# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_planted_wrong_mapping_in_tp_mlp_raises_in_debug_mode(world2, which: str) -> None:
    def planted(which: str) -> dict:
        torch.manual_seed(0)
        serial = P.MLP(4, 8, activation="tanh", dtype=F64)
        x = torch.randn(3, 4, dtype=F64, requires_grad=True)
        if which == "reduce_at_entry":  # partial backward treated as replicated
            model = _HandTPMLP(serial, P.reduce_from_region, P.reduce_from_region)
        else:  # "copy_at_exit": partial sums treated as replicated
            model = _HandTPMLP(serial, P.copy_to_region, P.copy_to_region)
        with dc.debug(False):  # (pinned: the suite also runs under DIFFCOMM_DEBUG=1)
            silent = model(x).sum()  # without debug: no error, wrong value
            silent.backward()
        ref = serial(x).sum()
        result = {"silently_wrong": not torch.allclose(silent, ref)}
        x.grad = None
        result["debug"] = _expect_mismatch(lambda: model(x).sum().backward())
        return result

    out = world2.run(planted, which)
    assert all(o["silently_wrong"] for o in out)
    where = "reduce_from_region backward" if which == "reduce_at_entry" else "copy_to_region:"
    assert all(where in o["debug"] and "ranks [1] differ from ranks [0]" in o["debug"] for o in out), out


def test_uneven_split_is_a_value_error_before_communicating(world2) -> None:
    def uneven_split_error() -> str:
        try:
            P.scatter_to_region(torch.ones(2, 5))
        except ValueError as exc:
            return str(exc)
        return "no error"

    msg = world2.run(uneven_split_error)[0]
    assert "parallel.scatter_to_region" in msg and "divisible by the group size 2" in msg and "(2, 5)" in msg


# ======================================================================================
# vocab-parallel cross entropy
# ======================================================================================


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_of_only_ignored_tokens(world, reduction, smoothing) -> None:
    """An all-padding micro-batch: ``"mean"`` is NaN as in torch, and the gradient is 0 as in
    torch (it was NaN on every logit: the mean's inf times the ignored tokens' 0)."""

    def all_ignored(reduction: str, smoothing: float) -> tuple[bool, bool]:
        r, w = dc.get_rank(), dc.get_world_size()
        logits, target = _data(5, -1, 3, 4 * w), torch.full((3,), -100)
        full = logits.clone().requires_grad_()
        shard = logits[:, 4 * r : 4 * (r + 1)].clone().requires_grad_()
        ref = F.cross_entropy(full, target, label_smoothing=smoothing, reduction=reduction)
        loss = P.vocab_parallel_cross_entropy(shard, target, label_smoothing=smoothing, reduction=reduction)
        loss.sum().backward()
        ref.sum().backward()
        same_loss = torch.equal(loss.nan_to_num(), ref.nan_to_num()) and torch.equal(
            loss.isnan(), ref.isnan()
        )

        return same_loss, torch.equal(shard.grad, full.grad[:, 4 * r : 4 * (r + 1)])

    assert all(all(res) for res in world.run(all_ignored, reduction, smoothing))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [False, True], ids=["all", "ignore_index"])
# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(world, reduction, smoothing, ignore) -> None:
    def ce_case(reduction: str, smoothing: float, ignore: bool) -> bool:
        r, w = dc.get_rank(), dc.get_world_size()
        vocab = 12
        logits = _data(5, -1, 4, 3, vocab) * 3
        target = torch.randint(0, vocab, (4, 3), generator=torch.Generator().manual_seed(5))
        if ignore:
            target[0, :2] = -100
            target[3, 1] = -100
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(
            full.reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing, reduction=reduction
        )
        ref = ref.reshape(4, 3) if reduction == "none" else ref
        v = vocab // w
        shard = logits[..., r * v : (r + 1) * v].clone().requires_grad_()
        loss = P.vocab_parallel_cross_entropy(shard, target, label_smoothing=smoothing, reduction=reduction)
        assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        cot = _data(6, -1, *ref.shape)
        (g_ref,) = torch.autograd.grad(ref, full, cot)
        (g,) = torch.autograd.grad(loss, shard, cot)
        assert_close(g, g_ref[..., r * v : (r + 1) * v], rtol=1e-12, atol=1e-12)
        # forward mode agrees with reverse mode
        t = _data(7, r, *shard.shape)
        _, t_loss = torch.func.jvp(
            lambda z: P.vocab_parallel_cross_entropy(
                z, target, label_smoothing=smoothing, reduction=reduction
            ),
            (shard.detach(),),
            (t,),
        )
        t_full = torch.cat([_data(7, q, *shard.shape) for q in range(w)], -1)
        _, t_ref = torch.func.jvp(
            lambda z: F.cross_entropy(
                z.reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing, reduction=reduction
            ),
            (logits,),
            (t_full,),
        )
        assert_close(t_loss, t_ref.reshape(t_loss.shape), rtol=1e-10, atol=1e-12)
        return True

    assert world.run(ce_case, reduction, smoothing, ignore) == [True] * world.world_size


def test_vocab_parallel_cross_entropy_is_stable_and_validates(world2) -> None:
    def ce_stable_and_errors() -> dict:
        r = dc.get_rank()
        big = torch.tensor([[1000.0, -1000.0], [0.0, 0.0]]) + 500.0 * r  # would overflow exp()
        loss = P.vocab_parallel_cross_entropy(big, torch.tensor([0, 3]))
        full = torch.cat([big - 500.0 * r, big - 500.0 * r + 500.0], -1)
        out = {
            "stable": torch.isfinite(loss).item(),
            "value": loss.item(),
            "ref": F.cross_entropy(full, torch.tensor([0, 3])).item(),
        }
        calls = {
            "range": lambda: P.vocab_parallel_cross_entropy(torch.zeros(2, 2), torch.tensor([0, 4])),
            "shape": lambda: P.vocab_parallel_cross_entropy(torch.zeros(2, 2), torch.tensor([0, 1, 2])),
            "reduction": lambda: P.vocab_parallel_cross_entropy(
                torch.zeros(2, 2), torch.tensor([0, 1]), reduction="avg"
            ),
        }
        out.update(outcomes(calls, ValueError))
        out["target_debug"] = _expect_mismatch(
            lambda: P.vocab_parallel_cross_entropy(torch.zeros(2, 2), torch.tensor([0, r]))
        )
        z = torch.zeros(2, 2, requires_grad=True)
        (g,) = torch.autograd.grad(
            P.vocab_parallel_cross_entropy(z, torch.tensor([0, 1])), z, create_graph=True
        )
        try:
            g.sum().backward()
            out["double"] = "no error"
        except RuntimeError as exc:
            out["double"] = str(exc)
        return out

    out = world2.run(ce_stable_and_errors)[0]
    assert out["stable"] and out["value"] == pytest.approx(out["ref"], rel=1e-6)
    assert "class ids in [0, 4)" in out["range"] and "id 4" in out["range"]
    assert "logits.shape[:-1] = (2,)" in out["shape"]
    assert "`reduction` must be one of" in out["reduction"]
    assert "the target" in out["target_debug"] and "ranks [1] differ" in out["target_debug"]
    # the loss is linear in its incoming gradient: the documented error, not torch's generic
    # "does not require grad" (which said nothing of why)
    assert "vocab_parallel_cross_entropy has a first-order backward only" in out["double"], out["double"]


def _ce_under_torch_func(smoothing: float) -> dict:
    """``vocab_parallel_cross_entropy`` under ``torch.func`` (3 examples of 4 tokens, vocabulary
    4 * world, one ignored target) against the same math by autograd, example by example."""
    from torch.func import grad, vmap

    r, w = dc.get_rank(), dc.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 4, 4 * w, generator=g, dtype=torch.float64)
    target = torch.randint(0, 4 * w, (3, 4), generator=g)
    target[1, 2] = -100
    z = full.chunk(w, -1)[r].contiguous()

    def ce(zz: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        return P.vocab_parallel_cross_entropy(zz, tt, label_smoothing=smoothing)

    ref_loss, ref_grad = [], []
    for i in range(3):
        zi = z[i].clone().requires_grad_()
        loss = ce(zi, target[i])
        loss.backward()
        ref_loss.append(loss.detach())
        ref_grad.append(zi.grad)
    out = {
        "grad": (grad(ce)(z[0], target[0]), ref_grad[0]),
        "vmap": (vmap(ce)(z, target), torch.stack(ref_loss)),
        "vmap_grad": (vmap(grad(ce))(z, target), torch.stack(ref_grad)),
        "vmap_shared_target": (vmap(ce, in_dims=(0, None))(z, target[0]), None),
    }
    shared = [ce(z[i], target[0]) for i in range(3)]
    out["vmap_shared_target"] = (out["vmap_shared_target"][0], torch.stack(shared))
    # second order through the first-order backward: an error, never a silent zero
    calls = {
        "grad_of_grad": lambda: grad(lambda y: grad(ce)(y, target[0]).square().sum())(z[0]),
        "autograd_over_grad": lambda: torch.autograd.grad(
            grad(ce)(zz := z[0].clone().requires_grad_(), target[0]).square().sum(), zz
        ),
    }
    out.update(outcomes(calls, RuntimeError))
    bad = target.clone()
    bad[2, 1] = 4 * w  # outside the vocabulary, in one example of the batch
    out.update(outcomes({"range": lambda: vmap(ce)(z, bad)}, ValueError))
    return out


@pytest.mark.parametrize(
    ("smoothing", "debug"), [(0.0, False), (0.1, False), (0.1, True)], ids=["0.0", "0.1", "0.1-debug"]
)
def test_vocab_parallel_cross_entropy_under_torch_func(world3, smoothing: float, debug: bool) -> None:
    """``torch.func.grad``, ``vmap`` and per-example gradients (``vmap(grad)``) equal autograd
    example by example; second order through the first-order backward raises its
    documented error (in ``grad(grad)`` and autograd over ``grad`` too). Before: ``grad``
    failed in torch (``requires_grad_()`` inside a transform, from the first-order marker),
    ``vmap`` failed in the target check (``.item()``) and then for want of a vmap rule; a
    target outside the vocabulary under vmap is still the ValueError. In debug mode too: its
    check of the incoming gradient (in the backward, under ``grad(grad)``) made its
    fingerprint at the transform's level, which escaped through the gather: torch's
    INTERNAL ASSERT ("escaped?") in place of the first-order error."""
    with dc.debug(debug):
        results = world3.run(_ce_under_torch_func, smoothing)
    for out in results:
        for key in ("grad", "vmap", "vmap_grad", "vmap_shared_target"):
            assert_close(*out[key], rtol=1e-12, atol=1e-15, msg=key)
        for key in ("grad_of_grad", "autograd_over_grad"):
            assert "vocab_parallel_cross_entropy has a first-order backward only" in out[key], out[key]
        assert "class ids in [0, 12)" in out["range"] and "id 12" in out["range"], out["range"]


# ======================================================================================
# vocab-parallel embedding
# ======================================================================================


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_vocab_parallel_embedding_matches_nn_embedding(world, sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    serial = torch.nn.Embedding(12, 5, dtype=F64)
    ids = torch.randint(0, 12, (12, 2))
    assert_matches_serial(
        build(lambda s: P.VocabParallelEmbedding.from_serial(s, sequence_parallel=sequence_parallel)),
        serial,
        ids,
        world=world,
        output_specs=[Shard(0)] if sequence_parallel else None,
    )


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_equality_is_per_element_in_bfloat16(world2) -> None:
    def debug_per_element(case: str) -> str:
        """bfloat16: one huge channel beside ordinary values; rank 1 doubles the ordinary ones."""
        x = torch.ones(64, dtype=torch.bfloat16)
        x[0] = 1e4  # the large channel, the same on every rank
        if case == "2x" and dc.get_rank() == 1:
            x[1:] *= 2
        if case == "noise":  # one bfloat16 ulp of difference on every element
            x = x if dc.get_rank() == 0 else torch.nextafter(x, torch.full_like(x, 1e9))
        if case == "2x":
            return _expect_mismatch(lambda: P.copy_to_region(x))
        with dc.debug(True):
            P.copy_to_region(x)
        return "passed"

    msg = world2.run(debug_per_element, "2x")[0]
    assert "ranks [1] differ from ranks [0]" in msg, msg
    assert world2.run(debug_per_element, "noise") == ["passed", "passed"]


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
@pytest.mark.parametrize("held", ["-inf", "nan", "1e20"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_debug_sees_a_2x_beside_an_inf_a_nan_or_a_huge_value(world2, held: str, dtype) -> None:
    """A causal mask's -inf (or a NaN, or a value 1e20 times the others) made every float
    sum of the fingerprint the same whatever the other elements held: rank 1's doubled
    element passed unseen (before: no error; now the ranks are named)."""

    def debug_beside(held: str, dtype: torch.dtype) -> str:
        x = torch.zeros(4, 4, dtype=dtype).masked_fill(torch.ones(4, 4).triu(1).bool(), float(held))
        x[2, 0] = 2.0 if dc.get_rank() == 1 else 1.0
        return _expect_mismatch(lambda: P.copy_to_region(x))

    msg = world2.run(debug_beside, held, dtype)[0]
    assert "ranks [1] differ from ranks [0]" in msg, msg
