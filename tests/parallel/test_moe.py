"""Expert parallelism (``diffcomm.parallel.moe``) on real gloo ranks.

The objective: each rank holds its own tokens and its loss is taken over them, so the
**sum of the per-rank losses** is the serial MoE's loss over all tokens (rank 0's tokens
first). Under that convention ``ExpertParallelMoE`` must equal the serial ``MoE`` with the
same weights, in float64: every rank's output rows, the summed loss, the input
gradients, each expert's gradient (on the rank that holds it), and the router's and
shared expert's gradients once summed over ranks (``sync_replicated_grads``). Covered:
worlds 2, 3, 4; k = 1, 2, 8; experts that receive no tokens; ranks with no tokens (that
send zero rows); dropped tokens under a capacity factor; an expert tied to the shared
expert; hypothesis over token counts, experts and k. Plus: one counts exchange per step and
none in backward, one all_to_all each way; the dispatch/combine pair is adjoint
(dot-product test); bad input raises before any communication.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from _shared import assert_refused_before_communicating, refusal_messages
from hypothesis import given, settings
from hypothesis import strategies as st

import diffcomm as dc

# The expert-parallel values and gradients need no real transport: this module's shared worlds are in-
# process (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a
# process per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


F64 = torch.float64


# shared: the rank body of both equality tests (fixed cases and hypothesis), via _assert_equal
def _moe_vs_serial(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run every config on this rank: the parallel layer against the serial one."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    r, w = dc.get_rank(), dc.get_world_size()
    results = []
    for cfg in cfgs:
        e, k, h = cfg["experts"], cfg["k"], cfg["hidden"]
        tokens = cfg["tokens"]  # per rank
        n = sum(tokens)
        layer_kw = {
            "capacity_factor": cfg.get("capacity"),
            "renormalize": cfg.get("renormalize", False),
            "shared_expert_size": cfg.get("shared"),
            "activation": "tanh",
            "dtype": F64,
            "seed": cfg["seed"],
        }
        serial = MoE(h, 6, e, k, **layer_kw)
        gen = torch.Generator().manual_seed(cfg["seed"] + 1)
        xs = torch.randn(n, h, dtype=F64, generator=gen)
        cot = torch.randn(n, h, dtype=F64, generator=gen)
        if cfg.get("tied_logits"):  # every token's probabilities equal: top-k breaks the ties
            with torch.no_grad():
                serial.router.weight.zero_()
        dead = cfg.get("dead", [])
        if dead:  # experts no token picks: a large constant feature, very negative weights
            xs[:, 0] = 3.0
            with torch.no_grad():
                serial.router.weight[dead, 0] = -40.0
        if cfg.get("built", False):
            ep = ExpertParallelMoE(h, 6, e, k, **layer_kw)
            if dead:
                with torch.no_grad():
                    ep.router.weight[dead, 0] = -40.0
        else:
            ep = ExpertParallelMoE.from_serial(serial)
        coef = 0.7
        # serial: all tokens on one process
        x_all = xs.clone().requires_grad_(True)
        y_all = serial(x_all)
        loss = (y_all * cot).sum() + coef * serial.aux_loss
        loss.backward()
        # parallel: this rank's tokens
        lo = sum(tokens[:r])
        x_mine = xs[lo : lo + tokens[r]].clone().requires_grad_(True)
        y_mine = ep(x_mine)
        loss_r = (y_mine * cot[lo : lo + tokens[r]]).sum() + coef * ep.aux_loss
        loss_r.backward()
        ep.sync_replicated_grads()
        loss_sum = dc.all_reduce(loss_r.detach())

        def err(a: Any, b: Any) -> float:
            a = torch.zeros(()) if a is None else a
            b = torch.zeros(()) if b is None else b
            if a.numel() == 0 and b.numel() == 0:
                return 0.0
            return float((a - b).abs().max())

        first = r * (e // w)
        expert_errs = []
        for j, mod in enumerate(ep.experts):
            ref = serial.experts[first + j]
            for p, q in zip(mod.parameters(), ref.parameters()):
                g_ref = q.grad if q.grad is not None else torch.zeros_like(q)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                expert_errs.append(err(g, g_ref))
        repl = [err(p.grad, q.grad) for p, q in zip(ep.router.parameters(), serial.router.parameters())]
        if serial.shared_expert is not None:
            repl += [
                err(p.grad, q.grad)
                for p, q in zip(ep.shared_expert.parameters(), serial.shared_expert.parameters())
            ]
        results.append(
            {
                "cfg": cfg,
                "out": err(y_mine.detach(), y_all.detach()[lo : lo + tokens[r]]),
                "loss": abs(loss_sum.item() - loss.item()),
                "aux": abs(float(dc.all_reduce(ep.aux_loss.detach())) - serial.aux_loss.item()),
                "x_grad": err(x_mine.grad, x_all.grad[lo : lo + tokens[r]]),
                "experts": max(expert_errs, default=0.0),
                "replicated": max(repl, default=0.0),
                "histogram": ep.tokens_per_expert.tolist() == serial.tokens_per_expert.tolist(),
                "dropped": ep.dropped,
                "dead_got_none": all(ep.tokens_per_expert[d] == 0 for d in dead),
                "received": list(ep.plan.expert_splits),
            }
        )
    return results


def _assert_equal(world: dc.LocalWorld, cfgs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    per_rank = world.run(_moe_vs_serial, cfgs)
    for rank, res in enumerate(per_rank):
        for row in res:
            bad = {
                key: row[key]
                for key in ("out", "loss", "aux", "x_grad", "experts", "replicated")
                if row[key] > 1e-10
            }
            assert not bad and row["histogram"] and row["dead_got_none"], (rank, row["cfg"], bad, row)
    return per_rank


def _fixed_cases(w: int) -> list[dict[str, Any]]:
    """k = 1, 2, 8; an expert no token picks; a rank without tokens; dropping; shared
    expert; renormalised gates; parameters built from a seed or copied from the serial;
    equal router logits (top-k ties) with dropping."""
    zero = [3 + i for i in range(w)]
    zero[w // 2] = 0  # this rank sends nothing (and gets nothing back)
    return [
        {"experts": 2 * w, "k": 1, "hidden": 4, "tokens": [5] * w, "seed": 1},
        {"experts": 2 * w, "k": 2, "hidden": 4, "tokens": zero, "seed": 2, "shared": 5, "dead": [1]},
        {"experts": 8, "k": 8, "hidden": 3, "tokens": [4 + i for i in range(w)], "seed": 3, "shared": 4},
        {"experts": 2 * w, "k": 2, "hidden": 4, "tokens": [7] * w, "seed": 4, "capacity": 0.5, "built": True},
        {"experts": w, "k": 1, "hidden": 5, "tokens": zero, "seed": 5, "capacity": 1.0, "renormalize": True},
        {"experts": 8, "k": 8, "hidden": 3, "tokens": [3] * w, "seed": 6, "capacity": 0.75, "shared": 3},
        # equal logits (ties in the top-k, broken alike on every rank and in the serial MoE):
        # every token picks experts 0 and 1, on rank 0, which sends nothing away
        {
            "experts": 2 * w,
            "k": 2,
            "hidden": 4,
            "tokens": [4] * w,
            "seed": 7,
            "capacity": 0.5,
            "tied_logits": True,
        },
    ]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_expert_parallel_moe_equals_serial(local_worlds, world_size) -> None:
    cases = [c for c in _fixed_cases(world_size) if c["experts"] % world_size == 0]
    per_rank = _assert_equal(local_worlds(world_size), cases)
    by_cfg = list(zip(*per_rank))
    for cfg, rows in zip(cases, by_cfg):
        if cfg.get("capacity") in (0.5, 0.75):
            assert rows[0]["dropped"] > 0, (cfg, rows[0])  # the capacity really dropped some
        if cfg.get("dead"):  # expert 1 (rank 0's second) got no rows, and still a zero gradient
            assert rows[0]["received"][1] == 0, rows[0]
        if 0 in cfg["tokens"]:  # the rank without tokens still received rows for its experts
            assert sum(rows[cfg["tokens"].index(0)]["received"]) > 0, rows


@st.composite
def moe_cases(draw: st.DrawFn, w: int) -> dict[str, Any]:
    per_rank = draw(st.sampled_from([1, 2]))
    e = w * per_rank
    k = draw(st.sampled_from([kk for kk in (1, 2, 8) if kk <= e]))
    return {
        "experts": e,
        "k": k,
        "hidden": draw(st.integers(2, 4)),
        "tokens": draw(st.lists(st.integers(0, 6), min_size=w, max_size=w)),
        "seed": draw(st.integers(0, 10_000)),
        "capacity": draw(st.sampled_from([None, None, 0.5, 1.0, 1.5])),
        "shared": draw(st.sampled_from([None, 3])),
        "renormalize": draw(st.booleans()),
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_hypothesis_tokens_experts_k(local_worlds, world_size) -> None:
    world = local_worlds(world_size)

    @settings(max_examples=8, deadline=None)
    @given(st.lists(moe_cases(world_size), min_size=3, max_size=3))
    def check(cases: list[dict[str, Any]]) -> None:
        _assert_equal(world, cases)

    check()


# --------------------------------------------------------------------------------------
# communication: one counts exchange per step, one all_to_all each way, none extra
# --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_one_counts_exchange_and_one_all_to_all_each_way(world2) -> None:
    def count_moe() -> dict[str, Any]:
        from diffcomm import backend as B
        from diffcomm.parallel import ExpertParallelMoE

        r = dc.get_rank()
        moe = ExpertParallelMoE(4, 8, num_experts=4, k=2, shared_expert_size=6, dtype=F64, seed=0)
        x = torch.randn(3 + r, 4, dtype=F64, requires_grad=True)
        with B.log_comms() as fwd:
            y = moe(x)
        with B.log_comms() as bwd:
            ((y * y).sum() + moe.aux_loss).backward()
        return {
            "fwd": [(rec.op, rec.label) for rec in fwd.records],
            "bwd": [(rec.op, rec.label) for rec in bwd.records],
        }

    for rec in world2.run(count_moe):
        assert rec["fwd"] == [
            ("all_gather", "parallel.dispatch (counts exchange)"),
            ("all_to_all", "parallel.dispatch -> all_to_all"),
            ("all_to_all", "parallel.combine -> all_to_all"),
        ], rec
        # backward: the combine's adjoint and the dispatch's adjoint, the counts reused
        assert [op for op, _ in rec["bwd"]] == ["all_to_all", "all_to_all"], rec
        assert all("exchange" not in label for _, label in rec["bwd"]), rec


@pytest.mark.parametrize("world_size", [3, 4])
def test_dispatch_combine_adjoint(local_worlds, world_size) -> None:
    def adjoint() -> dict[str, float]:
        """dispatch is linear in x, combine in the expert outputs (gates fixed): the
        dot-product test <dispatch(x), h> == <x, dispatch^T(h)> summed over ranks, with the
        transpose taken by autograd, and combine's transpose likewise; and the transpose of
        dispatch is combine with unit gates."""
        from diffcomm.parallel import combine, dispatch, route

        r = dc.get_rank()
        gen = torch.Generator().manual_seed(10 + r)
        t = [4, 0, 3, 5][r % 4]
        x = torch.randn(t, 3, dtype=F64, generator=gen, requires_grad=True)
        gate, idx, _ = route(
            torch.randn(t, 6 if dc.get_world_size() != 4 else 8, dtype=F64, generator=gen), 2
        )
        e = 6 if dc.get_world_size() != 4 else 8
        h, plan = dispatch(x, idx, e)
        y = torch.randn(h.shape, dtype=F64, generator=gen)
        (gx,) = torch.autograd.grad(h, x, y)
        lhs = float(dc.all_reduce((h.detach() * y).sum()))
        rhs = float(dc.all_reduce((x.detach() * gx).sum()))
        ones = torch.ones_like(gate)
        via_combine = combine(y, ones, plan)
        hv = h.detach().clone().requires_grad_(True)
        out = combine(hv, gate.detach(), plan)
        c = torch.randn(out.shape, dtype=F64, generator=gen)
        (gh,) = torch.autograd.grad(out, hv, c)
        lhs2 = float(dc.all_reduce((out.detach() * c).sum()))
        rhs2 = float(dc.all_reduce((hv.detach() * gh).sum()))
        return {
            "dispatch": abs(lhs - rhs) / max(1.0, abs(lhs)),
            "combine": abs(lhs2 - rhs2) / max(1.0, abs(lhs2)),
            "transpose_is_combine": float((via_combine - gx).abs().max()) if gx.numel() else 0.0,
        }

    for res in local_worlds(world_size).run(adjoint):
        assert max(res.values()) < 1e-12, res


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug_mode"])
def test_bad_input_raises_before_any_communication(world2, debug: bool) -> None:
    """Debug mode too: its cross-rank check runs after the local checks (it ran first, so
    an id out of range was named after 2 communications)."""

    def bad() -> list[str]:
        from diffcomm.parallel import ExpertParallelMoE, combine, dispatch

        x = torch.randn(3, 4)
        idx = torch.zeros(3, 2, dtype=torch.int64)
        calls = [
            lambda: dispatch(x, idx, 3),  # not divisible by 2 ranks
            lambda: dispatch(x, idx.float(), 4),
            lambda: dispatch(x, idx[:2], 4),
            lambda: dispatch(x, idx + 7, 4),
            lambda: dispatch(x, idx - 1, 4),
            lambda: dispatch(x, idx, 4, capacity_factor=0.0),
            lambda: combine(x, x, "plan"),
            lambda: ExpertParallelMoE(4, 8, num_experts=3),
            lambda: ExpertParallelMoE(4, 8, num_experts=4, k=5),
        ]
        return refusal_messages(calls)

    patterns = [
        r"`num_experts` must be divisible by the group size 2",
        r"TypeError: .*`expert_index` must be an int64 tensor",
        r"`expert_index` must be a \(3, k\) tensor",
        r"`expert_index` must be expert ids in \[0, 4\)",
        r"`expert_index` must be expert ids in \[0, 4\)",
        r"`capacity_factor` must be None or a positive float",
        r"TypeError: .*`plan` must be the DispatchPlan",
        r"`num_experts` must be divisible by the group size 2",
        r"`k` must be at most num_experts=4",
    ]
    import re

    with dc.debug(debug):
        per_rank = world2.run(bad)
    for msgs in per_rank:
        for pat, msg in zip(patterns, msgs):
            assert re.search(pat, msg) and msg.endswith("[0 comms]"), (pat, msg)


# --------------------------------------------------------------------------------------
# composing: data parallelism over another axis, tensor parallelism inside the experts
# --------------------------------------------------------------------------------------


def _g(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, zeros where none flowed (shared by two rank bodies below)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def test_composes_with_data_and_tensor_parallelism(world4) -> None:
    def composed() -> dict[str, float]:
        """World 4 as a 2 x 2 mesh. (a) EP over {0,1} / {2,3}, DP over {0,2} / {1,3}: each EP
        group is the serial MoE over its own tokens, and the DP-averaged gradients are the
        average of the two serial MoEs' gradients. (b) EP over {0,1} / {2,3} with each expert
        a ParallelMLP over the TP group {0,2} / {1,3}: the TP ranks hold the same tokens, the
        expert shards' gradients are the shards of the serial experts' gradients."""
        import torch.distributed as dist

        from diffcomm.parallel import ExpertParallelMoE, MoE, ParallelMLP

        r = dc.get_rank()
        g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
        g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
        ep, other = (g01 if r < 2 else g23), (g02 if r % 2 == 0 else g13)
        ep_rank, replica = r % 2, r // 2
        e, k, h, seed = 4, 2, 4, 11
        tokens = [5, 3]
        out: dict[str, float] = {}

        def serial_grads(xs: torch.Tensor, cot: torch.Tensor) -> tuple[MoE, torch.Tensor]:
            m = MoE(h, 6, e, k, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed)
            y = m(xs)
            ((y * cot).sum() + 0.5 * m.aux_loss).backward()
            return m, y.detach()

        # (a) data parallel over `other`: the two replicas see different tokens
        gen = torch.Generator().manual_seed(replica)
        xs = torch.randn(sum(tokens), h, dtype=F64, generator=gen)
        cot = torch.randn(sum(tokens), h, dtype=F64, generator=gen)
        lo = sum(tokens[:ep_rank])
        mine = slice(lo, lo + tokens[ep_rank])
        moe = ExpertParallelMoE(h, 6, e, k, ep, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed)
        y = moe(xs[mine])
        ((y * cot[mine]).sum() + 0.5 * moe.aux_loss).backward()
        moe.sync_replicated_grads()
        for p in moe.parameters():  # data parallel: average over the other axis
            p.grad = dc.all_reduce(p.grad, "avg", other)
        refs = []
        for rep in (0, 1):
            g = torch.Generator().manual_seed(rep)
            refs.append(
                serial_grads(
                    torch.randn(sum(tokens), h, dtype=F64, generator=g),
                    torch.randn(sum(tokens), h, dtype=F64, generator=g),
                )
            )
        out["dp_out"] = float((y.detach() - refs[replica][1][mine]).abs().max())
        first = ep_rank * (e // 2)
        errs = []
        for j, mod in enumerate(moe.experts):
            for p, q0, q1 in zip(
                mod.parameters(),
                refs[0][0].experts[first + j].parameters(),
                refs[1][0].experts[first + j].parameters(),
            ):
                avg = (_g(q0) + _g(q1)) / 2
                errs.append(float((_g(p) - avg).abs().max()))
        for p, q0, q1 in zip(
            moe.replicated_parameters(), refs[0][0].router.parameters(), refs[1][0].router.parameters()
        ):
            errs.append(float((_g(p) - (_g(q0) + _g(q1)) / 2).abs().max()))
        out["dp_grads"] = max(errs)

        # (b) tensor parallel inside each expert, over `other`: same tokens on the TP ranks
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(sum(tokens), h, dtype=F64, generator=gen)
        cot = torch.randn(sum(tokens), h, dtype=F64, generator=gen)
        serial, y_ref = serial_grads(xs, cot)
        fresh = MoE(h, 6, e, k, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed)
        local = [ParallelMLP.from_serial(fresh.experts[first + j], group=other) for j in range(e // 2)]
        moe = ExpertParallelMoE(
            h, 6, e, k, ep, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed, experts=local
        )
        y = moe(xs[mine])
        ((y * cot[mine]).sum() + 0.5 * moe.aux_loss).backward()
        moe.sync_replicated_grads()
        out["tp_out"] = float((y.detach() - y_ref[mine]).abs().max())
        tp_rank, errs = replica, []
        for j, mod in enumerate(moe.experts):
            ref = serial.experts[first + j]
            half = 3  # ffn 6 over 2 TP ranks
            cols = slice(tp_rank * half, (tp_rank + 1) * half)
            errs.append(float((mod.fc1.weight.grad - ref.fc1.weight.grad[cols]).abs().max()))
            errs.append(float((mod.fc1.bias.grad - ref.fc1.bias.grad[cols]).abs().max()))
            errs.append(float((mod.fc2.weight.grad - ref.fc2.weight.grad[:, cols]).abs().max()))
            errs.append(float((mod.fc2.bias.grad - ref.fc2.bias.grad).abs().max()))
        for p, q in zip(moe.router.parameters(), serial.router.parameters()):
            errs.append(float((p.grad - q.grad).abs().max()))
        out["tp_grads"] = max(errs)
        return out

    for res in world4.run(composed):
        assert max(res.values()) < 1e-10, res


@pytest.mark.parametrize("world_size", [2, 3])
def test_double_backward_and_blocking_shared_expert(local_worlds, world_size) -> None:
    def double_backward() -> dict[str, float]:
        """Second order through dispatch/combine (a gradient penalty on the input gradient),
        against the serial MoE; and the blocking shared expert (overlap_shared=False)."""
        from diffcomm.parallel import ExpertParallelMoE, MoE

        r, w = dc.get_rank(), dc.get_world_size()
        tokens = [4, 0, 6, 3][:w]
        e, k, h = 2 * w, 2, 3
        gen = torch.Generator().manual_seed(5)
        xs = torch.randn(sum(tokens), h, dtype=F64, generator=gen)
        v = torch.randn(sum(tokens), h, dtype=F64, generator=gen)
        serial = MoE(h, 4, e, k, shared_expert_size=3, activation="tanh", dtype=F64, seed=9)
        x_all = xs.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad((serial(x_all) ** 2).sum(), x_all, create_graph=True)
        (gx * v).sum().backward()
        out = {}
        for overlap in (True, False):
            ep = ExpertParallelMoE.from_serial(serial, overlap_shared=overlap)
            for p in ep.parameters():
                p.grad = None
            lo = sum(tokens[:r])
            x_mine = xs[lo : lo + tokens[r]].clone().requires_grad_(True)
            (g_mine,) = torch.autograd.grad((ep(x_mine) ** 2).sum(), x_mine, create_graph=True)
            (g_mine * v[lo : lo + tokens[r]]).sum().backward()
            ep.sync_replicated_grads()
            first = r * (e // w)
            errs = [float((g_mine - gx[lo : lo + tokens[r]]).abs().max()) if tokens[r] else 0.0]
            for j, mod in enumerate(ep.experts):
                errs += [
                    float((_g(p) - _g(q)).abs().max())
                    for p, q in zip(mod.parameters(), serial.experts[first + j].parameters())
                ]
            errs += [
                float((_g(p) - _g(q)).abs().max())
                for p, q in zip(
                    ep.replicated_parameters(),
                    [*serial.router.parameters(), *serial.shared_expert.parameters()],
                )
            ]
            out[f"overlap={overlap}"] = max(errs)
        return out

    for res in local_worlds(world_size).run(double_backward):
        assert max(res.values()) < 1e-10, res


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_dispatch_reuses_a_given_plan(world2) -> None:
    def plan_reuse() -> dict[str, Any]:
        """dispatch(..., plan=) reuses an earlier plan of the same routing (a recomputed
        forward): the same rows, no counts exchange; a plan of other tokens is refused."""
        from diffcomm import backend as B
        from diffcomm.parallel import dispatch

        r = dc.get_rank()
        gen = torch.Generator().manual_seed(r)
        x = torch.randn(5 + r, 3, dtype=F64, generator=gen)
        idx = torch.randint(0, 4, (5 + r, 1), generator=gen)
        h1, plan = dispatch(x, idx, 4)
        with B.log_comms() as log:
            h2, same = dispatch(x, idx, 4, plan=plan)
        try:
            dispatch(x[:2], idx[:2], 4, plan=plan)
            refused = "no error"
        except ValueError as exc:
            refused = str(exc)
        return {
            "equal": torch.equal(h1, h2) and same is plan,
            "ops": [(rec.op, rec.label) for rec in log.records],
            "refused": refused,
        }

    for res in world2.run(plan_reuse):
        assert res["equal"] and res["ops"] == [("all_to_all", "parallel.dispatch -> all_to_all")], res
        assert "`plan` must be a plan of the same routing (2 tokens" in res["refused"], res


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_debug_mode_names_a_routing_mismatch(world2) -> None:
    def debug_mismatch() -> str:
        from diffcomm.parallel import dispatch

        r = dc.get_rank()
        x = torch.randn(3, 4)
        idx = torch.zeros(3, 1 + r, dtype=torch.int64)  # k differs between the ranks
        with dc.debug(True):
            try:
                dispatch(x, idx, 4)
            except dc.CrossRankMismatchError as exc:
                return str(exc)
        return "no error"

    for msg in world2.run(debug_mismatch):
        assert "parallel.dispatch()" in msg and "k differs (rank 0: 1, rank 1: 2)" in msg, msg


def _dispatch_settings_differ(what: str) -> str:
    from diffcomm.parallel import dispatch

    odd, w = dc.get_rank() == 1, dc.get_world_size()
    x = torch.arange(8.0).reshape(4, 2) + 10 * dc.get_rank()
    idx = torch.zeros(4, 1 + (odd and what == "k"), dtype=torch.int64)  # every token to expert 0
    cf = 0.5 if odd and what == "capacity_factor" else None
    pos = torch.arange(4) + 4 * dc.get_rank() if odd and what == "positions" else None
    try:
        h, _ = dispatch(x, idx, w, capacity_factor=1.0 if what == "positions" else cf, positions=pos)
    except dc.CrossRankMismatchError as exc:
        return str(exc)
    return f"no error: {h.tolist()}"


# on processes too: gloo carried the mismatched plans silently (in-process: the same check)
@pytest.mark.parametrize("world", ["processes", "in_process"])
@pytest.mark.usefixtures("debug_off")
def test_dispatch_settings_that_differ_between_ranks_are_named_without_debug_mode(
    local_worlds, world: str
) -> None:
    """The ranks' ``k``, ``capacity_factor`` and ``positions`` (given or not) shape the
    plan: ranks that disagree planned split sizes their peers did not (a capacity on rank
    1 only: rank 0 received rows rank 1 never sent, silently wrong values and no error).
    They travel with the counts, in the same exchange, so every rank raises naming them."""
    words = {
        "k": "k (expert_index.shape[1]) differs (rank 0: 1, rank 1: 2, rank 2: 1)",
        "capacity_factor": "capacity_factor differs (rank 0: None, rank 1: 0.5, rank 2: None)",
        "positions": "positions differs (rank 0: None, rank 1: given, rank 2: None)",
    }
    for what, expected in words.items():
        for msg in local_worlds(3, in_process=world == "in_process").run(_dispatch_settings_differ, what):
            assert msg.startswith("diffcomm.parallel.dispatch(): ranks called it with inconsistent"), msg
            assert expected in msg, msg


# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
def test_torch_func_grad_jvp_vmap(world2) -> None:
    def func_transforms() -> dict[str, float]:
        """torch.func.grad / jvp / vmap through dispatch and combine (the routing fixed)."""
        from diffcomm.parallel import combine, dispatch, route

        r = dc.get_rank()
        g = torch.Generator().manual_seed(r)
        x = torch.randn(5 - r, 3, dtype=F64, generator=g)
        gate, idx, _ = route(torch.randn(5 - r, 4, dtype=F64, generator=g), 2)
        v = torch.randn(x.shape, dtype=F64, generator=g)

        def loss(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            h, plan = dispatch(x, idx, 4)
            return (combine(h.sin(), gate, plan) ** 2).sum()

        gx, gg = torch.func.grad(loss, argnums=(0, 1))(x, gate)
        xa, ga = x.clone().requires_grad_(), gate.clone().requires_grad_()
        rx, rg = torch.autograd.grad(loss(xa, ga), (xa, ga))
        tangent = torch.func.jvp(lambda x: loss(x, gate), (x,), (v,))[1]
        batch = torch.stack([x, 2 * x, x.cos()])
        batched = torch.func.vmap(lambda x: loss(x, gate))(batch)
        looped = torch.stack([loss(b, gate) for b in batch])
        return {
            "grad": max(float((gx - rx).abs().max()), float((gg - rg).abs().max())),
            "jvp": abs(float(tangent) - float((rx * v).sum())),
            "vmap": float((batched - looped).abs().max()),
        }

    for res in world2.run(func_transforms):
        assert max(res.values()) < 1e-10, res


# --------------------------------------------------------------------------------------
# issue 45: the seams (async result, every documented shape, the serial mapping)
# --------------------------------------------------------------------------------------


# on processes: the asynchronous path (the communication thread) needs a process per rank
@pytest.mark.diffcomm_in_process(False)
def test_async_dispatch_returns_an_async_tensor_usable_in_torch_ops(world2) -> None:
    """``dispatch(..., async_op=True)`` returns the documented ``AsyncTensor`` (it was an
    internal wrapper: ``torch.tanh(h)`` raised TypeError); values and gradients equal the
    blocking dispatch's, with 1 and 2 experts per rank (the second needs a permutation)."""

    def body() -> list[Any]:
        from diffcomm.parallel import combine, dispatch, route

        out = []
        for experts in (2, 4):
            g = torch.Generator().manual_seed(10 + dc.get_rank())
            x = torch.randn(5, 3, dtype=F64, generator=g)
            gate, idx, _ = route(torch.randn(5, experts, dtype=F64, generator=g), 2)
            res = []
            for async_op in (False, True):
                xr = x.clone().requires_grad_()
                h, plan = dispatch(xr, idx, experts, async_op=async_op)
                kind = type(h).__name__
                y = combine(torch.tanh(h) * 2.0, gate, plan)  # a torch op straight on the result
                (gx,) = torch.autograd.grad((y * y).sum(), xr)
                res.append((kind, y.detach(), gx))
            out.append(
                (
                    res[1][0],
                    float((res[0][1] - res[1][1]).abs().max()),
                    float((res[0][2] - res[1][2]).abs().max()),
                )
            )
        return out

    for per_rank in world2.run(body):
        for kind, dy, dg in per_rank:
            assert kind == "AsyncTensor" and dy == 0.0 and dg == 0.0, per_rank


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug_mode"])
def test_every_documented_shape_is_checked_before_communication(world2, debug: bool) -> None:
    """combine's ``gate_weights`` must be ``(T, k)`` of the dispatch (``(T, k+1)`` was
    accepted and gave a silently wrong result); a hidden-size mismatch names ``x`` and
    the layer; ``ExpertParallelMoE``'s own arguments name ``ExpertParallelMoE``."""

    def bad() -> list[str]:
        from diffcomm.parallel import ExpertParallelMoE, MoE, combine, dispatch, load_balancing_loss, route

        x = torch.randn(3, 4)
        gate, idx, probs = route(torch.randn(3, 4), 2)
        h, plan = dispatch(x, idx, 4)
        ep = ExpertParallelMoE(6, 5, num_experts=4, seed=0)
        calls = [
            lambda: combine(h, torch.ones(3, 3), plan),  # k + 1 gate columns
            lambda: combine(h, gate[:, :1], plan),
            lambda: combine(h, gate.long(), plan),
            lambda: dispatch(x, idx[:, :0], 4),
            lambda: dispatch(x, idx[:, :1], 4, plan=plan),  # a plan of another k
            lambda: load_balancing_loss(probs[:, :2], plan),
            lambda: route(torch.randn(3, 4).long(), 2),
            lambda: ep(torch.zeros(3, 7)),
            lambda: MoE(6, 5, num_experts=4, seed=0)(torch.zeros(3, 7)),
            lambda: ExpertParallelMoE(6, 5, num_experts=4, k=9),
            lambda: ExpertParallelMoE(6, 0, num_experts=4),
            lambda: ExpertParallelMoE(6, 5, num_experts=4, shared_expert_size=0),
            lambda: ep(torch.zeros(3, 6, dtype=torch.int64)),
            lambda: ExpertParallelMoE(6, 5, num_experts=4, seed=0, generator=torch.Generator()),
        ]
        return refusal_messages(calls)

    patterns = [
        r"ValueError: diffcomm.parallel.combine\(\): `gate_weights` must be a \(3, 2\) tensor",
        r"ValueError: diffcomm.parallel.combine\(\): `gate_weights` must be a \(3, 2\) tensor",
        r"TypeError: diffcomm.parallel.combine\(\): `gate_weights` must be a floating-point tensor",
        r"diffcomm.parallel.dispatch\(\): `expert_index` must be a \(3, k\) tensor of expert ids, k >= 1",
        r"diffcomm.parallel.dispatch\(\): `plan` must be a plan of the same routing \(3 tokens, k=1",
        r"diffcomm.parallel.load_balancing_loss\(\): `probs` must be a \(3, 4\) tensor",
        r"TypeError: diffcomm.parallel.route\(\): `logits` must be a floating-point tensor",
        r"ValueError: diffcomm.parallel.ExpertParallelMoE\(\): `x` must be a \(\.\.\., hidden_size=6\) "
        r"tensor, "
        r"got shape \(3, 7\)",
        r"ValueError: diffcomm.parallel.MoE\(\): `x` must be a \(\.\.\., hidden_size=6\) tensor",
        r"ValueError: diffcomm.parallel.ExpertParallelMoE\(\): `k` must be at most num_experts=4",
        r"ValueError: diffcomm.parallel.ExpertParallelMoE\(\): `ffn_hidden_size` must be a positive int",
        r"ValueError: diffcomm.parallel.ExpertParallelMoE\(\): `shared_expert_size` must be a positive int",
        r"TypeError: diffcomm.parallel.ExpertParallelMoE\(\): `x` must be a floating-point tensor",
        r"ValueError: diffcomm.parallel.ExpertParallelMoE\(\): `seed` must be None when `generator` is given",
    ]

    with dc.debug(debug):
        per_rank = world2.run(bad)
    assert_refused_before_communicating(per_rank, patterns)


def test_expert_parallel_moe_has_the_serial_mapping(world2) -> None:
    """``serial_names()`` / ``serial_slices()`` map every parameter to the serial MoE's
    (local expert ``i`` is the serial ``experts.{rank * E / W + i}``), so
    ``assert_matches_serial`` compares with the serial MoE with no hand-written map (the
    router's and shared expert's per-rank gradient shares summed, ``partial_gradients()``);
    ``load_serial_state_dict`` / ``to_serial_state_dict`` round-trip a serial checkpoint."""
    from diffcomm.parallel import ExpertParallelMoE, MoE
    from diffcomm.testing import Shard, assert_matches_serial, build

    def make_serial() -> MoE:
        return MoE(4, 6, 4, 2, shared_expert_size=3, activation="tanh", dtype=F64, seed=3)

    assert_matches_serial(
        build(ExpertParallelMoE.from_serial),
        build(make_serial),
        lambda: torch.randn(6, 4, dtype=F64),
        world=world2,
        input_specs=[Shard(0)],
        output_specs=[Shard(0)],
        rtol=1e-10,
        atol=1e-12,
    )

    def round_trip() -> list[Any]:
        serial = make_serial()
        other = ExpertParallelMoE(4, 6, 4, 2, shared_expert_size=3, activation="tanh", dtype=F64, seed=99)
        names = other.serial_names()
        other.load_serial_state_dict(serial.state_dict())
        sd = serial.state_dict()
        back = other.to_serial_state_dict()
        return [
            names["experts.1.fc1.weight"],
            names["router.weight"],
            sorted(back) == sorted(sd),
            max(float((back[n] - sd[n]).abs().max()) for n in sd),
            other.partial_gradients()[:1],
        ]

    out = world2.run(round_trip)
    assert out[0][:2] == ["experts.1.fc1.weight", "router.weight"], out
    assert out[1][:2] == ["experts.3.fc1.weight", "router.weight"], out
    for row in out:
        assert row[2] and row[3] == 0.0 and row[4] == ["router.weight"], row


def _load_with_unexpected_keys() -> list[str]:
    from diffcomm.parallel import ExpertParallelMoE, MoE

    with_shared = MoE(4, 6, 4, 2, shared_expert_size=3, dtype=F64, seed=0).state_dict()
    extra = dict(MoE(4, 6, 4, 2, dtype=F64, seed=0).state_dict())
    extra["experts.7.fc1.weight"] = extra["experts.0.fc1.weight"]
    moe = ExpertParallelMoE(4, 6, 4, 2, dtype=F64, seed=1)  # no shared expert
    out = []
    for sd in (with_shared, extra):
        try:
            moe.load_serial_state_dict(sd)
            out.append("no error")
        except KeyError as exc:
            out.append(str(exc))
    skipped = moe.load_serial_state_dict(with_shared, strict=False)  # ignores them, as torch's
    out.append(skipped)
    partial = {k: v for k, v in extra.items() if k != "router.weight"}
    out.append(moe.load_serial_state_dict(partial, strict=False))
    return out


def test_load_serial_state_dict_refuses_unexpected_keys(world2) -> None:
    """With ``strict`` (the default) a serial key the layer does not shard is a KeyError,
    as ``ParallelModule.load_serial_state_dict`` and torch's ``load_state_dict``: a serial
    MoE with a shared expert loaded into one without was silently loaded without it. With
    ``strict=False`` the skipped keys come back, as ``load_state_dict`` returns them (it
    returned ``None``: a misspelt state dict loaded nothing, with no word)."""
    for shared, expert, skipped, partial in world2.run(_load_with_unexpected_keys):
        assert "unexpected keys ['shared_expert.fc1.bias'" in shared, shared
        assert "unexpected keys ['experts.7.fc1.weight']" in expert, expert
        assert skipped.missing_keys == [] and skipped.unexpected_keys[0] == "shared_expert.fc1.bias", skipped
        assert partial.missing_keys == ["router.weight"], partial
        assert partial.unexpected_keys == ["experts.7.fc1.weight"], partial


# on processes: the asynchronous path (the communication thread) needs a process per rank
@pytest.mark.diffcomm_in_process(False)
def test_async_dispatch_keeps_its_replication_type_under_the_check(world2) -> None:
    """Under ``dc.spmd_check`` the asynchronous dispatch's rows are typed as the blocking
    dispatch's (varying), with one and with two experts per rank."""

    def body() -> list[str]:
        from diffcomm.parallel import dispatch, route

        x = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(dc.get_rank()))
        out = []
        with dc.spmd_check(varying=[x]):
            for experts in (2, 4):
                _, idx, _ = route(torch.randn(5, experts, dtype=F64), 2)
                for async_op in (False, True):
                    h, _ = dispatch(x, idx, experts, async_op=async_op)
                    out.append(str(dc.spmd.type_of(torch.tanh(h))))
        return out

    for types in world2.run(body):
        assert types == ["V"] * 4, types


def test_moe_layers_take_the_shared_layer_options(world2) -> None:
    """``MoE`` and ``ExpertParallelMoE`` take ``options=LayerOptions(...)`` like the other
    layers: the same draws as the old keywords (which keep working and override it), the
    group from the options, and a field they do not read (sequence parallelism) or a
    keyword they do not take is a ``TypeError`` naming it, before any communication."""

    def body() -> list[Any]:
        from diffcomm import backend as B
        from diffcomm.parallel import ExpertParallelMoE, LayerOptions, MoE

        opts = LayerOptions(seed=5, dtype=F64)
        by_keywords = MoE(4, 6, 4, 2, shared_expert_size=3, seed=5, dtype=F64)
        by_options = MoE(4, 6, 4, 2, shared_expert_size=3, options=opts)
        overridden = MoE(4, 6, 4, 2, shared_expert_size=3, options=LayerOptions(seed=1), seed=5, dtype=F64)
        same = [
            all(torch.equal(a, b) for a, b in zip(by_keywords.parameters(), m.parameters()))
            for m in (by_options, overridden)
        ]
        ep_keywords = ExpertParallelMoE(4, 6, 4, 2, None, seed=5, dtype=F64)
        ep_options = ExpertParallelMoE(4, 6, 4, 2, options=LayerOptions(group=None, seed=5, dtype=F64))
        same.append(all(torch.equal(a, b) for a, b in zip(ep_keywords.parameters(), ep_options.parameters())))
        same.append(ep_options.router.weight.dtype == F64)
        errors = []
        for fn in (
            lambda: MoE(4, 6, 4, options=LayerOptions(sequence_parallel=True)),
            lambda: ExpertParallelMoE(4, 6, 4, options=LayerOptions(overlap=True)),
            lambda: MoE(4, 6, 4, group=None),
            lambda: ExpertParallelMoE(4, 6, 4, options={"seed": 0}),
        ):
            with B.log_comms() as log:
                try:
                    fn()
                    errors.append("no error")
                except TypeError as exc:
                    errors.append(f"{exc} [{log.count()} comms]")
        return [same, errors]

    for same, errors in world2.run(body):
        assert same == [True, True, True, True], same
        assert "diffcomm.parallel.MoE(): `options.sequence_parallel`" in errors[0], errors
        assert "diffcomm.parallel.ExpertParallelMoE(): `options.overlap`" in errors[1], errors
        assert "unexpected keyword argument 'group'" in errors[2], errors
        assert "`options` must be a LayerOptions" in errors[3], errors
        assert all(e.endswith("[0 comms]") for e in errors), errors


def _tp_experts_serial_state_dict() -> dict[str, Any]:
    """World 4 as 2 x 2: EP over {0,1} / {2,3}, each expert a ParallelMLP over the TP
    group {0,2} / {1,3}, built from one serial MoE."""
    import torch.distributed as dist

    from diffcomm.parallel import ExpertParallelMoE, MoE, ParallelMLP

    r = dc.get_rank()
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
    ep, tp = (g01 if r < 2 else g23), (g02 if r % 2 == 0 else g13)
    e, k, h, seed = 4, 2, 4, 11
    serial = MoE(h, 6, e, k, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed)
    first = (r % 2) * (e // 2)
    local = [ParallelMLP.from_serial(serial.experts[first + j], group=tp) for j in range(e // 2)]
    moe = ExpertParallelMoE(
        h, 6, e, k, ep, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed, experts=local
    )
    sd, want = moe.to_serial_state_dict(), serial.state_dict()
    fresh = MoE(h, 6, e, k, shared_expert_size=3, activation="tanh", dtype=F64, seed=seed + 1)
    fresh.load_state_dict(sd)  # the serial shapes: torch's loader takes them
    other = ExpertParallelMoE(  # and back: a TP-expert layer loads the serial state dict
        h,
        6,
        e,
        k,
        ep,
        shared_expert_size=3,
        activation="tanh",
        dtype=F64,
        seed=seed + 2,
        experts=[ParallelMLP.from_serial(fresh.experts[first + j], group=tp) for j in range(e // 2)],
    )
    other.load_serial_state_dict(want)
    back = other.to_serial_state_dict()
    return {
        "keys": sorted(sd) == sorted(want),
        "shapes": {
            n: (tuple(sd[n].shape), tuple(want[n].shape)) for n in want if sd[n].shape != want[n].shape
        },
        "err": max(float((sd[n] - want[n]).abs().max()) for n in want),
        "back": max(float((back[n] - want[n]).abs().max()) for n in want),
    }


def test_to_serial_state_dict_gathers_tensor_parallel_experts(world4) -> None:
    """Experts that are tensor-parallel shards (a ParallelMLP over another group passed as
    ``experts=``): ``to_serial_state_dict`` returned each expert's shard under the serial
    name (``experts.0.fc1.weight`` of shape (3, 4) for the serial (6, 4) at TP 2), a
    checkpoint that was no serial MoE's. Now every tensor is the serial one, loadable."""
    for res in world4.run(_tp_experts_serial_state_dict):
        assert res["keys"] and res["shapes"] == {} and res["err"] == 0.0 and res["back"] == 0.0, res


def _sync_per_micro_batch() -> dict[str, Any]:
    """Two micro-batches of this rank's tokens accumulated into the replicated gradients,
    ``sync_replicated_grads`` after each (the documented misuse); a second call with no
    backward between; ``zero_grad(set_to_none=False)`` between steps. Against the serial
    MoE on every rank's tokens."""
    from diffcomm import backend as B
    from diffcomm.parallel import ExpertParallelMoE, MoE

    w, r = dc.get_world_size(), dc.get_rank()
    serial = MoE(8, 6, 4, 2, shared_expert_size=5, activation="tanh", dtype=F64, seed=3)
    ep = ExpertParallelMoE.from_serial(serial)
    xs = torch.randn(2, w, 3, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}

    def worst() -> float:
        mine = dict(ep.named_parameters())
        return max(
            float((mine[n].grad - q.grad).abs().max())
            for n, q in serial.named_parameters()
            if n in mine and n.startswith(("router", "shared"))
        )

    for m in range(2):
        serial(xs[m].reshape(-1, 8)).sum().backward()
    ep(xs[0, r]).sum().backward()
    ep.sync_replicated_grads()
    ep(xs[1, r]).sum().backward()
    with B.log_comms() as log:
        try:
            ep.sync_replicated_grads()
            out["per micro-batch"] = f"no error, {worst():.2g} off"
        except ValueError as e:
            out["per micro-batch"] = f"{e} [{log.count()} comms]"
    for mod in (ep, serial):
        mod.zero_grad(set_to_none=False)  # (kept tensors, zeroed in place)
    for m in range(2):
        serial(xs[m].reshape(-1, 8)).sum().backward()
        ep(xs[m, r]).sum().backward()
    ep.sync_replicated_grads()
    ep.sync_replicated_grads()  # nothing new: sums nothing again
    out["once per step, called twice"] = worst()
    return out


def test_sync_replicated_grads_per_micro_batch_refused(world2) -> None:
    """Before, a call after each of two micro-batches counted the first one's part twice at
    world 2 (router and shared expert gradients off by up to ~1, no error), and a second
    call with no backward between doubled the gradients again. Now the first is a
    ValueError before any communication and the second sums nothing."""
    for res in world2.run(_sync_per_micro_batch):
        msg = res["per micro-batch"]
        assert "sync_replicated_grads(): `router.weight`'s gradient was summed" in msg, res
        assert msg.endswith("[0 comms]"), res
        assert res["once per step, called twice"] < 1e-12, res


def _sync_clip_sync(between: str) -> float:
    """``sync_replicated_grads``, an in-place change of the summed gradients (``clip``:
    ``parallel.clip_grad_norm_``; ``unscale``: a ``GradScaler``'s ``unscale_``), then
    ``sync_replicated_grads`` again with no backward between: the router's and shared
    expert's gradients against the serial MoE's."""
    from diffcomm import parallel as P

    serial = P.MoE(4, 6, 4, 2, shared_expert_size=5, activation="tanh", dtype=F64, seed=3)
    ep = P.ExpertParallelMoE.from_serial(serial)
    xs = torch.randn(dc.get_world_size(), 3, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    serial(xs.reshape(-1, 4)).pow(2).sum().backward()
    opt = torch.optim.SGD(ep.parameters(), lr=0.1)
    y = ep(xs[dc.get_rank()]).pow(2).sum()
    (scaler.scale(y) if between == "unscale" else y).backward()
    ep.sync_replicated_grads()
    if between == "clip":
        P.clip_grad_norm_(ep, 1e9)  # (scales every gradient in place, here by 1)
    else:
        scaler.unscale_(opt)
    ep.sync_replicated_grads()  # no backward since the last call: sums nothing again
    mine = dict(ep.named_parameters())
    return max(
        float((mine[n].grad - q.grad).abs().max())
        for n, q in serial.named_parameters()
        if n.startswith(("router", "shared"))
    )


@pytest.mark.parametrize("between", ["clip", "unscale"])
def test_sync_replicated_grads_again_after_an_in_place_scaling_sums_nothing(world2, between: str) -> None:
    """A second call with no backward between sums nothing, also when the summed
    gradients were scaled in place in between. After ``parallel.clip_grad_norm_`` (an
    in-place ``mul_``) it took the changed version counter for a new backward's parts and
    summed again: the gradients 2x the serial ones at world 2 (4.5 off here), no error.
    (``GradScaler.unscale_``'s fused kernel leaves the version as it is: right before too.)"""
    assert max(world2.run(_sync_clip_sync, between)) < 1e-12


# --------------------------------------------------------------------------------------
# probes: autocast's dtypes, experts tied across ranks
# --------------------------------------------------------------------------------------


def _autocast_vs_serial() -> dict[str, Any]:
    """Under CPU autocast (bf16) the experts give bf16 rows and the tokens are float32:
    the serial MoE weighs the rows by float32 gates and sums them in float32. The layer
    cast the gates to bf16 and summed in bf16: a bf16 output, 0.0022 off the serial one."""
    from diffcomm import parallel as P

    r = dc.get_rank()
    serial = P.MoE(4, 6, 4, 2, shared_expert_size=3, activation="tanh", seed=3)
    ep = P.ExpertParallelMoE.from_serial(serial, overlap_shared=False)
    gen = torch.Generator().manual_seed(5)
    xs, cot = torch.randn(10, 4, generator=gen), torch.randn(10, 4, generator=gen)
    mine = slice(5 * r, 5 * r + 5)
    x_all, x_mine = xs.clone().requires_grad_(True), xs[mine].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_all, y_mine = serial(x_all), ep(x_mine)
    (y_all * cot).sum().backward()
    (y_mine * cot[mine]).sum().backward()
    # combine on its own: bf16 rows, float32 gates -> torch's promotion, float32
    gate, idx, _ = P.route(torch.randn(5, 4, generator=gen), k=2)
    h, plan = P.dispatch(torch.randn(5, 4, generator=gen), idx, num_experts=4)
    rows = (h * 1.37).to(torch.bfloat16)
    y = P.combine(rows, gate, plan)
    y_ref = P.combine(rows.float(), gate, plan)
    return {
        "dtypes": (str(y_mine.dtype), str(y_all.dtype), str(y.dtype)),
        "out": float((y_mine.detach() - y_all.detach()[mine]).abs().max()),
        "x_grad": float((x_mine.grad - x_all.grad[mine]).abs().max()),
        "combine": float((y - y_ref).abs().max()),
    }


def test_autocast_sums_the_expert_rows_in_the_tokens_dtype(world2) -> None:
    for res in world2.run(_autocast_vs_serial):
        assert res["dtypes"] == ("torch.float32",) * 3, res
        assert res["out"] == 0.0 and res["x_grad"] == 0.0 and res["combine"] == 0.0, res


# on processes: the asynchronous combine (the communication thread) needs a process per rank
@pytest.mark.diffcomm_in_process(False)
def test_async_combine_promotes_as_the_blocking_one(world2) -> None:
    def body() -> dict[str, Any]:
        from diffcomm import parallel as P

        gen = torch.Generator().manual_seed(dc.get_rank())
        gate, idx, _ = P.route(torch.randn(5, 4, generator=gen), k=2)
        h, plan = P.dispatch(torch.randn(5, 4, generator=gen), idx, num_experts=4)
        rows = h.to(torch.bfloat16).requires_grad_(True)
        g = gate.detach().requires_grad_(True)
        y = P.combine(rows, g, plan, async_op=True).wait()
        y_ref = P.combine(rows, g, plan)
        cot = torch.randn(y.shape, generator=gen)
        got = torch.autograd.grad((y * cot).sum(), (rows, g))
        want = torch.autograd.grad((y_ref * cot).sum(), (rows, g))
        return {
            "dtypes": (str(y.dtype), str(got[0].dtype)),
            "err": max(float((a.float() - b.float()).abs().max()) for a, b in zip((y, *got), (y_ref, *want))),
        }

    for res in world2.run(body):
        assert res["dtypes"] == ("torch.float32", "torch.bfloat16") and res["err"] == 0.0, res


def _tied_experts() -> list[str]:
    from diffcomm import parallel as P

    serial = P.MoE(4, 6, 4, 2, seed=1)
    serial.experts[2].fc1.weight = serial.experts[0].fc1.weight  # rank 0's and rank 1's
    across = refusal_messages([lambda: P.ExpertParallelMoE.from_serial(serial)])
    serial = P.MoE(4, 6, 4, 2, seed=1)
    serial.experts[1].fc1.weight = serial.experts[0].fc1.weight  # both on rank 0: right
    P.ExpertParallelMoE.from_serial(serial)
    return across


def test_from_serial_refuses_experts_tied_across_ranks(world2) -> None:
    """Serial experts sharing a parameter but placed on different ranks: each rank kept
    its own copy and stepped it with its part of the gradient (0.13 off the serial
    parameter after one SGD step), silently."""
    tied = r"experts.0.fc1.weight \(rank 0\) and experts.2.fc1.weight \(rank 1\)"
    assert_refused_before_communicating(
        world2.run(_tied_experts),
        [rf"ValueError: .*from_serial\(\).*{tied} are one parameter"],
    )


def _layer_under_torch_func() -> dict[str, float]:
    """The whole layer under torch.func: ``grad`` over ``functional_call`` (loss with the
    aux loss, capacity dropping) equals autograd, ``jvp`` a central difference; two
    accumulated micro-batches (aux loss each) equal the serial MoE's summed gradients."""
    from torch.func import functional_call, grad, jvp

    from diffcomm import parallel as P

    r = dc.get_rank()
    serial = P.MoE(
        4, 6, 4, 2, capacity_factor=1.0, shared_expert_size=3, activation="tanh", dtype=F64, seed=2
    )
    ep = P.ExpertParallelMoE.from_serial(serial, overlap_shared=False)
    x = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(r))
    params = {n: p.detach() for n, p in ep.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (functional_call(ep, p, (x,)) ** 2).sum() + 0.3 * ep.aux_loss

    g = grad(loss)(params, x)
    loss(dict(ep.named_parameters()), x).backward()
    out = {"grad": max(float((g[n] - p.grad).abs().max()) for n, p in ep.named_parameters())}
    t = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(9))
    _, jt = jvp(lambda x: functional_call(ep, params, (x,)), (x,), (t,))
    fd = (ep(x + 1e-6 * t) - ep(x - 1e-6 * t)) / 2e-6
    out["jvp"] = float((jt - fd).abs().max())
    ep.zero_grad()
    gen = torch.Generator().manual_seed(3)
    for mb in range(2):  # micro-batches of 3 + 4 and 3 + 5 tokens
        tokens = [3, 4 + mb]
        xs = torch.randn(sum(tokens), 4, dtype=F64, generator=gen)
        lo = sum(tokens[:r])
        ((serial(xs) ** 3).sum() + 0.5 * serial.aux_loss).backward()
        ((ep(xs[lo : lo + tokens[r]]) ** 3).sum() + 0.5 * ep.aux_loss).backward()
    ep.sync_replicated_grads()
    names, ref = ep.serial_names(), dict(serial.named_parameters())
    out["accumulated"] = max(
        float((p.grad - ref[names[n]].grad).abs().max()) for n, p in ep.named_parameters()
    )
    return out


# on processes: forward-mode AD (jvp) keeps one level stack per process
@pytest.mark.diffcomm_in_process(False)
def test_the_layer_under_torch_func_and_gradient_accumulation(world2) -> None:
    for res in world2.run(_layer_under_torch_func):
        assert res["grad"] < 1e-12 and res["jvp"] < 1e-6 and res["accumulated"] < 1e-12, res


def _strided_ep_axis() -> dict[str, Any]:
    """EP over the first axis of a 2 x 2 mesh (groups {0, 2} and {1, 3}: the group rank is
    not the world rank's low bit), data parallel over the second, with dropping and the
    aux loss: each EP group is the serial MoE over its own tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm import parallel as P

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    ep_rank, dp_rank = mesh.get_local_rank("ep"), mesh.get_local_rank("dp")
    serial = P.MoE(
        4, 6, 4, 2, capacity_factor=0.75, shared_expert_size=3, activation="tanh", dtype=F64, seed=1
    )
    ep = P.ExpertParallelMoE.from_serial(serial, group=(mesh, "ep"))
    xs = torch.randn(9, 4, dtype=F64, generator=torch.Generator().manual_seed(dp_rank))
    tokens = [4, 5]
    mine = slice(sum(tokens[:ep_rank]), sum(tokens[: ep_rank + 1]))
    ys = serial(xs)
    ((ys**2).sum() + 0.7 * serial.aux_loss).backward()
    y = ep(xs[mine])
    ((y**2).sum() + 0.7 * ep.aux_loss).backward()
    ep.sync_replicated_grads()
    names, ref = ep.serial_names(), dict(serial.named_parameters())
    aux = dc.all_reduce(ep.aux_loss.detach(), group=(mesh, "ep"))
    return {
        "first": (ep_rank, ep.first_expert, ep.dropped > 0),
        "out": float((y - ys[mine]).abs().max()),
        "aux": abs(float(aux) - float(serial.aux_loss)),
        "grads": max(float((p.grad - ref[names[n]].grad).abs().max()) for n, p in ep.named_parameters()),
    }


def test_expert_parallel_over_a_strided_mesh_axis(world4) -> None:
    for res in world4.run(_strided_ep_axis):
        assert res["first"] in ((0, 0, True), (1, 2, True)), res
        assert max(res["out"], res["aux"], res["grads"]) < 1e-12, res


def _expert_tied_to_shared(tied: int) -> dict[str, Any]:
    """Serial expert ``tied`` shares its ``fc1.weight`` and ``fc2.bias`` with the shared
    expert; one step of the expert-parallel layer (world 2, 4 experts) against the serial
    one in float64: gradients after ``sync_replicated_grads`` and one SGD step."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    r, w = dc.get_rank(), dc.get_world_size()
    serial = MoE(4, 6, 4, 2, shared_expert_size=6, activation="tanh", dtype=F64, seed=3)
    for name in ("fc1", "fc2"):
        attr = "weight" if name == "fc1" else "bias"
        setattr(
            getattr(serial.experts[tied], name), attr, getattr(serial.shared_expert.get_submodule(name), attr)
        )
    ep = ExpertParallelMoE.from_serial(serial)
    gen = torch.Generator().manual_seed(4)
    xs, cot = torch.randn(10, 4, dtype=F64, generator=gen), torch.randn(10, 4, dtype=F64, generator=gen)
    (serial(xs) * cot).sum().backward()
    mine = slice(5 * r, 5 * r + 5)
    (ep(xs[mine]) * cot[mine]).sum().backward()
    ep.sync_replicated_grads()
    first = r * (4 // w)
    pairs = [(p, q) for p, q in zip(ep.router.parameters(), serial.router.parameters())]
    pairs += list(zip(ep.shared_expert.parameters(), serial.shared_expert.parameters()))
    for j, expert in enumerate(ep.experts):
        pairs += list(zip(expert.parameters(), serial.experts[first + j].parameters()))
    grad = max(float((p.grad - q.grad).abs().max()) for p, q in pairs)
    torch.optim.SGD(ep.parameters(), lr=0.1).step()
    torch.optim.SGD(serial.parameters(), lr=0.1).step()
    step = max(float((p - q).abs().max()) for p, q in pairs)
    holds_it = first <= tied < first + len(ep.experts)
    still_tied = ep.experts[tied - first].fc1.weight is ep.shared_expert.fc1.weight if holds_it else True
    return {"grad": grad, "step": step, "still_tied": still_tied, "holds_it": holds_it}


@pytest.mark.parametrize("tied", [0, 3])
def test_an_expert_tied_to_the_shared_expert_equals_serial(world2, tied: int) -> None:
    """An expert sharing parameters with the (replicated) shared expert, on rank 0 or on
    rank 1 only: its rank's gradient is the expert's whole part plus its share of the
    shared expert's, the other rank's its share only; ``sync_replicated_grads`` sums the
    parameter under its shared-expert name, so every rank ends with the serial gradient
    and the same step. (Right only because the sum picks the parameter up by that name.)"""
    per_rank = world2.run(_expert_tied_to_shared, tied)
    assert [res["holds_it"] for res in per_rank] == [tied < 2, tied >= 2]
    for res in per_rank:
        assert res["grad"] < 1e-12 and res["step"] < 1e-12 and res["still_tied"], res


def _sync_clip_backward_sync(between: str) -> str:
    """``sync_replicated_grads``, then ``between`` — ``clip`` (``parallel.clip_grad_norm_``,
    an in-place ``mul_``), ``zero`` (``zero_grad(set_to_none=False)``), ``none``,
    ``zero clip`` (zeroed, a backward, clipped) — then a backward with no ``zero_grad``
    and ``sync_replicated_grads`` again: the error's start and its communication count,
    or how far the gradients are from the serial MoE's."""
    from diffcomm import backend as B
    from diffcomm import parallel as P

    serial = P.MoE(4, 6, 4, 2, shared_expert_size=5, activation="tanh", dtype=F64, seed=3)
    ep = P.ExpertParallelMoE.from_serial(serial)
    w, r = dc.get_world_size(), dc.get_rank()
    xs = torch.randn(2, w, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    ep(xs[0, r]).pow(2).sum().backward()
    ep.sync_replicated_grads()
    if "zero" in between:
        ep.zero_grad(set_to_none=False)
        ep(xs[0, r]).pow(2).sum().backward()
        serial(xs[0].reshape(-1, 4)).pow(2).sum().backward()
    if "clip" in between:  # (zero clip: clipped unsummed on purpose, which debug mode refuses)
        with dc.debug(False) if between == "zero clip" else contextlib.nullcontext():
            P.clip_grad_norm_(ep, 1e9)  # (scales every gradient in place, here by 1)
    ep(xs[1, r]).pow(2).sum().backward()
    serial(xs[1].reshape(-1, 4)).pow(2).sum().backward()
    with B.log_comms() as log:
        try:
            ep.sync_replicated_grads()
        except ValueError as e:
            return f"{str(e)[:60]} [{log.count()} comms]"
    mine = dict(ep.named_parameters())
    off = max(
        float((mine[n].grad - q.grad).abs().max())
        for n, q in serial.named_parameters()
        if n.startswith(("router", "shared"))
    )
    return f"no error, {off:.2g} off"


@pytest.mark.parametrize("between", ["none", "clip", "zero", "zero clip"])
def test_sync_replicated_grads_after_an_in_place_scaling_and_a_backward_refused(world2, between: str) -> None:
    """sync, clip (an in-place ``mul_``), backward without zero_grad, sync: the clip moved
    the version counter the mark of a backward added onto a sum read, so the second sum
    counted the first backward's part twice at world 2, with no error. Now refused as
    without the clip; after ``zero_grad(set_to_none=False)`` (clipped or not) it sums."""
    want = (
        "diffcomm.parallel.ExpertParallelMoE.sync_replicated_grads(): `router.weight`'s"[:60] + " [0 comms]"
    )
    for res in world2.run(_sync_clip_backward_sync, between):
        if "zero" in between:
            assert res.startswith("no error") and float(res.split(", ")[1].split()[0]) < 1e-12, res
        else:
            assert res == want, res


def _aux_loss_under_checkpointing() -> dict[str, float]:
    """``ExpertParallelMoE`` (capacity, shared expert) with its aux loss under
    ``torch.utils.checkpoint``, against the serial ``MoE`` without: reentrant with
    ``moe.aux_loss`` read after the region (no graph: the documented limitation, the
    router's gradient misses the load-balancing term), reentrant with the aux loss
    attached inside by ``add_aux_loss``, and non-reentrant."""
    from torch.utils.checkpoint import checkpoint

    from diffcomm import parallel as P
    from diffcomm.pipeline import add_aux_loss

    r = dc.get_rank()
    serial = P.MoE(
        4, 6, 4, 2, capacity_factor=0.5, shared_expert_size=3, activation="tanh", dtype=F64, seed=5
    )
    xs = torch.randn(8, 4, dtype=F64, generator=torch.Generator().manual_seed(3))
    ((serial(xs) ** 2).sum() + 0.3 * serial.aux_loss).backward()
    ref = dict(serial.named_parameters())
    out = {}
    for how in ("reentrant, read after", "reentrant, attached", "non-reentrant"):
        ep = P.ExpertParallelMoE.from_serial(serial)
        x = xs[4 * r : 4 * r + 4].clone().requires_grad_(True)
        if how == "reentrant, attached":
            y = checkpoint(lambda t, ep=ep: add_aux_loss(ep(t), 0.3 * ep.aux_loss), x, use_reentrant=True)
            loss = (y**2).sum()
        else:
            y = checkpoint(ep, x, use_reentrant=how != "non-reentrant")
            loss = (y**2).sum() + 0.3 * ep.aux_loss
        loss.backward()
        ep.sync_replicated_grads()
        names = ep.serial_names()
        out[how] = max(float((p.grad - ref[names[n]].grad).abs().max()) for n, p in ep.named_parameters())
    return out


def test_aux_loss_under_reentrant_checkpointing(world2) -> None:
    for res in world2.run(_aux_loss_under_checkpointing):
        assert res["reentrant, attached"] < 1e-12 and res["non-reentrant"] < 1e-12, res
        assert res["reentrant, read after"] > 1e-3, res  # (docs/moe.md: the limitation, pinned)


def _tensor_parallel_experts_refused() -> list[str]:
    """Tensor-parallel experts (2 x 2 mesh, EP over ``ep``) built ``sequence_parallel=True``
    (bare, and inside a wrapper), or over a group holding other EP ranks (the ``ep`` axis
    itself, the world: ``group=None``): each refused, naming it."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm import parallel as P

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    tp = (mesh, "tp")
    bare = [P.ParallelMLP(4, 6, group=tp, sequence_parallel=True, seed=j, dtype=F64) for j in range(2)]
    wrapped = [nn.Sequential(P.MLP(4, 4, dtype=F64), e) for e in bare]
    over_ep = [P.ParallelMLP(4, 6, group=(mesh, "ep"), seed=j, dtype=F64) for j in range(2)]
    over_world = [P.ParallelMLP(4, 8, seed=j, dtype=F64) for j in range(2)]

    class Wrapper(P.ParallelModule):  # a container with no group of its own: accepted
        def __init__(self, j: int) -> None:
            super().__init__()
            self.inner = P.ParallelMLP(4, 6, group=tp, seed=j, dtype=F64)

    contained = [Wrapper(j) for j in range(2)]
    return refusal_messages(
        [
            lambda experts=experts: P.ExpertParallelMoE(
                4, 6, 4, 2, (mesh, "ep"), experts=experts, seed=0, dtype=F64
            )
            for experts in (bare, wrapped, over_ep, over_world, contained)
        ]
    )


def test_tensor_parallel_experts_refused(world4) -> None:
    """A sequence-parallel ``ParallelMLP`` as an expert all_gathered the dispatched rows over
    its TP group as a sequence shard, but the TP ranks hold the same rows: outputs and
    input gradients were right, the experts' weight gradients twice the serial ones at
    TP 2 (1.50 off), with no error. A ``ParallelMLP`` over ranks of the EP group summed its
    shards of different experts as one MLP (0.35 off the serial rows at world 2, k = E; a
    gloo abort where the row counts differ)."""
    sp = r"\(ParallelMLP\) with sequence_parallel=True"
    other = r"`experts` must be tensor-parallel experts over a group orthogonal.*experts\[0\] \(ParallelMLP\)"
    per_rank = world4.run(_tensor_parallel_experts_refused)
    assert all(msgs[4] == "no error" for msgs in per_rank), per_rank
    assert_refused_before_communicating(
        [msgs[:4] for msgs in per_rank],
        [
            rf"ValueError: .*ExpertParallelMoE\(\).*`experts`.*experts\[0\] {sp}",
            rf"ValueError: .*ExpertParallelMoE\(\).*`experts`.*experts\[0\]\.1 {sp}",
            rf"ValueError: .*ExpertParallelMoE\(\).*{other} over the global ranks \[\d, \d\], which hold",
            rf"ValueError: .*ExpertParallelMoE\(\).*{other} over the global ranks \[0, 1, 2, 3\], which hold",
        ],
    )
