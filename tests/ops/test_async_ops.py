"""``async_op=True`` of every collective and coalesced op: values and gradients equal the
blocking op's (bit for bit, float64, worlds 2/3/4), the result is an AsyncTensor, and the
backward of the linear ops hands on an asynchronous gradient."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import diffcomm as dc

CASES = {
    "all_reduce(sum)": lambda x, a: dc.all_reduce(x, async_op=a),
    "all_reduce(avg)": lambda x, a: dc.all_reduce(x, "avg", async_op=a),
    "all_reduce(max)": lambda x, a: dc.all_reduce(x, "max", async_op=a),
    "all_reduce(product)": lambda x, a: dc.all_reduce(x, "product", async_op=a),
    "broadcast": lambda x, a: dc.broadcast(x, 1, async_op=a),
    "reduce(sum)": lambda x, a: dc.reduce(x, 1, async_op=a),
    "reduce(avg)": lambda x, a: dc.reduce(x, 1, "avg", async_op=a),
    "reduce(min)": lambda x, a: dc.reduce(x, 0, "min", async_op=a),
    "all_gather": lambda x, a: dc.all_gather(x, 1, async_op=a),
    "all_gather(uneven)": lambda x, a: dc.all_gather(x[: dc.get_rank() + 1], 0, async_op=a),
    "reduce_scatter(sum)": lambda x, a: dc.reduce_scatter(x, 0, async_op=a),
    "reduce_scatter(avg, uneven)": lambda x, a: dc.reduce_scatter(
        x,
        0,
        "avg",
        split_sizes=[1] * (dc.get_world_size() - 1) + [x.shape[0] - dc.get_world_size() + 1],
        async_op=a,
    ),
    "reduce_scatter(max)": lambda x, a: dc.reduce_scatter(x, 0, "max", async_op=a),
    "gather": lambda x, a: dc.gather(x, 1, 1, async_op=a),
    "scatter": lambda x, a: dc.scatter(x, 1, 0, async_op=a),
    "all_to_all": lambda x, a: dc.all_to_all(x, 0, 0, async_op=a),
    "all_to_all(dims)": lambda x, a: dc.all_to_all(x, 0, 1, async_op=a),
}
# max/min/product reduce and reduce_scatter are a local function (keep on dst / own
# chunk) of an asynchronous all_reduce, run on the engine after it: an AsyncTensor too
FINISHED_RESULT: set[str] = set()
# ops whose backward hands on an AsyncTensor (linear ops whose rule is the dual alone)
ASYNC_BACKWARD = {
    "all_reduce(sum)",
    "all_reduce(avg)",
    "broadcast",
    "reduce(sum)",
    "all_gather",  # (the uneven case slices x first: the slice's backward consumes it)
    "reduce_scatter(sum)",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all(dims)",
}


def _grads(fn, x0: torch.Tensor, async_op: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, str]:
    x = x0.clone().requires_grad_()
    y = fn(x, async_op)
    kind = type(y).__name__
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(5 + dc.get_rank()))
    w.requires_grad_()
    (gx,) = torch.autograd.grad((y * w).sum(), x, create_graph=True)
    gkind = type(gx).__name__
    # double backward: the gradient of a function of gx with respect to w runs the dual's
    # backward (and, for max/min/product, the weight's own)
    (ggx,) = torch.autograd.grad((gx * gx).sum(), w)
    y = y.wait() if isinstance(y, dc.AsyncTensor) else y
    return y.detach(), gx.detach(), ggx, kind, gkind


def _every_rank(world: dc.LocalWorld, rank_fn: Callable[[], dict[str, dict]]) -> list[tuple[str, dict]]:
    """``(op name, result)`` for every op of ``rank_fn``'s table, on every rank."""
    return [(name, r) for res in world.run(rank_fn) for name, r in res.items()]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_async_op_values_and_gradients_equal_blocking(local_worlds, n) -> None:
    def ops_rank() -> dict[str, dict[str, object]]:
        r, n = dc.get_rank(), dc.get_world_size()
        x0 = torch.randn(2 * n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        out = {}
        for name, fn in CASES.items():
            yb, gb, ggb, _, _ = _grads(fn, x0, False)
            ya, ga, gga, kind, gkind = _grads(fn, x0, True)
            out[name] = {
                "value": torch.equal(yb, ya),
                "grad": torch.equal(gb, ga),
                "double": torch.equal(ggb, gga),
                "async": kind == "AsyncTensor",
                "async_grad": gkind == "AsyncTensor",
            }
        return out

    for name, r in _every_rank(local_worlds(n), ops_rank):
        assert r["value"] and r["grad"] and r["double"], (name, r)
        assert r["async"] == (name not in FINISHED_RESULT), (name, r)
        assert r["async_grad"] == (name in ASYNC_BACKWARD), (name, r)


COALESCED = {
    "all_reduce_coalesced": lambda ts, a: dc.all_reduce_coalesced(ts, async_op=a),
    "all_reduce_coalesced(max)": lambda ts, a: dc.all_reduce_coalesced(ts, "max", async_op=a),
    "broadcast_coalesced": lambda ts, a: dc.broadcast_coalesced(ts, 1, async_op=a),
    "reduce_coalesced": lambda ts, a: dc.reduce_coalesced(ts, 1, async_op=a),
    "all_gather_coalesced": lambda ts, a: dc.all_gather_coalesced(ts, 0, async_op=a),
    "reduce_scatter_coalesced": lambda ts, a: dc.reduce_scatter_coalesced(ts, 0, async_op=a),
}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_async_coalesced_values_and_gradients_equal_blocking(local_worlds, n) -> None:
    def coalesced_rank() -> dict[str, dict[str, object]]:
        r, n = dc.get_rank(), dc.get_world_size()
        g = torch.Generator().manual_seed(r)
        base = [
            torch.randn(2 * n, 3, dtype=torch.float64, generator=g),
            torch.randn(n, dtype=torch.float32, generator=g),
            torch.arange(2 * n) + r,  # integer: forward only
        ]
        out = {}
        for name, fn in COALESCED.items():
            res = []
            for a in (False, True):
                ts = [t.clone().requires_grad_(t.is_floating_point()) for t in base]
                ys = fn(ts, a)
                kinds = {type(y).__name__ for y in ys}
                loss = sum((y * (1.0 + i)).sum() for i, y in enumerate(ys[:2]))
                gs = torch.autograd.grad(loss, ts[:2])
                res.append(
                    (
                        [y.detach() for y in ys],
                        [g.detach() for g in gs],
                        kinds,
                        {type(g).__name__ for g in gs},
                    )
                )
            (yb, gb, _, _), (ya, ga, kinds, gkinds) = res
            out[name] = {
                "value": all(torch.equal(u, v) for u, v in zip(yb, ya)),
                "grad": all(torch.equal(u, v) for u, v in zip(gb, ga)),
                "async": kinds == {"AsyncTensor"},
                "async_grad": gkinds,
            }
        return out

    for name, r in _every_rank(local_worlds(n), coalesced_rank):
        assert r["value"] and r["grad"] and r["async"], (name, r)
        if "max" not in name:  # max/min/product: the weight multiplies (and waits)
            assert r["async_grad"] == {"AsyncTensor"}, (name, r)


def test_async_op_under_torch_func_runs_blocking(world2) -> None:
    def transforms_rank() -> dict[str, object]:
        """Under torch.func the asynchronous ops run blocking (plain tensors, same values)."""
        x = torch.arange(3.0, dtype=torch.float64) + dc.get_rank()

        def f(t: torch.Tensor) -> torch.Tensor:
            y = dc.all_gather(t, async_op=True)
            return (y * y).sum()

        g_async = torch.func.grad(f)(x)
        g_block = torch.func.grad(lambda t: (dc.all_gather(t) ** 2).sum())(x)
        batched = torch.func.vmap(lambda t: dc.all_reduce(t, async_op=True))(torch.ones(4, 2))
        return {
            "grad": torch.equal(g_async, g_block),
            "vmap": torch.equal(batched, torch.full((4, 2), float(dc.get_world_size()))),
            "type": type(batched).__name__,
        }

    for res in world2.run(transforms_rank):
        assert res == {"grad": True, "vmap": True, "type": "Tensor"}


def test_async_op_without_autograd(world2) -> None:
    def no_grad_rank() -> list[bool]:
        x = torch.ones(4, requires_grad=True)
        with torch.no_grad():
            y = dc.all_reduce(x, async_op=True)
        z = dc.broadcast(torch.ones(2), async_op=True)  # no grad needed
        return [type(y).__name__ == "AsyncTensor", not y.requires_grad, torch.equal(z.wait(), torch.ones(2))]

    assert world2.run(no_grad_rank) == [[True, True, True]] * 2


# the ops whose backward reads their input and output (max / min / product: the weight
# dy/dx; reduce(max) its input), and two whose backward reads neither (no in-place error,
# blocking or not)
SAVING = {
    "all_reduce(max)": lambda x, a: dc.all_reduce(x, "max", async_op=a),
    "all_reduce(min)": lambda x, a: dc.all_reduce(x, "min", async_op=a),
    "all_reduce(product)": lambda x, a: dc.all_reduce(x, "product", async_op=a),
    "reduce_scatter(max)": lambda x, a: dc.reduce_scatter(x, 0, "max", async_op=a),
    "all_reduce_coalesced(max)": lambda x, a: dc.all_reduce_coalesced([x], "max", async_op=a)[0],
    "reduce(max)": lambda x, a: dc.reduce(x, 0, "max", async_op=a),
    "all_reduce(sum)": lambda x, a: dc.all_reduce(x, async_op=a),
    "all_gather": lambda x, a: dc.all_gather(x, async_op=a),
}
INPLACE = "modified by an inplace operation"


def _grad_after_inplace(fn, async_op: bool, where: str) -> object:
    """The gradient of ``fn`` when, after the result was used, ``where`` is modified in
    place: the output itself, the tensor ``.wait()`` returned, or the input (under
    ``no_grad``, an input that came from an earlier asynchronous op); the error text if
    backward refuses."""
    r = dc.get_rank()
    x = torch.tensor([1.0 + r, 5.0 - r, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    h = dc.all_reduce(x * 1, "avg", async_op=async_op) if where == "async input" else x * 1
    y = fn(h, async_op)
    used = y + 0  # the result is used: its communication has finished
    if where == "output":
        y.mul_(2)
    elif where == "waited output":
        y = dc.ops.engine.wait(y)
        y.mul_(2)
    else:
        with torch.no_grad():
            (dc.ops.engine.wait(h) if where == "async input" else h).add_(10.0 * (r == 0))
    try:
        (gx,) = torch.autograd.grad(((y + used) * torch.arange(1.0, y.numel() + 1)).sum(), x)
    except RuntimeError as err:
        return ("error", INPLACE in str(err), str(err))
    return ("grad", gx.tolist())


def test_async_op_refuses_a_backward_that_reads_a_tensor_modified_in_place(world2) -> None:
    """The backward of max / min / product reads its input and output: a blocking op's
    backward refuses them modified in place (autograd's saved-tensor check), and so must
    the asynchronous op's, also where the modification went through ``.wait()``'s result
    or an input that was itself asynchronous; an op whose backward reads neither never
    refuses. (Before: the asynchronous backward read the modified values — NaN or wrong
    gradients.)"""

    def inplace_rank() -> dict[str, object]:
        out = {}
        for name, fn in SAVING.items():
            for where in ("output", "waited output", "input", "async input"):
                blocking = _grad_after_inplace(fn, False, where)
                asynchronous = _grad_after_inplace(fn, True, where)
                like = blocking
                if name == "reduce_scatter(max)" and where in ("output", "waited output"):
                    # the blocking op returns a view of its all_reduce's output (refused when
                    # changed); the asynchronous one a chunk of its own, which nothing in
                    # backward reads: the gradient of the blocking op's copy
                    like = _grad_after_inplace(lambda x, a, fn=fn: fn(x, a).clone(), False, where)
                out[f"{name} {where}"] = (blocking, asynchronous, like)
        return out

    results = _every_rank(world2, inplace_rank)
    for name, (_, asynchronous, like) in results:
        assert like[:2] == asynchronous[:2], (name, like, asynchronous)
        if asynchronous[0] == "error":  # the message names the op (reduce_scatter(max) runs one)
            assert "asynchronous all_reduce" in asynchronous[2], (name, asynchronous[2])
    refused = {name for name, (b, _, _) in results if b[0] == "error"}
    assert {"all_reduce(max) output", "all_reduce(product) input", "reduce_scatter(max) output"} <= refused
    # (reduce(max) keeps the all_reduce's result on dst: its output is a new tensor)
    assert not {
        name for name in refused if name.startswith(("all_reduce(sum)", "all_gather", "reduce(max) output"))
    }


def _under_hooks_after_inplace(op: str, through: str) -> object:
    """all_reduce(``op``, async_op=True) under saved-tensor hooks that copy what is saved,
    its output then changed in place through ``.wait()``'s result or a view of it, or its
    input changed: the gradient, or the error."""
    r = dc.get_rank()
    x = torch.tensor([1.0 + r, 5.0 - r, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        h = x * 1
        y = dc.all_reduce(h, op, async_op=True)
        used = y + 0
    with torch.no_grad():
        {"wait": lambda: dc.ops.engine.wait(y), "view": lambda: y[1:3], "input": lambda: h}[through]().mul_(2)
    try:
        (gx,) = torch.autograd.grad(((y + used) * torch.arange(1.0, 5.0, dtype=torch.float64)).sum(), x)
    except RuntimeError as err:
        return ("error", INPLACE in str(err))
    return ("grad", gx.tolist())


def test_under_saved_tensor_hooks_a_changed_tensor_is_refused_not_read(world2) -> None:
    """Under saved-tensor hooks autograd checks no versions, and the asynchronous backward
    replays the rule on the finished output and the inputs themselves, not on what the
    hook kept: a change in place of the output (through ``.wait()``'s result or a view) or
    of the input must be refused, never read. (The blocking op's backward reads the hook's
    copies, rank 0: max [0, 8, 6, 8], product [8, 32, 24, 48]; the asynchronous one read
    the changed tensors: max [0, nan, nan, 8] after ``y[1:3].mul_(2)``, [4, nan, nan, nan]
    after the input was doubled, product [16, 64, 48, 96].)"""

    def hooks_rank() -> dict[str, object]:
        cases = [("max", "wait"), ("max", "view"), ("max", "input"), ("product", "input")]
        return {f"{op} {through}": _under_hooks_after_inplace(op, through) for op, through in cases}

    for res in world2.run(hooks_rank):
        assert all(v == ("error", True) for v in res.values()), res


ALIASES = {  # (what the user's op saved, what is then changed in place)
    "wait, then the result saved": ("result", "waited"),
    "the waited tensor saved, then the result": ("waited", "result"),
    "a second wait, then the first saved": ("waited", "waited again"),
}


def _user_op_after_inplace(fn, async_op: bool, saved: str, changed: str, grad: bool) -> object:
    """A user's own op (``z = p * s * s``) saves ``s`` — the result, or the tensor ``.wait()``
    returned — and then ``changed`` is modified in place before ``z``'s backward: the
    gradient of ``x`` (``grad``: through the result) or of ``p`` (the result needs none),
    or the error text."""
    r = dc.get_rank()
    x = torch.tensor([1.0 + r, 5.0 - r, 2.0, 3.0], dtype=torch.float64, requires_grad=grad)
    p = torch.full((), 2.0 + r, dtype=torch.float64, requires_grad=True)
    y = fn(x * 1, async_op)
    alias = {"result": y}
    alias["waited"] = dc.ops.engine.wait(y)
    alias["waited again"] = dc.ops.engine.wait(y)
    z = p * alias[saved] * alias[saved]
    alias[changed].add_(1.0)
    try:
        gs = torch.autograd.grad(z.sum(), x if grad else p)
    except RuntimeError as err:
        return ("error", INPLACE in str(err))
    return ("grad", gs[0].tolist())


@pytest.mark.parametrize("in_process", [False, True])
def test_an_alias_of_the_result_modified_in_place_is_refused_by_a_saving_backward(
    local_worlds, in_process
) -> None:
    """The result and the tensor ``.wait()`` returned are one tensor (as the blocking op's
    result is): a user's op that saved one refuses, in backward, a change in place through
    the other, as the blocking op's autograd does. (Before: ``.wait()`` returned the
    finished tensor, whose version counter the AsyncTensor does not share, so
    ``z = p * y * y; y.wait().add_(1)`` backpropagated the changed values silently —
    x.grad [52, 60, 68, 76] at world 2 instead of autograd's in-place error.)"""

    def aliases_rank() -> dict[str, object]:
        out = {}
        for name, fn in {
            "all_reduce(sum)": lambda x, a: dc.all_reduce(x, async_op=a),
            "all_gather": lambda x, a: dc.all_gather(x, async_op=a),
            "all_reduce_coalesced": lambda x, a: dc.all_reduce_coalesced([x, x.float()], async_op=a)[0],
        }.items():
            for case, (saved, changed) in ALIASES.items():
                for grad in (True, False):
                    blocking = _user_op_after_inplace(fn, False, saved, changed, grad)
                    asynchronous = _user_op_after_inplace(fn, True, saved, changed, grad)
                    out[f"{name}: {case}, grad={grad}"] = (blocking, asynchronous)
        return out

    for name, (blocking, asynchronous) in _every_rank(local_worlds(2, in_process=in_process), aliases_rank):
        assert blocking == ("error", True), (name, blocking)
        assert asynchronous == blocking, (name, asynchronous)


REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def _reduce_waits() -> dict[str, object]:
    """``reduce`` and ``reduce_scatter`` with every reduce op, ``async_op=True``: the
    result's type, and ``.wait()``'s value and gradient against the blocking op's."""
    r = dc.get_rank()
    x0 = torch.tensor([1.5 + r, 4.0 - r, 2.0, 3.0 + r], dtype=torch.float64)
    out: dict[str, object] = {}
    for op in REDUCE_OPS:
        for name, fn in (
            (f"reduce({op})", lambda x, a, op=op: dc.reduce(x, 1, op, async_op=a)),
            (f"reduce_scatter({op})", lambda x, a, op=op: dc.reduce_scatter(x, 0, op, async_op=a)),
        ):
            got = []
            for a in (False, True):
                x = x0.clone().requires_grad_()
                y = fn(x, a)
                kind = type(y).__name__
                z = y.wait() if a else y  # (before: max/min/product returned a plain tensor)
                (gx,) = torch.autograd.grad((z * torch.arange(1.0, z.numel() + 1)).sum(), x)
                got.append((kind, type(z).__name__, z.detach(), gx))
            (_, _, zb, gb), (kind, wkind, za, ga) = got
            out[name] = (kind, wkind, torch.equal(zb, za), torch.equal(gb, ga))
    return out


def test_async_reduce_and_reduce_scatter_wait_with_every_op(world2) -> None:
    """``dc.reduce(x, dst, "max", async_op=True)`` (and min / product, and reduce_scatter
    with them) returned a plain tensor, which has no ``.wait()`` (AttributeError), where
    the contract says an asynchronous op returns an AsyncTensor. Now every reduce op does;
    ``.wait()`` gives the blocking op's value and gradient."""
    for res in world2.run(_reduce_waits):
        assert res == {n: ("AsyncTensor", "Tensor", True, True) for n in res}, res
