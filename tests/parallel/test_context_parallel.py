"""Context parallelism (diffcomm.parallel.context): ring, Ulysses and USP attention equal
serial attention over the whole sequence, forward and every gradient, in float64.

References are dense attention written here (softmax of masked scores) and
``torch.nn.functional.scaled_dot_product_attention``; the only library function the
references use is ``dropout_keep_mask``, which *is* the specification of the dropout
pattern (a hash of global coordinates).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _shared import check_in_batches, refusals
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm import backend as B
from diffcomm import parallel
from diffcomm.parallel import context as cp
from diffcomm.parallel.context import plan, ring

# ----------------------------------------------------------------------------- cases


@st.composite
def ring_cases(draw: Any) -> dict[str, Any]:
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    seq_len = draw(st.integers(1, 19))
    docs = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, seq_len), min_size=0, max_size=3)))
        docs = [0, *cuts, seq_len]
    return {
        "layout": draw(st.sampled_from(cp.LAYOUTS)),
        "causal": draw(st.booleans()),
        "heads": heads,
        "kv_heads": kv_heads,
        "seq_len": seq_len,
        "cu_seqlens": docs,
        "mask": draw(st.sampled_from([None, "bool", "float"])),
        "dropout_p": draw(st.sampled_from([0.0, 0.0, 0.4])),
        "dv": draw(st.sampled_from([3, 4])),
        "seed": draw(st.integers(0, 2**20)),
    }


def _dense(q: Any, k: Any, v: Any, allowed: Any, add: Any, p: float, seed: int) -> Any:
    """Dense attention (float64): rows with nothing allowed are zero."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if add is not None:
        s = s + add
    s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, -1).nan_to_num(0.0)
    if p:
        pos = torch.arange(q.shape[2])
        w = w * cp.dropout_keep_mask(seed, q.shape[0], q.shape[1], pos, pos, p) / (1 - p)
    return w @ v


def _allowed(case: dict[str, Any]) -> Any:
    S = case["seq_len"]
    pos = torch.arange(S)
    doc = torch.zeros(S, dtype=torch.long)
    if case["cu_seqlens"]:
        for a in case["cu_seqlens"][1:-1]:
            doc[a:] += 1
    ok = doc.view(-1, 1) == doc.view(1, -1)
    if case["causal"]:
        ok &= pos.view(1, -1) <= pos.view(-1, 1)
    return ok


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_attention_equals_serial(local_worlds: Callable[[int], dc.LocalWorld], n: int) -> None:
    def rank_body(batch: list[dict[str, Any]]) -> list[float]:
        import torch

        from diffcomm.parallel import context as cp

        errs = []
        for case in batch:
            g = torch.Generator().manual_seed(case["seed"])
            S, H, Hk = case["seq_len"], case["heads"], case["kv_heads"]
            f64 = {"dtype": torch.float64, "generator": g}
            q = torch.randn(2, H, S, 4, **f64, requires_grad=True)
            k = torch.randn(2, Hk, S, 4, **f64, requires_grad=True)
            v = torch.randn(2, Hk, S, case["dv"], **f64, requires_grad=True)
            w = torch.randn(2, H, S, case["dv"], **f64)
            allowed = _allowed(case)
            add = mask = None
            if case["mask"] == "bool":  # random, the diagonal always kept (no all-masked rows)
                mask = (torch.rand(1, H, S, S, generator=g) > 0.3) | torch.eye(S, dtype=torch.bool)
                allowed = allowed & mask
            elif case["mask"] == "float":
                mask = torch.randn(2, 1, S, S, **f64, requires_grad=True)
                add = mask
            ref = _dense(q, k, v, allowed, add, case["dropout_p"], 11)
            ins = [q, k, v] + ([mask] if case["mask"] == "float" else [])
            grads = torch.autograd.grad((ref * w).sum(), ins)
            kw = {"layout": case["layout"], "cu_seqlens": case["cu_seqlens"]}
            ql, kl, vl = (cp.shard(t.detach(), **kw).requires_grad_() for t in (q, k, v))
            ml = None
            if mask is not None:
                # this rank's rows of the mask, columns in global order (pad rows: anything)
                ml = cp.shard(mask.detach(), **kw).requires_grad_(case["mask"] == "float")
            out = cp.ring_attention(
                ql,
                kl,
                vl,
                causal=case["causal"],
                attn_mask=ml,
                dropout_p=case["dropout_p"],
                dropout_seed=11,
                seq_len=S,
                **kw,
            )
            local_ins = [ql, kl, vl] + ([ml] if case["mask"] == "float" else [])
            lgrads = torch.autograd.grad((out * cp.shard(w, **kw)).sum(), local_ins)
            e = [(out - cp.shard(ref.detach(), **kw)).abs().max()]
            e += [(a - cp.shard(b, **kw)).abs().max() for a, b in zip(lgrads[:3], grads[:3], strict=True)]
            if case["mask"] == "float":
                # the mask's gradient: this rank's rows (padding rows get none)
                e.append((lgrads[3] - cp.shard(grads[3], **kw)).abs().max())
            e.append((cp.unshard(out, seq_len=S, **kw) - ref).abs().max())
            errs.append(float(max(e)))
        return errs

    def assert_ok(world: dc.LocalWorld, batch: list[dict[str, Any]]) -> None:
        for errs in world.run(rank_body, batch):
            assert max(errs) < 1e-12, (errs, batch)

    check_in_batches(local_worlds(n), ring_cases(), assert_ok, max_examples=4)


def test_ring_attention_matches_sdpa_and_serial_reference(world3: dc.LocalWorld) -> None:
    """The plain causal GQA case against torch's SDPA itself, and the library's
    ``attention_reference`` against SDPA (with and without documents)."""

    def body() -> list[float]:
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 4, 18, 8, dtype=torch.float64, generator=g)
        k, v = (torch.randn(2, 2, 18, 8, dtype=torch.float64, generator=g) for _ in range(2))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        zig = (parallel.shard(t, layout="zigzag") for t in (q, k, v))
        out = parallel.ring_attention(*zig, causal=True, layout="zigzag")
        tiled = []
        calls = []
        flash = ring._FLASH_CPU
        old, plan.TILE = plan.TILE, 4  # query tiles of 4 rows (a block splits into a staircase)
        try:
            # full and causal-diagonal pieces run on torch's fused CPU kernel: count them,
            # then run once more with the kernel off (every piece on the dense math path)
            ring._FLASH_CPU = lambda *a, **kw: calls.append(1) or flash(*a, **kw)
            for kernel in (True, False):
                if not kernel:
                    ring._FLASH_CPU = None
                for layout in cp.LAYOUTS:
                    ql, kl, vl = (parallel.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
                    o = parallel.ring_attention(ql, kl, vl, causal=True, layout=layout)
                    o.square().sum().backward()
                    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                    r = torch.nn.functional.scaled_dot_product_attention(
                        qr, kr, vr, is_causal=True, enable_gqa=True
                    )
                    r.square().sum().backward()
                    tiled.append(float((parallel.unshard(o, layout=layout) - r).abs().max()))
                    for a, b in ((ql, qr), (kl, kr), (vl, vr)):
                        # the loss is the sum of the ranks' parts: shard the full gradient
                        tiled.append(float((a.grad - parallel.shard(b.grad, layout=layout)).abs().max()))
            assert calls, "the fused kernel was never used"
        finally:
            ring._FLASH_CPU = flash
            plan.TILE = old
        cu = [0, 7, 18]
        blockdiag = torch.zeros(18, 18, dtype=torch.bool)
        blockdiag[:7, :7] = blockdiag[7:, 7:] = True
        ref_docs = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=blockdiag & torch.ones(18, 18, dtype=torch.bool).tril(), enable_gqa=True
        )
        return [
            float((parallel.unshard(out) - ref).abs().max()),
            float((cp.attention_reference(q, k, v, causal=True) - ref).abs().max()),
            float((cp.attention_reference(q, k, v, causal=True, cu_seqlens=cu) - ref_docs).abs().max()),
            *tiled,
        ]

    for errs in world3.run(body):
        assert max(errs) < 1e-12


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_ring_attention_overlaps_and_stays_local(world4: dc.LocalWorld) -> None:
    """The communication is the ring and nothing else: the comms logger sees W-1 forward
    hops of one K/V block and, in backward, W-1 K/V hops and W hops of their gradient,
    each one K/V block (O(S/W) bytes) sent and one received."""

    def body() -> dict[str, Any]:

        q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        with B.log_comms() as log:
            out = parallel.ring_attention(q, k, v, causal=True, layout="zigzag")
            out.sum().backward()
        names = [e.label for e in log.records if "ring_attention" in (e.label or "")]
        sizes = {e.nbytes for e in log.records if "ring_attention" in (e.label or "")}
        return {"names": names, "sizes": sorted(sizes)}

    res = world4.run(body)
    kv_bytes = 2 * 1 * 2 * 8 * 4 * 8
    for r in res:
        fwd = [n for n in r["names"] if "backward" not in n]
        bwd = [n for n in r["names"] if "backward" in n]
        assert len(fwd) == 3 and len(bwd) == 3 + 4, r
        assert r["sizes"] == [2 * kv_bytes], r  # sent + received


# ------------------------------------------------------------------ layouts & balance


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_layout_index_is_a_padded_permutation(layout: str) -> None:
    for world in (1, 2, 3, 4):
        for S in (0, 1, 5, 16, 23):
            for cu in (None, [0, S], [0, S // 3, S // 3, S]):
                t = cp.layout_index(S, world, layout=layout, cu_seqlens=cu)
                real = t[t >= 0]
                assert sorted(real.tolist()) == list(range(S))
                pad = (t < 0).sum().item()
                docs = 1 if cu is None else len([a for a, b in zip(cu, cu[1:]) if b > a])
                bound = world - 1 if layout == "contiguous" else docs * (2 * world - 1)
                assert pad <= bound, (S, world, cu, t)
    assert cp.layout_index(8, 2, layout="zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_cu_seqlens_of_any_integer_dtype_or_device_and_meta_refused() -> None:
    """int32 and int64 ``cu_seqlens`` give the same table; one on the meta device (no
    values) is a ``ValueError`` naming ``cu_seqlens``, not torch's bare
    ``NotImplementedError: Cannot copy out of meta tensor``."""
    want = cp.layout_index(9, 2, layout="zigzag", cu_seqlens=[0, 3, 9])
    for dt in (torch.int32, torch.int64):
        got = cp.layout_index(9, 2, layout="zigzag", cu_seqlens=torch.tensor([0, 3, 9], dtype=dt))
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="`cu_seqlens` must be a tensor with values"):
        cp.layout_index(9, 2, layout="zigzag", cu_seqlens=torch.tensor([0, 3, 9], device="meta"))


def test_zigzag_balances_causal_work() -> None:
    """Per-rank computed score entries (proportional to FLOPs) of causal ring attention:
    zigzag within 5 % of the mean at every world size (plain ring far from it)."""
    for world in (2, 3, 4, 8):
        for S, cu in ((1024, None), (1000, None), (1200, [0, 300, 700, 760, 1200])):
            zig = cp.ring_attention_work(S, world, layout="zigzag", cu_seqlens=cu)
            plain = cp.ring_attention_work(S, world, layout="contiguous", cu_seqlens=cu)
            for key in ("computed", "attended"):
                mean = sum(zig[key]) / world
                assert max(abs(c - mean) for c in zig[key]) <= 0.05 * mean, (world, S, cu, key, zig)
            pmean = sum(plain["computed"]) / world
            if cu is None:
                assert max(plain["computed"]) > 1.3 * pmean  # rank W-1 computes W blocks, rank 0 one


def test_shard_unshard_adjoint_and_round_trip(world3: dc.LocalWorld) -> None:
    def body() -> list[float]:
        from diffcomm.testing import check_adjoint

        errs = []
        g = torch.Generator().manual_seed(dc.get_rank())
        for layout in cp.LAYOUTS:
            for S, cu in ((12, None), (13, [0, 4, 13]), (5, [0, 1, 2, 5])):
                kw = {"layout": layout, "cu_seqlens": cu}
                x = torch.randn(2, S, 3, dtype=torch.float64, generator=g)
                n = cp.layout_index(S, 3, **kw).shape[1]
                y = torch.randn(2, n, 3, dtype=torch.float64, generator=g)
                errs.append(check_adjoint(lambda t, kw=kw: cp.shard(t, 1, **kw), x, y))
                errs.append(check_adjoint(lambda t, S=S, kw=kw: cp.unshard(t, 1, seq_len=S, **kw), y, x))
                same = torch.randn(2, S, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
                back = cp.unshard(cp.shard(same, 1, **kw), 1, seq_len=S, **kw)
                errs.append(float((back - same).abs().max()))
        pos = cp.shard(torch.arange(10), 0, layout="zigzag", pad_value=-1)
        assert pos.tolist() == cp.layout_index(10, 3, layout="zigzag")[dc.get_rank()].tolist()
        return errs

    for errs in world3.run(body):
        assert max(errs) < 1e-12


def test_bad_arguments_name_the_argument(world2: dc.LocalWorld) -> None:
    def body() -> dict[str, str]:
        from _shared import outcomes

        q = torch.randn(1, 4, 6, 8)
        k = torch.randn(1, 2, 6, 8)
        calls = {
            "layout": lambda: parallel.ring_attention(q, k, k, layout="striped"),
            "gqa": lambda: parallel.ring_attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8)),
            "dim": lambda: parallel.ring_attention(q[0], k, k),
            "seq": lambda: parallel.ring_attention(q, k, k, layout="zigzag", seq_len=100),
            "dropout": lambda: parallel.ring_attention(q, k, k, dropout_p=1.0),
            "mask": lambda: parallel.ring_attention(q, k, k, attn_mask=torch.ones(6, 6, dtype=torch.bool)),
            "cu": lambda: parallel.ring_attention(q, k, k, cu_seqlens=[0, 5, 4, 12]),
            "seq_lens": lambda: parallel.ulysses_attention(q, k, k, seq_lens=[6, 7, 8]),
        }
        out = outcomes(calls, ValueError)
        out["dtype"] = outcomes({"x": lambda: parallel.ring_attention(q, k.double(), k)}, TypeError)["x"]
        return out

    errs = world2.run(body)[0]
    for key, arg in {
        "layout": "`layout`",
        "gqa": "`k`",
        "dim": "`q`",
        "seq": "`q`",
        "dropout": "`dropout_p`",
        "mask": "`attn_mask`",
        "cu": "`cu_seqlens`",
        "seq_lens": "`seq_lens`",
        "dtype": "`k/v`",
    }.items():
        assert arg in errs[key], (key, errs[key])


# ----------------------------------------------------------------------------- Ulysses


@st.composite
def ulysses_cases(draw: Any) -> dict[str, Any]:
    kv_heads = draw(st.integers(1, 3))
    return {
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.integers(1, 3)),
        "lens": draw(st.lists(st.integers(0, 5), min_size=4, max_size=4)),
        "causal": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**20)),
    }


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ulysses_any_heads_any_lengths(local_worlds: Callable[[int], dc.LocalWorld], n: int) -> None:
    def body(batch: list[dict[str, Any]]) -> list[float]:
        n, r = dc.get_world_size(), dc.get_rank()
        errs = []
        for case in batch:
            lens = case["lens"][:n]
            if sum(lens) == 0:
                lens[0] = 1
            S, H, Hk = sum(lens), case["heads"], case["kv_heads"]
            g = torch.Generator().manual_seed(case["seed"])
            q = torch.randn(1, H, S, 4, dtype=torch.float64, generator=g, requires_grad=True)
            k, v = (
                torch.randn(1, Hk, S, 4, dtype=torch.float64, generator=g, requires_grad=True)
                for _ in range(2)
            )
            w = torch.randn(1, H, S, 4, dtype=torch.float64, generator=g)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=case["causal"], enable_gqa=True
            )
            grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
            a = sum(lens[:r])
            mine = slice(a, a + lens[r])
            ql, kl, vl = (t.detach()[:, :, mine].requires_grad_() for t in (q, k, v))
            out = parallel.ulysses_attention(ql, kl, vl, causal=case["causal"])
            lg = torch.autograd.grad((out * w[:, :, mine]).sum(), (ql, kl, vl))
            assert out.shape == (1, H, lens[r], 4)
            if lens[r]:  # a rank may hold no position at all (then it only relays)
                e = [(out - ref.detach()[:, :, mine]).abs().max()]
                e += [(x - y[:, :, mine]).abs().max() for x, y in zip(lg, grads, strict=True)]
                errs.append(float(max(e)))
        return errs

    def assert_ok(world: dc.LocalWorld, batch: list[dict[str, Any]]) -> None:
        for errs in world.run(body, batch):
            assert max(errs, default=0.0) < 1e-12, (errs, batch)

    check_in_batches(local_worlds(n), ulysses_cases(), assert_ok, max_examples=3)


def test_ulysses_double_backward(world3: dc.LocalWorld) -> None:
    """A gradient penalty through Ulysses around a twice-differentiable local attention
    (dense math; torch's CPU SDPA kernel has no double backward) equals the serial one:
    double backward through the all_to_alls."""

    def body() -> float:
        r = dc.get_rank()
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, 4, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
        k, v = (
            torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2)
        )

        def penalty(out: Any, x: Any) -> Any:
            (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
            return gx.pow(2).sum()

        def math(q: Any, k: Any, v: Any, is_causal: bool, scale: float) -> Any:
            return cp.attention_reference(q, k, v, causal=is_causal, scale=scale)

        ref = math(q, k, v, True, 0.5)
        (gq_ref,) = torch.autograd.grad(penalty(ref, q), q)
        mine = slice(2 * r, 2 * r + 2)
        ql = q.detach()[:, :, mine].requires_grad_()
        kl, vl = k.detach()[:, :, mine], v.detach()[:, :, mine]
        out = parallel.ulysses_attention(ql, kl, vl, causal=True, attn_fn=math)
        # the penalty of the whole output is the sum over ranks of the local penalties
        (gq,) = torch.autograd.grad(penalty(out, ql), ql)
        return float((gq - gq_ref[:, :, mine]).abs().max())

    assert max(world3.run(body)) < 1e-10


def _forward_ad_attention() -> dict[str, Any]:
    from torch.autograd import forward_ad as fwad

    from diffcomm.backend import log_comms

    r = dc.get_rank()
    g = torch.Generator().manual_seed(3)
    q, k, v, tq, tk, tv = (torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=g) for _ in range(6))
    _, want = torch.func.jvp(
        lambda a, b, c: cp.attention_reference(a, b, c, causal=True), (q, k, v), (tq, tk, tv)
    )
    mine = slice(4 * r, 4 * r + 4)
    with fwad.dual_level():
        ql, kl, vl = (fwad.make_dual(a[:, :, mine], t[:, :, mine]) for a, t in ((q, tq), (k, tk), (v, tv)))
        out = parallel.ulysses_attention(ql, kl, vl, causal=True, attn_fn=cp.attention_reference)
        err = float((fwad.unpack_dual(out).tangent - want[:, :, mine]).abs().max())
        with log_comms() as log:
            try:
                parallel.ring_attention(ql, kl, vl, causal=True)
                msg = "no error"
            except RuntimeError as exc:
                msg = f"{exc} | comms={log.count()}"
    return {"ulysses": err, "ring": msg}


def test_forward_mode_ad_through_ulysses_and_a_clear_error_from_the_ring(world2: dc.LocalWorld) -> None:
    """``torch.autograd.forward_ad`` (dual tensors): Ulysses gives the serial tangent; ring
    attention (no forward-mode rule) raises naming the op, before any communication.
    Before: Ulysses raised torch's "forward is returning a view ... but the jvp is not
    returning a view" (its entry's jvp returned the tangent itself), the ring torch's
    "You must implement the jvp function", naming no op."""
    for res in world2.run(_forward_ad_attention):
        assert res["ulysses"] < 1e-12, res
        assert "parallel.ring_attention(): has no forward-mode derivative" in res["ring"], res
        assert res["ring"].endswith("comms=0"), res


# --------------------------------------------------------------------------------- USP


def test_usp_on_a_2x2_mesh_and_two_groups(world4: dc.LocalWorld) -> None:
    def body() -> list[float]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        r = dc.get_rank()
        groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
        u_group = groups[0] if r in (0, 1) else groups[1]
        r_group = groups[2] if r in (0, 2) else groups[3]
        errs = []
        cases = [
            ("zigzag", True, 4, 2, 16, None),
            ("zigzag", True, 3, 1, 13, None),
            ("contiguous", False, 2, 2, 11, None),
            ("zigzag", True, 4, 2, 19, [0, 6, 7, 19]),
        ]
        singles = [dist.new_group([i]) for i in range(4)]
        cases.append(("zigzag", True, 5, 1, 17, [0, 9, 17]))  # Ulysses over 4 ranks, a ring of one
        for i, (layout, causal, H, Hk, S, cu) in enumerate(cases):
            ug, rg = ((mesh, "ulysses"), (mesh, "ring")) if i % 2 == 0 else (u_group, r_group)
            if i == 4:
                ug, rg = dist.group.WORLD, singles[r]
            g = torch.Generator().manual_seed(i)
            q = torch.randn(2, H, S, 4, dtype=torch.float64, generator=g, requires_grad=True)
            k, v = (
                torch.randn(2, Hk, S, 4, dtype=torch.float64, generator=g, requires_grad=True)
                for _ in range(2)
            )
            w = torch.randn(2, H, S, 4, dtype=torch.float64, generator=g)
            ref = cp.attention_reference(q, k, v, causal=causal, cu_seqlens=cu)
            grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
            kw = {"layout": layout, "cu_seqlens": cu, "ulysses_group": ug}
            ql, kl, vl = (cp.shard(t.detach(), 2, rg, **kw).requires_grad_() for t in (q, k, v))
            out = cp.usp_attention(ql, kl, vl, ug, rg, causal=causal, layout=layout, cu_seqlens=cu, seq_len=S)
            lg = torch.autograd.grad((out * cp.shard(w, 2, rg, **kw)).sum(), (ql, kl, vl))
            e = [(out - cp.shard(ref.detach(), 2, rg, **kw)).abs().max()]
            e += [(a - cp.shard(b, 2, rg, **kw)).abs().max() for a, b in zip(lg, grads, strict=True)]
            e.append((cp.unshard(out, 2, rg, seq_len=S, **kw) - ref).abs().max())
            errs.append(float(max(e)))
        return errs

    for errs in world4.run(body):
        assert max(errs) < 1e-12, errs


def test_debug_mode_names_the_argument_ranks_disagree_on(world2: dc.LocalWorld) -> None:
    def body() -> str:
        q = torch.randn(1, 2, 6, 8, requires_grad=True)
        with dc.debug(True):
            out = parallel.ring_attention(q, q, q, causal=True, layout="zigzag", cu_seqlens=[0, 3, 8])
            out.sum().backward()  # consistent calls pass
            try:
                parallel.ring_attention(q, q, q, causal=dc.get_rank() == 0)
            except dc.CrossRankMismatchError as exc:
                return str(exc)
        return "no error"

    for msg in world2.run(body):
        assert "ring_attention" in msg and "causal differs (rank 0: 1, rank 1: 0)" in msg, msg


@pytest.mark.parametrize("which", ["ring_scale", "ulysses_scale", "ulysses_causal"])
def test_debug_mode_names_a_scale_or_causal_only_each_rank_reads(world2: dc.LocalWorld, which: str) -> None:
    """A ``scale`` (ring, Ulysses) or ``causal`` (Ulysses) that differs between ranks
    travels in no communication: each rank attended with its own, a silently wrong output
    and gradient even in debug mode. Debug mode compares them."""

    def body(which: str) -> str:
        r = dc.get_rank()
        q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(r))
        with dc.debug(True):
            try:
                if which == "ring_scale":
                    parallel.ring_attention(q, q, q, scale=0.5 if r else None)
                elif which == "ulysses_scale":
                    parallel.ulysses_attention(q, q, q, scale=0.5 if r else None)
                else:
                    parallel.ulysses_attention(q, q, q, causal=r == 1)
            except dc.CrossRankMismatchError as exc:
                return str(exc)
        return "no error"

    field = "causal differs (rank 0: 0, rank 1: 1)" if which == "ulysses_causal" else "scale differs"
    for msg in world2.run(body, which):
        assert which.split("_")[0] in msg and field in msg, msg


@pytest.mark.usefixtures("debug_off")
@pytest.mark.parametrize(
    "fn, which",
    [
        ("ring", "causal"),
        ("ring", "scale"),
        ("ring", "layout"),
        ("ulysses", "causal"),
        ("ulysses", "scale"),
    ],
)
def test_attention_settings_that_differ_ride_in_the_length_exchange_without_debug_mode(
    world3: dc.LocalWorld, fn: str, which: str
) -> None:
    """With no ``seq_len`` (ring) or ``seq_lens`` (Ulysses) the call already exchanges the
    shards' lengths (one small all_gather of host ints); ``causal`` on one rank only (or
    another ``scale``, or ``layout``) went nowhere and gave a silently wrong output there.
    They travel with the length now, and every rank raises naming the setting."""

    def body(fn: str, which: str) -> str:
        odd = dc.get_rank() == 1
        q = torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(dc.get_rank()))
        kw = {
            "causal": {"causal": odd},
            "scale": {"scale": 0.5 if odd else None},
            "layout": {"layout": "zigzag" if odd else "contiguous"},
        }[which]
        try:
            (parallel.ring_attention if fn == "ring" else parallel.ulysses_attention)(q, q, q, **kw)
        except dc.CrossRankMismatchError as exc:
            return str(exc)
        return "no error"

    want = {
        "causal": "causal differs (rank 0: False, rank 1: True, rank 2: False)",
        "scale": "scale differs (rank 0: 0.35355",
        "layout": "layout differs (rank 0: contiguous, rank 1: zigzag, rank 2: contiguous)",
    }[which]
    for msg in world3.run(body, fn, which):
        assert msg.startswith(f"diffcomm.parallel.{fn}_attention(): ranks called it with inconsistent"), msg
        assert want in msg, msg


def test_llama_block_with_context_parallelism_equals_serial(world3: dc.LocalWorld) -> None:
    """``examples/context_parallel_llama.py``: a Llama-style block (RMSNorm, RoPE, GQA,
    SwiGLU) with ring attention equals the serial block — output, loss and every weight's
    gradient — in both layouts, with a length the layout must pad (25 over 3 ranks)."""
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[2] / "examples")

    def body() -> list[dict[str, float]]:
        if examples not in sys.path:
            sys.path.insert(0, examples)
        from context_parallel_llama import compare

        with warnings.catch_warnings():  # the example prints no warning (it printed torch's
            warnings.simplefilter("error")  # "Converting a tensor with requires_grad=True")
            return [compare(seq, layout) for seq in (24, 25) for layout in cp.LAYOUTS]

    for per_rank in world3.run(body):
        for errs in per_rank:
            assert max(errs.values()) < 1e-11, per_rank


def test_empty_batch_and_empty_sequence(world2: dc.LocalWorld) -> None:
    def body() -> list[tuple[int, ...]]:
        shapes = []
        for shape in ((0, 2, 4, 8), (1, 2, 0, 8)):
            q = torch.randn(*shape, requires_grad=True)
            k = torch.randn(shape[0], 1, shape[2], 8, requires_grad=True)
            o = parallel.ring_attention(q, k, k, causal=True, layout="zigzag", seq_len=2 * shape[2])
            u = parallel.ulysses_attention(q, k, k, causal=True, layout="contiguous")  # (zigzag above)
            (o.sum() + u.sum()).backward()
            shapes += [tuple(o.shape), tuple(u.shape), tuple(q.grad.shape), tuple(k.grad.shape)]
        return shapes

    for shapes in world2.run(body):
        assert shapes == [(0, 2, 4, 8), (0, 2, 4, 8), (0, 2, 4, 8), (0, 1, 4, 8)] + [(1, 2, 0, 8)] * 3 + [
            (1, 1, 0, 8)
        ]


# ----------------------------------------------------- issue 45: no silent wrong answer


def _ring_under_torch_func(debug: bool) -> list[str]:
    from torch.func import grad, jvp, vmap

    from diffcomm.backend import log_comms

    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    calls = {
        "grad": lambda: grad(lambda qq: cp.ring_attention(qq, k, v, layout="contiguous").sum())(q),
        "vmap": lambda: vmap(lambda qq: cp.ring_attention(qq, k, v, layout="contiguous"))(q[None]),
        "jvp": lambda: jvp(lambda qq: cp.ring_attention(qq, k, v, layout="contiguous"), (q,), (q,)),
    }
    msgs = []
    with dc.debug(debug), log_comms() as log:
        for call in calls.values():
            try:
                call()
                msgs.append("no error")
            except RuntimeError as exc:
                msgs.append(f"{exc} | comms={log.count()}")
    return msgs


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
def test_ring_attention_under_torch_func_is_a_clear_error(local_worlds, debug: bool) -> None:
    """Ring attention's fused ring cannot run under ``torch.func`` (its first-order backward
    is its own): ``grad``, ``vmap`` and ``jvp`` raise naming the op and the ways out, before
    any communication. Before: torch's "must override the setup_context staticmethod"."""
    for msgs in local_worlds(2, in_process=True).run(_ring_under_torch_func, debug):
        for m in msgs:
            assert "parallel.ring_attention(): cannot run under a torch.func transform" in m, m
            assert "ulysses_attention" in m and m.endswith("comms=0"), m


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_gradient_penalty_raises_even_with_a_linear_loss(
    local_worlds: Callable[[int], dc.LocalWorld], n: int
) -> None:
    """The backward is first order only. A gradient penalty through it must raise, also
    when the task loss is *linear* in the output (torch's ``once_differentiable`` then adds
    no error node, and the penalty's term used to vanish silently), and a penalty alone
    raises the same documented error (not torch's generic "does not require grad")."""

    def body() -> list[str]:
        g = torch.Generator().manual_seed(dc.get_rank())
        q, k, v = (
            torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3)
        )
        w = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g)
        msgs = []
        for loss_of in (lambda o: (o * w).sum(), lambda o: o.pow(2).sum()):  # linear, then not
            for penalty_only in (False, True):
                task = loss_of(cp.ring_attention(q, k, v, causal=True))
                (gq,) = torch.autograd.grad(task, q, create_graph=True)
                penalty = gq.square().sum()
                try:
                    (penalty if penalty_only else task + penalty).backward()
                    msgs.append("no error")
                except RuntimeError as exc:
                    msgs.append(str(exc))
                dc.all_reduce(torch.zeros(1))  # keep the ranks in step
        return msgs

    for msgs in local_worlds(n).run(body):
        assert len(msgs) == 4
        for m in msgs:
            assert "parallel.ring_attention has a first-order backward only" in m, msgs
            assert "ulysses_attention" in m, m


def test_shard_with_the_defaults_then_attend_without_layout_is_right(world3: dc.LocalWorld) -> None:
    """The issue's program: shard with the defaults, ``ring_attention(..., causal=True)``
    without ``layout=``, unshard with the defaults — it used to run and be wrong (shard
    zigzag, ring contiguous: max error 1.39, gradients off by ~1). Every entry point now
    has one default, and the placement travels with the shards: right with the tensors
    straight from ``shard``, right with the placement lost on the way (a new tensor), and
    right for an explicit ``layout="zigzag"`` given to ``shard`` only."""

    def body() -> list[float]:
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=g) for _ in range(3))
        w = torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=g)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        (ref * w).sum().backward()
        errs = []
        for how in ("defaults", "placement lost", "zigzag given to shard only"):
            kw = {"layout": "zigzag"} if how.startswith("zigzag") else {}
            ins = [parallel.shard(t, **kw).requires_grad_() for t in (q, k, v)]
            used = [t * 1.0 for t in ins] if how == "placement lost" else ins  # a new tensor
            assert (cp.placement_of(used[0]) is None) == (how == "placement lost")
            out = parallel.ring_attention(*used, causal=True)
            full = parallel.unshard(out)
            errs.append(float((full - ref.detach()).abs().max()))
            # the objective: the sum over ranks of <out_r, w_r> = <ref, w>
            (out * parallel.shard(w, **kw)).sum().backward()
            for a, b in zip(ins, (qr, kr, vr), strict=True):
                errs.append(float((a.grad - parallel.shard(b.grad, **kw)).abs().max()))
        return errs

    for errs in world3.run(body):
        assert max(errs) < 1e-12, errs


def test_a_sequence_placed_one_way_and_used_another_raises(world4: dc.LocalWorld) -> None:
    """Every wrong combination of a placement and a use is a ``ValueError`` naming the
    argument, before any communication: an explicit layout against the shards', q and k
    placed differently, an output unsharded with another layout, a zigzag shard or a USP
    shard fed to Ulysses, a USP shard fed to the ring, a placement over another group size,
    and over another group of the same size (usp_attention's two groups swapped, another
    mesh axis: those ran, with wrong attention, 1.56 and 2.87 off SDPA)."""

    def body() -> dict[str, str]:
        import torch.distributed as dist

        r = dc.get_rank()
        x = torch.randn(1, 2, 16, 4, dtype=torch.float64)
        zig = parallel.shard(x, layout="zigzag")
        cont = parallel.shard(x)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ring_g = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ug, rg = pairs[r // 2], ring_g[r % 2]
        usp = parallel.shard(x, 2, rg, ulysses_group=ug)
        pair = parallel.shard(x, group=ug)  # placed over a group of 2
        out = parallel.ring_attention(zig, zig, zig, causal=True)  # zigzag, from the shards
        calls = {
            "ring explicit": lambda: parallel.ring_attention(zig, zig, zig, causal=True, layout="contiguous"),
            "ring explicit 2": lambda: parallel.ring_attention(cont, cont, cont, layout="zigzag"),
            "q vs k": lambda: parallel.ring_attention(zig, cont, cont, causal=True),
            "unshard": lambda: parallel.unshard(out, layout="contiguous"),
            "ulysses zigzag": lambda: parallel.ulysses_attention(zig, zig, zig, causal=True),
            "ulysses usp": lambda: parallel.ulysses_attention(usp, usp, usp, group=ug),
            "ring usp": lambda: parallel.ring_attention(usp, usp, usp, rg),
            "usp plain": lambda: parallel.usp_attention(pair, pair, pair, ug, rg),
            "world": lambda: parallel.ring_attention(pair, pair, pair),
            "unshard usp": lambda: parallel.unshard(usp, 2, rg),
            # over another group of as many ranks (issue 45: once silently wrong attention)
            "usp swapped": lambda: parallel.usp_attention(usp, usp, usp, rg, ug),
            "other axis": lambda: parallel.ring_attention(pair, pair, pair, ring_g[r % 2]),
            "unshard other axis": lambda: parallel.unshard(pair, group=ring_g[r % 2]),
            "q vs k groups": lambda: parallel.ring_attention(pair, parallel.shard(x, group=rg), pair, ug),
        }
        return refusals(calls)

    expect = {
        "ring explicit": "`layout` must be 'zigzag', the layout `q` was placed with",
        "ring explicit 2": "`layout` must be 'contiguous', the layout `q` was placed with",
        "q vs k": "`k` must be placed like `q` (layout='zigzag' over 4 ranks)",
        "unshard": "parallel.unshard(): `layout` must be 'zigzag', the layout `x` was placed with",
        "ulysses zigzag": "parallel.ulysses_attention(): `q` must be placed with layout='contiguous' "
        "(the only order parallel.ulysses_attention takes), got a tensor placed with layout='zigzag'",
        "ulysses usp": "parallel.ulysses_attention(): `q` must be placed without a Ulysses split",
        "ring usp": "parallel.ring_attention(): `q` must be placed without a Ulysses split",
        "usp plain": "usp_attention(): `q` must be placed for usp_attention with a Ulysses group of 2",
        "world": "parallel.ring_attention(): `q` must be placed over this group's 4 ranks",
        "unshard usp": "parallel.unshard(): `x` must be placed without a Ulysses split",
        "usp swapped": "usp_attention(): `q` must be placed over this op's group, ranks",
        "other axis": "ring_attention(): `q` must be placed over this op's group, ranks",
        "unshard other axis": "unshard(): `x` must be placed over this op's group, ranks",
        "q vs k groups": "`k` must be placed like `q` (layout='contiguous' over 2 ranks [",
    }
    for res in world4.run(body):
        for key, want in expect.items():
            assert want in res[key] and res[key].endswith("[0 comms]"), (key, res[key])


def test_ulysses_refuses_the_whole_sequence_under_the_check_as_the_ring_does(world2: dc.LocalWorld) -> None:
    """Fed the whole sequence on every rank (a replicated value), ring attention is
    refused by ``dc.spmd_check``; Ulysses used to accept it (its all_to_alls take it for
    ``W`` pieces of a longer sequence: a silent wrong answer). Now both are refused, naming
    the op and the argument; this rank's piece (varying) passes."""

    def body() -> dict[str, str]:
        full = torch.randn(1, 2, 8, 4, dtype=torch.float64)
        res = {}
        for name, op in (("ring", parallel.ring_attention), ("ulysses", parallel.ulysses_attention)):
            with dc.spmd_check():
                try:
                    op(full, full, full, causal=True)
                    res[name] = "no error"
                except dc.SPMDTypeError as exc:
                    res[name] = str(exc)
            with dc.spmd_check():
                piece = dc.spmd.varying(parallel.shard(full).requires_grad_())
                op(piece, piece, piece, causal=True).sum().backward()
        return res

    for res in world2.run(body):
        assert "RingAttention" in res["ring"] and "replicated" in res["ring"], res
        assert "UlyssesAttention" in res["ulysses"] and "not the whole sequence" in res["ulysses"], res


def _usp_contiguous_documents_unshard() -> float:
    """USP under ``"contiguous"`` with packed documents on a 2x2 mesh, S = 10: the ring
    ranks hold 5 positions each, the Ulysses pieces 3 and 2. The output's placement
    recorded the documents but no length, and ``unshard`` takes documents from a zigzag
    placement only, so each rank inferred its own ``U * seq_local`` (6 or 4): the
    all_gathers disagreed (gloo aborted a rank; in-process a shape error)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    ug, rg = (mesh, "ulysses"), (mesh, "ring")
    s, cu = 10, [0, 3, 10]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, s, 4, dtype=torch.float64, generator=g) for _ in range(3))
    kw = {"layout": "contiguous", "cu_seqlens": cu, "ulysses_group": ug}
    ql, kl, vl = (cp.shard(t, 2, rg, **kw) for t in (q, k, v))
    out = cp.usp_attention(ql, kl, vl, ug, rg, causal=True, cu_seqlens=cu)
    ref = cp.attention_reference(q, k, v, causal=True, cu_seqlens=cu)
    return float((cp.unshard(out, 2, rg, ulysses_group=ug) - ref).abs().max())


def test_usp_output_with_contiguous_documents_unshards(local_worlds: Callable[..., dc.LocalWorld]) -> None:
    errs = local_worlds(4, in_process=True).run(_usp_contiguous_documents_unshard)
    assert max(errs) < 1e-12, errs


def _masks_against_serial(kind: str) -> float:
    """World 3, zigzag, S = 10 (padded), causal, GQA 4:2; float64 against dense attention.
    ``"kpm"``: a key-padding mask ``(batch, 1, 1, S)``, bool and additive (its gradient
    summed over the ranks), the same tensor on every rank: refused before ("seq_local=4"
    wanted for the row dim) though documented as broadcastable. ``"placed"``: an additive
    ``(batch, heads, S, S)`` mask leaf sharded by rows: ``unshard(mask.grad)`` raised
    (``seq_len`` / ``layout`` must be given) where ``unshard(q.grad)`` used q's placement."""
    s, b, h, kv = 10, 2, 4, 2
    g = torch.Generator().manual_seed(6)
    q = torch.randn(b, h, s, 4, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, kv, s, 4, dtype=torch.float64, generator=g) for _ in range(2))
    w = torch.randn(b, h, s, 4, dtype=torch.float64, generator=g)
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
    keep[0, ..., -3:] = False
    keep[1, ..., :2] = False
    if kind == "kpm":
        masks = [keep, torch.randn(b, 1, 1, s, dtype=torch.float64, generator=g)]
    else:
        masks = [torch.randn(b, h, s, s, dtype=torch.float64, generator=g)]
    worst = 0.0
    for m in masks:
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        mf = m.clone().requires_grad_(m.is_floating_point())
        allowed = torch.ones(s, s, dtype=torch.bool).tril() & (mf if m.dtype == torch.bool else True)
        sc = qf @ kf.repeat_interleave(2, 1).transpose(-1, -2) / 2.0
        sc = sc + mf if m.is_floating_point() else sc
        ref = torch.softmax(sc.masked_fill(~allowed, float("-inf")), -1) @ vf.repeat_interleave(2, 1)
        (ref * w).sum().backward()
        ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
        ml = m.clone() if kind == "kpm" else parallel.shard(m, layout="zigzag")
        ml.requires_grad_(m.is_floating_point())
        out = parallel.ring_attention(ql, kl, vl, causal=True, attn_mask=ml)
        (out * parallel.shard(w, layout="zigzag")).sum().backward()
        got = [parallel.unshard(t) for t in (out, ql.grad, kl.grad, vl.grad)]
        errs = [(a - r).abs().max() for a, r in zip(got, (ref, qf.grad, kf.grad, vf.grad), strict=True)]
        if m.is_floating_point():
            dm = dc.all_reduce(ml.grad) if kind == "kpm" else parallel.unshard(ml.grad)
            errs.append((dm - mf.grad).abs().max())
        worst = max(worst, float(max(errs)))
    return worst


@pytest.mark.parametrize("kind", ["kpm", "placed"])
def test_key_padding_masks_and_placed_mask_gradients(
    local_worlds: Callable[..., dc.LocalWorld], kind: str
) -> None:
    errs = local_worlds(3, in_process=True).run(_masks_against_serial, kind)
    assert max(errs) < 1e-12, errs


def _placed_along_another_dim() -> dict[str, str]:
    """The placement's sequence dim. ``(B, S, D)`` sharded along dim 1 (zigzag, S = 10,
    world 3: 4 local positions) and unsharded with the default ``dim=2``: with ``D = 4``
    it gathered the hidden dim as the sequence, a ``(2, 4, 10)`` tensor of shuffled values.
    ``(B, S, H, D)`` (flash-attention's layout) sharded along dim 1 and given to the ring
    as it is: with ``H = 4`` it ran, the heads taken for the sequence. No error before."""
    x = torch.arange(2 * 10 * 4, dtype=torch.float64).view(2, 10, 4)
    xl = parallel.shard(x, 1, layout="zigzag")
    assert torch.equal(parallel.unshard(xl, -2), x)  # the placed dim, named either way
    q = parallel.shard(torch.randn(1, 10, 4, 8, dtype=torch.float64), 1, layout="zigzag")
    return refusals(
        {
            "unshard": lambda: parallel.unshard(xl),
            "ring": lambda: parallel.ring_attention(q, q, q, causal=True),
            "ulysses": lambda: parallel.ulysses_attention(q, q, q),
        },
        "| comms={}",
    )


def test_a_placement_is_used_along_its_own_dim(local_worlds: Callable[..., dc.LocalWorld]) -> None:
    for res in local_worlds(3, in_process=True).run(_placed_along_another_dim):
        assert "`dim` must be 1, the sequence dim `x` was placed along, got 2" in res["unshard"], res
        for op in ("ring", "ulysses"):
            assert "`q` must be placed along the sequence dim 2" in res[op], res
        assert all(m.endswith("comms=0") for m in res.values()), res


def _placed_grads_and_lengths() -> dict[str, Any]:
    """The gradient of a placed leaf carries its placement after every accumulation (one
    hook however many calls); a padded shard's recorded length reaches unshard of the
    output and of the gradient; a cu_seqlens that contradicts it is refused."""
    w = dc.get_world_size()
    s = 5 * w  # padded under zigzag (2W chunks of ceil(5/2)=3)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 4, dtype=torch.float64, generator=g) for _ in range(3))
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    for _ in range(2):  # two backwards: the grad accumulates, and stays tagged
        parallel.ring_attention(ql, kl, vl, causal=True).sum().backward()
    assert ql.grad is not None
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    (2 * parallel.attention_reference(qf, kf, vf, causal=True).sum()).backward()
    hooks = len(getattr(ql, "_post_accumulate_grad_hooks", None) or {})
    out: dict[str, Any] = {
        "dq": float((parallel.unshard(ql.grad) - qf.grad).abs().max()),
        "placement": cp.placement_of(ql.grad),
        "hooks": hooks,
    }
    try:
        parallel.ring_attention(ql, kl, vl, cu_seqlens=[0, 2, s + 1])
    except ValueError as exc:
        out["cu"] = str(exc)
    return out


def test_placed_gradients_and_the_recorded_length(world2: dc.LocalWorld) -> None:
    for res in world2.run(_placed_grads_and_lengths):
        assert res["dq"] < 1e-12
        assert res["placement"] == cp.Placement("zigzag", 2)
        assert res["hooks"] == 1
        assert "`cu_seqlens` must be cumulative lengths ending at 10" in res["cu"]


def test_attention_reference_takes_sdpa_is_causal() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(parallel.attention_reference(q, k, v, is_causal=True), want, atol=1e-12)
    assert torch.allclose(
        parallel.attention_reference(q, k, v, causal=True, is_causal=True), want, atol=1e-12
    )
    with pytest.raises(ValueError, match="`is_causal`"):
        parallel.attention_reference(q, k, v, causal=True, is_causal=False)
    with pytest.raises(TypeError, match="`is_causal`"):
        parallel.attention_reference(q, k, v, is_causal=1)  # type: ignore[arg-type]


def _packed_zigzag(s: int, cu: list[int]) -> dict[str, Any]:
    """Packed documents under zigzag: each document is zigzagged on its own, so the
    documents are part of the layout. The output's placement did not record them:
    ``unshard(out)`` used the plain zigzag table (3.16 off the document-causal attention,
    the gradient 0.98 off), and an attention call told other documents (or none) than the
    sequence was placed with read its positions in a wrong order, all without an error."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, s, 4, dtype=torch.float64, generator=g) for _ in range(3))
    ql, kl, vl = (parallel.shard(t, layout="zigzag", cu_seqlens=cu).requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True, cu_seqlens=cu)
    out.sum().backward()
    qf = q.clone().requires_grad_()
    ref = parallel.attention_reference(qf, k, v, causal=True, cu_seqlens=cu)
    ref.sum().backward()  # (the sum of the ranks' objectives: the whole output's sum)
    res: dict[str, Any] = {
        "out": float((parallel.unshard(out) - ref).abs().max()),
        "dq": float((parallel.unshard(ql.grad) - qf.grad).abs().max()),
    }
    plain = [parallel.shard(t, layout="zigzag") for t in (q, k, v)]
    calls = {
        "no_cu": lambda: parallel.ring_attention(ql, kl, vl, causal=True),
        "other_cu": lambda: parallel.ring_attention(ql, kl, vl, causal=True, cu_seqlens=[0, 2, s]),
        "cu_on_plain": lambda: parallel.ring_attention(*plain, causal=True, cu_seqlens=cu),
        "unshard_other": lambda: parallel.unshard(out, cu_seqlens=[0, 2, s]),
    }
    res.update(refusals(calls, "| comms={}"))
    # one document is no packing: the same table as none
    res["one_doc"] = parallel.ring_attention(*plain, causal=True, cu_seqlens=[0, s]).shape == plain[0].shape
    return res


@pytest.mark.parametrize(("s", "cu"), [(8, [0, 4, 8]), (11, [0, 5, 11])])
def test_packed_documents_are_part_of_a_zigzag_placement(
    world2: dc.LocalWorld, s: int, cu: list[int]
) -> None:
    for res in world2.run(_packed_zigzag, s, cu):
        assert res["out"] < 1e-12 and res["dq"] < 1e-12, res
        for name in ("no_cu", "other_cu", "cu_on_plain", "unshard_other"):
            assert "`cu_seqlens` must be the documents" in res[name] and res[name].endswith("comms=0"), res
        assert res["one_doc"]
