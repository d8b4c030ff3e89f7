"""Pipeline stages holding ``torch.compile``'d regions, under every schedule, split
backward included: gradients equal the serial model's (float64) and each compiled
region's backward runs once per micro-batch.

With an AOTAutograd backend (``aot_eager``, ``inductor``) a compiled region's backward is
one ``CompiledFunctionBackward`` node that computes every input's gradient at once. Before,
the split ran it in ``I`` (keeping the graph) and again in ``W``: twice the work, and
AOTAutograd's "compiled with non-empty donated buffers" error where the region's backward
had first run without keeping the graph (the cooldown split of 1F1B / interleaved,
DualPipeV). Now ``I`` runs such a micro-batch's whole backward once and ``W`` nothing
(``TimelineEntry.whole``). One compiled function serves every block (weights passed as
arguments), so the whole file compiles it a few times in all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import diffcomm as dc
from diffcomm.pipeline import PipelineRunner, partition

# in-process: the ranks share the process's compiled code (one compile for all ranks)
pytestmark = pytest.mark.diffcomm_in_process

WIDTH = 4


def _block_fn(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    h = x @ w.T + b
    return torch.tanh(h) * h  # keeps intermediates for backward: donated buffers under AOT


_FNS: dict[str, Callable[..., Tensor]] = {"none": _block_fn}
_RUNS: dict[int, int] = {}  # rank -> compiled backward runs


def _fn(backend: str) -> Callable[..., Tensor]:
    if backend not in _FNS:
        _FNS[backend] = torch.compile(_block_fn, backend=backend)
    return _FNS[backend]


class _Block(nn.Module):
    """A linear layer and a nonlinearity, as one compiled region (``backend="none"``: eager)."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=torch.float64) / 2)
        self.bias = nn.Parameter(torch.randn(WIDTH, dtype=torch.float64) / 2)

    def forward(self, x: Tensor) -> Tensor:
        y = _fn(self.backend)(x, self.weight, self.bias)
        if self.backend == "aot_eager" and y.grad_fn is not None:
            rank = dist.get_rank()
            y.grad_fn.register_prehook(lambda _: _RUNS.__setitem__(rank, _RUNS.get(rank, 0) + 1))
        return y


def _compiled_pipeline(schedule: str, backend: str, grad_first: bool | str | None, m: int) -> int:
    """Pipelined compiled blocks == the serial eager model (loss, every gradient, the input
    gradient); returns how many micro-batch backwards ran whole in ``I``."""
    rank, p = dist.get_rank(), dist.get_world_size()
    v = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(backend) for _ in range(2 * p)))  # two blocks per rank
    serial = copy.deepcopy(model)
    for blk in serial:
        blk.backend = "none"
    x, y = (torch.randn(2 * m, WIDTH, dtype=torch.float64) for _ in range(2))

    def mine(parts: list[nn.Sequential]) -> list[nn.Sequential]:
        if v == 2 and schedule != "interleaved":  # the V placement
            return [parts[rank], parts[2 * p - 1 - rank]]
        return parts[rank::p]

    chunks = mine(partition(model, p * v))
    kw = {} if grad_first is None else {"grad_first": grad_first}
    runner = PipelineRunner(chunks if v > 1 else chunks[0], schedule, loss_fn=nn.functional.mse_loss, **kw)
    _RUNS[rank] = 0
    loss = runner.step(x, y, n_micro=m, input_grad=True)
    runs = _RUNS[rank]
    xs = x.clone().requires_grad_()
    ref = nn.functional.mse_loss(serial(xs), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-13, atol=1e-15)
    for chunk, theirs in zip(chunks, mine(partition(serial, p * v)), strict=True):
        for a, b in zip(chunk.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    if rank == 0:
        torch.testing.assert_close(runner.input_grad, xs.grad, rtol=1e-12, atol=1e-14)
    if backend == "aot_eager":  # each compiled region's backward once per micro-batch, not in I and W
        assert runs == 2 * m, f"rank {rank}: the compiled backward ran {runs} times for {m} micro-batches"
    whole = [e for e in runner.timeline if e.whole]
    assert all(e.kind in "IB" for e in whole)
    return len(whole)


CASES = [
    ("gpipe", False),  # plain B steps: nothing splits
    ("gpipe", None),
    ("1f1b", None),  # the cooldown split: AOT's donated-buffer error before
    ("1f1b", True),
    ("interleaved", None),
    ("zb-h1", None),  # ran, but each compiled backward twice (I and W)
    ("zbv", None),
    ("dualpipev", None),
]


@pytest.mark.parametrize(("schedule", "grad_first"), CASES)
def test_compiled_stages_match_the_serial_model(
    world2: dc.LocalWorld, schedule: str, grad_first: bool | str | None
) -> None:
    m = 4 if schedule == "dualpipev" else 2
    whole = world2.run(_compiled_pipeline, schedule, "aot_eager", grad_first, m)
    if grad_first is False:
        assert whole == [0, 0]
    else:  # the ranks whose chunks take a received input run it whole
        assert whole[1] > 0, whole


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_eager_backend_stages_still_split(world2: dc.LocalWorld, schedule: str) -> None:
    # dynamo's eager backend keeps eager autograd nodes: the split works as without compile
    assert world2.run(_compiled_pipeline, schedule, "eager", None, 2) == [0, 0]


def test_compiled_stages_on_three_ranks(world3: dc.LocalWorld) -> None:
    whole = world3.run(_compiled_pipeline, "zbv", "aot_eager", None, 3)
    assert all(w > 0 for w in whole), whole
