"""Time to error of every desync scenario of the flight-recorder issue (the scenarios of
``tests/_desync.py``, which ``tests/debug/test_flight.py`` checks).

Each scenario runs on a :class:`~diffcomm.LocalWorld` of each world size with
``collective_timeout=T`` (the ranks' ``DIFFCOMM_TIMEOUT``), a live world (restarted after
the previous scenario tore it down), ``reps`` times. Two clocks:

* ``from run``: from ``world.run(...)`` until the caller holds the error (what a user
  waits; includes the ranks' work before the desync and the teardown);
* ``from desync``: from the moment the culprit rank went wrong (returned, started to
  sleep, called the odd op; its ``time.monotonic()``, a system-wide clock on Linux,
  written to a file) until the caller holds the error.

Targets (issue 13): the early-return cases (a rank returns while others wait) within
1 s; every other case within ``T + 2`` s. Also checked per run: the error type, the
culprit ranks, the sequence number and op in ``facts``, and that no rank process is left
(psutil). ``--torchrun`` adds two scenarios under ``torchrun --standalone
--nproc-per-node=2`` (time inside the ranks, from before their first collective).

Usage::

    python benchmarks/bench_desync.py                 # worlds 2 4, 3 reps, T = 2 s
    python benchmarks/bench_desync.py --worlds 2 --reps 1 --torchrun
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

import diffcomm as dc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _desync import SCENARIOS, TORCHRUN_JOB, victim  # the scenarios the tests check


def _alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def measure(world: dc.LocalWorld, name: str, path: str) -> dict[str, Any]:
    fn, _ = SCENARIOS[name]
    world.run(time.sleep, 0)  # live (restarted after the previous scenario)
    pids = world.pids
    if os.path.exists(path):
        os.unlink(path)
    v = victim(world.world_size)
    start = time.monotonic()
    try:
        world.run(fn, v, path)
        err: BaseException | None = None
    except dc.RankError as exc:
        err = exc
    now = time.monotonic()
    with open(path) as f:
        went_wrong = float(f.read())
    time.sleep(0.5)
    facts = getattr(err, "facts", None) or {}
    return {
        "from_run": now - start,
        "from_desync": now - went_wrong,
        "error": type(err).__name__ if err is not None else "none",
        "culprits": facts.get("culprits"),
        "seq": facts.get("seq"),
        "op": facts.get("op"),
        "victim": v,
        "left": _alive(pids),
    }


def measure_torchrun(scenario: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(TORCHRUN_JOB)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFCOMM_TIMEOUT": str(timeout)}
        start = time.monotonic()
        proc = subprocess.run(
            ["torchrun", "--standalone", "--nproc-per-node=2", script, scenario],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        total = time.monotonic() - start
    pids = [int(p) for p in re.findall(r"RANK \d PID (\d+)", proc.stdout)]
    found = re.findall(r"RANK (\d) DESYNC ([0-9.]+) seq=(\d+) culprits=(\[[0-9, ]*\])", proc.stdout)
    return {
        "errors": {int(r): (float(s), int(q), c) for r, s, q, c in found},
        "done": re.findall(r"RANK (\d) DONE", proc.stdout),
        "job_s": total,
        "left": _alive(pids),
        "rc": proc.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=3, help="runs of each scenario per world (default 3)")
    parser.add_argument("--timeout", type=float, default=2.0, help="collective timeout T (default 2 s)")
    parser.add_argument("--torchrun", action="store_true", help="also the two torchrun scenarios")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    table = Table(
        title=f"time to error, T = {args.timeout:g} s, {args.reps} run(s) each; "
        f"load avg before {load[0]:.1f}",
        caption="seconds; median [min-max] over runs; target: early return <= 1 s, others <= T + 2",
    )
    for col in (
        "world",
        "scenario",
        "error",
        "culprits / seq",
        "from desync s",
        "from run s",
        "target",
        "left",
    ):
        table.add_column(col, justify="left" if col in ("scenario", "error", "culprits / seq") else "right")

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "went_wrong")
        for n in args.worlds:
            with dc.LocalWorld(n, timeout=120, collective_timeout=args.timeout) as world:
                for name, (_, at_once) in SCENARIOS.items():
                    runs = [measure(world, name, path) for _ in range(args.reps)]
                    target = 1.0 if at_once else args.timeout + 2
                    errors = sorted({r["error"] for r in runs})
                    facts = sorted({f"{r['culprits']} #{r['seq']}" for r in runs})
                    left = sum(len(r["left"]) for r in runs)
                    worst = max(r["from_desync"] for r in runs)
                    ok = "ok" if worst <= target else "MISSED"
                    table.add_row(
                        str(n),
                        f"{name} (victim {runs[0]['victim']})",
                        ", ".join(errors),
                        ", ".join(facts),
                        fmt([r["from_desync"] for r in runs]),
                        fmt([r["from_run"] for r in runs]),
                        f"<= {target:g} {ok}",
                        str(left),
                    )
    if args.torchrun:
        if shutil.which("torchrun") is None:
            print("torchrun is not on PATH", file=sys.stderr)
            return 1
        for scenario in ("skip", "different_op"):
            for _ in range(args.reps):
                r = measure_torchrun(scenario, args.timeout)
                errs = "; ".join(
                    f"rank {k}: {t:.2f} s seq={q} culprits={c}"
                    for k, (t, q, c) in sorted(r["errors"].items())
                )
                done = f"; done: {r['done']}" if r["done"] else ""
                worst = max((t for t, _, _ in r["errors"].values()), default=float("inf"))
                ok = "ok" if worst <= args.timeout + 2 else "MISSED"
                table.add_row(
                    "2 (torchrun)",
                    scenario,
                    "DesyncError" if r["errors"] else f"none (rc {r['rc']})",
                    errs + done,
                    f"{worst:.2f}",
                    f"job {r['job_s']:.1f}",
                    f"<= {args.timeout + 2:g} {ok}",
                    str(len(r["left"])),
                )
    Console(width=200).print(table)
    print(f"load avg after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
