"""The fault matrix's ``LocalWorld`` cells (see ``bench_lifecycle.py``): one caller process.

    python benchmarks/lifecycle_localworld.py SCENARIO WORLD OUTDIR

Writes ``key=value`` facts to ``OUTDIR/rank0.out`` (the caller speaks for the survivors)
and the ranks' pids to ``OUTDIR/rank<r>.pid`` (the driver checks none is left running).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import diffcomm as dc

TIMEOUT = float(os.environ.get("DIFFCOMM_TIMEOUT", "5"))


def main(scenario: str, world: int, outdir: str) -> None:
    facts = open(os.path.join(outdir, "rank0.out"), "w")

    def say(k: str, v: object) -> None:
        facts.write(f"{k}={v}\n")
        facts.flush()

    def pids(w: dc.LocalWorld) -> None:
        for r, p in enumerate(w.pids):
            with open(os.path.join(outdir, f"rank{r}.pid"), "w") as f:
                f.write(str(p))

    if scenario == "exit":

        def ops() -> float:
            x = torch.arange(4.0, requires_grad=True)
            dc.all_reduce(x).sum().backward()
            (dc.all_gather(x.detach().requires_grad_(), async_op=True) * 2).sum().backward()
            sum(t.sum() for t in dc.all_reduce_coalesced([torch.ones(3, requires_grad=True)])).backward()
            dc.shift(x.detach().requires_grad_(), 1).sum().backward()
            dc.wait_sends()
            return float(x.grad.sum())

        with dc.LocalWorld(world, collective_timeout=TIMEOUT) as w:
            pids(w)
            w.run(ops)
        return
    if scenario == "reinit":
        for g in range(3):
            with dc.LocalWorld(world, collective_timeout=TIMEOUT) as w:
                pids(w)

                def body(last: bool) -> None:
                    x = torch.ones(3, requires_grad=True)
                    dc.all_reduce(x).sum().backward()
                    if last and dc.get_rank() == dc.get_world_size() - 1:
                        return  # skips op #2
                    if last:
                        dc.all_reduce(x)

                try:
                    w.run(body, g == 2)
                except dc.DiffcommError as err:
                    text = str(err)
                    say("error", text.splitlines()[0].replace("=", ":"))
                    say("error_names_culprit", f"rank {world - 1}" in text or f"[{world - 1}]" in text)
                    say("error_names_seq", "#2" in text)
                    say("diagnosis_failed", "diagnosis failed" in text)
        return
    if scenario in ("kill", "raise"):
        stamp = os.path.join(outdir, "event_at")

        def body(stamp: str) -> None:
            x = torch.ones(2**12)
            dc.all_reduce(x)
            me, n = dc.get_rank(), dc.get_world_size()
            victim = n - 1 if scenario == "kill" else 1
            if me == victim:
                time.sleep(0.5)
                with open(stamp, "w") as f:
                    f.write(str(time.time()))
                if scenario == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("planted error in user code on rank 1")
            dc.all_reduce(x)

        with dc.LocalWorld(world, collective_timeout=TIMEOUT) as w:
            pids(w)
            try:
                w.run(body, stamp)
                say("error", "none")
            except dc.DiffcommError as err:
                t = time.time()
                with open(stamp) as f:
                    say("raised_after", round(t - float(f.read()), 3))
                victim = world - 1 if scenario == "kill" else 1
                text = str(err)
                say("names_dead" if scenario == "kill" else "names_culprit", f"rank {victim}" in text)
                say("error", text.splitlines()[0].replace("=", ":"))
        return
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
