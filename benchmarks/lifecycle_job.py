"""One rank of a fault-matrix job (``benchmarks/bench_lifecycle.py``, ``tests/runtime/test_lifecycle.py``).

Runs under ``torchrun`` (environment), under ``torch.multiprocessing.spawn`` (through
:func:`spawn_entry`) or as a plain subprocess with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set.
Every scenario starts with ``init_process_group("gloo")`` (plain torch: diffcomm never asks
for a call of its own) and prints what the driver checks, one ``key=value`` line on
stdout per fact. Usage::

    torchrun --nproc-per-node=4 benchmarks/lifecycle_job.py SCENARIO [OUTDIR]

Scenarios:

* ``exit`` — ops of every kind (blocking, ``async_op=True``, coalesced, point-to-point, a
  1F1B pipeline step), ``destroy_process_group()``, check no diffcomm thread is alive,
  return. ``control`` does the same with one plain ``dist.all_reduce`` only.
* ``reinit`` — three process groups in a row in the same processes (init, ops, destroy),
  the last rank skipping the second op of the third group: the others' error must name it.
* ``kill`` — the last rank kills itself (``SIGKILL``) while the others wait in a collective.
* ``loop`` — collectives until killed (for ``SIGTERM`` to every rank).
* ``restart`` — under ``torchrun --max-restarts=1``: the first attempt asks the recorder's
  store for a diagnosis round (keys written) and then rank 1 exits with an error; the
  second attempt must see none of it and compute the right result.
* ``raise`` — rank 1 raises in user code while the others wait in a collective.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc


def _say(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def _ops_of_every_kind(rank: int, world: int) -> None:
    x = torch.arange(6.0, requires_grad=True) + rank
    dc.all_reduce(x).sum().backward()  # blocking
    y = dc.all_gather(x.detach().requires_grad_(), async_op=True)
    (y * 2).sum().backward()  # asynchronous, its backward too
    ts = [torch.ones(3, requires_grad=True), torch.ones(2, 2, dtype=torch.float64, requires_grad=True)]
    sum(t.sum() for t in dc.all_reduce_coalesced(ts)).backward()  # coalesced
    dc.shift(x.detach().requires_grad_(), 1).sum().backward()  # point-to-point ring
    sub = dist.new_group(list(range(world)))  # a subgroup's collectives and channels too
    (dc.all_gather(x, group=sub).sum() + dc.shift(x, 1, group=sub).sum()).backward()
    if world > 1:  # a numbered send/recv channel on it
        dc.send(x.detach(), (rank + 1) % world, group=sub)
        dc.recv(src=(rank - 1) % world, group=sub)
    if world > 1:  # one 1F1B step over a two-layer model split across the ranks
        from diffcomm.pipeline import PipelineRunner

        torch.manual_seed(0)
        stage = nn.Linear(4, 4)
        runner = PipelineRunner(stage, "1f1b", loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean())
        runner.step(torch.randn(4, 4), torch.randn(4, 4), n_micro=2)
    dc.wait_sends()


def _init(via_diffcomm: bool = False) -> tuple[int, int]:
    """``init_process_group("gloo")`` as plain torch does it, or through ``dc.init()``
    (which, under torchrun, keys each attempt's and each group's rendezvous apart)."""
    if via_diffcomm:
        dc.init("gloo")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def scenario_exit(control: bool = False) -> None:
    rank, world = _init()
    if control:
        t = torch.ones(4)
        dist.all_reduce(t)
    else:
        _ops_of_every_kind(rank, world)
    dist.destroy_process_group()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("diffcomm-")]
    if alive:  # stderr: the driver counts any line there as a failure
        print(f"diffcomm threads alive after destroy_process_group: {alive}", file=sys.stderr)
    _say("threads_after_destroy", len(alive))
    gloo = gloo_threads()  # the group itself is freed: nothing of ours holds it
    if gloo:
        print(f"{gloo} gloo worker thread(s) alive after destroy_process_group", file=sys.stderr)


def gloo_threads() -> int:
    """How many of gloo's own threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) run."""
    n = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # not Linux: nothing to count
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().startswith(("pt_gloo", "gloo_"))
        except OSError:  # a thread that ended while we looked
            pass
    return n


def scenario_reinit() -> None:
    ports = os.environ.get("LIFECYCLE_PORTS", "").split(",")  # one free port per group
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun: one store
    for g in range(3):
        if agent_store:
            pass  # dc.init() keys each group's rendezvous apart on the agent's store
        elif g and len(ports) == 3:
            os.environ["MASTER_PORT"] = ports[g]
        elif g:
            os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
        _say(f"g{g}_init_start", time.time())
        rank, world = _init(via_diffcomm=True)
        _say(f"g{g}_init_done", time.time())
        x = torch.ones(3, requires_grad=True)
        dc.all_reduce(x).sum().backward()
        _say(f"g{g}_first_op_done", time.time())
        if g == 2:
            if rank == world - 1:
                time.sleep(float(os.environ.get("DIFFCOMM_TIMEOUT", "5")) + 3)  # skips op #2
            else:
                try:
                    dc.all_reduce(x)
                except dc.DesyncError as err:
                    _say("error", str(err).splitlines()[0].replace("=", ":"))
                    _say("error_names_culprit", f"rank {world - 1}" in str(err))
                    _say("error_names_seq", "#2" in str(err))
                    _say("diagnosis_failed", "diagnosis failed" in str(err))
                    sys.exit(3)
        dist.destroy_process_group()
        _say(f"g{g}_destroyed", time.time())
    _say("groups", 3)


def scenario_kill() -> None:
    rank, world = _init()
    x = torch.ones(2**16)
    dc.all_reduce(x)  # every rank is up
    if rank == world - 1:
        time.sleep(0.5)  # the others are inside the next all_reduce
        _say("killed_at", time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    _all_reduce_raises(x, "names_dead", f"rank {world - 1}")


def _all_reduce_raises(x: torch.Tensor, key: str, culprit: str) -> None:
    """The next all_reduce, which a failed peer never joins: say how long it took to raise,
    whether the error names ``culprit`` (under ``key``) and its first line; exit 3."""
    t0 = time.time()
    try:
        dc.all_reduce(x)
        _say("error", "none")
    except dc.DiffcommError as err:
        _say("raised_after", round(time.time() - t0, 3))
        _say(key, culprit in str(err))
        _say("error", str(err).splitlines()[0].replace("=", ":"))
        sys.exit(3)


def scenario_loop() -> None:
    _init()
    x = torch.ones(1024)
    _say("looping", 1)
    while True:
        dc.all_reduce(x)


def scenario_restart(outdir: str) -> None:
    from diffcomm.diagnostics import responder as _flight

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = _init(via_diffcomm=True)
    x = torch.full((4,), float(rank + 1), requires_grad=True)
    y = dc.all_reduce(x)
    y.sum().backward()
    resp = _flight._RESPONDER[0]
    if attempt == 0:
        if rank == 0 and resp is not None:  # a diagnosis round: keys in the recorder's namespace
            _flight.request_states(resp.asker, list(range(world)), wait=0.5, ns=resp.ns)
        dist.barrier()
        if rank == 1:
            raise SystemExit("rank 1 fails in the first attempt (planted)")
        time.sleep(30)  # torchrun stops this attempt
        return
    expected = torch.full((4,), world * (world + 1) / 2)
    gen = int(resp.asker.add(f"{resp.ns}gen", 0)) if resp is not None else -1
    first_seq = dc.flight_recorder()[0]["seq"]
    ok = torch.equal(y, expected) and torch.equal(x.grad, torch.full((4,), float(world)))
    with open(os.path.join(outdir, f"restart_rank{rank}.txt"), "w") as f:
        f.write(f"attempt={attempt} ok={ok} diag_rounds_seen={gen} first_seq={first_seq}\n")
    dist.destroy_process_group()


def scenario_raise() -> None:
    rank, world = _init()
    x = torch.ones(8)
    dc.all_reduce(x)
    if rank == 1:
        time.sleep(0.3)
        raise ValueError("planted error in user code on rank 1")
    _all_reduce_raises(x, "names_culprit", "rank 1")


def _redirect(outdir: str) -> None:
    """This rank's stdout / stderr (file descriptors, so torch's C++ lines too) go to
    ``OUTDIR/rank<r>.out`` / ``.err``; its pid to ``OUTDIR/rank<r>.pid``."""
    rank = os.environ["RANK"]
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    stem = os.path.join(outdir, f"rank{rank}" + (f".a{attempt}" if attempt != "0" else ""))
    for fd, ext in ((1, ".out"), (2, ".err")):
        f = os.open(stem + ext, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    with open(stem + ".pid", "w") as f:
        f.write(str(os.getpid()))


def main(scenario: str, outdir: str = ".") -> None:
    if os.environ.get("LIFECYCLE_REDIRECT"):
        _redirect(outdir)
    # a rank that hangs leaves its stacks on stderr (the driver reports them) and ends
    faulthandler.dump_traceback_later(float(os.environ.get("LIFECYCLE_HANG_S", "100")), exit=True)
    if scenario == "exit":
        scenario_exit()
    elif scenario == "control":
        scenario_exit(control=True)
    elif scenario == "reinit":
        scenario_reinit()
    elif scenario == "kill":
        scenario_kill()
    elif scenario == "loop":
        scenario_loop()
    elif scenario == "restart":
        scenario_restart(outdir)
    elif scenario == "raise":
        scenario_raise()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


def spawn_entry(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    """``torch.multiprocessing.spawn`` target: the environment torchrun would set."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    main(scenario, outdir)


def spawn_main(world: int, scenario: str, outdir: str, port: int, limit: float) -> None:
    """``torch.multiprocessing.spawn(join=False)`` of ``world`` ranks, each rank's exit code
    (negative: the signal) written to ``OUTDIR/exitcodes`` once all ended (or ``limit``)."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(spawn_entry, args=(world, port, scenario, outdir), nprocs=world, join=False)
    deadline = time.monotonic() + limit
    for p in ctx.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = []
    for p in ctx.processes:
        if p.exitcode is None:
            p.kill()
            p.join()
            codes.append("hung")
        else:
            codes.append(str(p.exitcode))
    with open(os.path.join(outdir, "exitcodes"), "w") as f:
        f.write(" ".join(codes))


if __name__ == "__main__":
    if sys.argv[1] == "--spawn":
        world, scenario, outdir, port, limit = sys.argv[2:7]
        spawn_main(int(world), scenario, outdir, int(port), float(limit))
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ".")
