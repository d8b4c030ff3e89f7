"""An in-process transport: every rank of a world is a thread of this process.

``LocalWorld(n, in_process=True)`` (:mod:`diffcomm.runtime.in_process`) runs each rank as a
thread that joins a real ``torch.distributed`` world through the c10d backend registered
here (``"inproc"``): :class:`InProcessGroup`, a Python ``ProcessGroup`` whose collectives
and point-to-point ops meet in one shared :class:`Hub` instead of a network. Everything
above (``torch.distributed``'s Python API, the diffcomm backend adapter, the collectives,
``dist.new_group``, ``DeviceMesh``) runs unchanged, so an in-process run exercises the same
code as a run on processes; only the bytes do not travel.

Exactly one rank thread runs at a time (the hub's lock is a run lock, handed over only
while a rank waits for its peers), so each rank sees its own torch RNG stream (swapped in
and out with the lock, each starting where a fresh process starts), and a run is
deterministic. Reductions add the ranks' values in rank order.

What cannot happen in one process is refused with a message naming the op: a collective
that can never complete (a rank returned, or ranks wait in different ops: a desync) raises
:class:`InProcessDesyncError` at once on every waiting rank, instead of a timeout.

Backend gaps are filled here and only here (STYLE habit 7): the adapter sees a backend
named ``"inproc"`` with every capability (:func:`~diffcomm.backend.groups.static_capabilities`).
"""

from __future__ import annotations

import copy
import ctypes
import random
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.distributed as dist

from .. import _config, _torch
from .. import accelerator as _accelerator
from .._errors import DiffcommError
from ..diagnostics import recorder as _flight
from .buffers import joined

# Size: ~1150 lines, over the ~600 guideline: the in-process transport is one piece (the
# hub the ranks meet in, the per-rank state it swaps, the thread-local group record, and the
# process group whose ops are the hub's exchanges); split, each part would only make sense
# next to the others.

NAME = "inproc"

_RED: Any = dist.ReduceOp.RedOpType
_PG: Any = dist.ProcessGroup  # subclassed by a Python group (untyped overrides)


class InProcessDesyncError(DiffcommError):
    """The ranks of an in-process world can never complete a collective (a rank returned
    while others wait in it, or ranks wait in different ops)."""


class InProcessUnsupportedError(DiffcommError, NotImplementedError):
    """Something an in-process world cannot do (named in the message with the way out)."""


class RankStates:
    """Every rank's process state between the runs of one in-process world: its CPU RNG
    state, the contents of the per-rank boxes (:func:`per_rank`: settings such as
    ``dc.debug`` set inside a rank, named RNG streams) and attributes (:func:`per_rank_attr`:
    ``set_backend``'s adapter, the flight recorder's ring), torch's process-wide settings
    (:func:`torch_settings`: default dtype, deterministic algorithms, anomaly detection), its
    grad mode, its comm-off switches and its flight recorder's history. A process
    keeps these from one ``LocalWorld.run`` to the next, so the world keeps them here
    (:meth:`reset`: a fresh process's, as a world restarted after a failure)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rng: dict[int, torch.Tensor] = {}
        #: each rank's Python ``random`` state and NumPy global state (:class:`_HostRNG`:
        #: the legacy state and its struct's bytes; ``None``: a fresh one, made when needed)
        self.py_rng: dict[int, Any] = {}
        self.np_rng: dict[int, tuple[Any, bytes] | None] = {}
        self.saved: dict[int, list[Any]] = {}
        #: each rank's module attributes registered with :func:`per_rank_attr`
        self.attrs: dict[int, list[Any]] = {}
        #: each rank's torch settings that are one per process (:func:`torch_settings`)
        self.torch: dict[int, tuple[Any, ...]] = {}
        #: each rank's torch settings that are per thread (:func:`thread_settings`: grad
        #: mode, autocast, default device) between runs (a run's threads end)
        self.thread: dict[int, tuple[Any, ...]] = {}
        #: each rank's comm-off switches (per thread: kept here between its runs' threads)
        self.switched: dict[int, set[str]] = {}
        #: each rank's flight-recorder history (its run's group is destroyed at the run's end)
        self.history: dict[int, Any] = {}
        self.reset()

    def reset(self) -> None:
        for r in range(self.world_size):
            self.rng[r] = _fresh_rng()
            self.py_rng[r] = random.Random().getstate()  # (seeded by the system's entropy)
            self.np_rng[r] = None
            self.saved[r] = [_copy_of(c) for c in _INITIAL]
            self.attrs[r] = [fresh() for _owner, _name, fresh in _ATTRS]
            self.torch[r] = FRESH_TORCH
            self.thread[r] = FRESH_THREAD
            self.switched[r] = set()
            self.history[r] = None


class Hub:
    """The meeting point of one in-process world's ranks: the run lock, every group's
    pending collectives and every point-to-point mailbox.

    ``status[r]`` is what rank ``r`` does now: ``"running"``, ``"done"`` or the op it waits
    in (with the group's name). A rank waits only inside :meth:`wait_for`, which releases
    the run lock to the next rank; when no rank can run and no waiting rank's condition
    holds, every waiting rank raises :class:`InProcessDesyncError` naming who waits where.
    """

    def __init__(self, world_size: int, states: RankStates | None = None) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.status: dict[int, str] = dict.fromkeys(range(world_size), "starting")
        self.ready: dict[int, Callable[[], bool]] = {}
        self.slots: dict[tuple[str, int], list[Any]] = {}
        self.reads: dict[tuple[str, int], int] = {}
        # each channel's messages by number, and how many were sent and how many receives
        # posted on it: a receive takes the message of its turn at posting, as gloo's
        # matches in posting order (see :meth:`take`)
        self.mail: dict[tuple[str, int, int, int], dict[int, torch.Tensor]] = {}
        self.sent: dict[tuple[str, int, int, int], int] = {}
        self.posted: dict[tuple[str, int, int, int], int] = {}
        #: each group name's members (global ranks) and the rank that first used it
        self.members: dict[str, tuple[tuple[int, ...], int]] = {}
        self.failure: str | None = None
        # every rank's CPU RNG state and process state (:func:`per_rank`), swapped with
        # the run lock: the world's, kept from its last run (a fresh process's at first)
        states = states if states is not None else RankStates(world_size)
        self.states = states
        self.rng = states.rng
        self.host_rng = _HostRNG(states)
        self.saved = states.saved
        self.attrs = states.attrs
        self.torch = states.torch
        # torch's compile-session flag (``torch.compiler.is_compiling()``, diffcomm's
        # compile check that picks the traceable backend) is one per process: each rank's
        # own, swapped with the run lock, so a rank that runs while another is mid-compile
        # (e.g. eager code after a graph break) picks the eager backend, not funcol
        self.compiling: dict[int, bool] = dict.fromkeys(range(world_size), False)

    def _swap_in(self, rank: int) -> None:
        torch.set_rng_state(self.rng[rank])
        self.host_rng.swap_in(rank)
        for box, value in zip(_STATE, self.saved[rank]):
            _restore(box, value)
        for (owner, name, _fresh), value in zip(_ATTRS, self.attrs[rank]):
            setattr(owner, name, value)
        set_torch_settings(self.torch[rank])
        _torch.swap_compiling_flag(self.compiling[rank])

    def _swap_out(self, rank: int) -> None:
        self.rng[rank] = torch.get_rng_state()
        self.host_rng.swap_out(rank)
        self.saved[rank] = [_copy_of(box) for box in _STATE]
        self.attrs[rank] = [getattr(owner, name) for owner, name, _fresh in _ATTRS]
        self.torch[rank] = torch_settings()
        self.compiling[rank] = _torch.swap_compiling_flag(False)

    # ---- the run lock ----------------------------------------------------------------
    def acquire(self, rank: int) -> None:
        """Take the run lock for ``rank`` (its thread's start) and install its RNG."""
        self.lock.acquire()
        self.status[rank] = "running"
        self._swap_in(rank)

    def release(self, rank: int, final: bool, outcome: str = "done") -> None:
        """Give the run lock up for good (``rank`` returned, or raised: ``outcome``)."""
        self._swap_out(rank)
        self.status[rank] = outcome if final else "running"
        self.cond.notify_all()
        self.lock.release()

    def fail(self, message: str) -> None:
        """Abort the world: every waiting rank raises with ``message`` (lock held)."""
        if self.failure is None:
            self.failure = message
        self.cond.notify_all()

    def wait_for(self, rank: int, what: str, ready: Callable[[], bool]) -> None:
        """Wait (run lock held) until ``ready()``, letting the other ranks run meanwhile."""
        if ready():
            return
        if _profiling():  # torch's profiler is one per process: another rank's would crash it
            message = (
                f"diffcomm in-process world: rank {rank} {what} inside torch.profiler; the profiler "
                "is one per process, and the other ranks cannot run while it records (torch "
                "crashes). Profile with real processes (dc.LocalWorld(n)), or outside the collectives."
            )
            raise InProcessUnsupportedError(message)
        hooks = _users_global_hooks()
        if hooks:
            raise InProcessUnsupportedError(_GLOBAL_HOOK.format(rank=rank, what=what, hooks=hooks))
        if _forward_ad.__dict__.get("_current_level", -1) >= 0:  # levels are one stack per process
            raise InProcessUnsupportedError(
                f"diffcomm in-process world: rank {rank} {what} inside forward-mode AD "
                "(torch.func.jvp / jacfwd, torch.autograd.forward_ad.dual_level); its levels are "
                "one stack per process, which the other ranks would interleave. Run it on real "
                "processes (dc.LocalWorld(n))."
            )
        self._swap_out(rank)
        self.status[rank] = what
        self.ready[rank] = ready
        try:
            # the failure first: a rank that finds the ranks in different collectives fills
            # its slot before it fails the world, and a waiting rank must not take that
            # slot as a completed collective (it went on with the other op's data)
            while self.failure is not None or not ready():
                if self.failure is not None:
                    raise InProcessDesyncError(self.failure)
                if self._stuck():
                    self.fail(self._stuck_story())
                    raise InProcessDesyncError(self.failure or "")
                self.cond.notify_all()
                self.cond.wait(1.0)
        finally:
            self.status[rank] = "running"
            self.ready.pop(rank, None)
            self._swap_in(rank)

    def _stuck(self) -> bool:
        if any(s in ("running", "starting") for s in self.status.values()):
            return False
        return not any(ok() for ok in self.ready.values())

    def _stuck_story(self) -> str:
        where = "; ".join(f"rank {r}: {s}" for r, s in sorted(self.status.items()))
        return (
            "diffcomm in-process world: the ranks can never complete their pending "
            f"collectives (a desync: a rank returned, or ranks wait in different ops). {where}. "
            "In one process this is found at once; there is no timeout to wait for."
        )

    def same_members(self, group: str, members: tuple[int, ...], rank: int, what: str) -> None:
        """Refuse a group whose name another rank's group of other members holds (lock
        held). A group's name is its place in the order of ``dist.new_group`` calls, so
        ranks that each made only their own group (``new_group([0, 1])`` on ranks 0 and 1,
        ``new_group([2, 3])`` on 2 and 3) hold two groups of one name: their collectives met
        in one slot and completed as two groups, where on processes the two groups' gloo
        connections mix (a desync, a hang or another group's data)."""
        first, by = self.members.setdefault(group, (members, rank))
        if first != members:
            self.fail(
                f"diffcomm in-process world: rank {rank} {what} on group {group} of ranks "
                f"{list(members)}, but rank {by}'s group {group} is of ranks {list(first)}: the "
                "ranks did not call dist.new_group for every group in the same order (every rank "
                "of the world calls it for every group, members or not, unless "
                "use_local_synchronization=True); on real processes such groups mix up their "
                "connections (a desync, a hang or another group's data)"
            )
            raise InProcessDesyncError(self.failure or "")

    # ---- collectives: every rank deposits, every rank reads all ----------------------
    def exchange(self, group: str, seq: int, rank: int, size: int, what: str, payload: Any) -> list[Any]:
        """Every group member's ``payload`` for the group's ``seq``-th collective, by group rank."""
        key = (group, seq)
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = [_EMPTY] * size
            self.reads[key] = 0
        if slot[rank] is not _EMPTY:  # cannot happen: each rank counts its own calls
            raise InProcessDesyncError(f"{what}: rank {rank} entered collective {seq} twice")
        slot[rank] = (what, payload)
        ops = {w for w, _ in (s for s in slot if s is not _EMPTY)}
        if len(ops) > 1:  # ranks in different collectives: never completes, never mixes data
            calls = "; ".join(f"rank {r}: {s[0]}" for r, s in enumerate(slot) if s is not _EMPTY)
            self.fail(f"diffcomm in-process world: a desync in call {seq} on group {group}: {calls}")
            raise InProcessDesyncError(self.failure or "")
        self.cond.notify_all()
        self.wait_for(_me(rank), f"waits in {what} (group {group}, call {seq})", lambda: _EMPTY not in slot)
        got = [s[1] for s in slot]
        self.reads[key] += 1
        if self.reads[key] == size:
            del self.slots[key], self.reads[key]
        return got

    # ---- point to point --------------------------------------------------------------
    def post(self, group: str, src: int, dst: int, tag: int, t: torch.Tensor) -> None:
        key = (group, src, dst, tag)
        n = self.sent.get(key, 0)
        self.sent[key] = n + 1
        self.mail.setdefault(key, {})[n] = t.detach().clone()
        self.cond.notify_all()

    def turn(self, group: str, src: int, dst: int, tag: int) -> int:
        """The number of the message a receive posted now on the channel takes."""
        key = (group, src, dst, tag)
        n = self.posted.get(key, 0)
        self.posted[key] = n + 1
        return n

    def take(self, group: str, src: int, dst: int, tag: int, turn: int, what: str) -> torch.Tensor:
        """Message number ``turn`` of the channel (a receive's, from :meth:`turn` when it
        was posted), once sent. (The first message waiting when the receive was *waited*,
        before: a receive posted ahead (``p2p.irecv``) and waited after a later blocking
        ``recv`` on its channel lost its message to that ``recv``, where gloo matches
        receives in posting order.)"""
        box = self.mail.setdefault((group, src, dst, tag), {})
        self.wait_for(
            _me(dst), f"waits in {what} from group rank {src} (group {group}, tag {tag})", lambda: turn in box
        )
        return box.pop(turn)

    def unreceived(self) -> list[str]:
        """The channels holding messages no receive took, once every rank returned: a send
        whose peer never received it, which a rank process waits for before it reports (its
        run fails at the collective timeout, naming the send); here it died with the hub and
        the run returned normally."""
        return [
            f"group rank {src} -> {dst} (group {group}, wire tag {tag}): {len(box)} message(s) on the wire"
            for (group, src, dst, tag), box in sorted(self.mail.items())
            if box
        ]


_EMPTY = object()


# A collective that runs for real while dynamo compiles a frame (e.g. fake-tensor constant
# propagation runs an op whose inputs are all trace-time constants): the rank would wait
# for its peers holding dynamo's compile lock, which the peers need to compile their own
# frames, so the world would hang (there is no timeout in-process). Refused instead.
_TRACED = (
    "diffcomm in-process world: rank {rank} {what} while torch.compile traces (a collective "
    "run for real during compilation, e.g. on trace-time constants); dynamo's compile lock "
    "is one per process and the other ranks need it to compile, so this would hang. Make "
    "the collective's input depend on a traced input, or run on real processes (dc.LocalWorld(n))."
)


_profiling: Callable[[], bool] = _torch.profiler_enabled

# torch's global hooks (``register_module_forward_hook``, ``register_optimizer_step_pre_hook``,
# ...) are one registry per process: a hook every rank registered ran on every rank's modules
# while registered (a forward hook ``o * 2`` and a full backward hook ``3 * grad_input``
# around a Linear and an all_reduce at world 2: output 5.827, input gradient 60.91 on rank 1,
# where processes give 3.885 and 10.15, no error), and a caller's on the ranks' modules,
# where no rank process has it.
# Refused at a hand-over while one is registered; torch's and diffcomm's own (registered
# once per process, as each rank process registers its own) are not the user's.
_GLOBAL_HOOK = (
    "diffcomm in-process world: rank {rank} {what} while torch's global hooks {hooks} are "
    "registered; torch keeps one registry per process, so a hook that every rank registers "
    "would run once per rank on every rank's modules (and one of the caller's on them all). "
    "Register it on the module (module.register_forward_hook, register_full_backward_hook) "
    "or the optimizer (optimizer.register_step_pre_hook), or run on real processes "
    "(dc.LocalWorld(n))."
)


def _users_global_hooks() -> list[str]:
    """The hooks in torch's global registries that neither torch nor diffcomm registered, as
    ``"registry: hook"`` (usually none: a look into a few empty dicts)."""
    return [
        f"{name}: {getattr(hook, '__qualname__', repr(hook))}"
        for name, registry in _torch.global_hooks()
        for hook in registry.values()
        if _users(hook)
    ]


def _users(hook: Any) -> bool:
    """Not torch's or diffcomm's own, or one of torch's per-use trackers'
    (``_torch.PER_USE_HOOKS``): a ``ModuleTracker`` on rank 0 listed rank 1's module among
    its parents; a ``ModTracker`` or ``CommDebugMode`` raised torch's "Module hierarchy
    tracking is wrong", or the latter counted no collective (2 on processes)."""
    module = getattr(hook, "__module__", None) or ""
    return module.startswith(_torch.PER_USE_HOOKS) or module.partition(".")[0] not in ("torch", "diffcomm")


def global_hook_ids() -> set[tuple[str, int]]:
    """The handle ids in torch's global hook registries now (the caller's, before a run)."""
    return {(name, key) for name, registry in _torch.global_hooks() for key in registry}


def drop_global_hooks(before: set[tuple[str, int]]) -> None:
    """After a run: remove the user's global hooks its ranks registered and left behind (a
    rank that raised, or one refused above), which no rank process would hand its caller."""
    for name, registry in _torch.global_hooks():
        for key in [k for k, hook in registry.items() if (name, k) not in before and _users(hook)]:
            del registry[key]


def _fresh_rng() -> torch.Tensor:
    """A fresh process's CPU generator state: seeded by the operating system's entropy
    (each rank its own; a run that wants equal streams seeds them, as on processes)."""
    g = torch.Generator()
    g.seed()
    return g.get_state()


# Python's and NumPy's global random generators are one per process too: each rank's own,
# swapped with the run lock (a rank's `random.seed(100 + rank)` was the other ranks' stream:
# after a hand-over rank 0 drew rank 1's numbers), starting as a fresh process's.
#: NumPy's MT19937 state struct behind ``ctypes.state_address``: uint32 key[624], int pos
_MT_BYTES = 624 * 4 + 4


def _np_raw(np: Any) -> bytes:
    """The bytes of NumPy's global MT19937 state struct (its words and position)."""
    return ctypes.string_at(np.random.mtrand._rand._bit_generator.ctypes.state_address, _MT_BYTES)


def _raw_of(np: Any, state: tuple[Any, ...]) -> bytes:
    """The struct's bytes that the legacy ``state`` (``np.random.get_state()``) holds."""
    return np.asarray(state[1], dtype=np.uint32).tobytes() + struct.pack("=i", state[2])


def _np_fast(np: Any) -> bool:
    """Whether the struct is laid out as :data:`_MT_BYTES` says (checked once per NumPy;
    else every hand-over reads and writes the whole state, ~60 µs instead of ~2)."""
    if _NP_FAST[0] is None:
        try:
            _NP_FAST[0] = _np_raw(np) == _raw_of(np, np.random.get_state())
        except Exception:  # (no ctypes interface: the slow, exact path)
            _NP_FAST[0] = False
    return bool(_NP_FAST[0])


_NP_FAST: list[bool | None] = [None]


def host_rng() -> tuple[Any, Any]:
    """The Python ``random`` and NumPy global RNG states now (NumPy's ``None`` where it is
    not imported): the caller's, put back after a run."""
    np = sys.modules.get("numpy")
    return random.getstate(), None if np is None else np.random.get_state()


def set_host_rng(states: tuple[Any, Any]) -> None:
    """Put the states :func:`host_rng` returned."""
    py, np_state = states
    random.setstate(py)
    np = sys.modules.get("numpy")
    if np is not None:  # (imported during the run: a fresh process's state, not a rank's)
        np.random.set_state(np_state) if np_state is not None else np.random.seed()


class _HostRNG:
    """Each rank's Python ``random`` and NumPy global generator states, swapped with the run
    lock. NumPy's full state (~30 µs to read, as much to write) is read only where a rank
    changed it — its struct's bytes (~1 µs) differ from what was put in — and written as
    those bytes, except where a cached Gaussian (``has_gauss``, outside the struct) is in
    play: then the full state, exactly."""

    def __init__(self, states: RankStates) -> None:
        self.py, self.np = states.py_rng, states.np_rng
        self.now: tuple[bytes, int] | None = None  # the struct's bytes and has_gauss put in

    def swap_in(self, rank: int) -> None:
        random.setstate(self.py[rank])
        np = sys.modules.get("numpy")
        if np is None:
            return
        saved = self.np[rank]
        if saved is None:  # a fresh process's, made once NumPy is imported
            fresh = np.random.RandomState().get_state()
            saved = self.np[rank] = (fresh, _raw_of(np, fresh))
        state, raw = saved
        if self.now is not None and self.now[1] == 0 and state[3] == 0 and _np_fast(np):
            ctypes.memmove(np.random.mtrand._rand._bit_generator.ctypes.state_address, raw, _MT_BYTES)
        else:
            np.random.set_state(state)
        self.now = (raw, state[3])

    def swap_out(self, rank: int) -> None:
        self.py[rank] = random.getstate()
        np = sys.modules.get("numpy")
        if np is None:
            return
        fast = _np_fast(np)
        raw = _np_raw(np) if fast else b""
        if fast and self.now is not None and self.now[1] == 0 and raw == self.now[0]:
            return  # not drawn from (a draw moves the position; a Gaussian needs has_gauss 0 -> words)
        state = np.random.get_state()
        raw = raw if fast else _raw_of(np, state)
        self.np[rank] = (state, raw)
        self.now = (raw, state[3]) if fast else None


# Process state that belongs to a rank (a dict, list or set at module level, e.g. the group
# records' cache, the point-to-point message counters): each rank of an in-process world
# sees its own contents, swapped in and out with the run lock, starting as a fresh
# process's (the contents when it was registered, at import).
_STATE: list[Any] = []
_INITIAL: list[Any] = []


def per_rank(*boxes: Any) -> None:
    """Register module-level dicts / lists whose contents belong to a rank (see above)."""
    for box in boxes:
        if not isinstance(box, dict | list | set | deque):
            raise TypeError(f"per_rank(): a dict, list, set or deque, got {type(box).__name__}")
        _STATE.append(box)
        _INITIAL.append(_copy_of(box))


#: Module attributes that belong to a rank and that their module rebinds (a ``global``
#: assignment: ``set_backend``'s adapter, the flight recorder's ring, resized): ``(owner,
#: name, fresh)``, each rank's own object swapped in with ``setattr`` (nothing copied),
#: starting as ``fresh()`` (a fresh process's).
_ATTRS: list[tuple[Any, str, Callable[[], Any]]] = []


def per_rank_attr(owner: Any, name: str, fresh: Callable[[], Any]) -> None:
    """Register ``owner.name`` (a module attribute its module rebinds, so not a box
    :func:`per_rank` could fill in place) as a rank's own; ``fresh()``: a fresh process's
    value (called once per rank: return a new object where the value is mutable)."""
    if not hasattr(owner, name):
        raise AttributeError(f"per_rank_attr(): {owner!r} has no attribute {name!r}")
    _ATTRS.append((owner, name, fresh))


def attrs_now() -> list[Any]:
    """The registered attributes' values now (the caller's, put back after a run)."""
    return [getattr(owner, name) for owner, name, _fresh in _ATTRS]


def put_attrs(values: list[Any]) -> None:
    for (owner, name, _fresh), value in zip(_ATTRS, values):
        setattr(owner, name, value)


# torch's own settings that are one per process (a rank process has its own, starting at
# torch's defaults; in one process the ranks would share them: rank 1's
# ``torch.set_default_dtype(torch.float64)`` made rank 0's ``torch.ones`` float64, and a
# run left it in the caller). Each rank's own, swapped with the run lock; grad mode and
# autocast are per thread in torch already.
#: a fresh process's: default dtype, deterministic algorithms (and warn-only), anomaly
#: detection (and its NaN check), float32 matmul precision
FRESH_TORCH: tuple[Any, ...] = (torch.float32, False, False, False, True, "highest")


def torch_settings() -> tuple[Any, ...]:
    """torch's process-wide settings now, in the order of :data:`FRESH_TORCH`."""
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
        torch.get_float32_matmul_precision(),
    )


def set_torch_settings(values: tuple[Any, ...]) -> None:
    """Put torch's process-wide settings to ``values`` (from :func:`torch_settings`),
    calling only the setters whose value differs (a hand-over usually changes none)."""
    now = torch_settings()
    if values == now:
        return
    dtype, deterministic, warn_only, anomaly, check_nan, matmul = values
    if dtype != now[0]:
        torch.set_default_dtype(dtype)
    if (deterministic, warn_only) != now[1:3]:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if (anomaly, check_nan) != now[3:5]:
        torch.autograd.set_detect_anomaly(anomaly, check_nan=check_nan)
    if matmul != now[5]:
        torch.set_float32_matmul_precision(matmul)


# torch's settings that are per thread (a rank process keeps them from one run to the next
# in its one thread; an in-process rank runs each run in a new thread, which starts at
# torch's defaults: `torch.set_autocast_enabled("cpu", True)` or `set_default_device` called
# plainly in one run held in the next on processes, bfloat16 matmuls, and not in-process).
# `torch.set_flush_denormal` is the thread's floating-point control word, which a new thread
# inherits from the one that made it: the caller's leaked into every in-process rank and a
# rank's own was dropped at its next run (a denormal 1e-310 * 1.0 gave 0.0 in-process where
# processes give 1e-310, and the reverse), so it is set on every run's thread.
#: a fresh thread's: grad mode, CPU autocast on and its dtype, the default device, denormals
#: flushed to zero
FRESH_THREAD: tuple[Any, ...] = (True, False, torch.bfloat16, torch.device("cpu"), False)


def _denormals_flushed(tiny: float = sys.float_info.min, half: float = 0.5) -> bool:
    """Whether this thread flushes denormals to zero (``torch.set_flush_denormal``, which
    has no getter): the smallest normal float halved is then 0 (Python's floats use the
    thread's control word too; arguments, not constants, so nothing is folded)."""
    return tiny * half == 0.0


def thread_settings() -> tuple[Any, ...]:
    """torch's per-thread settings now, in the order of :data:`FRESH_THREAD`."""
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.get_default_device(),
        _denormals_flushed(),
    )


def set_thread_settings(values: tuple[Any, ...]) -> None:
    """Put this thread's settings to ``values`` (from :func:`thread_settings`), calling only
    the setters whose value differs from a fresh thread's (a default device set even to the
    CPU puts a mode in front of every torch call), and the denormal mode always (a thread
    starts with its maker's)."""
    grad, autocast, dtype, device, flush = values
    torch.set_grad_enabled(grad)
    if flush != _denormals_flushed():
        torch.set_flush_denormal(flush)
    if (autocast, dtype) != FRESH_THREAD[1:3]:
        torch.set_autocast_enabled("cpu", autocast)
        torch.set_autocast_dtype("cpu", dtype)
    if device != FRESH_THREAD[3]:
        torch.set_default_device(device)


def _copy_of(box: Any) -> Any:
    return copy.copy(box)


def _restore(box: Any, value: Any) -> None:
    if isinstance(box, list):
        box[:] = value
    elif isinstance(box, deque):
        box.clear()
        box.extend(value)
    else:
        box.clear()
        box.update(value)


# The lower layers' per-rank state (they cannot import this module): every setting's
# value (a `with dc.debug(True)` block on one rank is that rank's), the flight recorder's
# records and sequence numbers, the accelerator set_accelerator selected.
per_rank(*(vars(s) for s in vars(_config).values() if isinstance(s, _config.Setting)))
per_rank(_flight._GROUPS, _flight._LAST, _flight._WORLD_PG, _flight._STATUS)
# (the ring is rebound when DIFFCOMM_FLIGHT_SIZE resizes it: as a box, the resized ring was
# every rank's, a rank's flight recorder listing the other ranks' ops)
_RING_SIZE = _flight._RING.maxlen
per_rank_attr(_flight, "_RING", lambda: deque(maxlen=_RING_SIZE))
# torch's print options (one object per process, set in place by torch.set_printoptions):
# rank 0's set_printoptions(precision=1) printed rank 1's tensor([1.23456]) as tensor([1.2])
# and outlived the run in the caller, where a rank process has its own
per_rank(vars(_torch.PRINT_OPTS))
_INITIAL[-1] = vars(type(_torch.PRINT_OPTS)())  # a fresh process's: torch's defaults
per_rank(_accelerator._OVERRIDE)
# torch's autograd switches kept in module globals (one per process): a rank's
# `with set_checkpoint_early_stop(False):` around a collective held for the other ranks
# until it ended (a rank then checkpointed without early stop where its own program asked
# for none: its recomputation ran a collective the others' did not, a false desync), and a
# rank's `with parametrize.cached():` cached the other ranks' parametrized weights while it
# waited in a collective (a rank computed with a weight from before its optimizer step).
for _owner, _name, _fresh in _torch.AUTOGRAD_GLOBALS:
    per_rank_attr(_owner, _name, _fresh)


# ---- the thread-local torch.distributed world ------------------------------------------
# torch keeps one record of the process groups per process (``distributed_c10d._world``);
# an in-process rank needs its own. The record's class is swapped, once, for a subclass
# whose fields come from the calling rank thread's own record while it runs in an
# in-process world, and from the process's record otherwise (so every holder of the
# record, torch's and diffcomm's alike, sees the calling rank's groups).

_LOCAL = threading.local()


class _RankWorld:
    """One rank thread's record of its process groups (the fields of torch's ``_World``)."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self._default_pg: Any = None
        self.pg_map: dict[Any, Any] = {}
        self.pg_names: dict[Any, Any] = {}
        self.pg_group_ranks: dict[Any, Any] = {}
        self.pg_backend_config: dict[Any, Any] = {}
        self.group_count = 0
        self.tags_to_pg: dict[str, list[Any]] = {}
        self.pg_to_tag: dict[Any, str] = {}
        self._pg_coalesce_state: dict[Any, Any] = {}
        self._comms: list[Any] = []
        self.pg_config_info_: list[Any] = []


def _rank_world() -> _RankWorld | None:
    return getattr(_LOCAL, "world", None)


def _me(group_rank: int) -> int:
    """The calling rank thread's **global** rank: what the hub's per-rank state, status and
    run lock are kept by (``group_rank``, a slot of a subgroup's collective, is not: world
    rank 2 is rank 0 of the group {2, 3}, and waited under it swapped rank 0's state in)."""
    w = _rank_world()
    return w.rank if w is not None else group_rank


def _field(name: str) -> property:
    base = getattr(_torch.world_record_class(), name, None)

    def get(self: Any) -> Any:
        w = _rank_world()
        if w is not None:
            return getattr(w, name)
        if isinstance(base, property):
            return base.fget(self)  # type: ignore[misc]
        return self.__dict__[name]

    def put(self: Any, value: Any) -> None:
        w = _rank_world()
        if w is not None:
            setattr(w, name, value)
        elif isinstance(base, property):
            if base.fset is None:
                raise AttributeError(name)
            base.fset(self, value)
        else:
            self.__dict__[name] = value

    return property(get, put)


_FIELDS = (
    "_default_pg",
    "pg_map",
    "pg_names",
    "pg_group_ranks",
    "pg_backend_config",
    "group_count",
    "tags_to_pg",
    "pg_to_tag",
    "_pg_coalesce_state",
    "_comms",
)

_INSTALLED: list[bool] = []


def install() -> None:
    """Make torch's record of the process groups per rank thread (once per process)."""
    if _INSTALLED:
        return
    world = _torch.C10D
    base = type(world)
    fields = {name: _field(name) for name in _FIELDS}

    def default_pg(self: Any) -> Any:
        return self._default_pg

    def set_default_pg(self: Any, value: Any) -> None:
        self._default_pg = value

    fields["default_pg"] = property(default_pg, set_default_pg)
    fields["pg_coalesce_state"] = property(lambda self: self._pg_coalesce_state)
    fields["comms"] = property(lambda self: self._comms)
    world.__class__ = type("_PerRankWorld", (base,), fields)
    _INSTALLED.append(True)


def enter_rank(hub: Hub, rank: int) -> None:
    """Make the calling thread rank ``rank`` of ``hub``'s world (its own group record)."""
    install()
    _LOCAL.world = _RankWorld(hub, rank)


def leave_rank() -> None:
    _LOCAL.world = None


def current_rank() -> int | None:
    """The calling thread's global rank in its in-process world, or ``None`` (no world)."""
    w = _rank_world()
    return w.rank if w is not None else None


def current_hub() -> Hub | None:
    """The in-process world the calling thread is a rank of, or ``None``."""
    w = _rank_world()
    return w.hub if w is not None else None


# ---- the process group ----------------------------------------------------------------


def _done(result: Any = None) -> Any:
    return _torch.completed_work(result)


class _RecvWork(dist.Work):
    """A receive that completes when waited on (the sender may post later)."""

    def __init__(self, finish: Callable[[], None]) -> None:
        super().__init__()
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def _reduce(op: Any, parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """Reduce the ranks' tensors in rank order (sum: ((t0 + t1) + t2) + ...)."""
    _one_dtype(parts, what)
    kind = op.op if hasattr(op, "op") else op
    if kind == _RED.PREMUL_SUM:
        raise NotImplementedError("diffcomm in-process backend: ReduceOp.PREMUL_SUM is not supported")
    out = parts[0].clone()
    for t in parts[1:]:
        if kind in (_RED.SUM, _RED.AVG):
            out.add_(t)
        elif kind == _RED.PRODUCT:
            out.mul_(t)
        elif kind == _RED.MAX:
            torch.maximum(out, t, out=out)
        elif kind == _RED.MIN:
            torch.minimum(out, t, out=out)
        elif kind == _RED.BAND:
            out.bitwise_and_(t)
        elif kind == _RED.BOR:
            out.bitwise_or_(t)
        elif kind == _RED.BXOR:
            out.bitwise_xor_(t)
        else:
            raise NotImplementedError(f"diffcomm in-process backend: reduce op {kind} is not supported")
    if kind == _RED.AVG:
        if out.is_floating_point() or out.is_complex():
            out.div_(len(parts))
        else:
            out.copy_(torch.div(out, len(parts), rounding_mode="floor"))
    return out


#: what a size mismatch between ranks does on real processes (the in-process message)
_MISMATCH = (
    "the ranks called it with different shapes or split sizes; on real processes gloo "
    "aborts a rank that receives more than it expects and leaves a larger buffer's extra "
    "elements as they were (DIFFCOMM_DEBUG=1 compares the arguments before any data moves)"
)


def _one_dtype(parts: Sequence[torch.Tensor], what: str) -> None:
    """Refuse the ranks' tensors of one collective in different dtypes. A transport moves
    bytes: gloo aborts a rank that receives more bytes than it expects and reinterprets
    bytes of one size (float32 read as int32); here ``add_`` and ``cat`` would convert,
    a value no real run gives (all_reduce of float32 ones on rank 0 and float64 twos on
    rank 1 gave 3 on both, where gloo processes abort)."""
    dtypes = [p.dtype for p in parts]
    if any(d != dtypes[0] for d in dtypes):
        held = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
        raise RuntimeError(
            f"diffcomm in-process backend: {what}: the ranks' tensors are of {held}: {_DTYPES}"
        )


#: what a dtype mismatch between ranks does on real processes (the in-process message)
_DTYPES = (
    "the ranks called it with different dtypes; on real processes gloo aborts a rank that "
    "receives more bytes than it expects or reads another dtype's bytes as its own "
    "(DIFFCOMM_DEBUG=1 compares the arguments before any data moves)"
)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str = "collective") -> None:
    if dst.dtype != src.dtype:
        raise RuntimeError(
            f"diffcomm in-process backend: {what}: this rank's buffer is of {dst.dtype}, the data "
            f"for it of {src.dtype}: {_DTYPES}"
        )
    if dst.numel() != src.numel():
        raise RuntimeError(
            f"diffcomm in-process backend: {what}: this rank's buffer holds {dst.numel()} "
            f"elements, the data for it {src.numel()}: {_MISMATCH}"
        )
    with torch.no_grad():
        dst.copy_(src.reshape(dst.shape))


def _gathered_parts(got: Any) -> list[torch.Tensor]:
    """What one rank put into an all_gather, as a list: a rank may gather with the list
    call (``allgather``) where another gathers into one tensor (``all_gather_single``), as
    gloo's ranks may (a rank's capability overrides are its own). They met in debug mode's
    check (a rank holding ``all_gather_into_tensor: False``): "'list' object has no
    attribute 'reshape'"."""
    return got if isinstance(got, list) else [got]


def _joined(parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``torch.cat(parts)`` as a transport joins bytes: outside the caller's autocast
    (:func:`~diffcomm.backend.buffers.joined`) and of one dtype, as bytes are (``cat``
    would promote)."""
    _one_dtype(parts, what)
    return joined(parts)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous ``t`` (a view: writing into it writes ``t``)."""
    t = torch.view_as_real(t) if t.is_complex() else t
    if not t.numel():
        return t.new_empty(0, dtype=torch.uint8)
    # contiguous: its elements are dense from its offset (a size-1 dim may have any stride)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _copy_bytes(out: torch.Tensor, message: torch.Tensor) -> None:
    """A receive, as c10d's transports do it: the message's bytes fill the front of the
    receive buffer (a fused receive posts one buffer for messages of any shape)."""
    got = _bytes(message.detach().clone(memory_format=torch.contiguous_format))
    if got.numel() > out.numel() * out.element_size():
        raise RuntimeError(
            f"diffcomm in-process backend: recv: a message of {got.numel()} bytes does not fit "
            f"the receive buffer of {out.numel() * out.element_size()} bytes"
        )
    with torch.no_grad():
        if out.is_contiguous():
            _bytes(out)[: got.numel()].copy_(got)
        else:  # (c10d takes contiguous buffers; kept for safety)
            flat = out.contiguous()
            _bytes(flat)[: got.numel()].copy_(got)
            out.copy_(flat)


class InProcessGroup(_PG):
    """A c10d process group whose ranks are threads of this process (see the module)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        hub = current_hub()
        if hub is None:
            raise RuntimeError(
                "diffcomm in-process backend: a process group of backend 'inproc' can only be "
                "made on a rank of an in-process world (dc.LocalWorld(n, in_process=True))"
            )
        self._hub = hub
        self._seq = 0
        self._name: str | None = None
        self._members_checked = False

    def getBackendName(self) -> str:
        return NAME

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"InProcessGroup(rank={self._rank}, size={self._size})"

    @property
    def group_name(self) -> str:
        return self._gname()

    # the group's name is the same on every rank (torch names groups identically)
    def _gname(self) -> str:
        if self._name is None:
            w = _rank_world()
            names = w.pg_names if w is not None else {}
            self._name = str(names.get(self, "?"))
        return self._name

    def _checked_name(self, what: str) -> str:
        """The group's name, its members checked once against the other ranks' group of
        that name (:meth:`Hub.same_members`)."""
        name = self._gname()
        if not self._members_checked:
            w = _rank_world()
            members = tuple(sorted(w.pg_group_ranks.get(self, {}))) if w is not None else ()
            self._hub.same_members(name, members, _me(self._rank), what)
            self._members_checked = True
        return name

    def _refuse_in_compilation(self, what: str) -> None:
        """Refuse an op run for real while this rank's thread compiles (see ``_TRACED``),
        before it counts or deposits anything (dynamo may catch the error and go on)."""
        if _torch.dynamo_compiling_here():
            raise InProcessUnsupportedError(_TRACED.format(rank=_me(self._rank), what=what))

    def _all(self, what: str, payload: Any) -> list[Any]:
        self._refuse_in_compilation(f"runs {what} (group {self._gname()})")
        name = self._checked_name(f"runs {what}")
        seq = self._seq
        self._seq += 1
        return self._hub.exchange(name, seq, self._rank, self._size, what, payload)

    # ---- collectives ------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        got = self._all("all_reduce", [t.detach().clone() for t in tensors])
        for i, t in enumerate(tensors):
            _copy(t, _reduce(op, [g[i] for g in got], "all_reduce"), "all_reduce")
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        got = self._all("reduce", [t.detach().clone() for t in tensors])
        if self._rank == opts.rootRank:
            for i, t in enumerate(tensors):
                _copy(t, _reduce(opts.reduceOp, [g[i] for g in got], "reduce"), "reduce")
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        mine = [t.detach().clone() for t in tensors] if self._rank == opts.rootRank else None
        got = self._all("broadcast", mine)[opts.rootRank]
        for t, g in zip(tensors, got):
            _copy(t, g, "broadcast")
        return _done(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        got = self._all("all_gather", [t.detach().clone() for t in inputs])
        for i, outs in enumerate(outputs):
            for r, o in enumerate(outs):
                _copy(o, _gathered_parts(got[r])[i], "all_gather")
        return _done(outputs)

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        got = self._all("all_gather", input.detach().clone())
        parts = [p.reshape(-1) for g in got for p in _gathered_parts(g)]
        _copy(output, _joined(parts, "all_gather"), "all_gather")
        return _done(output)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    def reduce_scatter(self, output: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        got = self._all("reduce_scatter", [[t.detach().clone() for t in ts] for ts in inputs])
        for i, o in enumerate(output):
            _copy(
                o, _reduce(opts.reduceOp, [g[i][self._rank] for g in got], "reduce_scatter"), "reduce_scatter"
            )
        return _done(output)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        got = self._all("reduce_scatter", input.detach().clone())
        n = output.numel()
        if any(g.numel() != n * self._size for g in got):  # (a slice would silently fit)
            sizes = ", ".join(f"rank {r}: {g.numel()}" for r, g in enumerate(got))
            raise RuntimeError(
                f"diffcomm in-process backend: reduce_scatter: this rank's output holds {n} "
                f"elements of {self._size}, so every input {n * self._size}; the inputs hold "
                f"{sizes}: {_MISMATCH}"
            )
        mine = [g.reshape(-1)[self._rank * n : (self._rank + 1) * n] for g in got]
        _copy(output, _reduce(opts.reduceOp, mine, "reduce_scatter"), "reduce_scatter")
        return _done(output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        n = self._size
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        chunks = [c.clone() for c in input.detach().split(ins)] if input.dim() else [input] * n
        got = self._all("all_to_all", chunks)
        mine = [g[self._rank] for g in got]
        outs = list(output_split_sizes)
        if outs and mine and mine[0].dim() and [m.shape[0] for m in mine] != outs:
            sent = ", ".join(f"rank {r}: {m.shape[0]}" for r, m in enumerate(mine))
            raise RuntimeError(
                f"diffcomm in-process backend: all_to_all: this rank expects {outs} rows from "
                f"the ranks, they send {sent}: {_MISMATCH}"
            )
        if mine and mine[0].dim():
            _copy(output, _joined(mine, "all_to_all"), "all_to_all")
        return _done(output)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        got = self._all("all_to_all", [t.detach().clone() for t in inputs])
        for r, o in enumerate(outputs):
            _copy(o, got[r][self._rank], "all_to_all")
        return _done(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        got = self._all("gather", [t.detach().clone() for t in inputs])
        if self._rank == opts.rootRank:
            for r, o in enumerate(outputs[0]):
                _copy(o, got[r][0], "gather")
        return _done(outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        mine = [t.detach().clone() for t in inputs[0]] if self._rank == opts.rootRank else None
        got = self._all("scatter", mine)[opts.rootRank]
        _copy(outputs[0], got[self._rank], "scatter")
        return _done(outputs)

    def barrier(self, opts: Any = None) -> Any:
        self._all("barrier", None)
        return _done()

    # ---- point to point ---------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._refuse_in_compilation(f"sends to group rank {dst} (group {self._gname()})")
        self._hub.post(self._checked_name(f"sends to group rank {dst}"), self._rank, dst, tag, tensors[0])
        return _done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self._refuse_in_compilation(f"receives from group rank {src} (group {self._gname()})")
        out, me, hub = tensors[0], self._rank, self._hub
        name = self._checked_name(f"receives from group rank {src}")
        turn = hub.turn(name, src, me, tag)  # (posted now: its message is fixed now)
        return _RecvWork(lambda: _copy_bytes(out, hub.take(name, src, me, tag, turn, "recv")))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise NotImplementedError(
            "diffcomm in-process backend: recv from any source is not supported (name the source rank)"
        )


def _create(store: Any, rank: int, size: int, timeout: Any) -> InProcessGroup:
    return InProcessGroup(rank, size)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])
