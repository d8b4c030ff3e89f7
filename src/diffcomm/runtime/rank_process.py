"""Entry point of a LocalWorld rank process: ``python -m diffcomm.runtime.rank_process ...``.

The rank side of :class:`~diffcomm.LocalWorld` (the caller side is :mod:`diffcomm.runtime.world`):
rendezvous, join the process group, then run the functions the caller sends until it
says stop or goes away.
"""

import signal
import sys

# First thing, before importing torch (seconds on a loaded machine): a Ctrl-C typed in the
# caller's terminal reaches every rank, and the caller alone owns the ranks' lifetime —
# without this, each rank would print its own KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

# No garbage collection while the rank imports (also when started as a module: a rank
# from LocalWorld has it off from its first line, ``_WORKER_BOOT``, as the package imports
# before this body runs); after the imports, everything imported is frozen out of the
# collector, so a rank's later full collections do not re-walk torch's objects either.
import gc  # noqa: E402

gc.disable()

import datetime  # noqa: E402
import faulthandler  # noqa: E402
import multiprocessing.connection as mpc  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

import cloudpickle  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from diffcomm import _lifecycle  # noqa: E402
from diffcomm._errors import CollectiveTimeoutError  # noqa: E402
from diffcomm.accelerator import comm_accelerator  # noqa: E402
from diffcomm.diagnostics import recorder as _flight  # noqa: E402
from diffcomm.diagnostics import responder as _responder  # noqa: E402
from diffcomm.runtime import shipping as _ship  # noqa: E402
from diffcomm.runtime.joining import _STARTUP_TIMEOUT  # noqa: E402

gc.freeze()
gc.enable()


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
            os._exit(17)


#: told to the caller when the run's function returned, before its pending work completes
_RETURNED = pickle.dumps(("returned", None))


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_port: int,
    conn_fd: int,
    collective_timeout: float,
    parent_pid: int,
) -> None:
    conn = mpc.Connection(conn_fd)
    # The caller owns the ranks' lifetime: a Ctrl-C typed in the caller's terminal reaches
    # the whole process group, and must not kill idle ranks (the caller tears them down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the rank's one thread of its own; stopped and joined at the rank's orderly end
    watcher_stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_parent, args=(parent_pid, watcher_stop), name="diffcomm-watch-parent", daemon=True
    )
    watcher.start()
    fault_dir = os.environ.get("DIFFCOMM_FAULT_DIR")
    if fault_dir:  # a rank the backend aborts (gloo on a size mismatch) leaves its stack here
        try:
            faulthandler.enable(open(os.path.join(fault_dir, f"rank{rank}.txt"), "w"), all_threads=True)
        except FileNotFoundError:  # the caller removed it: it is tearing this world down
            os._exit(0)
    os.environ["DIFFCOMM_TIMEOUT"] = str(collective_timeout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=collective_timeout)
        # Ranks reach this point seconds apart on a loaded machine (importing torch), so
        # the rendezvous must not run under a short collective timeout: first wait, under
        # a start-up timeout, until every rank has arrived; then join the group.
        startup = datetime.timedelta(seconds=max(collective_timeout, _STARTUP_TIMEOUT))
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, False, timeout=startup)
        store.set(f"diffcomm/arrived/{rank}", "1")
        store.wait([f"diffcomm/arrived/{r}" for r in range(world_size)], startup)
        # the recorder answers through the world's store for the rank's whole life (also
        # across process groups the user's functions create and destroy)
        _responder.start_responder(store, rank, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        _flight.set_status("returned")
        acc = comm_accelerator(backend)
        if acc.name != "cpu":  # one device per local rank, on the accelerator the backend uses
            acc.set_device(rank % acc.device_count())
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("err", (traceback.format_exc(), None, True))))
        except OSError:  # the caller is gone or tearing down: nobody to tell
            os._exit(1)
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        kind, payload = pickle.loads(data)
        if kind == "stop":
            break
        try:
            fn, args, kwargs, paths, carried = _ship.loads(payload)
            for p in paths:
                if p not in sys.path:
                    sys.path.append(p)
            _lifecycle.program_start()  # a new program: nothing of the last one's is remembered
            _flight.set_status("running")
            try:
                with _ship.applied(carried):  # the caller's settings (dc.debug(True), dc.timeout(2))
                    result = fn(*args, **kwargs)
            finally:
                _flight.set_status("returned")
            # returned (the caller's desync checks count it so), its pending asynchronous ops
            # and posted sends complete before it reports: one that no peer matches fails
            # this run, not the next
            conn.send_bytes(_RETURNED)
            with _ship.applied(carried):
                _lifecycle.program_end()
            reply = pickle.dumps(("ok", _ship.dumps(result)))
        except BaseException as exc:  # reported to the caller
            fatal = isinstance(exc, CollectiveTimeoutError | dist.DistBackendError)
            try:
                exc_bytes = cloudpickle.dumps(exc)
            except Exception:
                exc_bytes = None
            reply = pickle.dumps(("err", (traceback.format_exc(), exc_bytes, fatal)))
        try:
            conn.send_bytes(reply)
        except (EOFError, OSError, BrokenPipeError):
            break
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    _lifecycle.stop_all(None, exiting=True)  # the world's own answering thread
    watcher_stop.set()
    watcher.join()
    os._exit(0)


if __name__ == "__main__":
    rank, world, backend, port, fd, timeout, parent = sys.argv[1:8]
    _worker_main(int(rank), int(world), backend, int(port), int(fd), float(timeout), int(parent))
