"""Context parallelism's last silent wrong answers (issue 45): a sequence whose layout the
op can only guess, and shards of unequal length.

* An entry point that reads a layout (``ring_attention``, ``usp_attention``, ``unshard``)
  given tensors that carry no placement and no ``layout=`` uses the default
  (``"contiguous"``) -- unless the program used another layout over as many ranks
  (``shard``, ``layout_index``, an op given ``layout=``): then it raises ``ValueError``
  naming ``layout``, before any communication. The rule only ever raises: in every case
  where it does not, the value equals serial attention.
* Shards of unequal length with no ``seq_len=`` raise ``ValueError`` naming ``q`` and
  every rank's length on every rank (one small exchange), not a rank aborted by gloo.

The references are torch's SDPA over the whole sequence and the positions each rank
holds, written here from the docs' pictures (not read from the library).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import diffcomm as dc
from diffcomm import _lifecycle, parallel
from diffcomm import backend as B

F64 = torch.float64
TOL = 1e-12
NAMED = "`layout` must be named"


def _positions(s: int, w: int, r: int, layout: str) -> list[int]:
    """Rank ``r``'s global positions (``s`` divisible by ``2w``), from the docs' pictures."""
    if layout == "contiguous":
        c = s // w
        return list(range(r * c, (r + 1) * c))
    c = s // (2 * w)  # zigzag: chunks r and 2W-1-r of 2W
    return list(range(r * c, (r + 1) * c)) + list(range((2 * w - 1 - r) * c, (2 * w - r) * c))


def _inputs(s: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    return tuple(torch.randn(1, 2, s, 4, dtype=F64, generator=g) for _ in range(4))


def _shards(
    ts: tuple[torch.Tensor, ...], how: str, layout: str, w: int, r: int, dim: int = 2
) -> list[torch.Tensor]:
    """This rank's shards of ``ts``, made three ways: ``"shard"`` (placed),
    ``"layout_index"`` (by hand with the library's table: unplaced) or ``"dropped"``
    (``shard``, then an op that makes a new tensor: unplaced)."""
    if how == "shard":
        return [parallel.shard(t, dim, layout=layout) for t in ts]
    if how == "layout_index":
        idx = parallel.layout_index(ts[0].shape[dim], w, layout=layout)[r]
        return [t.index_select(dim, idx) for t in ts]
    return [parallel.shard(t, dim, layout=layout) * 1.0 for t in ts]


def _attempt(fn: Any) -> tuple[str, Any, int]:
    """``("ok", value, comms)`` or ``("err", message, comms)``; ``comms``: the raw
    communications diffcomm ran during the attempt."""
    with B.log_comms() as log:
        try:
            out = ("ok", fn())
        except ValueError as exc:
            out = ("err", str(exc))
    return (*out, len(log.records))


def _grid(w: int) -> dict[str, tuple[str, Any, int]]:
    """Every combination (layout the shards are in, how they were made, layout named at
    the op or not) through ring_attention and unshard, each its own program."""
    r = dc.get_rank()
    s = 4 * w
    q, k, v, cot = _inputs(s)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    res: dict[str, tuple[str, Any, int]] = {}
    for layout, how, named in itertools.product(
        ("contiguous", "zigzag"), ("shard", "layout_index", "dropped"), (True, False)
    ):
        _lifecycle.program_start()  # each case is a program of its own (a fresh run)
        kw = {"layout": layout} if named else {}
        ql, kl, vl = _shards((q, k, v), how, layout, w, r)
        pos = _positions(s, w, r, layout)

        def ring(ql: Any = ql, kl: Any = kl, vl: Any = vl, kw: Any = kw, pos: Any = pos) -> float:
            out = parallel.ring_attention(ql, kl, vl, causal=True, **kw)
            return float((out - ref[:, :, pos]).abs().max())

        res[f"ring {layout} {how} named={named}"] = _attempt(ring)
        (xl,) = _shards((cot,), how, layout, w, r)

        def gather(xl: torch.Tensor = xl, kw: Any = kw) -> float:
            return float((parallel.unshard(xl, **kw) - cot).abs().max())

        res[f"unshard {layout} {how} named={named}"] = _attempt(gather)
    # another layout used over another number of ranks does not make this group's guess
    _lifecycle.program_start()
    parallel.layout_index(s, w + 1, layout="zigzag")
    q0, k0, v0 = (t.chunk(w, 2)[r] for t in (q, k, v))
    pos = _positions(s, w, r, "contiguous")
    res["ring other world"] = _attempt(
        lambda: float((parallel.ring_attention(q0, k0, v0, causal=True) - ref[:, :, pos]).abs().max())
    )
    return res


def _expect_grid(results: list[dict[str, tuple[str, Any, int]]]) -> None:
    for rank, res in enumerate(results):
        assert len(res) == 2 * 2 * 3 * 2 + 1
        for case, (kind, value, comms) in res.items():
            _, layout, how, named = (case.split() + ["", "", ""])[:4]
            guess = named == "named=False" and how != "shard" and layout == "zigzag"
            if guess:  # unplaced, unnamed, and the program used zigzag: refused
                assert kind == "err", f"rank {rank} {case}: no error, difference {value}"
                assert NAMED in value and "'zigzag'" in value, (case, value)
                assert comms == 0, f"rank {rank} {case}: {comms} communications before the error"
            else:  # the rule raised nothing: the value is right
                assert kind == "ok", f"rank {rank} {case}: {value}"
                assert value <= TOL, f"rank {rank} {case}: silently wrong by {value}"


@pytest.mark.parametrize("w", [2, 3, 4])
def test_a_guessed_layout_is_refused_and_only_a_guess(local_worlds: Any, w: int) -> None:
    """Worlds 2-4, both layouts, shards placed / by hand / projected, the layout named or
    not: right, or (unplaced, unnamed, zigzag in use) a ValueError naming ``layout``
    before any communication (debug mode pinned off: its argument check communicates
    first; the suite also runs under DIFFCOMM_DEBUG=1)."""
    with dc.debug(False):
        _expect_grid(local_worlds(w).run(_grid, w))


def test_a_guessed_layout_is_refused_in_process() -> None:
    """The same grid on an in-process world (each rank's record is its own)."""
    with dc.debug(False), dc.LocalWorld(2, in_process=True) as world:
        _expect_grid(world.run(_grid, 2))


def _usp_grid() -> dict[str, tuple[str, Any, int]]:
    """usp_attention on a 2x2 mesh (Ulysses pairs (0,1), (2,3); rings (0,2), (1,3))."""
    r = dc.get_rank()
    pairs = [dist.new_group(g) for g in ([0, 1], [2, 3], [0, 2], [1, 3])]  # every rank makes all
    ug, rg = pairs[r // 2], pairs[2 + r % 2]
    q, k, v, _ = _inputs(16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    res: dict[str, tuple[str, Any, int]] = {}
    for layout, placed, named in itertools.product(("contiguous", "zigzag"), (True, False), (True, False)):
        _lifecycle.program_start()
        ql, kl, vl = (parallel.shard(t, 2, rg, layout=layout, ulysses_group=ug) for t in (q, k, v))
        if not placed:
            ql, kl, vl = ql * 1.0, kl * 1.0, vl * 1.0
        kw = {"layout": layout} if named else {}
        ring_pos = _positions(16, 2, r // 2, layout)
        pos = ring_pos[:4] if r % 2 == 0 else ring_pos[4:]

        def usp(ql: Any = ql, kl: Any = kl, vl: Any = vl, kw: Any = kw, pos: Any = pos) -> float:
            out = parallel.usp_attention(ql, kl, vl, ug, rg, causal=True, **kw)
            return float((out - ref[:, :, pos]).abs().max())

        res[f"usp {layout} placed={placed} named={named}"] = _attempt(usp)
    return res


def test_usp_refuses_a_guessed_layout(local_worlds: Any) -> None:
    for rank, res in enumerate(local_worlds(4).run(_usp_grid)):
        for case, (kind, value, comms) in res.items():
            if "zigzag placed=False named=False" in case:
                assert kind == "err" and NAMED in value and comms == 0, (rank, case, value, comms)
            else:
                assert kind == "ok" and value <= TOL, (rank, case, kind, value)


def test_the_record_is_the_programs_not_the_worlds(local_worlds: Any) -> None:
    """A LocalWorld rank forgets the layouts of the last ``run``: a shared world (the test
    suite's, a notebook's) does not carry one program's zigzag into the next, while
    inside one run the record holds."""

    def zigzag_program() -> str:
        parallel.layout_index(8, 2, layout="zigzag")
        q = torch.randn(1, 2, 4, 4)
        try:
            parallel.ring_attention(q, q, q, causal=True)
        except ValueError as exc:
            return str(exc)
        return "no error"

    def plain_program() -> float:
        q, k, v, _ = _inputs(8)
        r = dc.get_rank()
        out = parallel.ring_attention(*(t.chunk(2, 2)[r] for t in (q, k, v)), causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return float((out - ref.chunk(2, 2)[r]).abs().max())

    world = local_worlds(2)
    assert all(NAMED in m for m in world.run(zigzag_program))
    assert max(world.run(plain_program)) <= TOL


# ----------------------------------------------------------------------- unequal lengths


def _uneven(lens: list[int]) -> tuple[str, Any, int]:
    """Contiguous pieces of lengths ``lens`` (rank order), cut by hand; no ``seq_len``."""
    r = dc.get_rank()
    q, k, v, _ = _inputs(sum(lens))
    lo = sum(lens[:r])
    ql, kl, vl = (t[:, :, lo : lo + lens[r]] for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, lo : lo + lens[r]]
    return _attempt(lambda: float((parallel.ring_attention(ql, kl, vl, causal=True) - ref).abs().max()))


@pytest.mark.parametrize("w", [2, 3, 4])
def test_unequal_lengths_are_a_value_error_on_every_rank(local_worlds: Any, w: int) -> None:
    """Shards cut by hand with unequal lengths and no ``seq_len``: every rank raises
    ``ValueError`` naming ``q`` and every rank's length, after one small exchange (no
    rank dies, nothing is computed); equal lengths pass with that exchange and the ring.
    Debug mode pinned off (the suite also runs under DIFFCOMM_DEBUG=1); in debug mode its
    argument check finds the lengths apart first, as a ValueError naming ``q``, on every
    rank."""
    world = local_worlds(w)
    patterns = [[3] * (w - 1) + [1], [1] + [2] * (w - 1), list(range(1, w + 1))]
    for lens in patterns:
        with dc.debug(False):
            results = world.run(_uneven, lens)
        for rank, (kind, msg, comms) in enumerate(results):
            assert kind == "err", (lens, rank, msg)
            listed = ", ".join(f"rank {i}: {n}" for i, n in enumerate(lens))
            assert "ring_attention(): `q` must be of the same length" in msg and listed in msg, (lens, msg)
            assert comms == 1, (lens, rank, comms)  # the length exchange, no hop
        with dc.debug(True):
            results = world.run(_uneven, lens)
        for rank, (kind, msg, _) in enumerate(results):
            assert kind == "err" and "inconsistent arguments" in msg and "q differs" in msg, (lens, rank, msg)
    with dc.debug(False):
        results = world.run(_uneven, [3] * w)
    for rank, (kind, err, comms) in enumerate(results):
        assert kind == "ok" and err <= TOL, (rank, err)
        assert comms == 1 + (w - 1), (rank, comms)  # the exchange, then the W-1 hops


def test_placed_or_given_lengths_skip_the_exchange(local_worlds: Any) -> None:
    """The lengths are known from a placement or ``seq_len=``: no exchange, only hops
    (debug mode, whose argument check communicates, pinned off)."""

    def body() -> list[int]:
        r, w = dc.get_rank(), dc.get_world_size()
        q, k, v, _ = _inputs(12)
        counts = []
        for ts, kw in (
            ([parallel.shard(t) for t in (q, k, v)], {}),
            ([t.chunk(w, 2)[r] for t in (q, k, v)], {"seq_len": 12}),
        ):
            with B.log_comms() as log:
                parallel.ring_attention(*ts, causal=True, **kw)
            counts.append(len(log.records))
        return counts

    with dc.debug(False):
        results = local_worlds(3).run(body)
    for counts in results:
        assert counts == [2, 2], counts


def _usp_uneven(lens: list[int]) -> tuple[str, Any, int]:
    """usp_attention on the 2x2 mesh of :func:`_usp_grid`, contiguous over the ring, each
    rank's piece cut by hand with length ``lens[rank]``, no ``seq_len``."""
    r = dc.get_rank()
    pairs = [dist.new_group(g) for g in ([0, 1], [2, 3], [0, 2], [1, 3])]
    ug, rg = pairs[r // 2], pairs[2 + r % 2]
    # contiguous over the ring (ring rank r // 2), each ring rank's positions split in
    # order over its Ulysses pair (rank r % 2): the pieces of ranks 0, 1, 2, 3 in order
    q, k, v, _ = _inputs(sum(lens))
    lo = sum(lens[:r])
    ql, kl, vl = (t[:, :, lo : lo + lens[r]] for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, lo : lo + lens[r]]
    return _attempt(
        lambda: float((parallel.usp_attention(ql, kl, vl, ug, rg, causal=True) - ref).abs().max())
    )


def test_usp_unequal_lengths_are_a_value_error_on_every_rank(local_worlds: Any) -> None:
    """The same for usp_attention: every rank of both groups raises (the mismatch is in
    one Ulysses group and one ring group only); equal lengths are right."""
    world = local_worlds(4)
    for lens in ([2, 2, 2, 1], [3, 2, 2, 2], [2, 1, 1, 2]):
        for rank, (kind, msg, _) in enumerate(world.run(_usp_uneven, lens)):
            assert kind == "err", (lens, rank, msg)
            assert "usp_attention(): `q` must be of the same length" in msg, (lens, msg)
            assert f"lengths from {min(lens)} to {max(lens)}" in msg, (lens, msg)
    for rank, (kind, err, _) in enumerate(world.run(_usp_uneven, [2, 2, 2, 2])):
        assert kind == "ok" and err <= TOL, (rank, err)


def _ulysses_grid(w: int) -> dict[str, tuple[str, Any, int]]:
    """ulysses_attention (no ring: the pieces gathered in rank order) over both layouts,
    shards placed / by hand / projected, ``layout=`` named or not, causal or not."""
    r = dc.get_rank()
    s = 4 * w
    q, k, v, _ = _inputs(s)
    res: dict[str, tuple[str, Any, int]] = {}
    for layout, how, named, causal in itertools.product(
        ("contiguous", "zigzag"), ("shard", "layout_index", "dropped"), (True, False), (True, False)
    ):
        _lifecycle.program_start()
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        kw = {"layout": layout} if named else {}
        ql, kl, vl = _shards((q, k, v), how, layout, w, r)
        pos = _positions(s, w, r, layout)

        def uly(
            ql: Any = ql,
            kl: Any = kl,
            vl: Any = vl,
            kw: Any = kw,
            want: Any = ref[:, :, pos],
            c: bool = causal,
        ) -> float:
            out = parallel.ulysses_attention(ql, kl, vl, causal=c, **kw)
            return float((out - want).abs().max())

        res[f"ulysses {layout} {how} named={named} causal={causal}"] = _attempt(uly)
    return res


@pytest.mark.parametrize("w", [2, 3])
def test_ulysses_refuses_a_guessed_or_zigzag_order(local_worlds: Any, w: int) -> None:
    """Ulysses takes only the contiguous order: zigzag shards are refused when placed or
    named, and (causal, the program used zigzag) when they carry no placement and no
    ``layout``; without a mask the order does not matter and the value is right. Every
    refusal comes before any communication; every value that comes is right."""
    for rank, res in enumerate(local_worlds(w).run(_ulysses_grid, w)):
        assert len(res) == 2 * 3 * 2 * 2
        for case, (kind, value, comms) in res.items():
            _, layout, how, named, causal = case.split()
            if layout == "zigzag" and named == "named=True":
                assert kind == "err" and "`layout`" in value and comms == 0, (rank, case, value, comms)
            elif layout == "zigzag" and how == "shard":  # placed zigzag: refused by its placement
                assert kind == "err" and "`q` must be placed" in value and comms == 0, (rank, case, value)
            elif layout == "zigzag" and causal == "causal=True":
                assert kind == "err" and NAMED in value and comms == 0, (rank, case, value, comms)
            else:
                assert kind == "ok", (rank, case, value)
                assert value <= TOL, f"rank {rank} {case}: silently wrong by {value}"


def _ulysses_unplaced_zigzag_noncausal(w: int) -> dict[str, tuple[str, Any, int]]:
    """Non-causal Ulysses on zigzag pieces that lost their placement (projected). Its rows
    are right in any order, but (1) it placed its output as ``"contiguous"``, so
    ``unshard(out)`` reassembled zigzag rows in contiguous order (0.78 off SDPA at world
    3, S = 12; 1.37 at world 2, S = 8), and (2) with a padded length and the ``seq_len=``
    the refusal asks for, it took the last slots in rank order for the padding where
    zigzag's padding is elsewhere (rows 0.21 off at world 3, S = 10; 0.48 at world 2)."""
    res: dict[str, tuple[str, Any, int]] = {}
    for s in (4 * w, 4 * w - 2):
        _lifecycle.program_start()
        res.update(_ulysses_on_dropped_zigzag(s))
    return res


def _ulysses_on_dropped_zigzag(s: int) -> dict[str, tuple[str, Any, int]]:
    q, k, v, _ = _inputs(s)
    ref = F.scaled_dot_product_attention(q, k, v)
    ql, kl, vl = (parallel.shard(t, layout="zigzag") * 1.0 for t in (q, k, v))
    out: list[torch.Tensor] = []

    def attend() -> float:
        out.append(parallel.ulysses_attention(ql, kl, vl, seq_len=s))
        return float((out[0] - parallel.shard(ref, layout="zigzag")).abs().max())

    res = {f"attend {s}": _attempt(attend)}
    if out:
        res[f"unshard {s}"] = _attempt(lambda: float((parallel.unshard(out[0]) - ref).abs().max()))
        res[f"unshard zigzag {s}"] = _attempt(
            lambda: float((parallel.unshard(out[0], layout="zigzag") - ref).abs().max())
        )
    return res


@pytest.mark.parametrize("w", [2, 3])
def test_ulysses_on_unplaced_zigzag_pieces_places_nothing_and_refuses_padding(
    local_worlds: Any, w: int
) -> None:
    for rank, res in enumerate(local_worlds(w, in_process=True).run(_ulysses_unplaced_zigzag_noncausal, w)):
        s, p = 4 * w, 4 * w - 2
        assert res[f"attend {s}"][0] == "ok" and res[f"attend {s}"][1] <= TOL, (rank, res)
        kind, msg, comms = res[f"unshard {s}"]
        assert kind == "err" and NAMED in msg and comms == 0, (rank, res)
        assert res[f"unshard zigzag {s}"][0] == "ok" and res[f"unshard zigzag {s}"][1] <= TOL, (rank, res)
        kind, msg, _ = res[f"attend {p}"]
        assert kind == "err" and NAMED in msg, (rank, res)


def _compiled_zigzag_then_unnamed(first: str) -> dict[str, tuple[str, Any, int]]:
    """A model that shards zigzag and attends without ``layout=``, compiled. Under
    ``torch.compile`` nothing is placed and ``shard`` recorded no layout either, so the
    ring ran the zigzag shards as contiguous (4.10 and 6.43 off SDPA's rows at world 2,
    S = 12) where the same model run eagerly first was refused."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 8, dtype=F64, generator=g)
    wq = torch.randn(8, 8, dtype=F64, generator=g)

    def model(x: torch.Tensor) -> torch.Tensor:
        q = (parallel.shard(x, 1, layout="zigzag") @ wq).view(1, -1, 2, 4).transpose(1, 2)
        return parallel.ring_attention(q, q, q, causal=True)

    q = (x @ wq).view(1, 12, 2, 4).transpose(1, 2)
    want = parallel.shard(F.scaled_dot_product_attention(q, q, q, is_causal=True), layout="zigzag")
    _lifecycle.program_start()
    runs = {"compiled": torch.compile(model, backend="eager"), "eager": model}
    return {
        name: _attempt(lambda fn=runs[name]: float((fn(x) - want).abs().max()))
        for name in (first, "eager" if first == "compiled" else "compiled")
    }


@pytest.mark.parametrize("first", ["compiled", "eager"])
def test_a_compiled_zigzag_shard_is_recorded(local_worlds: Any, first: str) -> None:
    with dc.debug(False):  # (its argument check communicates first)
        out = local_worlds(2, in_process=True).run(_compiled_zigzag_then_unnamed, first)
    for res in out:
        for name, (kind, msg, comms) in res.items():
            assert kind == "err" and NAMED in msg and comms == 0, (name, res)


# ======================================================================================
# a padded sequence: the length is the placement's, or given, never the shards' guess
# ======================================================================================

SEQ_LEN = "`seq_len` must be given"


def _padded_case(
    op: str,
    causal: bool,
    kw: dict[str, Any],
    lay: dict[str, Any],
    ts: list[torch.Tensor],
    cot: torch.Tensor,
    ref: torch.Tensor,
    gref: torch.Tensor,
    idx: torch.Tensor,
) -> float:
    """The largest difference from serial of one padded case: the true positions' values
    (and gradient of ``q``) against SDPA's, the padding slots' against zero."""
    ql, kl, vl, cl = ts
    if op == "unshard":
        return float((parallel.unshard(cl, **lay, **kw) - cot).abs().max())
    attn = parallel.ring_attention if op == "ring" else parallel.ulysses_attention
    out = attn(ql, kl, vl, causal=causal, **lay, **kw)
    (g,) = torch.autograd.grad((out * cl).sum(), ql)
    real = idx >= 0
    err = (out[:, :, real] - ref[:, :, idx[real]]).abs().max()
    gerr = (g[:, :, real] - gref[:, :, idx[real]]).abs().max()
    pads = torch.cat([g[:, :, ~real].flatten(), out[:, :, ~real].flatten(), torch.zeros(1, dtype=F64)])
    return float(max(err, gerr, pads.abs().max()))


def _padded_grid(w: int) -> dict[str, tuple[str, Any, int]]:
    """A sequence of a length the layout does not divide (``shard`` pads it), through
    ring_attention (both layouts), ulysses_attention (its order) and unshard: placed, made
    unplaced by an op (``* 1.0``) with no ``seq_len``, or unplaced with ``seq_len=S``; the
    attention with and without a causal mask. Values of the true positions and, for the
    attention, the gradient of ``q`` (zero in the padding slots)."""
    r = dc.get_rank()
    s = 4 * w - 1  # no layout divides it: the last chunks are padded
    q, k, v, cot = _inputs(s)
    res: dict[str, tuple[str, Any, int]] = {}
    for op, layout, causal, how in itertools.product(
        ("ring", "ulysses", "unshard"),
        ("contiguous", "zigzag"),
        (False, True),
        ("shard", "dropped", "dropped+seq_len"),
    ):
        if (op == "ulysses" and layout == "zigzag") or (op == "unshard" and causal):
            continue  # ulysses takes the contiguous order; unshard has no mask
        _lifecycle.program_start()
        qr = q.clone().requires_grad_()
        ref = F.scaled_dot_product_attention(qr, k, v, is_causal=causal)
        (gref,) = torch.autograd.grad((ref * cot).sum(), qr)
        idx = parallel.layout_index(s, w, layout=layout)[r]
        ts = [parallel.shard(t, 2, layout=layout) for t in (q, k, v, cot)]
        if how != "shard":
            ts = [t * 1.0 for t in ts]
        ts[0].requires_grad_()  # q: its gradient is checked too
        kw: dict[str, Any] = {"seq_len": s} if how == "dropped+seq_len" else {}
        lay = {"layout": layout} if op != "ulysses" else {}
        case = functools.partial(_padded_case, op, causal, kw, lay, ts, cot, ref.detach(), gref, idx)
        res[f"{op} {layout} causal={causal} {how}"] = _attempt(case)
    return res


def _two_lengths_one_local() -> list[str]:
    """S = 10 then S = 11, both zigzag-padded to 4 positions per rank at world 3, each
    projected (unplaced) and attended with no ``seq_len``. The refusal remembered the
    first length only and said "pass seq_len=10" for the length-11 batch: followed, the
    ring reads the S = 11 shards with the S = 10 table (token 10 taken for padding)."""
    msgs = []
    for s in (10, 11):
        q = torch.randn(1, 2, s, 4, dtype=F64, generator=torch.Generator().manual_seed(s))
        ql = parallel.shard(q, layout="zigzag") * 1.0
        try:
            parallel.ring_attention(ql, ql, ql, causal=True, layout="zigzag")
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_a_refusal_names_every_padded_length(local_worlds: Any) -> None:
    for first, second in local_worlds(3, in_process=True).run(_two_lengths_one_local):
        assert SEQ_LEN in first and "pass seq_len=10 " in first, first
        assert SEQ_LEN in second and "lengths 10, 11" in second and "seq_len=10 " not in second, second


@pytest.mark.parametrize("w", [2, 3, 4])
def test_a_padded_length_is_never_inferred_from_the_shards(local_worlds: Any, w: int) -> None:
    """``shard`` pads a length its layout does not divide and records it. Once an op drops
    the placement (a projection), inferring ``W * seq_local`` would count the padding as
    tokens: ring_attention, ulysses_attention and unshard raise ``ValueError`` asking for
    ``seq_len`` before any communication (before, ring attention was wrong by up to 0.6 and
    unshard returned the padding). ulysses_attention on placed padded pieces attended the
    padding (wrong by 0.22, non-causal): it now takes the recorded length. Every case that
    raises nothing equals SDPA, values and the gradient of ``q``."""
    for rank, res in enumerate(local_worlds(w, in_process=True).run(_padded_grid, w)):
        assert len(res) == 2 * 2 * 3 + 2 * 3 + 2 * 3
        for case, (kind, value, comms) in res.items():
            if case.endswith(" dropped"):
                assert kind == "err" and SEQ_LEN in value and f"seq_len={4 * w - 1}" in value, (case, value)
                assert comms == 0, f"rank {rank} {case}: {comms} communications before the error"
            else:
                assert kind == "ok", f"rank {rank} {case}: {value}"
                assert value <= TOL, f"rank {rank} {case}: silently wrong by {value}"
