"""The fault matrix: a job's edges (exit, re-init, rank death, SIGTERM, restarts) under
real launchers, each cell repeated.

Usage::

    python benchmarks/bench_lifecycle.py                       # every cell, 20 repetitions
    python benchmarks/bench_lifecycle.py --reps 100 --cells spawn:exit:4 spawn:control:4
    python benchmarks/bench_lifecycle.py --json out.json

A cell is ``LAUNCHER:SCENARIO:WORLD``: launchers ``spawn`` (``torch.multiprocessing.spawn``),
``torchrun``, ``localworld``; scenarios as in ``lifecycle_job.py`` plus ``sigterm`` (the
``loop`` job, then ``SIGTERM`` to every rank once all are inside collectives). Each
repetition is judged by :func:`judge` (the expectations of issue 31's table); the table
printed (and written to ``docs/debugging.md`` by hand) has, per cell, how many repetitions
held and the median / max of the time that matters for the cell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "lifecycle_job.py"
#: the collective timeout every cell runs under (seconds)
TIMEOUT = 5.0

CELLS = [
    f"{launcher}:{scenario}:{world}"
    for world in (2, 4)
    for launcher, scenarios in (
        ("spawn", ("exit", "control", "reinit", "kill", "sigterm")),
        # "reinit" and "restart" join through dc.init(): under torchrun a plain second
        # init_process_group on the agent's store can read the first group's (or attempt's)
        # gloo addresses and fail to connect, in plain torch too (docs/debugging.md)
        ("torchrun", ("exit", "reinit", "kill", "sigterm", "restart", "raise")),
        ("localworld", ("exit", "reinit", "kill", "raise")),
    )
    for scenario in scenarios
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(timeout: float = TIMEOUT) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFCOMM_TIMEOUT": str(timeout), "LIFECYCLE_REDIRECT": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *[p for p in sys.path if p]])
    env.pop("DIFFCOMM_DEBUG", None)
    return env


def _read_ranks(out: Path, world: int) -> list[dict[str, Any]]:
    ranks = []
    for r in range(world):
        facts: dict[str, str] = {}
        err = ""
        for stem in sorted(out.glob(f"rank{r}.*out")):
            for line in stem.read_text().splitlines():
                if "=" in line:
                    k, v = line.split("=", 1)
                    facts[k] = v
        for stem in sorted(out.glob(f"rank{r}.*err")):
            err += stem.read_text()
        ranks.append({"facts": facts, "stderr": err})
    return ranks


def _pids(out: Path, world: int) -> list[int]:
    pids = []
    for r in range(world):
        f = out / f"rank{r}.pid"
        pids.append(int(f.read_text()) if f.exists() and f.read_text() else -1)
    return pids


def _wait_looping(out: Path, world: int, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        files = [out / f"rank{r}.out" for r in range(world)]
        if all(f.exists() and "looping=1" in f.read_text() for f in files):
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (not yet reaped by its launcher) has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _sigterm(out: Path, world: int, proc: subprocess.Popen[str]) -> dict[str, Any]:
    if not _wait_looping(out, world, 90):
        return {"error": "ranks never started looping"}
    pids = _pids(out, world)
    t0 = time.monotonic()
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    exit_s: list[float | None] = [None] * world
    while time.monotonic() - t0 < 15 and any(e is None for e in exit_s):
        for i, p in enumerate(pids):
            if exit_s[i] is None and not _alive(p):
                exit_s[i] = round(time.monotonic() - t0, 3)
        time.sleep(0.01)
    return {"exit_s": exit_s}


def run_once(
    launcher: str,
    scenario: str,
    world: int,
    limit: float = 300.0,
    keep: str | None = None,
    timeout: float = TIMEOUT,
) -> dict[str, Any]:
    """One repetition of a cell: exit codes, every rank's facts and stderr, timings; with
    ``keep``, the ranks' files are copied to a new folder under it. ``timeout``: the
    collective timeout (``DIFFCOMM_TIMEOUT``) of the job's ranks (the suite's ``reinit``
    cells, which wait for it, use a shorter one)."""
    with tempfile.TemporaryDirectory(prefix="diffcomm-lifecycle-") as d:
        out = Path(d)
        env = _env(timeout)
        env["LIFECYCLE_PORTS"] = ",".join(str(_free_port()) for _ in range(3))
        job = "loop" if scenario == "sigterm" else scenario
        t0 = time.monotonic()
        extra: dict[str, Any] = {}
        if launcher == "spawn":
            cmd = [sys.executable, str(JOB), "--spawn", str(world), job, d, str(_free_port()), str(limit)]
        elif launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
            cmd += ["--max-restarts=1"] if scenario == "restart" else []
            cmd += ["--monitor-interval=0.1", str(JOB), job, d]
        elif launcher == "localworld":
            cmd = [sys.executable, str(HERE / "lifecycle_localworld.py"), scenario, str(world), d]
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if scenario == "sigterm":
            extra = _sigterm(out, world, proc)
        try:
            stdout, stderr = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            extra["launcher_hung"] = True
        wall = time.monotonic() - t0
        codes = (out / "exitcodes").read_text().split() if (out / "exitcodes").exists() else []
        ranks = _read_ranks(out, world)
        restart = sorted(p.read_text().strip() for p in out.glob("restart_rank*.txt"))
        files = sorted(p.name for p in out.iterdir())
        leftover = [p for p in _pids(out, world) if p > 0 and _alive(p)]
        for p in leftover:
            os.kill(p, signal.SIGKILL)
        if keep:
            kept = Path(tempfile.mkdtemp(prefix=f"{launcher}-{scenario}-{world}-", dir=keep))
            shutil.copytree(out, kept, dirs_exist_ok=True)
            (kept / "launcher.err").write_text(stderr)
            (kept / "launcher.out").write_text(stdout)
    return {
        "launcher": launcher,
        "scenario": scenario,
        "world": world,
        "timeout": timeout,
        "rc": proc.returncode,
        "rank_codes": codes,
        "ranks": ranks,
        "launcher_stdout": stdout,
        "launcher_stderr": stderr,
        "wall_s": round(wall, 3),
        "restart": restart,
        "leftover": leftover,
        "files": files,
        **extra,
    }


_ABORT = ("SIGABRT", "terminate called", "exitcode: -6", "Aborted")


def judge(r: dict[str, Any]) -> tuple[bool, str, float | None]:
    """(held, why not, the cell's time) for one repetition, by issue 31's table."""
    scen, world, ranks = r["scenario"], r["world"], r["ranks"]
    errs = [x["stderr"] for x in ranks]
    everything = r["launcher_stderr"] + "".join(errs)
    if r["leftover"]:
        return False, f"processes left running: {r['leftover']}", None
    if any(a in everything for a in _ABORT) or "-6" in r["rank_codes"]:
        return False, "a rank aborted (SIGABRT)", None
    if scen in ("exit", "control"):
        if r["rc"] != 0 or any(c != "0" for c in r["rank_codes"]):
            return False, f"exit codes {r['rc']} {r['rank_codes']}", None
        if any(e.strip() for e in errs):
            return False, "stderr: " + next(e for e in errs if e.strip())[:300], None
        if r["launcher"] == "spawn" and r["launcher_stderr"].strip():
            return False, "launcher stderr: " + r["launcher_stderr"][:300], None
        if (
            scen == "exit"
            and r["launcher"] != "localworld"
            and any(x["facts"].get("threads_after_destroy") != "0" for x in ranks)
        ):
            return False, "a diffcomm thread outlived destroy_process_group", None
        return True, "", r["wall_s"]
    if scen == "reinit":
        facts = [x["facts"] for x in ranks]
        named = [
            f for f in facts if f.get("error_names_culprit") == "True" and f.get("error_names_seq") == "True"
        ]
        if not named or any(f.get("diagnosis_failed") == "True" for f in facts):
            tails = [e[-400:] for e in errs if e.strip()]
            return False, f"no full diagnosis: {[f.get('error') for f in facts]} {tails}", None
        return True, "", r["wall_s"]
    if scen in ("kill", "raise"):
        key = "names_dead" if scen == "kill" else "names_culprit"
        survivors = [x["facts"] for i, x in enumerate(ranks) if i != (world - 1 if scen == "kill" else 1)]
        if r["launcher"] == "localworld":  # the caller speaks for the survivors
            survivors = [ranks[0]["facts"]]
        elif r["launcher"] == "torchrun":  # torchrun stops the survivors once one rank failed:
            survivors = [f for f in survivors if "raised_after" in f]  # judge those that reported
            if not survivors:  # all stopped by torchrun's SIGTERM first: quietly, no abort
                noisy = [e for e in errs if len(e.strip().splitlines()) > 1]
                return (False, f"stopped survivors printed {noisy[:1]}", None) if noisy else (True, "", None)
        times = []
        for f in survivors:
            if f.get(key) != "True":
                tails = [e[-600:] for e in errs if e.strip()]
                return False, f"a survivor did not name the rank: {f}, codes {r['rank_codes']}, {tails}", None
            times.append(float(f["raised_after"]))
        if max(times) > r.get("timeout", TIMEOUT) + 2:
            return False, f"raised after {max(times)} s", None
        if r["launcher"] == "spawn" and any(c in ("0", "hung") for i, c in enumerate(r["rank_codes"])):
            return False, f"exit codes {r['rank_codes']}", None
        tracebacks = sum(e.count("Traceback (most recent call last)") for e in errs)
        if tracebacks > 1:  # the culprit's own traceback ("raise") is the user's
            return False, f"{tracebacks} tracebacks", None
        return True, "", max(times)
    if scen == "sigterm":
        exit_s = r.get("exit_s") or []
        if not exit_s or any(e is None or e > 5 for e in exit_s):
            return False, f"exit times {exit_s} {r.get('error', '')}", None
        lines = [len([ln for ln in e.splitlines() if ln.strip()]) for e in errs]
        if max(lines) > 1:
            return False, f"stderr lines per rank {lines}", None
        return True, "", max(exit_s)
    if scen == "restart":
        if r["rc"] != 0:
            return False, f"torchrun rc {r['rc']}: {r['launcher_stderr'][-500:]}", None
        want = ["attempt=1 ok=True diag_rounds_seen=0 first_seq=0"] * world
        if r["restart"] != want:
            return False, f"second attempt: {r['restart']}, files {r['files']}", None
        return True, "", r["wall_s"]
    return False, f"unknown scenario {scen}", None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cells", nargs="*", default=CELLS, help="LAUNCHER:SCENARIO:WORLD (default: all)")
    ap.add_argument("--json", help="write every repetition's judgement here")
    ap.add_argument("--verbose", action="store_true", help="print each failure's reason")
    ap.add_argument("--log", help="append one JSON line per repetition here, as it ends")
    ap.add_argument("--until", type=float, help="start no repetition after this Unix time")
    args = ap.parse_args(argv)
    if shutil.which("torchrun") is None:
        args.cells = [c for c in args.cells if not c.startswith("torchrun")]
    # repetitions outer, cells inner: a run cut short (--until) leaves every cell with about
    # the same number of repetitions, and load drifts over all cells alike
    results: dict[str, dict[str, Any]] = {
        c: {"held": 0, "reps": 0, "times": [], "fails": []} for c in args.cells
    }
    log = Path(args.log).open("a") if args.log else None
    for rep in range(args.reps):
        if args.until and time.time() > args.until:
            print(f"stopped at repetition {rep} (--until)", flush=True)
            break
        for cell in args.cells:
            launcher, scenario, world = cell.split(":")
            r = run_once(launcher, scenario, int(world))
            ok, why, t = judge(r)
            c = results[cell]
            c["held"] += ok
            c["reps"] += 1
            if t is not None:
                c["times"].append(t)
            if not ok:
                c["fails"].append(why)
                if args.verbose:
                    print(f"  {cell}: {why}", flush=True)
            if log is not None:
                log.write(json.dumps({"cell": cell, "rep": rep, "ok": ok, "why": why, "t": t}) + "\n")
                log.flush()
    rows = []
    print(f"{'cell':28} {'held':>7} {'median s':>9} {'max s':>7}  first failure")
    for cell, c in results.items():
        times, fails = c["times"], c["fails"]
        med = statistics.median(times) if times else float("nan")
        mx = max(times) if times else float("nan")
        print(
            f"{cell:28} {c['held']:>3}/{c['reps']:<3} {med:>9.2f} {mx:>7.2f}  "
            f"{fails[0][:60] if fails else ''}",
            flush=True,
        )
        rows.append(
            {"cell": cell, "held": c["held"], "reps": c["reps"], "median_s": med, "max_s": mx, "fails": fails}
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
