"""Running every rank in this process: the runner behind ``LocalWorld(n, in_process=True)``.

Each :meth:`~diffcomm.LocalWorld.run` starts one thread per rank; each joins a real
``torch.distributed`` world of backend ``"inproc"`` (:mod:`diffcomm.backend.in_process`:
its collectives meet in memory), calls the function, and leaves the world. One rank runs
at a time (the hand-over happens only inside a collective or a receive), each with its own
torch RNG stream and its own diffcomm per-rank state (kept from run to run, as a process
keeps it: :class:`~diffcomm.backend.in_process.RankStates`), and its own unpickled copy of
the function and arguments, so a run gives what separate processes give.
Failures are reported as :class:`~diffcomm.LocalWorld` reports them: one
:class:`~diffcomm.RankError` naming the ranks with their tracebacks (a desync:
:class:`~diffcomm.RankDesyncError`, found at once instead of after a timeout).
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import _lifecycle, _replication, _torch
from .._errors import DesyncError, RankDesyncError, RankError
from ..backend import in_process as _ip
from ..backend.in_process import RankStates
from ..diagnostics import logger as _logger
from ..diagnostics import recorder as _flight
from . import reports as _report
from . import shipping as _ship

_RUN_LOCK = threading.Lock()  # one in-process run at a time per process
#: what a rank raises when its collective can never complete (the backend's own error,
#: or the same one translated by diffcomm's dispatch into its DesyncError)
_DESYNC = (_ip.InProcessDesyncError, DesyncError)


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    carried: Mapping[str, Any] | None = None,
    state: RankStates | None = None,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` in-process ranks; results by rank.
    ``carried``: the caller's settings every rank runs under (``shipping.carried``);
    ``state``: the world's ranks' process state, kept from run to run (a fresh one if
    ``None``; reset to a fresh process's after a desync, which restarts a world of processes).

    The function and its arguments travel to each rank as they travel to a process: pickled
    once here, unpickled by every rank, so each rank has its own copies (a rank's
    ``.grad`` accumulation or in-place change never reaches another rank or the caller).
    Each rank's result travels back pickled too, as a process's does."""
    try:
        payload = _ship.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"LocalWorld.run(): cannot pickle the function or its arguments: {exc}") from exc
    # spmd_types' checker patches process-wide functions per entering thread: counted, so
    # that ranks inside it at once each type as alone (now, or when spmd_types is imported)
    _torch.when_loaded("spmd_types._checker", _replication.count_spmd_types_patches)
    if not _RUN_LOCK.acquire(blocking=False):
        raise RuntimeError(
            "LocalWorld(in_process=True).run(): an in-process run is already going on in this "
            "process (a run inside a run, or from two threads); in-process runs do not nest"
        )
    try:
        return _run(world_size, getattr(fn, "__name__", "fn"), payload, carried or {}, state)
    finally:
        _RUN_LOCK.release()


def _run(
    world_size: int,
    name: str,
    payload: bytes,
    carried: Mapping[str, Any],
    state: RankStates | None,
) -> list[Any]:
    hub = _ip.Hub(world_size, state)
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    exceptions: dict[int, BaseException] = {}
    outer_rng, outer_host_rng = torch.get_rng_state(), _ip.host_rng()
    outer = [_ip._copy_of(box) for box in _ip._STATE]  # the caller's own, put back after
    outer_attrs, outer_torch = _ip.attrs_now(), _ip.torch_settings()
    outer_hooks = _ip.global_hook_ids()

    def rank_main(rank: int) -> None:
        _ip.enter_rank(hub, rank)
        hub.acquire(rank)
        outcome = "done"
        # the comm-off switches are per thread: a rank's own (`comm_off("all_reduce")` as a
        # plain call) stays on from run to run, as in a rank process (it ended with the run)
        if state is not None and state.switched[rank]:
            _logger.STATE.off = set(state.switched[rank])
        try:
            dist.init_process_group(_ip.NAME, store=store, rank=rank, world_size=world_size)
            if state is not None and state.history[rank] is not None:
                _flight.resume(state.history[rank])  # the world's group, as a process keeps it
            try:
                _lifecycle.program_start()  # a new program, as a process rank's run (its own state)
                # grad mode, autocast and the default device are per thread in torch: the
                # rank's own, carried from its last run's thread (set after the world is joined)
                _ip.set_thread_settings(hub.states.thread[rank])
                fn, args, kwargs = _ship.loads(payload)
                with _ship.applied(carried):
                    result = fn(*args, **kwargs)
                # back as from a process: pickled (a tensor without the graph of this rank's
                # world, which a caller's backward cannot run; what cannot be is the rank's error)
                results[rank] = _ship.loads(_ship.dumps(result))
            finally:
                if dist.is_initialized():
                    if state is not None:  # (destroying the group ends its history)
                        state.history[rank] = _flight.history()
                    dist.destroy_process_group()
        except BaseException as exc:
            failures[rank] = traceback.format_exc()
            exceptions[rank] = exc
            # (not an abort of the world: as on processes, ranks in a collective without this
            # one complete it; those waiting for it are found stuck, the story naming it)
            outcome = f"raised {type(exc).__name__}: {exc}"
        finally:
            hub.states.thread[rank] = _ip.thread_settings()
            if state is not None:
                state.switched[rank] = set(getattr(_logger.STATE, "off", ()))
            hub.release(rank, final=True, outcome=outcome)
            _ip.leave_rank()

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"diffcomm-inproc-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    # torch's C++ registry of group names: one per thread while the ranks run
    isolation = _torch.set_thread_isolation
    isolation(True)
    hook = sys.excepthook  # init_process_group wraps it with a "[rankN]" prefix: put back
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        isolation(False)
        sys.excepthook = hook
        torch.set_rng_state(outer_rng)
        _ip.set_host_rng(outer_host_rng)
        for box, value in zip(_ip._STATE, outer):
            _ip._restore(box, value)
        _ip.put_attrs(outer_attrs)
        _ip.set_torch_settings(outer_torch)
        _ip.drop_global_hooks(outer_hooks)
    if failures:
        first = {r: tb for r, tb in failures.items() if not isinstance(exceptions[r], _DESYNC)}
        # a rank left waiting (a desync, or a peer that raised while it waited): a world of
        # processes tears down and restarts with fresh ranks, so the ranks start afresh here
        # too (a rank's set_default_dtype, grad mode or seed outlived such a run in-process)
        if state is not None and len(first) < len(failures):
            state.reset()
        if not first:  # only desyncs: every waiting rank names where it waited
            story = next(str(e) for e in exceptions.values())
            raise RankDesyncError(
                f"LocalWorld(in_process=True): the ranks went out of step during `{name}`.\n{story}"
                + _report.tracebacks(failures),
                {"op": None},
                failures,
                exceptions,
            )
        raise RankError(_report.failure_message(first, False), failures, exceptions)
    # every rank returned, yet the world went out of step: a rank process waits for its
    # pending asynchronous ops and posted sends before it reports, and such a run is its
    # error there (the world torn down: its ranks restart afresh here too). In-process an
    # asynchronous op runs at launch, so the desync it met stayed in a handle never waited;
    # a message no receive took died with the hub.
    left = hub.unreceived()
    if hub.failure is not None or left:
        if state is not None:
            state.reset()
        story = hub.failure or (
            f"every rank returned, but sends were never received: {'; '.join(left)} (a send "
            "missing its recv on the peer, or a receive too few there; on real processes the "
            "send fails at the collective timeout)"
        )
        raise RankDesyncError(
            f"LocalWorld(in_process=True): the ranks went out of step during `{name}`.\n{story}",
            {"op": None},
            {},
            {},
        )
    return results
