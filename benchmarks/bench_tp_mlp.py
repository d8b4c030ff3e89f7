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

``--overlap``: blocking vs overlapped (``ParallelMLP(overlap=...)``, ``docs/async.md``)
in one world, **paired interleaved rounds** (each round times one blocking and one
overlapped step, the order alternating between rounds), for tensor parallelism
(``overlap="comm"``: fc1's backward all_reduce runs while its weight gradient is
computed) and sequence parallelism (``overlap="ring"``). Reports the median step times
and the median and spread of the per-round ratio. ``--timeline PNG`` then records one
step of each configuration per rank — communication spans from
``diffcomm.backend.record_spans`` (any thread: the caller's blocking ops, the
communication engine's jobs, the caller's waits for asynchronous results) and compute
spans from ``torch.profiler`` (the caller's top-level ops) — plots them, writes the
spans as JSON next to the PNG, and prints per rank: step, compute, communication, the
communication hidden behind compute, and the step time predicted if communication had
its own engine (no CPU taken from compute: the overlapped step minus the time compute
was slowed, i.e. ``max(blocking step - hideable communication, compute-only path)``,
see ``_predict``).

Usage::

    python benchmarks/bench_tp_mlp.py                    # hidden 512, ffn 2048, 512 tokens
    python benchmarks/bench_tp_mlp.py --worlds 2 --iters 5 --hidden 256 --ffn 1024
    python benchmarks/bench_tp_mlp.py --overlap --hidden 1024 --ffn 4096 --seq 2048 --batch 1 \
        --rounds 8 --timeline tp_mlp_timeline.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import int_options

import diffcomm as dc
from diffcomm import backend as B
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
    _, step = _make(cfg, sp, overlap=False)
    times = _time_steps(step, cfg["iters"], cfg["warmup"], dist.barrier)
    with log_comms() as log:
        step()
    rows = log.by_op()
    measured = {
        op: (int(rows.get(op, {}).get("count", 0)), int(rows.get(op, {}).get("bytes", 0))) for op in OPS
    }
    others = sorted(set(rows) - set(OPS))
    return {"median": statistics.median(times), "measured": measured, "others": others}


# ----------------------------------------------------------------- blocking vs overlapped


def _make(cfg: dict[str, Any], sp: bool, overlap: Any) -> tuple[Any, Any]:
    rank, world = dc.get_rank(), dc.get_world_size()
    mlp = P.ParallelMLP(
        cfg["hidden"], cfg["ffn"], bias=cfg["bias"], sequence_parallel=sp, seed=0, overlap=overlap
    )
    x = torch.randn(cfg["seq"], cfg["batch"], cfg["hidden"], generator=torch.Generator().manual_seed(1))
    if sp:
        n = cfg["seq"] // world
        x = x[rank * n : (rank + 1) * n]
    x = x.clone().requires_grad_()

    def step() -> None:
        mlp(x).sum().backward()

    return mlp, step


def _overlap_rank(cfg: dict[str, Any], sp: bool, mode: str) -> dict[str, Any]:
    """Paired interleaved rounds: blocking and overlapped steps alternate (ABBA...)."""
    steps = {"blocking": _make(cfg, sp, False)[1], "overlapped": _make(cfg, sp, mode)[1]}
    for _ in range(cfg["warmup"]):
        for f in steps.values():
            f()
    times: dict[str, list[float]] = {"blocking": [], "overlapped": []}
    for i in range(cfg["rounds"]):
        order = ("blocking", "overlapped") if i % 2 == 0 else ("overlapped", "blocking")
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return times


def _timeline_rank(cfg: dict[str, Any], sp: bool, mode: str) -> dict[str, Any]:
    """One step of each variant: the communication spans of every thread of this rank."""
    out: dict[str, Any] = {}
    for name, overlap in (("blocking", False), ("overlapped", mode)):
        _, step = _make(cfg, sp, overlap)
        step()  # warm
        dist.barrier()
        with B.record_spans() as spans:
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
        out[name] = {
            "step": t1 - t0,
            "comm": [(op, lab, th, a - t0, b - t0) for op, lab, th, a, b in spans],
            "main_thread": threading.current_thread().name,
        }
        dist.barrier()
    return out


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(iv):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _union(iv))


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in _union(x):
        for c, d in _union(y):
            total += max(0.0, min(b, d) - max(a, c))
    return total


def _compute(tl: dict[str, Any]) -> list[tuple[float, float]]:
    """Compute spans: the calling thread's time neither in a communication nor waiting for
    one (matmuls, activations, autograd and Python overhead)."""
    busy = _union([(a, b) for _, _, th, a, b in tl["comm"] if th == tl["main_thread"]])
    out, t = [], 0.0
    for a, b in busy:
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < tl["step"]:
        out.append((t, tl["step"]))
    return out


def _moved(op: str, label: str | None, mode: str) -> bool:
    """Whether the blocking variant's communication ``op`` is one the overlapped variant
    runs on the engine (fc1's backward all_reduce; with the ring every all_gather and
    reduce_scatter)."""
    if mode == "ring":
        return op in ("all_gather", "reduce_scatter")
    return (
        op == "all_reduce" and "copy_to_region backward" in (label or "") and "coalesced" not in (label or "")
    )


def _summary(tl: dict[str, Any], mode: str) -> dict[str, float]:
    comp = _compute(tl)
    comm = [(a, b) for op, _, _, a, b in tl["comm"] if op != "wait"]
    engine = [(a, b) for op, _, th, a, b in tl["comm"] if op != "wait" and th == "diffcomm-comm"]
    return {
        "step": tl["step"],
        "compute": _length(comp),
        "comm": _length(comm),
        "comm_on_engine": _length(engine),
        "hidden": _intersect(engine, comp),
        "waited": _length([(a, b) for op, _, _, a, b in tl["comm"] if op == "wait"]),
        "movable": _length(
            [(a, b) for op, lab, _, a, b in tl["comm"] if op != "wait" and _moved(op, lab, mode)]
        ),
    }


def _predict(block: dict[str, float], ovl: dict[str, float]) -> float:
    """The overlapped step time if communication had its own engine (took no CPU from
    compute): the blocking step minus the communication the overlapped variant moves to
    the engine (as long as it took in the blocking step), capped by the compute it ran
    concurrently with in the overlapped step."""
    return block["step"] - min(block["movable"], ovl["hidden"])


def _plot(timelines: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(cfg, r, v) for cfg, per_rank in timelines.items() for r, tl in enumerate(per_rank) for v in tl]
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.25 * len(rows) + 1), squeeze=False)
    colours = {"compute": "#4c72b0", "comm_main": "#dd8452", "comm_engine": "#55a868", "wait": "#c44e52"}
    for ax, (cfg, r, variant) in zip(axes[:, 0], rows):
        tl = timelines[cfg][r][variant]
        comp = _compute(tl)
        ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in comp], (20, 8), color=colours["compute"])
        for op, _, th, a, b in tl["comm"]:
            if op == "wait":
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (20, 8), color=colours["wait"], alpha=0.8)
            else:
                lane, c = (
                    ((10, 8), colours["comm_engine"])
                    if th == "diffcomm-comm"
                    else ((0, 8), colours["comm_main"])
                )
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], lane, color=c)
        ax.set_yticks([4, 14, 24], ["comm (caller)", "comm (engine)", "compute"])
        ax.set_xlim(0, tl["step"] * 1e3)
        ax.set_ylabel(f"{cfg}\nrank {r}\n{variant}", rotation=0, ha="right", va="center", fontsize=8)
    axes[-1, 0].set_xlabel("ms since step start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(
        handles,
        ["compute", "communication (calling thread)", "communication (engine)", "waiting"],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)


def run_overlap(cfg: dict[str, Any]) -> None:
    world_n = cfg["worlds"][0]
    tokens = cfg["seq"] * cfg["batch"]
    print(
        f"ParallelMLP hidden={cfg['hidden']} ffn={cfg['ffn']} tokens={tokens} float32 fwd+bwd, "
        f"world {world_n}, "
        f"{cfg['rounds']} paired interleaved rounds (blocking vs overlapped), 1 compute thread per rank"
    )
    print(f"{'config':<22}{'blocking ms':>12}{'overlapped ms':>15}{'ratio median':>14}{'ratio min..max':>18}")
    timelines: dict[str, list[dict[str, Any]]] = {}
    with dc.LocalWorld(world_n, timeout=1800) as world:
        for sp, mode in ((False, "comm"), (True, "ring")):
            name = f"TP{world_n}{'+SP' if sp else ''} overlap={mode}"
            res = world.run(_overlap_rank, cfg, sp, mode)
            blk = [max(r["blocking"][i] for r in res) for i in range(cfg["rounds"])]
            ovl = [max(r["overlapped"][i] for r in res) for i in range(cfg["rounds"])]
            ratios = [b / o for b, o in zip(blk, ovl)]
            print(
                f"{name:<22}{statistics.median(blk) * 1e3:>12.1f}{statistics.median(ovl) * 1e3:>15.1f}"
                f"{statistics.median(ratios):>13.3f}x{min(ratios):>9.3f}..{max(ratios):.3f}x"
            )
            if cfg["timeline"]:
                timelines[name] = world.run(_timeline_rank, cfg, sp, mode)
    if not cfg["timeline"]:
        return
    path = Path(cfg["timeline"])
    print("\ntimeline (one step per variant and rank; ms):")
    print(
        f"{'config':<22}{'rank':>5}{'variant':>12}{'step':>9}{'compute':>9}{'comm':>8}{'engine':>8}"
        f"{'hidden':>8}{'waited':>8}{'predicted*':>11}"
    )
    for name, per_rank in timelines.items():
        for r, tl in enumerate(per_rank):
            mode = name.split("overlap=")[1]
            sb, so = _summary(tl["blocking"], mode), _summary(tl["overlapped"], mode)
            for variant, sm in (("blocking", sb), ("overlapped", so)):
                pred = f"{_predict(sb, so) * 1e3:>11.1f}" if variant == "overlapped" else f"{'':>11}"
                print(
                    f"{name:<22}{r:>5}{variant:>12}{sm['step'] * 1e3:>9.1f}{sm['compute'] * 1e3:>9.1f}"
                    f"{sm['comm'] * 1e3:>8.1f}{sm['comm_on_engine'] * 1e3:>8.1f}{sm['hidden'] * 1e3:>8.1f}"
                    f"{sm['waited'] * 1e3:>8.1f}{pred}"
                )
    print("compute: the calling thread neither communicating nor waiting; engine: communication on the")
    print("engine thread; hidden: engine communication concurrent with compute; waited: the calling thread")
    print("waiting for an asynchronous result. * predicted overlapped step with a separate communication")
    print("engine: blocking step - min(communication the overlapped variant moves, as long as it took in")
    print("the blocking step; engine communication hidden behind compute in the overlapped step)")
    title = f"ParallelMLP h={cfg['hidden']} ffn={cfg['ffn']} tokens={tokens}, world {world_n}: "
    title += "blocking vs overlapped"
    _plot(timelines, path, title)
    path.with_suffix(".json").write_text(json.dumps(timelines))
    print(f"wrote {path} and {path.with_suffix('.json')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    int_options(parser, hidden=512, ffn=2048, seq=256, batch=2, iters=10, warmup=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-bias", dest="bias", action="store_false")
    parser.add_argument("--overlap", action="store_true", help="blocking vs overlapped, paired rounds")
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds (--overlap)")
    parser.add_argument("--timeline", default=None, help="PNG path: plot one step per variant (--overlap)")
    cfg = vars(parser.parse_args())
    if cfg["overlap"]:
        run_overlap(cfg)
        return
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
