"""Capacity drops by token position: ``positions=`` of ``parallel.dispatch`` and
``ExpertParallelMoE.forward`` (docs/moe.md, "Capacity and dropping").

With a capacity factor the drops are first come first served in the serial order. Given
each token's global position, that order is the positions' (a context-parallel sequence
shard holds tokens that are not a consecutive run of the serial ones); without, it is
rank order. Checked in float64 against the serial ``MoE``: with ``positions`` (a random
permutation, spread out by a stride and an offset), the serial MoE on the tokens in
position order; without, the serial MoE on the tokens in rank order (the path as it was).
Hypothesis over worlds 1-4, token counts (0 on a rank too), ``k``, ``E`` and the
capacity factor. Plus: bad positions are named before any communication; a position
given twice is named on every rank; a reused plan keeps its positions; the communication
(one more exchange, only with a capacity).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _shared import assert_refused_before_communicating, refusal_messages
from hypothesis import given, settings
from hypothesis import strategies as st

import diffcomm as dc

# values and gradients, no transport: the shared worlds are in-process (tests/parallel/test_moe.py)
pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    a = torch.zeros(()) if a is None else a
    b = torch.zeros(()) if b is None else b
    return float((a - b).abs().max()) if a.numel() or b.numel() else 0.0


def _by_position(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every config on this rank: the expert-parallel layer with and without positions
    against the serial MoE on the tokens in position order and in rank order."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    r = dc.get_rank()
    results = []
    for cfg in cfgs:
        e, k, h, tokens = cfg["experts"], cfg["k"], cfg["hidden"], cfg["tokens"]
        n, lo = sum(tokens), sum(tokens[:r])
        serial = MoE(
            h, 5, e, k, capacity_factor=cfg["capacity"], activation="tanh", dtype=F64, seed=cfg["seed"]
        )
        ep = ExpertParallelMoE.from_serial(serial)
        gen = torch.Generator().manual_seed(cfg["seed"] + 1)
        xs = torch.randn(n, h, dtype=F64, generator=gen)  # the serial tokens, in position order
        cot = torch.randn(n, h, dtype=F64, generator=gen)
        rank_order = torch.tensor(cfg["perm"], dtype=torch.int64)  # token i of rank order: serial index
        mine = rank_order[lo : lo + tokens[r]]
        positions = mine * cfg["stride"] + cfg["offset"]  # any distinct ints in the same order

        x_all = xs.clone().requires_grad_(True)
        y_all = serial(x_all)
        ((y_all * cot).sum() + 0.7 * serial.aux_loss).backward()
        x_mine = xs[mine].clone().requires_grad_(True)
        y_mine = ep(x_mine, positions=positions)
        ((y_mine * cot[mine]).sum() + 0.7 * ep.aux_loss).backward()
        ep.sync_replicated_grads()
        first = r * (e // dc.get_world_size())
        experts = [
            _err(p.grad, q.grad)
            for j, mod in enumerate(ep.experts)
            for p, q in zip(mod.parameters(), serial.experts[first + j].parameters())
        ]
        router = _err(ep.router.weight.grad, serial.router.weight.grad)
        dropped = (ep.dropped, serial.dropped)

        # without positions: the serial MoE on the tokens in rank order (unchanged path)
        x_ro = xs[rank_order].clone().requires_grad_(True)
        y_ro = serial(x_ro)
        (y_ro * cot[rank_order]).sum().backward()
        x_mine2 = xs[mine].clone().requires_grad_(True)
        y_mine2 = ep(x_mine2)
        (y_mine2 * cot[mine]).sum().backward()
        results.append(
            {
                "cfg": cfg,
                "out": _err(y_mine.detach(), y_all.detach()[mine]),
                "x_grad": _err(x_mine.grad, x_all.grad[mine] if x_all.grad is not None else None),
                "experts": max(experts, default=0.0),
                "router": router,
                "dropped": dropped,
                "out_rank_order": _err(y_mine2.detach(), y_ro.detach()[lo : lo + tokens[r]]),
                "x_grad_rank_order": _err(
                    x_mine2.grad, x_ro.grad[lo : lo + tokens[r]] if x_ro.grad is not None else None
                ),
            }
        )
    return results


@st.composite
def position_cases(draw: st.DrawFn, w: int) -> dict[str, Any]:
    e = w * draw(st.sampled_from([1, 2]))
    tokens = draw(st.lists(st.integers(0, 6), min_size=w, max_size=w))
    n = sum(tokens)
    return {
        "experts": e,
        "k": draw(st.sampled_from(sorted({kk for kk in (1, 2, e) if kk <= e}))),
        "hidden": draw(st.integers(2, 4)),
        "tokens": tokens,
        "seed": draw(st.integers(0, 10_000)),
        "capacity": draw(st.sampled_from([0.25, 0.5, 1.0, 1.5])),
        "perm": draw(st.permutations(list(range(n)))),
        "stride": draw(st.integers(1, 3)),
        "offset": draw(st.integers(0, 5)),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_hypothesis_drops_follow_the_positions(local_worlds, world_size: int) -> None:
    world = local_worlds(world_size)

    @settings(max_examples=6, deadline=None)
    @given(st.lists(position_cases(world_size), min_size=3, max_size=3))
    def check(cases: list[dict[str, Any]]) -> None:
        for rank, rows in enumerate(world.run(_by_position, cases)):
            for row in rows:
                keys = ("out", "x_grad", "experts", "router", "out_rank_order", "x_grad_rank_order")
                bad = {key: row[key] for key in keys if row[key] > 1e-10}
                assert not bad and row["dropped"][0] == row["dropped"][1], (rank, row)

    check()


def test_the_positions_make_the_difference(world2) -> None:
    """A case where rank order and position order drop differently (rank 0 holds the
    later half of the serial tokens): with positions the serial rows, without the rank-order
    ones, and these differ."""

    def body() -> dict[str, float]:
        from diffcomm.parallel import ExpertParallelMoE, MoE

        r = dc.get_rank()
        serial = MoE(3, 4, 2, k=1, capacity_factor=0.5, dtype=F64, seed=3)
        ep = ExpertParallelMoE.from_serial(serial)
        xs = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(4))
        mine = torch.arange(4) + 4 * (1 - r)  # rank 0: serial tokens 4..7, rank 1: 0..3
        y_ref = serial(xs)[mine]
        return {
            "with": _err(ep(xs[mine], positions=mine), y_ref),
            "without": _err(ep(xs[mine]), y_ref),
        }

    got = world2.run(body)
    assert all(g["with"] <= 1e-12 for g in got), got
    assert max(g["without"] for g in got) > 1e-3, got


# --------------------------------------------------------------------------------------
# bad positions, duplicates, plans, communication
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug_mode"])
def test_bad_positions_raise_before_any_communication(world2, debug: bool) -> None:
    def bad() -> list[str]:
        from diffcomm.parallel import ExpertParallelMoE, dispatch

        x = torch.randn(3, 4)
        idx = torch.zeros(3, 1, dtype=torch.int64)
        pos = torch.arange(3) + 3 * dc.get_rank()
        moe = ExpertParallelMoE(4, 8, num_experts=2, k=1, capacity_factor=1.0, seed=0)
        calls = [
            lambda: dispatch(x, idx, 2, capacity_factor=1.0, positions=pos.float()),
            lambda: dispatch(x, idx, 2, capacity_factor=1.0, positions=pos.bool()),
            lambda: dispatch(x, idx, 2, capacity_factor=1.0, positions=pos[:2]),
            lambda: dispatch(x, idx, 2, capacity_factor=1.0, positions=pos.reshape(3, 1)),
            lambda: dispatch(x, idx, 2, capacity_factor=1.0, positions=[0, 1, 2]),
            lambda: dispatch(x, idx, 2, capacity_factor=1.0, positions=pos.to("meta")),
            lambda: moe(x, positions=pos.double()),
            lambda: moe(x.reshape(1, 3, 4), positions=pos.reshape(3, 1)),
        ]
        return refusal_messages(calls)

    patterns = [
        r"TypeError: .*dispatch.*`positions` must be an integer tensor",
        r"TypeError: .*`positions` must be an integer tensor",
        r"ValueError: .*`positions` must be a \(3,\) tensor",
        r"ValueError: .*`positions` must be a \(3,\) tensor",
        r"TypeError: .*`positions` must be None or a tensor",
        r"ValueError: .*`positions` must be a tensor on x's device cpu",
        r"TypeError: .*ExpertParallelMoE.*`positions` must be an integer tensor",
        r"ValueError: .*ExpertParallelMoE.*`positions` must be a \(3,\) tensor",
    ]
    with dc.debug(debug):
        per_rank = world2.run(bad)
    assert_refused_before_communicating(per_rank, patterns)


def test_a_position_given_twice_is_named_on_every_rank(world2) -> None:
    def dup(overlap: bool) -> str:
        from diffcomm.parallel import dispatch

        r = dc.get_rank()
        x = torch.randn(3, 4)
        idx = torch.zeros(3, 1, dtype=torch.int64)
        # overlap: ranks share position 2; else rank 0 alone repeats one
        pos = (
            torch.arange(3) + 2 * r
            if overlap
            else (torch.tensor([0, 0, 1]) if r == 0 else torch.arange(3) + 3)
        )
        try:
            dispatch(x, idx, 2, capacity_factor=1.0, positions=pos)
        except ValueError as exc:
            return str(exc)
        return "no error"

    for overlap in (True, False):
        msgs = world2.run(dup, overlap)
        assert all("`positions` must be distinct global token positions" in m for m in msgs), msgs
        assert "1 position(s) given more than once" in msgs[0], msgs


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_a_reused_plan_keeps_its_positions(world2) -> None:
    def reuse() -> dict[str, Any]:
        from diffcomm import backend as B
        from diffcomm.parallel import dispatch

        r = dc.get_rank()
        gen = torch.Generator().manual_seed(r)
        x = torch.randn(5, 3, dtype=F64, generator=gen)
        idx = torch.randint(0, 4, (5, 1), generator=gen)
        pos = torch.arange(5) * 2 + r  # interleaved ranks
        h1, plan = dispatch(x, idx, 4, capacity_factor=0.5, positions=pos)
        with B.log_comms() as log:
            h2, same = dispatch(x, idx, 4, capacity_factor=0.5, positions=pos.clone(), plan=plan)
        refused = []
        for other in (None, pos.flip(0)):
            try:
                dispatch(x, idx, 4, capacity_factor=0.5, positions=other, plan=plan)
                refused.append("no error")
            except ValueError as exc:
                refused.append(str(exc))
        return {
            "equal": torch.equal(h1, h2) and same is plan,
            "ops": [rec.label for rec in log.records],
            "refused": refused,
            "recorded": plan.positions is not None and torch.equal(plan.positions, pos),
        }

    for res in world2.run(reuse):
        assert res["equal"] and res["recorded"] and res["ops"] == ["parallel.dispatch -> all_to_all"], res
        assert "`plan` must be the plan of these same `positions`" in res["refused"][0], res
        assert "a plan made with positions (none given now)" in res["refused"][0], res
        assert "a plan made with other positions" in res["refused"][1], res


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_positions_cost_one_more_exchange_only_with_a_capacity(world2) -> None:
    def count(capacity: float | None) -> dict[str, Any]:
        from diffcomm import backend as B
        from diffcomm.parallel import ExpertParallelMoE

        r = dc.get_rank()
        moe = ExpertParallelMoE(4, 8, num_experts=4, k=2, capacity_factor=capacity, dtype=F64, seed=0)
        x = torch.randn(3 + r, 4, dtype=F64, requires_grad=True)
        pos = torch.arange(3 + r) * 2 + r
        with B.log_comms() as fwd:
            y = moe(x, positions=pos)
        with B.log_comms() as bwd:
            (y * y).sum().backward()
        return {"fwd": [(rec.op, rec.label) for rec in fwd.records], "bwd": [rec.op for rec in bwd.records]}

    a2a = [
        ("all_to_all", "parallel.dispatch -> all_to_all"),
        ("all_to_all", "parallel.combine -> all_to_all"),
    ]
    counts = ("all_gather", "parallel.dispatch (counts exchange)")
    for rec in world2.run(count, 1.0):
        assert rec["fwd"] == [counts, ("all_gather", "parallel.dispatch (positions exchange)"), *a2a], rec
        assert rec["bwd"] == ["all_to_all", "all_to_all"], rec
    for rec in world2.run(count, None):  # dropless: the order does not matter, nothing more
        assert rec["fwd"] == [counts, *a2a], rec


# on processes: a cross-rank diagnosis (debug mode) needs per-rank state (tests/parallel/test_moe.py)
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_names_positions_given_on_some_ranks_only(world2) -> None:
    def mismatch() -> str:
        from diffcomm.parallel import dispatch

        r = dc.get_rank()
        x = torch.randn(3, 4)
        idx = torch.zeros(3, 1, dtype=torch.int64)
        with dc.debug(True):
            try:  # rank 0 would exchange positions, rank 1 not: a hang without the check
                dispatch(x, idx, 2, capacity_factor=1.0, positions=torch.arange(3) if r == 0 else None)
            except dc.CrossRankMismatchError as exc:
                return str(exc)
        return "no error"

    for msg in world2.run(mismatch):
        assert "parallel.dispatch()" in msg and "positions differs (rank 0: given, rank 1: None)" in msg, msg
