"""Pipeline benchmark: 1F1B vs GPipe vs serial for a small MLP on local CPU ranks.

Reports, for each number of stages ``p`` and micro-batches ``m``:

* throughput (samples/s) of a training step (forward + backward, no optimizer) for the
  serial model on one process and for both schedules on ``p`` gloo ranks;
* the bubble fraction measured from the recorded per-step timelines (time blocked in
  receives counts as idle) next to the ideal ``(p - 1) / (m + p - 1)``;
* peak activation memory per stage (bytes of saved-for-backward tensors alive at once,
  as :class:`diffcomm.pipeline.PipelineRunner` counts them), GPipe vs 1F1B.

``--plot out.png`` draws the timeline of one step per rank (matplotlib).

Every rank (and the serial baseline) uses one thread, so ``p`` stages want ``p`` cores;
on a machine with fewer cores the ranks share them and the pipeline numbers say more
about scheduling than about speed-up.

    python benchmarks/bench_pipeline.py                    # ~1 minute
    python benchmarks/bench_pipeline.py --plot timeline.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.pipeline import PipelineRunner, bubble_fraction, partition, theoretical_bubble


def make_mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def serial_step_time(width: int, depth: int, batch: int, steps: int) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp(width, depth)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rank_bench(
    width: int, depth: int, batch: int, n_micro: int, schedule: str, steps: int
) -> dict[str, Any]:
    rank, n = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    model = make_mlp(width, depth)
    runner = PipelineRunner(partition(model, n)[rank], schedule, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    times = []
    for i in range(steps + 2):
        B.get_backend().barrier(None)
        t = time.perf_counter()
        runner.step(x, y, n_micro)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return {
        "times": times,
        "timeline": [(e.kind, e.micro, e.start, e.end, e.wait) for e in runner.timeline],
        "peak": runner.peak_activation_bytes,
    }


def _entries(raw: list[tuple]) -> list[Any]:
    from diffcomm.pipeline import TimelineEntry

    return [TimelineEntry(*e) for e in raw]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8, help="Linear+ReLU blocks (divisible by the stages)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after 2 warm-up)")
    ap.add_argument("--plot", default=None, help="write a timeline PNG of one step per rank")
    args = ap.parse_args(argv)

    print(f"MLP {args.depth} x Linear({args.width}, {args.width}) + ReLU, batch {args.batch}, float32, CPU")
    print(f"cores: {os.cpu_count()}, one thread per rank; torch {torch.__version__}\n")
    serial = serial_step_time(args.width, args.depth, args.batch, args.steps)
    print(f"serial (1 process): {serial * 1e3:8.2f} ms/step  {args.batch / serial:10.0f} samples/s\n")

    head = (
        f"{'p':>2} {'m':>3} {'schedule':>8} {'ms/step':>9} {'samples/s':>10} {'vs serial':>9} "
        f"{'bubble':>7} {'theory':>7}  peak activation KiB per stage"
    )
    print(head)
    print("-" * len(head))
    plots: dict[str, list[list[Any]]] = {}
    for p in args.stages:
        with dc.LocalWorld(p) as world:
            for m in args.micro:
                for schedule in ("gpipe", "1f1b"):
                    res = world.run(_rank_bench, args.width, args.depth, args.batch, m, schedule, args.steps)
                    step = statistics.median(max(r["times"][i] for r in res) for i in range(args.steps))
                    timelines = [_entries(r["timeline"]) for r in res]
                    bubble = bubble_fraction(timelines)
                    peaks = " ".join(f"{r['peak'] / 1024:7.0f}" for r in res)
                    print(
                        f"{p:>2} {m:>3} {schedule:>8} {step * 1e3:9.2f} {args.batch / step:10.0f} "
                        f"{serial / step:8.2f}x {bubble:7.2f} {theoretical_bubble(p, m):7.2f}  {peaks}"
                    )
                    plots[f"{schedule}, p={p}, m={m}"] = timelines
    if args.plot:
        _plot(plots, args.plot)
        print(f"\ntimeline written to {args.plot}")
    return 0


def _plot(plots: dict[str, list[list[Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plots), 1, figsize=(11, 1.1 + 0.45 * sum(len(t) for t in plots.values())))
    axes = [axes] if len(plots) == 1 else list(axes)
    for ax, (title, timelines) in zip(axes, plots.items()):
        t0 = min(e.start for tl in timelines for e in tl)
        for rank, tl in enumerate(timelines):
            for e in tl:
                color = "tab:blue" if e.kind == "F" else "tab:orange"
                # hatched: blocked in a receive; solid: compute
                ax.barh(rank, e.wait * 1e3, left=(e.start - t0) * 1e3, color="lightgrey", height=0.8)
                ax.barh(
                    rank,
                    e.busy * 1e3,
                    left=(e.start - t0 + e.wait) * 1e3,
                    color=color,
                    height=0.8,
                    edgecolor="k",
                )
                ax.text(
                    (e.start - t0 + e.wait + e.busy / 2) * 1e3, rank, f"{e.kind}{e.micro}",
                    ha="center", va="center", fontsize=6, color="white",
                )  # fmt: skip
        ax.set_yticks(range(len(timelines)), [f"stage {r}" for r in range(len(timelines))])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms (blue: forward, orange: backward, grey: waiting for a receive)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
