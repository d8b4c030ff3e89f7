"""Start-up cost of a LocalWorld rank process and of ``LocalWorld(2)`` (issue 47, item 4).

    python benchmarks/bench_boot.py [--rounds 5] [--bytecode]

Prints, median of ``--rounds`` (each round one fresh interpreter):

- ``rank import``: a fresh interpreter running a rank's boot (``_WORKER_BOOT``) to the end
  of its imports, before it would rendezvous: its CPU (user+sys, exit not counted) and
  wall (start to exit);
- ``import torch`` alone, the same way (the floor any fresh rank pays);
- ``LocalWorld(2) start``: wall from the constructor to the end of a first (empty) run,
  in a caller that has already imported diffcomm, with ranks spawned as fresh interpreters
  (``DIFFCOMM_RANK_START=spawn``), and the CPU of the two rank processes from start to
  their orderly exit (``os._exit``) at ``close()``;
- ``forked: first world``: the same with ranks forked by the fork server (the default on
  Linux), which this first world starts (its import is in the wall; the CPU column is the
  caller's children, which the server is not yet counted in: not shown);
- ``forked: next world``: a second ``LocalWorld(2)`` in the same caller (the server is up);
- ``first spmd_check step``: in that first forked world, the wall of a first run of a
  tensor-parallel MLP step inside ``dc.spmd_check`` (what a notebook's first checked cell
  waits for).

``--bytecode`` lets the measured interpreters cache bytecode (unsets
PYTHONDONTWRITEBYTECODE, as tests/conftest.py does for the suite); without it the
environment's setting holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from diffcomm.runtime.forkserver import _WORKER_BOOT

#: a rank's boot up to the end of its imports: ``_WORKER_BOOT`` with the rank module run
#: under another name than ``__main__`` (so it stops before the rendezvous)
_RANK_IMPORTS = _WORKER_BOOT.replace("run_name='__main__'", "run_name='bench_boot'")


def _fresh(code: str, env: dict[str, str]) -> tuple[float, float]:
    """(CPU, wall) seconds of one fresh interpreter running ``code`` and leaving at once.

    The CPU is the interpreter's own at the end of ``code`` (its exit is not counted: a
    rank leaves with ``os._exit``, and an interpreter's normal exit runs a full garbage
    collection that depends on what was frozen); the wall includes start and exit.
    """
    tail = "; import os, time; print(time.process_time(), flush=True); os._exit(0)"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", code + tail]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1]), time.perf_counter() - t0


def _checked_step() -> None:
    import torch

    import diffcomm as dc

    torch.manual_seed(0)  # the same replicas and input on every rank (each process has its own generator)
    mlp = dc.parallel.ParallelMLP(8, 16)
    with dc.spmd_check():
        mlp(torch.randn(4, 8)).pow(2).mean().backward()


def _forked_starts(env: dict[str, str]) -> tuple[float, float, float]:
    """(first world's start, first checked step, next world's start) walls in a fresh caller."""
    code = (
        "import time, sys, diffcomm as dc\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from bench_boot import _checked_step\n"
        "t0 = time.perf_counter(); w = dc.LocalWorld(2); w.run(lambda: None); t1 = time.perf_counter()\n"
        "w.run(_checked_step); t2 = time.perf_counter(); w.close()\n"
        "t3 = time.perf_counter(); v = dc.LocalWorld(2); v.run(lambda: None); t4 = time.perf_counter()\n"
        "v.close(); print(t1 - t0, t2 - t1, t4 - t3)\n"
    )
    env = {**env, "DIFFCOMM_RANK_START": "fork"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    first, step, again = map(float, out.stdout.split())
    return first, step, again


def _world_start(env: dict[str, str]) -> tuple[float, float]:
    """(CPU of the ranks, wall) of one ``LocalWorld(2)`` start with ranks spawned, in a
    fresh caller."""
    env = {**env, "DIFFCOMM_RANK_START": "spawn"}
    code = (
        "import time, resource, diffcomm as dc\n"
        "def cpu():\n"
        "    r = resource.getrusage(resource.RUSAGE_CHILDREN); return r.ru_utime + r.ru_stime\n"
        "c0, t0 = cpu(), time.perf_counter()\n"
        "w = dc.LocalWorld(2); w.run(lambda: None)\n"
        "t1 = time.perf_counter(); w.close(); c1 = cpu()\n"
        "print(c1 - c0, t1 - t0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    cpu, wall = map(float, out.stdout.split())
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="fresh interpreters per row (>= 1)")
    ap.add_argument("--bytecode", action="store_true", help="let the interpreters cache bytecode")
    a = ap.parse_args()
    assert _RANK_IMPORTS != _WORKER_BOOT, "the boot changed: update _RANK_IMPORTS"
    env = dict(os.environ)
    if a.bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        _fresh(_RANK_IMPORTS, env)  # writes the cache once
    names = ("import torch", "rank import", "LocalWorld(2) start")
    forked: list[tuple[float, float, float]] = []
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _ in range(a.rounds):  # interleaved, so a change in the machine's load hits every row alike
        rows["import torch"].append(_fresh("import torch", env))
        rows["rank import"].append(_fresh(_RANK_IMPORTS, env))
        rows["LocalWorld(2) start"].append(_world_start(env))
        forked.append(_forked_starts(env))
    print(f"median of {a.rounds}, load average {os.getloadavg()[0]:.2f}, bytecode cached: {a.bytecode}")
    for name, vals in rows.items():
        cpu = statistics.median(v[0] for v in vals)
        wall = statistics.median(v[1] for v in vals)
        print(f"  {name:<22} CPU {cpu:6.2f} s   wall {wall:6.2f} s")
    for i, name in enumerate(("forked: first world", "first spmd_check step", "forked: next world")):
        walls = [f[i] for f in forked]
        print(
            f"  {name:<22}                wall {statistics.median(walls):6.2f} s"
            f"   (range {min(walls):.2f}-{max(walls):.2f})"
        )


if __name__ == "__main__":
    main()
