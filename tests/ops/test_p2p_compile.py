"""diffcomm's point-to-point ops inside ``torch.compile`` (CPU/gloo, world 2).

send/recv/irecv/sendrecv/shift/ppermute are disabled for dynamo: a compiled function
that calls them is split into compiled graphs with the op run eagerly in between (a graph
break). Checked here: values and gradients equal eager's (float64, exactly), collectives
in the compiled parts around the break still compile and agree, the send/recv pair works
across compiled functions on both ranks (the token's backward pulls the gradient), and
``fullgraph=True`` refuses with a message that says what to do — never a trace that posts
a message twice or a wrong result. Compilation is slow on CPU: one compile per case,
``torch._dynamo.reset()`` before each.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _shared import fullgraph_error
from torch import Tensor

import diffcomm as dc
from diffcomm.ops import wire

F64 = torch.float64


def _peer() -> int:
    return 1 - dc.get_rank()


# name -> fn of this rank's x (world 2); each mixes compute before and after the op
PROGRAMS: dict[str, Callable[[Tensor], Tensor]] = {
    "shift": lambda x: dc.shift(x.sin(), 1) * x,
    "shift_back": lambda x: dc.shift(x * x, -1).exp(),
    "sendrecv": lambda x: dc.sendrecv(x * 2, dst=_peer(), src=_peer()).cos() + x,
    "ppermute": lambda x: dc.ppermute(x.exp(), [(0, 1), (1, 0)]) * x,
    "ppermute_one_way": lambda x: dc.ppermute(x.tanh(), [(0, 1)]) + x.sin(),
    # a ring step between collectives: compiled graph | eager shift | compiled graph
    "ring_between_collectives": lambda x: dc.all_reduce(dc.shift(dc.all_reduce(x).sin(), 1) * x),
}


def _data(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_p2p_under_compile_equals_eager(world2: dc.LocalWorld, name: str) -> None:
    def compiled_vs_eager(name: str) -> dict[str, float]:
        r = dc.get_rank()
        fn = PROGRAMS[name]
        x = _data((2, 3), 10 + r)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager")
        xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        yc, ye = compiled(xc), fn(xe)
        cot = _data(ye.shape, 20 + r)
        (yc * cot).sum().backward()
        (ye * cot).sum().backward()
        assert xc.grad is not None and xe.grad is not None
        y_nograd = compiled(x)  # inputs without grad: the other autograd path
        wire.wait_sends()
        return {
            "fwd": float((yc - ye).abs().max()),
            "grad": float((xc.grad - xe.grad).abs().max()),
            "nograd": float((y_nograd - ye).abs().max()),
            "pending": float(wire.SENDS.pending()),
        }

    for res in world2.run(compiled_vs_eager, name):
        assert res == {"fwd": 0.0, "grad": 0.0, "nograd": 0.0, "pending": 0.0}, res


def test_send_recv_under_compile_on_both_ranks(world2: dc.LocalWorld) -> None:
    def send_recv_compiled() -> dict[str, float]:
        """Rank 0 sends from a compiled function and pulls the gradient with the token; rank 1
        receives in a compiled function and runs its backward. Twice (the second call reuses
        the compiled code: the messages are numbered anew, not replayed from the trace)."""
        r = dc.get_rank()
        x = _data((2, 3), 30)

        def sender(v: Tensor) -> Tensor:
            return dc.send(v.sin() * 2, dst=1)

        def receiver(v: Tensor) -> Tensor:
            y = dc.recv(src=0)
            return (y * y * v).sum()

        torch._dynamo.reset()
        fn = sender if r == 0 else receiver
        compiled = torch.compile(fn, backend="aot_eager")
        errs: dict[str, float] = {}
        for i in range(2):
            xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            outc = compiled(xc)
            outc.backward()
            oute = fn(xe)
            oute.backward()
            assert xc.grad is not None and xe.grad is not None
            errs[f"out{i}"] = float((outc - oute).abs())
            errs[f"grad{i}"] = float((xc.grad - xe.grad).abs().max())
            if r == 0:
                # d/dv of the peer's sum(y * y * v) with y = 2 sin(v): 2 y v * 2 cos(v)
                y = 2 * x.sin()
                errs[f"exact{i}"] = float((xc.grad - 2 * y * x * 2 * x.cos()).abs().max())
        wire.wait_sends()
        return errs

    for res in world2.run(send_recv_compiled):
        assert res and max(res.values()) <= 1e-12, res


@pytest.mark.parametrize("name", ["shift", "sendrecv", "ppermute"])
def test_fullgraph_refuses_p2p_with_what_to_do(world2: dc.LocalWorld, name: str) -> None:
    def fullgraph_message(name: str) -> str:
        return fullgraph_error(PROGRAMS[name], _data((2, 3), 40))

    for msg in world2.run(fullgraph_message, name):
        assert "run eagerly inside torch.compile" in msg and "without fullgraph=True" in msg, msg
        assert name in msg, msg  # dynamo names the disabled function
