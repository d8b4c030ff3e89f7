"""Replication types for a user's own autograd Functions (issue 46, item 3): a rule given
with ``dc.spmd.register_function`` (or stated on the class as ``spmd``) types the Function
inside ``dc.spmd_check``; a differentiable Function with none is an error naming it; a bad
rule is a TypeError naming the Function and the argument at registration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import diffcomm as dc
from diffcomm.spmd import PARTIAL, REPLICATED, P, R, Rule, V

F64 = torch.float64


def _megatron_mlp(mode: str) -> str | None:
    """A column->row MLP with a hand-written Megatron copy/reduce pair (the functions of
    Megatron's ``mappings.py``, written on diffcomm's sum-convention all_reduce)."""

    class CopyToTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            return dc.all_reduce(g)

    class ReduceFromTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return dc.all_reduce(x.detach())

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            return g

    if mode != "no rule":
        dc.spmd.register_function(CopyToTP, Rule({R: R}, out_grad=PARTIAL, in_grad=REPLICATED), args=("x",))
        dc.spmd.register_function(ReduceFromTP, Rule({V: R, P: R}, out_grad=REPLICATED), args=("x",))
    rank = dc.get_rank()
    x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w1 = torch.nn.Parameter(torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(1 + rank)))
    w2 = torch.nn.Parameter(torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(5 + rank)))
    try:
        with dc.spmd_check():
            dc.spmd.varying(w1), dc.spmd.varying(w2)
            h = x if mode == "no copy" else CopyToTP.apply(x)
            y = ReduceFromTP.apply(F.linear(F.gelu(F.linear(h, w1)), w2))
            if mode == "reduced twice":
                y = ReduceFromTP.apply(y)
            y.pow(2).mean().backward()
    except TypeError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_hand_written_megatron_pair_with_a_rule(world2: dc.LocalWorld) -> None:
    def body() -> list[str | None]:
        return [_megatron_mlp(m) for m in ("correct", "no copy", "reduced twice")]

    for ok, no_copy, twice in world2.run(body):
        assert ok is None, ok
        assert no_copy is not None and "SPMDTypeError" in no_copy, no_copy
        assert "insert parallel.copy_to_region before the linear at test_spmd_user_functions.py:" in no_copy
        assert twice is not None and "ReduceFromTP at test_spmd_user_functions.py:" in twice, twice
        assert "argument `x` is replicated" in twice, twice


def test_user_function_without_a_rule_is_named(world2: dc.LocalWorld) -> None:
    """A differentiable user Function with no rule is refused by name (no guess); without
    a gradient to compute it runs as before (its ops typed one by one)."""

    def body() -> tuple[str | None, str | None]:
        class Scale(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):  # type: ignore[no-untyped-def]
                return x * 2

            @staticmethod
            def backward(ctx, g):  # type: ignore[no-untyped-def]
                return g * 2

        out = []
        for grad in (True, False):
            try:
                with dc.spmd_check():
                    Scale.apply(torch.ones(2, requires_grad=grad))
                out.append(None)
            except dc.SPMDTypeError as e:
                out.append(str(e))
        return out[0], out[1]

    for with_grad, without in world2.run(body):
        assert with_grad is not None and "Scale at test_spmd_user_functions.py:" in with_grad, with_grad
        assert "no typing rule" in with_grad and "dc.spmd.register_function(Scale" in with_grad
        assert without is None, without


def test_rule_stated_on_the_class_and_a_named_group(world2: dc.LocalWorld) -> None:
    """``spmd = Rule(...)`` on a user class is read; ``group=`` names the forward argument
    holding the group (a Function over another group passes types through)."""

    def body() -> tuple[object, str | None]:
        class ReduceOver(torch.autograd.Function):
            spmd = dc.spmd.Rule(
                {dc.spmd.V: dc.spmd.R, dc.spmd.P: dc.spmd.R}, out_grad="replicated", group="group"
            )

            @staticmethod
            def forward(ctx, x, group):  # type: ignore[no-untyped-def]
                return dc.all_reduce(x.detach(), group=group)

            @staticmethod
            def backward(ctx, g):  # type: ignore[no-untyped-def]
                return g, None

        with dc.spmd_check():
            y = ReduceOver.apply(dc.spmd.varying(torch.ones(2, requires_grad=True)), None)
            t = dc.spmd.type_of(y)
        try:
            with dc.spmd_check():
                ReduceOver.apply(torch.ones(2, requires_grad=True), None)
            err = None
        except dc.SPMDTypeError as e:
            err = str(e)
        return t, err

    for t, err in world2.run(body):
        assert t is R
        assert err is not None and "ReduceOver" in err and "`x` is replicated" in err, err


def test_a_torch_internal_function_is_not_a_user_function(world2: dc.LocalWorld) -> None:
    def body() -> object:
        from torch.utils.checkpoint import checkpoint

        w = torch.ones(2, requires_grad=True)
        with dc.spmd_check():
            y = checkpoint(lambda a: (a * w).sin(), torch.ones(2, requires_grad=True), use_reentrant=True)
            y.sum().backward()
        return dc.spmd.R

    assert world2.run(body) == [R, R]


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg=None):  # type: ignore[no-untyped-def]
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g, None


@pytest.mark.parametrize(
    ("rule", "args", "match"),
    [
        (Rule({R: R}), ("y",), r"register_function\(_Fn\): argument `y` is not an argument of _Fn.forward"),
        (Rule({R: R}, group="group"), None, r"register_function\(_Fn\): argument `group` \(rule.group\)"),
        (Rule({"R": R}), None, r"register_function\(_Fn\): `rule.maps` holds 'R', outside the vocabulary"),  # type: ignore[dict-item]
        (Rule({R: R}, out_grad="sum"), None, r"register_function\(_Fn\): `rule.out_grad` is 'sum'"),
        (Rule({R: R}, tensors=(3,)), None, r"register_function\(_Fn\): `rule.tensors` names argument 3"),
    ],
)
def test_a_bad_rule_is_a_type_error_at_registration(
    rule: Rule, args: tuple[str, ...] | None, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        dc.spmd.register_function(_Fn, rule, args=args)


def test_register_function_takes_only_function_classes_and_rules() -> None:
    with pytest.raises(TypeError, match="`cls` must be a torch.autograd.Function class"):
        dc.spmd.register_function(torch.nn.Linear, Rule({R: R}))
    with pytest.raises(TypeError, match="`rule` must be a diffcomm.spmd.Rule"):
        dc.spmd.register_function(_Fn, {R: R})  # type: ignore[arg-type]
    assert dc.spmd.register_function(_Fn, Rule({R: R}), args=("x",)) is _Fn


def _torch_nn_share(how: str, objective: str) -> tuple[str | None, list[float], list[float]]:
    """Each rank's share of a column-parallel sum over features, summed over the ranks by
    ``torch.distributed.nn.functional`` (``how``) into a loss: (the check's error or
    ``None``, this rank's weight gradient, the float64 serial reference under the check's
    ``objective``: a replicated loss counted once, or the sum of the ranks' copies)."""
    import torch.distributed.nn.functional as tnn

    world, rank = dc.get_world_size(), dc.get_rank()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, dtype=F64, generator=g)
    w_full = torch.randn(2 * world, 4, dtype=F64, generator=g)
    w_ref = w_full.clone().requires_grad_()
    serial = F.linear(x, w_ref).sum(-1).pow(2).mean()
    (serial * (world if objective == "sum" else 1)).backward()
    rows = slice(2 * rank, 2 * (rank + 1))
    w = torch.nn.Parameter(w_full[rows].clone())
    error = None
    try:
        with dc.spmd_check(objective=objective):
            s = F.linear(x, dc.spmd.varying(w)).sum(-1)  # this rank's share
            y = tnn.all_reduce(s) if how == "all_reduce" else torch.stack(tnn.all_gather(s)).sum(0)
            y.pow(2).mean().backward()
    except dc.SPMDTypeError as e:
        error = str(e)
    grad = w.grad.flatten().tolist() if w.grad is not None else []
    return error, grad, w_ref.grad[rows].flatten().tolist()


@pytest.mark.parametrize("how", ["all_reduce", "all_gather"])
def test_torch_distributed_nn_collectives_are_typed_by_their_rule(world2: dc.LocalWorld, how: str) -> None:
    """torch.distributed.nn.functional's collectives sum the gradient in their backward
    (the sum convention): into a replicated loss the weight gradients are world-size times
    the serial ones. As Functions of torch they were typed op by op (their forward's raw
    collective, not their backward) and passed; they are typed by the rule of the diffcomm
    op they are, so the replicated loss is refused and the sum convention passes."""

    def body() -> list[tuple[str | None, list[float], list[float]]]:
        return [_torch_nn_share(how, "loss"), _torch_nn_share(how, "sum")]

    for (bad, _, ref), (good, got, ref_sum) in world2.run(body):
        assert bad is not None and "world-size times too large" in bad, bad
        assert good is None, good
        assert got == pytest.approx(ref_sum, rel=1e-12)  # the sum convention's gradient
        assert got == pytest.approx([2 * r for r in ref], rel=1e-12)  # 2x the counted-once one


def test_torch_distributed_nn_collective_without_a_rule_is_refused_by_name(world2: dc.LocalWorld) -> None:
    """A torch.distributed.nn.functional collective taking its tensors as varargs (scatter,
    reduce_scatter, all_to_all) has no rule: refused by name, not typed by its forward."""

    def body() -> str | None:
        import torch.distributed.nn.functional as tnn

        x = torch.ones(2, 3, dtype=F64, requires_grad=True)
        try:
            with dc.spmd_check():
                tnn.scatter([x * 1, x * 2], src=0)
        except dc.SPMDTypeError as e:
            return str(e)
        return None

    for msg in world2.run(body):
        assert msg is not None and "_Scatter" in msg and "no typing rule" in msg, msg


class _CopyForgettingItsReduction(torch.autograd.Function):
    """Megatron's copy into the tensor-parallel region whose backward forgot its all_reduce."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g


def _copy_with_a_wrong_backward(debug: bool) -> tuple[str | None, list[float], list[float]]:
    """A column-parallel product entered through that copy, registered with the copy's rule:
    (the error or ``None``, this rank's input gradient, the float64 serial one)."""
    world, rank = dc.get_world_size(), dc.get_rank()
    dc.spmd.register_function(
        _CopyForgettingItsReduction, Rule({R: R}, out_grad=PARTIAL, in_grad=REPLICATED), args=("x",)
    )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, dtype=F64, generator=g, requires_grad=True)
    w_full = torch.randn(2 * world, 4, dtype=F64, generator=g)
    x_ref = x.detach().clone().requires_grad_()
    F.linear(x_ref, w_full).pow(2).sum().backward()
    w = w_full[2 * rank : 2 * (rank + 1)].clone().requires_grad_()
    error = None
    try:
        with dc.debug(debug), dc.spmd_check():
            h = F.linear(_CopyForgettingItsReduction.apply(x), dc.spmd.varying(w))
            dc.parallel.gather_from_region(h).pow(2).sum().backward()
    except (dc.SPMDTypeError, dc.CrossRankMismatchError) as e:
        error = str(e)
    grad = x.grad.flatten().tolist() if x.grad is not None else []
    return error, grad, x_ref.grad.flatten().tolist()


def test_a_user_rule_the_backward_breaks_is_caught_in_debug_mode(world2: dc.LocalWorld) -> None:
    """The check trusts a user Function's rule: a copy whose backward forgot its all_reduce,
    registered with the copy's rule, passes with each rank's share as the input's gradient
    (not the serial one). Debug mode checks the rule's promise in backward: the gradient of
    a replicated input given ``in_grad=REPLICATED`` is equal on every rank."""
    for (trusted, grad, ref), (caught, _, _) in world2.run(
        lambda: (_copy_with_a_wrong_backward(False), _copy_with_a_wrong_backward(True))
    ):
        assert trusted is None, trusted  # the limitation: the rule is trusted
        assert grad != pytest.approx(ref), (grad, ref)  # ... and the gradient is wrong
        assert caught is not None and "_CopyForgettingItsReduction backward" in caught, caught
        assert "in_grad=REPLICATED" in caught, caught
