"""Tensor-parallel MLP: step time vs the serial MLP, and communication vs the analytic count.

One step = forward + backward of ``ParallelMLP`` (fc1 column-parallel, fc2 row-parallel)
on ``[seq, batch, hidden]`` activations that require grad (as inside a transformer). The
serial reference is ``MLP`` on one rank (a ``LocalWorld(1)``, so it also runs with one
thread: every rank of a ``LocalWorld`` gets ``OMP_NUM_THREADS=1``).

Communication per step, from ``diffcomm.backend.log_comms`` (bytes as the logger counts
them: the full tensor for all_reduce, the gathered / pre-scatter tensor for all_gather /
reduce_scatter), ``A = seq * batch * hidden * itemsize``:

* tensor parallel: 2 all_reduce of ``A`` bytes (fc2 forward, fc1 backward);
* + sequence parallel: 2 all_gather and 2 reduce_scatter of ``A`` bytes (forward: fc1's
  all_gather, fc2's reduce_scatter; backward: the duals), plus, with a bias, 1 all_reduce
  of ``hidden * itemsize`` bytes (fc2's bias gradient: the bias meets a different
  sequence chunk on every rank).

The measured counts and bytes are asserted equal to these.

Usage::

    python benchmarks/bench_tp_mlp.py                    # hidden 512, ffn 2048, 512 tokens
    python benchmarks/bench_tp_mlp.py --worlds 2 --iters 5 --hidden 256 --ffn 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm.backend import log_comms

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def analytic(
    seq: int, batch: int, hidden: int, itemsize: int, sp: bool, bias: bool
) -> dict[str, tuple[int, int]]:
    """``{op: (count, bytes)}`` one step of ParallelMLP communicates."""
    act = seq * batch * hidden * itemsize
    if not sp:
        return {"all_reduce": (2, 2 * act), "all_gather": (0, 0), "reduce_scatter": (0, 0)}
    return {
        "all_reduce": (1, hidden * itemsize) if bias else (0, 0),
        "all_gather": (2, 2 * act),
        "reduce_scatter": (2, 2 * act),
    }


def _time_steps(step: Any, iters: int, warmup: int, sync: Any) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _serial_rank(cfg: dict[str, Any]) -> float:
    torch.manual_seed(0)
    mlp = P.MLP(cfg["hidden"], cfg["ffn"], bias=cfg["bias"])
    x = torch.randn(cfg["seq"], cfg["batch"], cfg["hidden"], requires_grad=True)

    def step() -> None:
        mlp(x).sum().backward()

    return statistics.median(_time_steps(step, cfg["iters"], cfg["warmup"], lambda: None))


def _parallel_rank(cfg: dict[str, Any], sp: bool) -> dict[str, Any]:
    rank, world = dc.get_rank(), dc.get_world_size()
    mlp = P.ParallelMLP(cfg["hidden"], cfg["ffn"], bias=cfg["bias"], sequence_parallel=sp, seed=0)
    x = torch.randn(cfg["seq"], cfg["batch"], cfg["hidden"], generator=torch.Generator().manual_seed(1))
    if sp:
        n = cfg["seq"] // world
        x = x[rank * n : (rank + 1) * n]
    x = x.clone().requires_grad_()

    def step() -> None:
        mlp(x).sum().backward()

    times = _time_steps(step, cfg["iters"], cfg["warmup"], dist.barrier)
    with log_comms() as log:
        step()
    rows = log.by_op()
    measured = {
        op: (int(rows.get(op, {}).get("count", 0)), int(rows.get(op, {}).get("bytes", 0))) for op in OPS
    }
    others = sorted(set(rows) - set(OPS))
    return {"median": statistics.median(times), "measured": measured, "others": others}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-bias", dest="bias", action="store_false")
    cfg = vars(parser.parse_args())
    itemsize = torch.empty((), dtype=torch.get_default_dtype()).element_size()

    with dc.LocalWorld(1, timeout=900) as world:
        serial = world.run(_serial_rank, cfg)[0]
    tokens = cfg["seq"] * cfg["batch"]
    print(
        f"MLP hidden={cfg['hidden']} ffn={cfg['ffn']} tokens={tokens} ({cfg['seq']}x{cfg['batch']}) "
        f"bias={cfg['bias']} float32, fwd+bwd, median of {cfg['iters']}; 1 thread per rank"
    )
    print(f"{'config':<12}{'ms/step':>10}{'vs serial':>11}   communication per step: measured == analytic")
    print(f"{'serial':<12}{serial * 1e3:>10.2f}{1.0:>10.2f}x")
    failures = []
    for n in cfg["worlds"]:
        with dc.LocalWorld(n, timeout=900) as world:
            for sp in (False, True):
                results = world.run(_parallel_rank, cfg, sp)
                t = max(r["median"] for r in results)
                expected = analytic(cfg["seq"], cfg["batch"], cfg["hidden"], itemsize, sp, cfg["bias"])
                comm = ", ".join(
                    f"{op} {c}x {b / 2**20:.3f} MiB" for op, (c, b) in results[0]["measured"].items() if c
                )
                ok = all(r["measured"] == expected and not r["others"] for r in results)
                name = f"TP{n}{'+SP' if sp else ''}"
                print(
                    f"{name:<12}{t * 1e3:>10.2f}{serial / t:>10.2f}x   {comm}  [{'ok' if ok else 'MISMATCH'}]"
                )
                if not ok:
                    failures.append((name, expected, [(r["measured"], r["others"]) for r in results]))
    assert not failures, f"communication differs from the analytic count: {failures}"


if __name__ == "__main__":
    main()
