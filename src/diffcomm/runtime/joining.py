"""Joining a process group from inside a launched process: :func:`init` (torchrun,
multi-node), and this process's rank and world size.

The caller side of a local world (``launch``, :class:`~diffcomm.LocalWorld`) is
:mod:`diffcomm.runtime.world`; it re-exports everything here.
"""

from __future__ import annotations

import datetime
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .. import _config, _torch

if TYPE_CHECKING:
    from ..accelerator import Accelerator

__all__ = ["init", "get_rank", "get_world_size", "is_initialized"]

_STARTUP_TIMEOUT = 120.0  # seconds for every rank to start (import torch) and rendezvous


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (group-local), 0 when not distributed. Under
    torch's ``LocalTensorMode`` a :class:`~diffcomm.backend.local_tensor.LocalTensorModeError`
    (one program for every simulated rank has no one rank; torch's fake group says 0)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    if _torch.local_tensor_mode_on():
        from ..backend.local_tensor import RANK_WHY, refuse

        raise refuse("get_rank", RANK_WHY)
    from ..backend.args import resolve_group

    return dist.get_rank(resolve_group(group, "get_rank"))


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group``, 1 when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    from ..backend.args import resolve_group

    return dist.get_world_size(resolve_group(group, "get_world_size"))


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------------------
# init (torchrun / multi-node)
# --------------------------------------------------------------------------------------


def init(
    backend: str | None = None, timeout: float | datetime.timedelta | None = None, set_device: bool = True
) -> None:
    """Join the process group described by the environment (torchrun, SLURM via torchrun).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
    ``backend=None`` picks the accelerator's default (gloo on CPU, nccl on CUDA, ...), and
    the local device is set from ``LOCAL_RANK`` (with more local ranks than devices, a
    gloo job leaves the device alone; the device's own backend raises ``ValueError``).
    ``timeout`` (seconds, or a ``datetime.timedelta`` as ``init_process_group`` takes)
    defaults to ``DIFFCOMM_TIMEOUT`` or torch's default; it bounds
    every collective (given here, it holds over ``DIFFCOMM_TIMEOUT``, as ``dc.timeout``
    set in code does), while the rendezvous itself may take up to 120 s (ranks still
    starting).

    Calling it again in a process that already belongs to a default group (an earlier
    ``init``, the user's own ``init_process_group``, a ``LocalWorld`` rank) is a no-op
    when it asks nothing else: ``backend`` and ``timeout`` left at ``None`` or equal to the
    running group's, ``set_device`` as the earlier ``init`` had it. A different value is a
    ``ValueError`` naming the argument, the running value and the asked one (it was
    silently ignored). In an in-process world (``LocalWorld(..., in_process=True)``) the
    ranks' ``"inproc"`` group stands for ``"gloo"`` and has no timeout to compare.

    Raises:
        ValueError: a second call asks for another ``backend``, ``timeout`` or ``set_device``
            than the running group's; before any rendezvous, where the launcher's variables do not describe
            one job (``RANK`` outside ``[0, WORLD_SIZE)``, ``LOCAL_RANK`` outside
            ``[0, LOCAL_WORLD_SIZE)``, a value that is no integer, ``MASTER_PORT`` outside
            1..65535), naming the variable; or a ``DIFFCOMM_*`` variable is malformed.
        TypeError: ``backend``, ``timeout`` or ``set_device`` of a wrong type.

    Example::

        # torchrun --standalone --nproc-per-node=2 train.py
        import diffcomm as dc
        dc.init()
        y = dc.all_reduce(torch.ones(3))
    """
    from ..backend.args import check_seconds

    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"diffcomm.init(): `backend` must be a str or None, got {type(backend).__name__}")
    asked = check_seconds("diffcomm.init()", "timeout", timeout, optional=True)
    if not isinstance(set_device, bool):  # a string such as "no" would be truthy
        raise TypeError(f"diffcomm.init(): `set_device` must be a bool, got {type(set_device).__name__}")
    if dist.is_initialized():
        _check_same_group(backend, timeout, asked, set_device)
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"diffcomm.init(): environment variables {missing} are not set; run the script under "
            "`torchrun --nproc-per-node=N script.py`, or use diffcomm.launch / LocalWorld locally"
        )
    _check_launcher_environment()
    _config.check_environment()
    from ..accelerator import get_accelerator

    acc = get_accelerator()
    name = backend or acc.communication_backend_name()
    seconds = asked if asked is not None else _config.TIMEOUT.get()
    kwargs: dict[str, Any] = {}
    if seconds is not None:
        # the rendezvous (every rank importing torch, then connecting) gets the start-up
        # allowance: on a loaded machine it outlasts a short collective timeout
        kwargs["timeout"] = datetime.timedelta(seconds=max(seconds, _STARTUP_TIMEOUT))
    if set_device and acc.name != "cpu":
        _set_local_device(acc, name)
    store = _torchrun_store(kwargs.get("timeout"))
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(name, **kwargs)
    if seconds is not None and seconds < _STARTUP_TIMEOUT:
        try:  # the collectives then wait `seconds`, no longer
            _torch.set_pg_timeout(seconds, None)
        except Exception:  # a backend without settable timeouts keeps its own
            pass
    if asked is not None:
        # the argument holds over DIFFCOMM_TIMEOUT (which diffcomm applies to a group before
        # each op): under DIFFCOMM_TIMEOUT=60, init(timeout=5) waited 60 s from the first op
        _config.TIMEOUT.set(asked)
    joined = _torch.default_pg()  # (a weak reference: destroy_process_group must free it)
    _JOINED[:] = [weakref.ref(joined) if joined is not None else None, set_device]


#: The default group the last :func:`init` joined (a weak reference), and its ``set_device``.
_JOINED: list[Any] = [None, True]


def _check_same_group(backend: str | None, timeout: Any, asked: float | None, set_device: bool) -> None:
    """A second :func:`init` asks what the running default group is, or is an error naming
    the argument: it used to return silently, the group keeping its own backend and timeout.
    ``None`` asks nothing (``asked``: ``timeout`` in seconds); the in-process world's
    ``"inproc"`` group stands for ``"gloo"`` (``LocalWorld(in_process=True)`` is a gloo
    world run in memory) and has no timeout."""
    from ..backend.in_process import NAME as INPROC

    running = str(dist.get_backend())
    names = {part.split(":")[-1].strip().lower() for part in running.split(",")}
    how = (
        "a process joins one default group: leave the argument out (or pass the running "
        "value), or call torch.distributed.destroy_process_group() first to join anew"
    )
    if INPROC in names:
        names.add("gloo")
    if backend is not None and backend.strip().lower() not in names:
        raise ValueError(
            f"diffcomm.init(): this process already belongs to a process group of backend "
            f"{running!r}, but `backend={backend!r}` was asked; {how}"
        )
    if asked is not None and INPROC not in names:
        now = _config.TIMEOUT.get()
        if now is None:
            now = _torch.pg_timeout()
        if now is None or abs(now - asked) > 1e-9 * max(now, 1.0):
            told = "unknown (its backend does not tell it)" if now is None else f"{now:g} s"
            raise ValueError(
                f"diffcomm.init(): this process already belongs to a process group whose "
                f"collectives wait {told}, but `timeout={timeout!r}` was asked; to change "
                f"the timeout of a running group use dc.timeout({timeout!r}); {how}"
            )
    ref, had = _JOINED
    pg = ref() if ref is not None else None
    if pg is not None and pg is _torch.default_pg() and set_device != had:
        from ..accelerator import get_accelerator

        if get_accelerator().name != "cpu":
            raise ValueError(
                f"diffcomm.init(): this process joined its group with `set_device={had}`, but "
                f"`set_device={set_device}` was asked; {how}"
            )


def _launcher_int(name: str, low: int, high: int | None = None, what: str = "") -> int | None:
    """The environment's integer ``name`` (``None`` if unset), in ``[low, high)``."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value >= high):
        bound = f"an integer >= {low}" + (f" and < {high}{what}" if high is not None else "")
        raise ValueError(
            f"diffcomm.init(): {name}={raw!r} must be {bound}; the launcher's environment "
            "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_PORT) does not describe one "
            "job: run the script under `torchrun --nproc-per-node=N script.py`"
        )
    return value


def _check_launcher_environment() -> None:
    """The launcher's variables describe one job, said before any rendezvous: a rank
    outside the world (``RANK=3 WORLD_SIZE=2``, ``RANK=-1``) waited the whole rendezvous
    timeout (120 s) for peers that never come, and ``RANK=abc`` or ``MASTER_PORT=abc``
    was a bare ``int()`` error naming no variable."""
    world = _launcher_int("WORLD_SIZE", 1)
    assert world is not None  # (init checked it is set)
    _launcher_int("RANK", 0, world, " (WORLD_SIZE)")
    local_world = _launcher_int("LOCAL_WORLD_SIZE", 1, world + 1, " (at most WORLD_SIZE)")
    if local_world is not None:
        _launcher_int("LOCAL_RANK", 0, local_world, " (LOCAL_WORLD_SIZE)")
    else:
        _launcher_int("LOCAL_RANK", 0, world, " (WORLD_SIZE)")
    _launcher_int("MASTER_PORT", 1, 65536)


_INITS = [0]  # default groups this process has joined through init()


def _torchrun_store(timeout: datetime.timedelta | None) -> Any:
    """Under torchrun, the agent's store with a key prefix of this attempt and this group.

    torchrun's workers share one store (the agent's) across restart attempts and across
    groups made one after another; torch keys the default group's rendezvous the same
    every time, so a rank can read an earlier attempt's (or group's) gloo addresses and
    fail to connect ("Connection refused": 3 of 4 plain-torch restarts on this machine,
    docs/debugging.md). A prefix per attempt and per group keeps each one's keys its own.
    None outside torchrun (``init_process_group`` reads the environment as usual).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    _INITS[0] += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        False,
        timeout=timeout or datetime.timedelta(seconds=_STARTUP_TIMEOUT),
    )
    return dist.PrefixStore(f"diffcomm/attempt_{attempt}/group_{_INITS[0]}", store)


def _set_local_device(acc: Accelerator, backend: str) -> None:
    """``init``'s device choice: the ``LOCAL_RANK``-th device of the accelerator.

    More local ranks than devices is an error for the accelerator's own backend (nccl
    allows one rank per GPU), said before any rendezvous; a CPU-capable backend (gloo)
    leaves the device alone instead, so CPU ranks on a GPU machine still start. (A launcher
    that gives each process only its own GPU is served by ``init(set_device=False)``.)
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = acc.device_count()
    if 0 <= local < count:
        acc.set_device(local)
    elif backend.lower() == acc.communication_backend_name().lower():
        raise ValueError(
            f"diffcomm.init(): LOCAL_RANK={local}, but this process sees {count} {acc.name} "
            f"device(s) and backend {backend!r} needs one device per local rank: start at most "
            f"{count} process(es) per node (torchrun --nproc-per-node={count}), or run CPU "
            "ranks with diffcomm.init(backend='gloo') or DIFFCOMM_ACCELERATOR=cpu; if each "
            "process sees only its own device (CUDA_VISIBLE_DEVICES set per process), pass "
            "set_device=False and make it current yourself"
        )
