"""``torch.compile`` in an in-process world (``LocalWorld(n, in_process=True)``): torch's
compile-session flag (diffcomm's compile check, which picks the traceable backend) is each
rank's own, and a collective that would run for real while dynamo compiles a frame (it
holds dynamo's one lock that the other ranks need) is refused instead of hanging.

Each world runs in a watchdog thread (:func:`_run_or_fail`): in-process there is no
collective timeout, and the failure these tests guard against was a hang.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import _torch
from diffcomm import parallel as P

F64 = torch.float64


def _run_or_fail(fn: Any, *args: Any, seconds: float = 150.0) -> list[Any]:
    """``fn`` on a fresh 2-rank in-process world, or the test fails after ``seconds`` (a
    hang: the rank threads are daemons and are left behind)."""
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(dc.LocalWorld(2, in_process=True).run(fn, *args))
        except BaseException as e:  # reported by the test
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{fn.__name__}: the in-process world hung under torch.compile")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]  # type: ignore[no-any-return]


def _graph_break_between_ops() -> float:
    """Worst difference of a compiled function from eager: two diffcomm ops with a forced
    graph break between them, the first graph with an all_gather of trace-time constants
    (which fake-tensor constant propagation would run for real while dynamo compiles)."""
    torch._dynamo.reset()
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(dc.get_rank() + 1))

    def f(x: torch.Tensor) -> torch.Tensor:
        y = dc.all_reduce(x * 2)
        n = dc.all_gather(torch.tensor([3.0], dtype=F64), 0, split_sizes=[1, 1])
        torch._dynamo.graph_break()
        return dc.all_gather(y + n.sum(), dim=0)

    want = f(x)
    compiled = torch.compile(f, backend="eager")
    compiled(x)
    return float((compiled(x) - want).abs().max())


def test_compiled_graph_break_between_two_ops_equals_eager_in_process() -> None:
    """Before, the compiling rank waited for its peers inside dynamo (holding dynamo's
    compile lock and with torch's process-wide compile flag set): the world hung, or a peer
    running eager code after its graph break saw the flag and took the traceable backend
    (``RuntimeError: No backend type associated with device type cpu``)."""
    assert _run_or_fail(_graph_break_between_ops) == [0.0, 0.0]


def _flag_seen_by_the_other_rank() -> tuple[bool, bool, float]:
    """Rank 0 sets torch's compile flag (as a compile or export session does) and waits
    for rank 1, which runs meanwhile: (what each rank's compile check said, twice, and an
    eager diffcomm op's result afterwards)."""
    t = torch.zeros(1)
    if dist.get_rank() == 0:
        torch.compiler._is_compiling_flag = True  # type: ignore[attr-defined]
        try:
            dist.send(t, 1)
            dist.recv(t, 1)  # rank 1 runs while rank 0 waits here
            seen = _torch.compiling()
        finally:
            torch.compiler._is_compiling_flag = False  # type: ignore[attr-defined]
        return seen, seen, float(dc.all_reduce(torch.ones(2)).sum())
    dist.recv(t, 0)  # rank 0's flag is set now
    seen = _torch.compiling()  # (True: a diffcomm op here took the traceable backend)
    dist.send(t, 0)
    return seen, seen, float(dc.all_reduce(torch.ones(2)).sum())


def test_the_compile_flag_is_each_ranks_own_in_process() -> None:
    """torch.compiler's compile-session flag is one per process: rank 1 ran with rank 0's
    ``True`` (so diffcomm picked the traceable backend in eager code); now it is swapped
    with the run lock, and rank 0 gets its own back after the wait."""
    got = _run_or_fail(_flag_seen_by_the_other_rank)
    assert got[0][0] is True and got[1][0] is False, got
    assert [g[2] for g in got] == [4.0, 4.0], got


def _compiled_ulysses_vs_eager(fullgraph: bool) -> float | str:
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(dc.get_rank() + 1)
    q, k, v = (torch.randn(1, 4, 4, 8, dtype=F64, generator=g).requires_grad_() for _ in range(3))

    def step(f: Any) -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        y = f(q, k, v)
        (y * torch.randn(y.shape, dtype=F64, generator=torch.Generator().manual_seed(7))).sum().backward()
        return [y.detach()] + [t.grad for t in (q, k, v)]  # type: ignore[misc]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return P.ulysses_attention(q, k, v, causal=True)

    want = step(fn)
    compiled = torch.compile(fn, backend="eager", fullgraph=fullgraph)
    try:
        got = step(compiled) and step(compiled)
    except torch._dynamo.exc.Unsupported as e:
        return f"Unsupported: {e}"
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


def test_compiled_ulysses_equals_eager_in_process() -> None:
    """Before, it hung in dynamo: the all_gather of the ranks' lengths (a trace-time
    constant) ran for real during fake-tensor propagation, on the compiling rank only."""
    assert _run_or_fail(_compiled_ulysses_vs_eager, False) == [0.0, 0.0]


def test_fullgraph_ulysses_says_what_to_do() -> None:
    """With fullgraph=True the length exchange's graph break is refused with the way out."""
    for msg in _run_or_fail(_compiled_ulysses_vs_eager, True):
        assert isinstance(msg, str) and "seq_lens" in msg, msg
