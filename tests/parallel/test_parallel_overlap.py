"""Overlapped tensor-parallel layers (``overlap=``) against the blocking path, float64.

``"comm"`` (the column-parallel backward launches its input-gradient collective before
the weight-gradient matmul) must be bit-identical to ``overlap=False`` on random data.
``"ring"`` re-associates the cross-rank sums (ring order) and splits matmuls into row
blocks: bit-identical on exactly representable data, within a few ulps on random data
(see ``diffcomm.parallel.overlap``).
"""

from __future__ import annotations

import pytest
import torch

import diffcomm as dc
from diffcomm import backend as B
from diffcomm import parallel as P

H, FFN, SEQ, BATCH = 8, 24, 12, 2


def _mlp_pair(sp: bool, mode: object, integer: bool, activation: str) -> tuple[P.ParallelMLP, P.ParallelMLP]:
    torch.manual_seed(0)
    serial = P.MLP(H, FFN, activation=activation, dtype=torch.float64)
    if integer:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in serial.parameters():
                p.copy_(torch.randint(-3, 4, p.shape, generator=g, dtype=torch.float64))
    blocking = P.ParallelMLP.from_serial(serial, sequence_parallel=sp)
    overlapped = P.ParallelMLP.from_serial(serial, sequence_parallel=sp, overlap=mode)
    return blocking, overlapped


def _run(mlp: P.ParallelMLP, x0: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    x = x0.clone().requires_grad_()
    y = mlp(x)
    (y * w).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in mlp.parameters())]


# shared: the rank body of the three blocking-vs-overlapped comparisons below
def _compare_rank(sp: bool, mode: object, integer: bool) -> dict[str, object]:
    r, n = dc.get_rank(), dc.get_world_size()
    activation = "relu" if integer else "gelu"
    blocking, overlapped = _mlp_pair(sp, mode, integer, activation)
    g = torch.Generator().manual_seed(7)
    if integer:
        x = torch.randint(-3, 4, (SEQ, BATCH, H), generator=g).double()
        w = torch.randint(-2, 3, (SEQ, BATCH, H), generator=g).double()
    else:
        x = torch.randn(SEQ, BATCH, H, generator=g, dtype=torch.float64)
        w = torch.randn(SEQ, BATCH, H, generator=g, dtype=torch.float64)
    if sp:
        x, w = x.chunk(n)[r], w.chunk(n)[r]
    ref = _run(blocking, x, w)
    with B.record_spans() as spans:
        got = _run(overlapped, x, w)
    return {
        "equal": [torch.equal(a, b) for a, b in zip(ref, got)],
        "close": [torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(ref, got)],
        "plain": all(type(t) is torch.Tensor for t in got),
        "engine": sorted({(op, thread) for op, _, thread, _, _ in spans}),
    }


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_comm_overlap_is_bit_identical(local_worlds, n, sp) -> None:
    for res in local_worlds(n).run(_compare_rank, sp, "comm", False):
        assert all(res["equal"]) and res["plain"], res
        # fc1's input-gradient collective ran on the communication engine
        op = "reduce_scatter" if sp else "all_reduce"
        assert (op, "diffcomm-comm") in res["engine"], res["engine"]


@pytest.mark.usefixtures("debug_off")  # pins the ops run (debug mode adds its check all_gathers)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_overlap_is_exact_on_representable_data(local_worlds, n) -> None:
    for res in local_worlds(n).run(_compare_rank, True, "ring", True):
        assert all(res["equal"]) and res["plain"], res
        # every all_gather / reduce_scatter of the MLP became ring hops on the engine
        ops = {op for op, thread in res["engine"] if thread == "diffcomm-comm"}
        assert "batch_p2p" in ops and not {o for o, _ in res["engine"]} & {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_overlap_matches_within_ulps_on_random_data(local_worlds, n) -> None:
    for res in local_worlds(n).run(_compare_rank, True, True, False):
        assert all(res["close"]) and res["plain"], res


@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_overlap(world3, gather_output) -> None:
    def column_rank(gather_output: bool) -> list[bool]:
        torch.manual_seed(0)
        lin = torch.nn.Linear(H, 3 * H, dtype=torch.float64)
        a = P.ColumnParallelLinear.from_serial(lin, gather_output=gather_output)
        b = P.ColumnParallelLinear.from_serial(lin, gather_output=gather_output, overlap=True)
        x0 = torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        outs = []
        for layer in (a, b):
            x = x0.clone().requires_grad_()
            y = layer(x)
            (y.square()).sum().backward()
            outs.append([y.detach(), x.grad, layer.weight.grad, layer.bias.grad])
        return [torch.equal(u, v) for u, v in zip(*outs)]

    assert world3.run(column_rank, gather_output) == [[True] * 4] * 3


def test_bad_overlap_mode_is_a_value_error(world2) -> None:
    def bad_mode_rank() -> list[str]:
        out = []
        for kwargs in ({"overlap": "ring"}, {"overlap": "fast"}):
            try:
                P.ColumnParallelLinear(4, 4, **kwargs)
            except ValueError as err:
                out.append(str(err))
        return out

    msgs = world2.run(bad_mode_rank)[0]
    assert len(msgs) == 2 and "'ring'" in msgs[0] and "'fast'" in msgs[1]


def test_double_backward_through_an_overlapped_layer_raises(world2) -> None:
    def double_backward_rank() -> str:
        lin = P.ColumnParallelLinear(4, 4, seed=0, overlap=True, dtype=torch.float64)
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        (gx,) = torch.autograd.grad(lin(x).square().sum(), x, create_graph=True)
        try:
            gx.sum().backward()
        except RuntimeError as err:
            dc.all_reduce(torch.zeros(1))  # keep ranks in step (nothing else pending)
            return str(err)
        return "no error"

    out = world2.run(double_backward_rank)
    assert all("once_differentiable" in m or "twice" in m for m in out), out


def test_gradient_penalty_through_an_overlapped_layer_with_a_linear_loss_raises(world2) -> None:
    """With a loss linear in the output, torch's ``once_differentiable`` adds no error
    node: the penalty's term for the weight used to be dropped silently. Now it raises."""

    def penalty_rank() -> list[str]:
        msgs = []
        for overlap in ("comm", "ring"):
            lin = P.ColumnParallelLinear(
                4, 4, seed=0, overlap=overlap, sequence_parallel=overlap == "ring", dtype=torch.float64
            )
            x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
            w = torch.randn(4, 3, 2, dtype=torch.float64)
            y = lin(x)
            (gx,) = torch.autograd.grad((y * w[: y.shape[0], :, : y.shape[2]]).sum(), x, create_graph=True)
            try:
                gx.square().sum().backward()
                msgs.append("no error")
            except RuntimeError as err:
                msgs.append(str(err))
            dc.all_reduce(torch.zeros(1))  # keep ranks in step
        return msgs

    for msgs in world2.run(penalty_rank):
        assert "ColumnParallelLinear(overlap='comm') has a first-order backward only" in msgs[0], msgs
        assert "ColumnParallelLinear(overlap='ring') has a first-order backward only" in msgs[1], msgs


def _func_grad_and_retained(sp: bool, mode: object) -> dict[str, list[bool]]:
    """The overlapped MLP against the blocking one (one serial MLP): ``torch.func.grad`` of
    the parameters and the input, and two backwards of one retained graph."""
    from torch.func import functional_call, grad

    r, n = dc.get_rank(), dc.get_world_size()
    blocking, overlapped = _mlp_pair(sp, mode, False, "gelu")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, BATCH, H, generator=g, dtype=torch.float64)
    w = torch.randn(SEQ, BATCH, H, generator=g, dtype=torch.float64)
    if sp:
        x, w = x.chunk(n)[r], w.chunk(n)[r]
    grads = []
    for mlp in (blocking, overlapped):
        params = {k: v.detach() for k, v in mlp.named_parameters()}
        loss = lambda p, xx, m=mlp: (functional_call(m, p, (xx,)) * w).sum()
        gp, gx = grad(loss, argnums=(0, 1))(params, x)
        grads.append([gx, *(gp[k] for k in sorted(gp))])
    retained = []
    for mlp in (blocking, overlapped):
        xx = x.clone().requires_grad_()
        loss = (mlp(xx) * w).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        retained.append([xx.grad, *(p.grad for p in mlp.parameters())])
    close = [torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(*grads)]
    # ("ring" adds in ring order: equal to a few ulps on random data, as above)
    again = [torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(*retained)]
    return {"func_grad": close, "retained": again}


@pytest.mark.parametrize(("sp", "mode"), [(False, "comm"), (True, "comm"), (True, "ring")])
def test_overlap_under_torch_func_and_with_a_retained_graph(world3, sp: bool, mode: str) -> None:
    """Under ``torch.func.grad`` an overlapped layer runs the blocking mappings (the same
    gradients); a retained graph's second backward runs as the blocking path's. Before:
    torch.func raised torch's "must override the setup_context staticmethod" from inside
    the layer, and ``overlap="comm"``'s second backward raised AttributeError ('graph':
    the first one deleted the inner graph it kept on ctx)."""
    for res in world3.run(_func_grad_and_retained, sp, mode):
        assert all(res["func_grad"]) and all(res["retained"]), res


def _forward_ad_tangents(sp: bool, mode: object) -> list[bool]:
    """The overlapped MLP's output tangent under ``torch.autograd.forward_ad`` (dual
    input and parameters) against the blocking MLP's."""
    from torch.autograd import forward_ad as fwad

    r, n = dc.get_rank(), dc.get_world_size()
    blocking, overlapped = _mlp_pair(sp, mode, False, "gelu")
    g = torch.Generator().manual_seed(7)
    x, t = (torch.randn(SEQ, BATCH, H, generator=g, dtype=torch.float64) for _ in range(2))
    if sp:
        x, t = x.chunk(n)[r], t.chunk(n)[r]
    tangents = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in blocking.parameters()]
    out = []
    for mlp in (blocking, overlapped):
        params = {k: v.detach() for k, v in mlp.named_parameters()}
        with fwad.dual_level():
            duals = {k: fwad.make_dual(v, tv) for (k, v), tv in zip(params.items(), tangents)}
            y = torch.func.functional_call(mlp, duals, (fwad.make_dual(x, t),))
            out.append(fwad.unpack_dual(y).tangent)
    return [out[1] is not None and torch.allclose(out[0], out[1], rtol=1e-12, atol=1e-12)]


@pytest.mark.parametrize(("sp", "mode"), [(False, "comm"), (True, "comm"), (True, "ring")])
def test_overlap_under_forward_mode_ad(world2, sp: bool, mode: str) -> None:
    """Forward-mode AD through an overlapped layer runs the blocking mappings, as a
    ``torch.func`` transform does: the blocking path's tangent. Before: torch's "You must
    implement the jvp function for custom autograd.Function" from the fused Functions."""
    for res in world2.run(_forward_ad_tangents, sp, mode):
        assert all(res), res
