"""Start-up cost of a LocalWorld rank process and of ``LocalWorld(2)`` (issue 47, item 4).

    python benchmarks/bench_boot.py [--rounds 5] [--bytecode]

Prints, median of ``--rounds`` (each round one fresh interpreter):

- ``rank import``: a fresh interpreter running a rank's boot (``_WORKER_BOOT``) to the end
  of its imports, before it would rendezvous: its CPU (user+sys, exit not counted) and
  wall (start to exit);
- ``import torch`` alone, the same way (the floor any fresh rank pays);
- ``LocalWorld(2) start``: wall from the constructor to the end of a first (empty) run,
  in a caller that has already imported diffcomm, and the CPU of the two rank processes
  from start to their orderly exit (``os._exit``) at ``close()``.

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

from diffcomm.runtime.world import _WORKER_BOOT

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


def _world_start(env: dict[str, str]) -> tuple[float, float]:
    """(CPU of the ranks, wall) of one ``LocalWorld(2)`` start, in a fresh caller."""
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
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _ in range(a.rounds):  # interleaved, so a change in the machine's load hits every row alike
        rows["import torch"].append(_fresh("import torch", env))
        rows["rank import"].append(_fresh(_RANK_IMPORTS, env))
        rows["LocalWorld(2) start"].append(_world_start(env))
    print(f"median of {a.rounds}, load average {os.getloadavg()[0]:.2f}, bytecode cached: {a.bytecode}")
    for name, vals in rows.items():
        cpu = statistics.median(v[0] for v in vals)
        wall = statistics.median(v[1] for v in vals)
        print(f"  {name:<22} CPU {cpu:6.2f} s   wall {wall:6.2f} s")


if __name__ == "__main__":
    main()
