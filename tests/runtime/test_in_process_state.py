"""Process state an in-process rank keeps as its own, as a rank process does (docs/in_process.md).

Each test runs one program on ``LocalWorld(n, in_process=True)`` and on real gloo
processes and wants the same answer: a rank that changes a process-wide setting (torch's
default dtype, deterministic algorithms, anomaly detection, grad mode, diffcomm's backend
adapter, the flight recorder's size) changes it for itself only, and a run leaves the
caller's as they were. Each names what the in-process world gave before it kept the state
per rank.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.diagnostics import recorder, responder

BOTH = pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "processes"])

_ONE = torch.ones(1, dtype=torch.float32)


def _rank_1_sets_float64() -> tuple[str, str]:
    """Rank 1 switches torch's default dtype to float64 before the ranks meet; rank 0 then
    makes a tensor. Returns (the default the rank started with, the dtype it made)."""
    start = str(torch.get_default_dtype())
    if dist.get_rank() == 1:
        torch.set_default_dtype(torch.float64)
    dc.all_reduce(_ONE)  # the ranks hand over here
    made = str(torch.ones(1).dtype)
    dc.all_reduce(_ONE)
    torch.set_default_dtype(torch.float32)  # (the shared world's rank as it was)
    return start, made


@BOTH
def test_a_ranks_default_dtype_is_its_own(local_worlds, in_process: bool) -> None:
    """``torch.set_default_dtype`` on one rank is that rank's, and a rank starts at torch's
    float32, not the caller's, as a fresh process does. Before, in-process: rank 0 made
    float64 tensors after rank 1 set float64 (processes: float32), a rank started at the
    caller's float64, and a run left rank 1's float64 in the caller."""
    world = local_worlds(2, in_process=in_process)
    assert world.run(_rank_1_sets_float64) == [
        ("torch.float32", "torch.float32"),
        ("torch.float32", "torch.float64"),
    ]
    assert torch.get_default_dtype() == torch.float32
    torch.set_default_dtype(torch.float64)
    try:
        assert world.run(_rank_1_sets_float64)[0] == ("torch.float32", "torch.float32")
        assert torch.get_default_dtype() == torch.float64  # the caller's, kept
    finally:
        torch.set_default_dtype(torch.float32)


def _rank_1_switches_modes_on() -> tuple[bool, bool, bool, str]:
    """Rank 1 switches deterministic algorithms (warn-only) and anomaly detection on and
    lowers the float32 matmul precision; what each rank sees after the hand-over."""
    if dist.get_rank() == 1:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.autograd.set_detect_anomaly(True)
        torch.set_float32_matmul_precision("medium")
    dc.all_reduce(_ONE)
    seen = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.get_float32_matmul_precision(),
    )
    dc.all_reduce(_ONE)
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)
    torch.set_float32_matmul_precision("highest")
    return seen


@BOTH
def test_deterministic_and_anomaly_modes_are_a_ranks_own(local_worlds, in_process: bool) -> None:
    """Before, in-process: rank 0 ran with rank 1's deterministic algorithms, anomaly
    detection and matmul precision ((True, True, True, 'medium') on both ranks; processes:
    rank 0 (False, False, False, 'highest')), so an op that warns or raises under them did
    so on rank 0 too, and its float32 matmuls could run in lower precision."""
    got = local_worlds(2, in_process=in_process).run(_rank_1_switches_modes_on)
    assert got == [(False, False, False, "highest"), (True, True, True, "medium")]
    assert not torch.are_deterministic_algorithms_enabled() and not torch.is_anomaly_enabled()
    assert torch.get_float32_matmul_precision() == "highest"


def _grad_off() -> None:
    torch.set_grad_enabled(False)  # plainly: for the rest of the rank's program


def _grad_mode_then_on() -> bool:
    on = torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    return on


@BOTH
def test_a_ranks_grad_mode_carries_to_its_next_run(local_worlds, in_process: bool) -> None:
    """``torch.set_grad_enabled(False)`` called plainly in one run holds in the rank's next
    run, as in a rank process. Before, in-process: grad mode (per thread in torch) was on
    again, as each run's rank is a new thread ([True, True]; processes [False, False])."""
    world = local_worlds(2, in_process=in_process)
    world.run(_grad_off)
    assert world.run(_grad_mode_then_on) == [False, False]
    assert world.run(_grad_mode_then_on) == [True, True]


class _Recording(B.TorchDistributedBackend):
    """The default adapter, noting the global rank of every ``all_reduce`` it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: list[int] = []

    def all_reduce(self, x: torch.Tensor, op: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
        self.ranks.append(dist.get_rank())
        return super().all_reduce(x, op, group, *args, **kwargs)


def _rank_0_records_its_ops() -> tuple[list[int] | None, str]:
    """Rank 0 runs two all_reduces inside ``set_backend(recording)``; rank 1 runs two plainly.
    Returns (the ranks rank 0's adapter saw, the adapter each rank has afterwards)."""
    if dist.get_rank() == 0:
        rec = _Recording()
        with B.set_backend(rec):
            dc.all_reduce(_ONE)
            dc.all_reduce(_ONE)
        seen: list[int] | None = rec.ranks
    else:
        dc.all_reduce(_ONE)
        dc.all_reduce(_ONE)
        seen = None
    return seen, type(B.get_backend()).__name__


@BOTH
def test_set_backend_on_one_rank_is_that_ranks_own(local_worlds, in_process: bool) -> None:
    """``diffcomm.backend.set_backend`` swaps the calling rank's adapter only. Before,
    in-process: rank 0's recording adapter ran rank 1's all_reduces too (it saw ranks
    [0, 1, 1, 0]; processes [0, 0]), and the ranks' restores interleaved (a rank could end
    with another rank's adapter installed, and the caller with it after the run)."""
    got = local_worlds(2, in_process=in_process).run(_rank_0_records_its_ops)
    assert got == [([0, 0], "TorchDistributedBackend"), (None, "TorchDistributedBackend")]
    assert B.get_backend() is B.DEFAULT


def _overrides_seen() -> dict[str, bool]:
    if dist.get_rank() == 0:
        B.DEFAULT.overrides = {"all_gather_into_tensor": False}
    dc.all_reduce(_ONE)
    seen = dict(B.get_backend().overrides)
    dc.all_reduce(_ONE)
    B.DEFAULT.overrides = {}
    return seen


@BOTH
def test_a_ranks_capability_overrides_are_its_own(local_worlds, in_process: bool) -> None:
    """The adapter's capability overrides (tests of the fallbacks set them) are a rank's own.
    Before, in-process: rank 1 ran with rank 0's (processes: none). In debug mode too, whose
    check gathers with the list call on rank 0 and into one tensor on rank 1: the
    in-process hub met them with "'list' object has no attribute 'reshape'"."""
    for debug in (False, True):
        with dc.debug(debug):
            got = local_worlds(2, in_process=in_process).run(_overrides_seen)
        assert got == [{"all_gather_into_tensor": False}, {}], debug


def _entries_in_the_flight_recorder() -> tuple[int, int]:
    """One all_reduce: this rank's flight-recorder entries, and those the diagnosis
    responder would report (both read the ring DIFFCOMM_FLIGHT_SIZE resized)."""
    dc.all_reduce(_ONE)
    return len(dc.flight_recorder()), len(responder._state()["recent"])


@BOTH
@pytest.mark.usefixtures("debug_off")
def test_a_resized_flight_recorder_is_a_ranks_own(monkeypatch: pytest.MonkeyPatch, in_process: bool) -> None:
    """With ``DIFFCOMM_FLIGHT_SIZE`` set (not 1024) the recorder makes a new ring of that
    size. Before: in-process, the new ring was every rank's (rank 0 listed 0 entries, rank 1
    both ranks' 2; processes 1 and 1) and stayed the caller's after the run; on processes
    too, the diagnosis responder read the old ring (0 entries: a desync report named no op)."""
    monkeypatch.setenv("DIFFCOMM_FLIGHT_SIZE", "16")
    ring = recorder._RING
    with dc.LocalWorld(2, in_process=in_process) as world:
        assert world.run(_entries_in_the_flight_recorder) == [(1, 1), (1, 1)]
    assert recorder._RING is ring


def _rank_0_records_spans() -> int | None:
    """Rank 0 records the spans of its two all_reduces (``record_spans``, the timeline's);
    rank 1 runs two too. Returns the spans rank 0 recorded."""
    D = sys.modules["diffcomm.backend.dispatch"]  # (``B.dispatch`` is the function)
    n = None
    if dist.get_rank() == 0:
        with D.record_spans() as spans:
            dc.all_reduce(_ONE)
            dc.all_reduce(_ONE)
        n = len(spans)
    else:
        dc.all_reduce(_ONE)
        dc.all_reduce(_ONE)
    dc.all_reduce(_ONE)
    assert D.current_spans() is None
    return n


@BOTH
@pytest.mark.usefixtures("debug_off")
def test_record_spans_on_one_rank_records_its_own_ops(local_worlds, in_process: bool) -> None:
    """The timeline's span recorder is a rank's own. Before, in-process: rank 0's block
    recorded rank 1's all_reduce too (3 spans; processes 2)."""
    assert local_worlds(2, in_process=in_process).run(_rank_0_records_spans) == [2, None]


class _Exp(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.exp()


def _step_then_cached_forward() -> float:
    """A parametrized weight: a forward, an SGD step on its original, a forward that must
    see the stepped weight, then a ``parametrize.cached()`` block around a collective (the
    ranks hand over inside it). Returns the second forward's sum."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)
    parametrize.register_parametrization(lin, "weight", _Exp())
    x = torch.ones(2, 4, dtype=torch.float64)
    lin(x).sum().backward()
    with torch.no_grad():
        lin.parametrizations.weight.original.sub_(0.5)
    y = lin(x)
    with parametrize.cached():
        dc.all_reduce(y.detach())
    return float(y.detach().sum())


def _checkpoint_after_an_early_stop_block() -> float:
    """A ``set_checkpoint_early_stop(False)`` block around a collective, then a checkpoint
    (outside it: early stop, the default) of a region that ends in a collective. Returns
    the weight gradient's sum."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    with set_checkpoint_early_stop(False):
        dc.all_reduce(_ONE)  # the ranks hand over inside the block
    y = checkpoint(lambda t: dc.all_reduce(t @ w.T), x, use_reentrant=False)
    y.sum().backward()
    assert w.grad is not None
    return float(w.grad.sum())


@BOTH
@pytest.mark.usefixtures("debug_off")
def test_a_ranks_parametrize_cache_is_its_own(local_worlds, in_process: bool) -> None:
    """``torch.nn.utils.parametrize.cached()`` keeps its depth and cache in module globals,
    one per process. Before, in-process: while rank 0 waited in a collective inside its
    ``cached()`` block, rank 1's forwards outside any block cached its parametrized weight,
    and its forward after the SGD step reused the weight from before it (33.898; processes
    20.609 on both ranks), with no error. A run leaves the caller's state as it was."""
    from torch.nn.utils import parametrize

    want = _single_process(_step_then_cached_forward)
    assert local_worlds(2, in_process=in_process).run(_step_then_cached_forward) == [want, want]
    assert parametrize._cache_enabled == 0


@BOTH
@pytest.mark.usefixtures("debug_off")
def test_a_ranks_checkpoint_early_stop_is_its_own(local_worlds, in_process: bool) -> None:
    """``torch.utils.checkpoint.set_checkpoint_early_stop`` keeps its flag in a module
    global, one per process. Before, in-process: a rank that ended its block after the
    other had entered its own kept the other's ``False`` and ran its next checkpoint without
    early stop, recomputing the region's all_reduce in backward where the other rank did not
    (a ``RankDesyncError``; processes: the same gradient on both ranks). A run leaves the
    caller's flag as it was."""
    import torch.utils.checkpoint as C

    want = _single_process(_checkpoint_after_an_early_stop_block)
    got = local_worlds(2, in_process=in_process).run(_checkpoint_after_an_early_stop_block)
    assert got == pytest.approx([2 * want] * 2, rel=1e-12)  # (the all_reduce's backward: 2x)
    assert C._enable_checkpoint_early_stop is None


def _single_process(fn: Any) -> Any:
    """``fn`` with every collective an identity (one rank's program, no world)."""
    from unittest import mock

    with mock.patch.object(dc, "all_reduce", lambda t, *a, **k: t):
        return fn()


def _global_hooks_around_a_linear() -> tuple[float, float]:
    """A global forward hook (``o * 2``) and full backward hook (``3 * grad_input``), every
    rank registering them, around a ``Linear`` and a collective. Returns the output's sum
    and the input gradient's."""
    from torch.nn.modules import module as M

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, dtype=torch.float64)
    x = torch.ones(2, 4, dtype=torch.float64, requires_grad=True)
    hooks = [
        M.register_module_forward_hook(lambda m, i, o: o * 2),
        M.register_module_full_backward_hook(lambda m, gi, go: (gi[0] * 3,)),
    ]
    try:
        y = dc.all_reduce(lin(x))  # the ranks hand over with the hooks registered
        y.sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert x.grad is not None
    return float(y.detach().sum()), float(x.grad.sum())


@BOTH
@pytest.mark.usefixtures("debug_off")
def test_torchs_global_hooks_are_refused_in_process(local_worlds, in_process: bool) -> None:
    """torch's global module (and optimizer) hooks are one registry per process. Before,
    in-process: a hook every rank registered ran on every rank's modules while registered
    (output 5.827 on both ranks, input gradient 60.906 on rank 1, where processes give 3.885
    and 10.151, no error); now ``InProcessUnsupportedError`` naming the hooks, and a run
    leaves none of the ranks' hooks in the caller."""
    from torch.nn.modules import module as M

    world = local_worlds(2, in_process=in_process)
    if not in_process:
        got = world.run(_global_hooks_around_a_linear)
        assert got == [pytest.approx((3.884701146, 10.150929581), rel=1e-9)] * 2
        return
    before = (dict(M._global_forward_hooks), dict(M._global_backward_hooks))
    with pytest.raises(
        dc.RankError, match=r"InProcessUnsupportedError.*torch's global hooks .*_global_forward_hooks"
    ):
        world.run(_global_hooks_around_a_linear)
    assert (dict(M._global_forward_hooks), dict(M._global_backward_hooks)) == before


def _tracked(tool: str) -> Any:
    """A ``Rank{r}Block`` module holding a collective, then a ``Rank{r}Net`` holding one, under one of
    torch's trackers (each registers global module hooks while in use): what the tracker saw
    inside the block (its parents, or CommDebugMode's count of collectives)."""
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.module_tracker import ModuleTracker

    r = dist.get_rank()
    tracker: Any = {"ModuleTracker": ModuleTracker, "ModTracker": ModTracker, "CommDebugMode": CommDebugMode}[
        tool
    ]()
    seen: list[Any] = []

    def block_forward(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = dc.all_reduce(x * 2)  # the ranks hand over inside the block
        seen.append(sorted(tracker.parents) if tool != "CommDebugMode" else None)
        return y

    block = type(f"Rank{r}Block", (torch.nn.Module,), {"forward": block_forward})()
    net = type(f"Rank{r}Net", (torch.nn.Module,), {"forward": lambda m, x: dc.all_reduce(x + 1)})()
    with tracker:
        net(block(torch.ones(2)))
    return tracker.get_total_counts() if tool == "CommDebugMode" else seen


@BOTH
@pytest.mark.usefixtures("debug_off")
@pytest.mark.parametrize("tool", ["ModuleTracker", "ModTracker", "CommDebugMode"])
def test_torchs_module_trackers_are_refused_in_process(local_worlds, in_process: bool, tool: str) -> None:
    """torch's trackers register global module hooks for their ``with`` block, which every
    in-process rank shares: a ModuleTracker on rank 0 listed rank 1's ``Rank1Net`` among its
    parents inside its own block; a ModTracker or CommDebugMode (2 collectives on processes)
    raised torch's "The Module hierarchy tracking is wrong. Report a bug to PyTorch".
    Now refused as a user's global hook is (test_torchs_global_hooks_are_refused_in_process)."""
    world = local_worlds(2, in_process=in_process)
    if not in_process:
        want = [2, 2] if tool == "CommDebugMode" else [[["Global", f"Rank{r}Block"]] for r in range(2)]
        assert world.run(_tracked, tool) == want
        return
    with pytest.raises(
        dc.RankError, match=r"InProcessUnsupportedError.*torch's global hooks .*_global_forward"
    ):
        world.run(_tracked, tool)
