"""spmd_types programs under ``dc.spmd_check`` (issue 46, item 2): its collectives and
conversions are typed by their ``src`` / ``dst``, its ``assert_type`` annotations read
(I -> replicated with a replicated gradient, R -> replicated with a partial gradient,
V / S(i) -> varying, P -> partial). The eight classic bugs written with spmd_types' API
(the list in ``docs/spmd_types.md``) are caught and their fixes pass; spmd_types' README
quickstart and the rows of its Megatron porting guide's mapping table raise nothing.

spmd_types is optional: without it these tests skip (nothing in diffcomm imports it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc

pytest.importorskip("spmd_types", reason="spmd-types is not installed (the interop tests need it)")

F64 = torch.float64


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _mlp(bug: str | None) -> None:
    """A column->row MLP in spmd_types' API (Megatron's mappings as its porting guide
    writes them), with one bug planted (``None``: correct)."""
    import spmd_types as spmd
    import torch.distributed as dist
    from spmd_types import I, R, S

    pg, rank = dist.group.WORLD, dc.get_rank()
    x = spmd.assert_type(_randn(3, 4, seed=0).requires_grad_(), {pg: I})
    w1 = spmd.assert_type(nn.Parameter(_randn(6, 4, seed=1 + rank)), {pg: S(0)})
    b1 = spmd.assert_type(nn.Parameter(_randn(6, seed=3 + rank)), {pg: S(0)})
    w2 = spmd.assert_type(nn.Parameter(_randn(4, 6, seed=5 + rank)), {pg: S(1)})
    b2 = spmd.assert_type(nn.Parameter(_randn(4, seed=7)), {pg: I})
    h = x if bug == "missing copy (convert I->R)" else spmd.convert(x, pg, src=I, dst=R)
    a = F.gelu(F.linear(h, w1, b1))
    if bug == "bias added before the reduction":
        y = spmd.all_reduce(F.linear(a, w2, b2), pg, dst=I)
    elif bug == "partial into GELU":
        y = spmd.all_reduce(F.gelu(F.linear(a, w2)), pg, dst=I) + b2
    elif bug == "residual added to a partial sum":
        y = spmd.all_reduce(F.linear(a, w2) + x, pg, dst=I) + b2
    else:
        dst = R if bug == "all_reduce dst=R under a replicated objective" else I
        y = spmd.all_reduce(F.linear(a, w2), pg, dst=dst) + b2
    if bug == "reduction done twice":
        y = spmd.all_reduce(y, pg, dst=I)
    y.pow(2).mean().backward()


def _gather(bug: str | None) -> None:
    """Sequence shards gathered into a replicated loss: dst=I (Megatron's
    gather_from_sequence_parallel_region(tensor_parallel_output_grad=False))."""
    import spmd_types as spmd
    import torch.distributed as dist
    from spmd_types import I, R, S

    pg = dist.group.WORLD
    xs = spmd.assert_type(_randn(2, 4, seed=10 + dc.get_rank()), {pg: S(0)})
    w = spmd.assert_type(nn.Parameter(_randn(4, 4, seed=20)), {pg: R})
    y = spmd.all_gather(xs @ w, pg, src=S(0), dst=R if bug else I)
    y.pow(2).mean().backward()
    for p in (w,):  # the R weight met per-rank shards: its partial gradient is summed
        p.grad = spmd.all_reduce(p.grad, pg, dst=R)


def _sp_layernorm(bug: str | None) -> None:
    """A LayerNorm on sequence shards: its (R) weights' partial gradients must be summed."""
    import spmd_types as spmd
    import torch.distributed as dist
    from spmd_types import I, R, S

    pg = dist.group.WORLD
    ln = nn.LayerNorm(4, dtype=F64)
    for p in ln.parameters():
        spmd.assert_type(p, {pg: R})
    xs = spmd.assert_type(_randn(2, 4, seed=30 + dc.get_rank()), {pg: S(0)})
    spmd.all_gather(ln(xs), pg, src=S(0), dst=I).pow(2).mean().backward()
    if not bug:
        for p in ln.parameters():
            p.grad = spmd.all_reduce(p.grad, pg, dst=R)


#: the eight classic bugs: name -> (program, strings the message must contain)
CLASSIC: dict[str, tuple[object, tuple[str, ...]]] = {
    "all_reduce dst=R under a replicated objective": (_mlp, ("spmd_types.all_reduce(src=P, dst=R)", "dst=I")),
    "all_gather dst=R under a replicated objective": (
        _gather,
        ("spmd_types.all_gather(src=S(0), dst=R)", "world-size times"),
    ),
    "missing copy (convert I->R)": (_mlp, ("linear", "clashes", "annotated I")),
    "reduction done twice": (_mlp, ("spmd_types.all_reduce(src=P, dst=I)", "`x` is replicated", "twice")),
    "partial into GELU": (_mlp, ("gelu", "partial")),
    "bias added before the reduction": (_mlp, ("linear", "`bias`", "once per rank")),
    "residual added to a partial sum": (_mlp, ("add", "partial")),
    "sequence-parallel LayerNorm gradients not reduced": (_sp_layernorm, ("LayerNorm", "missing reduction")),
}


def _run(name: str, bug: bool) -> tuple[str, str] | None:
    import spmd_types  # noqa: F401  (imported before the check: its assert_type is read)

    program = CLASSIC[name][0]
    try:
        with dc.spmd_check():
            program(name if bug else None)  # type: ignore[operator]
    except TypeError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("name", list(CLASSIC))
def test_classic_bug_in_spmd_types_api_is_caught_and_its_fix_passes(world2: dc.LocalWorld, name: str) -> None:
    for bad, good in world2.run(lambda: (_run(name, True), _run(name, False))):
        assert bad is not None and bad[0] == "SPMDTypeError", (name, bad)
        assert all(part in bad[1] for part in CLASSIC[name][1]), (name, bad)
        assert "_collectives.py" not in bad[1] and "_local.py" not in bad[1], bad  # the user's line
        assert good is None, (name, good)


def test_readme_quickstart_passes(world2: dc.LocalWorld) -> None:
    """spmd_types' README quickstart (a 1 x 2 dp x tp mesh here: gloo world 2), checked
    over tp: P -> all_reduce -> R -> R * R."""

    def body() -> tuple[object, object]:
        import spmd_types as spmd
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        with dc.spmd_check(tp), spmd.set_current_mesh(mesh):
            x = torch.randn(4)
            spmd.assert_type(x, {dp: spmd.R, tp: spmd.P})
            y = spmd.all_reduce(x, tp, src=spmd.P, dst=spmd.R)
            spmd.assert_type(y, {dp: spmd.R, tp: spmd.R})
            z = torch.mul(y, y)
            spmd.assert_type(z, {dp: spmd.R, tp: spmd.R})
            return dc.spmd.type_of(x), dc.spmd.type_of(z)

    assert world2.run(body) == [(dc.spmd.P, dc.spmd.R)] * 2


def test_megatron_porting_guide_mappings_pass(world2: dc.LocalWorld) -> None:
    """Every row of spmd_types' Megatron -> spmd_types mapping table, in its intended use
    (a replicated loss after an I output, a per-rank loss after an R or V output)."""

    def body() -> int:
        import spmd_types as spmd
        import torch.distributed as dist
        from spmd_types import I, R, S, V

        pg, rank, n = dist.group.WORLD, dc.get_rank(), dc.get_world_size()

        def inv(t: torch.Tensor) -> torch.Tensor:
            return spmd.assert_type(t.requires_grad_(), {pg: I})

        def var(t: torch.Tensor, s: object = V) -> torch.Tensor:
            return spmd.assert_type(t, {pg: s})

        def per_rank() -> torch.Tensor:
            return var(_randn(1, seed=rank))

        w = spmd.assert_type(nn.Parameter(_randn(4, 4, seed=40 + rank)), {pg: V})
        cases = [
            lambda: spmd.all_reduce(spmd.convert(inv(_randn(3, 4, seed=0)), pg, src=I, dst=R) @ w, pg, dst=I),
            lambda: spmd.all_reduce(var(_randn(3, 4, seed=rank)) @ w, pg, dst=I),
            lambda: spmd.reduce_scatter(var(_randn(3, 4 * n, seed=rank)), pg, dst=S(-1)) @ w,
            lambda: (
                spmd.all_gather(var(_randn(3, 4, seed=rank), S(-1)) @ w, pg, src=S(-1), dst=R)
                * var(_randn(1, seed=rank))
            ),
            lambda: spmd.convert(inv(_randn(2 * n, 4, seed=0)), pg, src=I, dst=S(0)) @ w,
            lambda: (
                spmd.all_gather(var(_randn(2, 4, seed=rank), S(0)) @ w, pg, src=S(0), dst=R)
                * var(_randn(1, seed=rank))
            ),
            lambda: spmd.all_gather(var(_randn(2, 4, seed=rank), S(0)) @ w, pg, src=S(0), dst=I),
            lambda: spmd.reduce_scatter(var(_randn(2 * n, 4, seed=rank)) @ w, pg, dst=S(0)),
            lambda: spmd.all_to_all(var(_randn(n, 4, seed=rank)) @ w, pg),
        ]
        for case in cases:
            with dc.spmd_check():
                out = case()
                loss = out.pow(2).mean() if dc.spmd.type_of(out) is dc.spmd.R else out.pow(2).sum()
                loss.backward()
        return len(cases)

    assert world2.run(body) == [9, 9]


def _megatron_pair_with_spmd_types_rules(mode: str) -> str | None:
    """A hand-written Megatron copy/reduce pair that carries spmd_types rules
    (``spmd_typecheck``) and no ``dc.spmd`` rule: typed from the spmd_types rules."""
    import torch.distributed as dist
    from spmd_types import I, P, R, rules

    class CopyToTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):  # type: ignore[no-untyped-def]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            return dc.all_reduce(g), None

        @staticmethod
        def spmd_typecheck(*, x, group):  # type: ignore[no-untyped-def]
            return rules.convert(x, group, src=I, dst=R)

    class ReduceFromTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):  # type: ignore[no-untyped-def]
            return dc.all_reduce(x.detach())

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            return g, None

        @staticmethod
        def spmd_typecheck(*, x, group):  # type: ignore[no-untyped-def]
            return rules.all_reduce(x, group, src=P, dst=I)

    pg, rank = dist.group.WORLD, dc.get_rank()
    x = _randn(3, 4, seed=0).requires_grad_()
    w1, w2 = nn.Parameter(_randn(6, 4, seed=1 + rank)), nn.Parameter(_randn(4, 6, seed=5 + rank))
    try:
        with dc.spmd_check():
            dc.spmd.varying(w1), dc.spmd.varying(w2)
            h = x if mode == "no copy" else CopyToTP.apply(x, pg)
            y = ReduceFromTP.apply(F.linear(F.gelu(F.linear(h, w1)), w2), pg)
            if mode == "reduced twice":
                y = ReduceFromTP.apply(y, pg)
            y.pow(2).mean().backward()
    except TypeError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_user_function_typed_from_its_spmd_types_rule(world2: dc.LocalWorld) -> None:
    def body() -> list[str | None]:
        return [_megatron_pair_with_spmd_types_rules(m) for m in ("correct", "no copy", "reduced twice")]

    for ok, no_copy, twice in world2.run(body):
        assert ok is None, ok
        assert no_copy is not None and "insert parallel.copy_to_region before the linear" in no_copy, no_copy
        assert twice is not None and "ReduceFromTP at test_spmd_types_programs.py:" in twice, twice
        assert "spmd_types rule (spmd_typecheck) refuses its inputs (replicated)" in twice, twice


# ======================================================================================
# spmd_types' API beside diffcomm's ops: each case once silently wrong or refused when right
# ======================================================================================


def _verdict(program: object, *args: object) -> tuple[str | None, object]:
    """``program`` under ``dc.spmd_check``: (the error message or ``None``, its result)."""
    import spmd_types  # noqa: F401  (imported before the check: its assert_type is read)

    try:
        with dc.spmd_check():
            return None, program(*args)  # type: ignore[operator]
    except TypeError as e:
        return f"{type(e).__name__}: {e}", None


def _copy_by_invariant_to_replicate(bug: bool) -> torch.Tensor:
    """Megatron's copy written as ``spmd_types.invariant_to_replicate`` (``convert(I, R)``:
    its backward sums the gradient); with ``bug`` its output is the replicated loss."""
    import spmd_types as spmd
    import torch.distributed as dist

    pg, rank = dist.group.WORLD, dc.get_rank()
    x = spmd.assert_type(_randn(3, 4, seed=0).requires_grad_(), {pg: spmd.I})
    h = spmd.invariant_to_replicate(x, pg)
    if bug:  # an R loss: the gradient of a loss counted once summed over the ranks
        h.pow(2).sum().backward()
        return x.grad.detach().clone()  # type: ignore[union-attr]
    w1 = spmd.assert_type(nn.Parameter(_randn(6, 4, seed=1 + rank)), {pg: spmd.V})
    w2 = spmd.assert_type(nn.Parameter(_randn(4, 6, seed=5 + rank)), {pg: spmd.V})
    y = spmd.all_reduce(F.linear(F.gelu(F.linear(h, w1)), w2), pg, src=spmd.P, dst=spmd.I)
    y.pow(2).mean().backward()
    return x.grad.detach().clone()  # type: ignore[union-attr]


def _serial_copy_by_invariant_to_replicate(bug: bool, world: int) -> torch.Tensor:
    x = _randn(3, 4, seed=0).requires_grad_()
    if bug:
        x.pow(2).sum().backward()
    else:
        w1 = torch.cat([_randn(6, 4, seed=1 + r) for r in range(world)])
        w2 = torch.cat([_randn(4, 6, seed=5 + r) for r in range(world)], 1)
        F.linear(F.gelu(F.linear(x, w1)), w2).pow(2).mean().backward()
    return x.grad  # type: ignore[return-value]


def test_invariant_to_replicate_is_typed_as_convert_from_i_to_r(inproc_world2: dc.LocalWorld) -> None:
    """``spmd_types.invariant_to_replicate`` reaches the check by its own name (not through
    ``convert``); it was typed as a plain op (its output tied to its I input): the correct
    Megatron copy was refused at the column-parallel matmul, and its R output used as a
    replicated loss passed with every gradient world-size times too large."""

    def body(bug: bool) -> tuple[tuple[str | None, object], torch.Tensor]:
        return _verdict(_copy_by_invariant_to_replicate, bug), _copy_by_invariant_to_replicate(bug)

    for bug in (False, True):
        serial = _serial_copy_by_invariant_to_replicate(bug, 2)
        results = inproc_world2.run(body, bug)
        assert len({str(v[0][0]) for v in results}) == 1, results  # one verdict on every rank
        for (error, _), plain in results:
            if bug:  # the serial truth: the unchecked gradients are wrong...
                assert torch.allclose(plain, 2 * serial), (plain, serial)
                assert error is not None and "spmd_types.invariant_to_replicate(src=I, dst=R)" in error, error
            else:  # ... or right, and then the check passes
                assert torch.allclose(plain, serial), (plain, serial)
                assert error is None, error


def _reduced_again(how: str) -> torch.Tensor:
    """A value spmd_types reduced (or gathered) summed again, without a gradient (eval)."""
    import spmd_types as spmd
    import torch.distributed as dist
    from spmd_types import I, P, R, S

    pg, rank = dist.group.WORLD, dc.get_rank()
    with torch.no_grad():
        if how == "all_reduce":
            y = spmd.all_reduce(spmd.assert_type(_randn(3, seed=rank), {pg: P}), pg, src=P, dst=R)
        elif how == "all_gather":
            y = spmd.all_gather(spmd.assert_type(_randn(2, seed=rank), {pg: S(0)}), pg, src=S(0), dst=I)
        else:  # a conversion of a replicated constant: nothing combined, a sum of it is W * y
            y = spmd.convert(spmd.assert_type(_randn(3, seed=0), {pg: I}), pg, src=I, dst=R)
        return dc.all_reduce(y)


def test_a_value_spmd_types_combined_over_the_ranks_is_not_summed_again(inproc_world2: dc.LocalWorld) -> None:
    """The replicated output of an spmd_types reduction or gather holds the ranks' values
    combined, as diffcomm's own ops' outputs do: ``dc.all_reduce`` of it (in evaluation, no
    gradient) sums the sum, world-size times the serial value. It passed as arithmetic."""

    def body() -> list[tuple[str | None, object]]:
        return [_verdict(_reduced_again, how) for how in ("all_reduce", "all_gather", "convert")]

    serial = _randn(3, seed=0) + _randn(3, seed=1)
    for (reduced, _), (gathered, _), (converted, value) in inproc_world2.run(body):
        assert reduced is not None and "spmd_types.all_reduce(src=P, dst=R)" in reduced, reduced
        assert "twice" in reduced, reduced
        assert gathered is not None and "spmd_types.all_gather(src=S(0), dst=I)" in gathered, gathered
        assert converted is None and torch.allclose(value, 2 * _randn(3, seed=0)), converted  # type: ignore[arg-type]
    plain = inproc_world2.run(lambda: _reduced_again("all_reduce"))
    assert all(torch.allclose(v, 2 * serial) for v in plain)  # the serial truth: twice the sum


def _clip_norm(via: str) -> torch.Tensor:
    """A clipping norm: a replicated parameter's squared norm stacked beside a shard's,
    summed over the ranks with spmd_types: the replicated term counted world-size times."""
    import spmd_types as spmd
    import torch.distributed as dist
    from spmd_types import I, P, V

    pg, rank = dist.group.WORLD, dc.get_rank()
    rep = _randn(4, seed=0)  # alike on every rank
    shard = spmd.assert_type(_randn(4, seed=1 + rank), {pg: V})
    sq = torch.stack([rep.pow(2).sum(), shard.pow(2).sum()]).sum()
    if via == "redistribute":
        return spmd.redistribute(sq, pg, src=P, dst=I)
    return spmd.all_reduce(sq, pg, src=P, dst=I)


def test_redistribute_from_partial_is_a_sum_over_the_ranks(inproc_world2: dc.LocalWorld) -> None:
    """``redistribute(src=P)`` is an all_reduce (or a reduce_scatter): the check's rules for
    sums hold there too. A replicated term summed with it passed (counted world-size times)."""

    def body() -> list[str | None]:
        return [_verdict(_clip_norm, via)[0] for via in ("all_reduce", "redistribute")]

    serial = _randn(4, seed=0).pow(2).sum() + sum(_randn(4, seed=1 + r).pow(2).sum() for r in range(2))
    plain = inproc_world2.run(lambda: _clip_norm("redistribute"))
    assert all(not torch.allclose(v, serial) for v in plain)  # the serial truth: wrong
    for by_all_reduce, by_redistribute in inproc_world2.run(body):
        assert by_all_reduce is not None and "holds a replicated term" in by_all_reduce, by_all_reduce
        assert by_redistribute is not None and "holds a replicated term" in by_redistribute, by_redistribute
        assert "spmd_types.redistribute(src=P, dst=I)" in by_redistribute, by_redistribute


def _fused_linear(after: str) -> torch.Tensor:
    """A user's fused matmul carrying an spmd_types rule (``rules.einsum``: local, R -> R
    and I -> I) on replicated values whose gradient kind nothing has fixed yet."""
    from spmd_types import rules

    class FusedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x, w)
            return x @ w.T

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            x, w = ctx.saved_tensors
            return g @ w, g.T @ x

        @staticmethod
        def spmd_typecheck(*, x, w):  # type: ignore[no-untyped-def]
            return rules.einsum("mk,nk->mn", x, w)

    x = _randn(3, 4, seed=0).requires_grad_()
    w = nn.Parameter(_randn(5, 4, seed=2))
    y = FusedLinear.apply(x, w)
    if after == "broadcast":  # sum convention under a replicated loss: the root's gradient x W
        y = dc.broadcast(y, src=0)
    y.pow(2).sum().backward()
    return x.grad.detach().clone()  # type: ignore[union-attr]


def test_user_function_with_a_local_spmd_types_rule_keeps_its_inputs_gradient_kind(
    inproc_world2: dc.LocalWorld,
) -> None:
    """A local rule (``R -> R``, ``I -> I``) fixes no gradient kind: its outputs share
    their inputs', as a plain op's do. Taking the unfixed inputs as ``R`` refused the correct
    replicated loss after it ("world-size times too large"); a sum-convention op after it
    under a replicated loss is still caught."""

    def body() -> list[str | None]:
        return [_verdict(_fused_linear, after)[0] for after in ("loss", "broadcast")]

    x, w = _randn(3, 4, seed=0).requires_grad_(), _randn(5, 4, seed=2)
    (x @ w.T).pow(2).sum().backward()
    plain = inproc_world2.run(lambda: _fused_linear("loss"))
    assert all(torch.allclose(v, x.grad) for v in plain)  # type: ignore[arg-type]  # right
    for local, broadcast in inproc_world2.run(body):
        assert local is None, local
        assert broadcast is not None and "broadcast" in broadcast, broadcast
        assert "world-size times" in broadcast, broadcast
