"""vmap over the collectives, and torch.compile vs eager, on local gloo ranks.

Part 1 — vmap (issue targets, world 4, B=8, 1 MiB per batch element per rank, float32):

* ``vmap``:    ``torch.func.vmap(op)(x_b)`` with ``x_b`` of shape ``(B, n)``;
* ``stacked``: the same op called once on the stacked tensor (what vmap lowers to);
* ``loop``:    ``B`` separate calls ``op(x_b[i])`` (results not stacked: favours the loop).

Targets: ``vmap / stacked <= 1.5`` and ``loop / vmap >= 4``.

Part 2 — torch.compile (inductor) vs eager for a small sequence-parallel step, forward and
backward (all_gather -> MLP -> reduce_scatter -> all_reduce'd norm): time per step after
warm-up, and the one-off compile time.

Each timing: every rank runs ``barrier(); t0; work; t1``; the step's time is the slowest
rank's; the median over ``--iters`` steps is reported.

Usage::

    python benchmarks/bench_transforms.py
    python benchmarks/bench_transforms.py --world 4 --batch 8 --mib 1 0.25 --iters 30
    python benchmarks/bench_transforms.py --skip-compile
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import diffcomm as dc


def _time(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _vmap_rank(batch: int, mib: float, iters: int, warmup: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    w, r = dc.get_world_size(), dc.get_rank()
    n = int(mib * 2**20) // 4
    xb = torch.randn(batch, n, generator=torch.Generator().manual_seed(r))
    sizes = [n] * w  # known sizes: no size exchange in any variant
    ops: dict[str, tuple[Callable, Callable, Callable]] = {
        "all_gather": (
            lambda: torch.func.vmap(lambda x: dc.all_gather(x, 0, split_sizes=sizes))(xb),
            lambda: dc.all_gather(xb, 1, split_sizes=sizes),
            lambda: [dc.all_gather(xb[i], 0, split_sizes=sizes) for i in range(batch)],
        ),
        "all_reduce": (
            lambda: torch.func.vmap(dc.all_reduce)(xb),
            lambda: dc.all_reduce(xb),
            lambda: [dc.all_reduce(xb[i]) for i in range(batch)],
        ),
    }
    res = {}
    for name, (vm, stacked, loop) in ops.items():
        assert torch.equal(vm(), stacked())
        res[f"{name} vmap"] = _time(vm, iters, warmup)
        res[f"{name} stacked"] = _time(stacked, iters, warmup)
        res[f"{name} loop"] = _time(loop, iters, warmup)
    return res


class _Step(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        w = dc.get_world_size()
        x = dc.all_gather(x_shard, 0, split_sizes=[x_shard.shape[0]] * w)
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        out = dc.reduce_scatter(h, 0)
        return out / dc.all_reduce(out.pow(2).sum().reshape(1)).sqrt()


def _compile_rank(tokens: int, d: int, iters: int, warmup: int) -> dict[str, list[float]]:
    import importlib

    torch.set_num_threads(1)
    # by name: cloudpickle would try to ship torch._inductor.config (not picklable)
    importlib.import_module("torch._inductor.config").compile_threads = 1
    r = dc.get_rank()
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(r))
    eager, comp = _Step(d), _Step(d)
    comp.load_state_dict(eager.state_dict())
    compiled = torch.compile(comp, fullgraph=True)

    def step(model: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        return run

    dist.barrier()
    t0 = time.perf_counter()
    step(compiled)()  # compiles forward and backward
    compile_s = time.perf_counter() - t0
    step(eager)()
    gap = max(float((pe.grad - pc.grad).abs().max()) for pe, pc in zip(eager.parameters(), comp.parameters()))
    return {
        "eager": _time(step(eager), iters, warmup),
        "compiled": _time(step(compiled), iters, warmup),
        "compile_s": [compile_s],
        "max_grad_gap": [gap],
    }


def _slowest(per_rank: list[dict[str, list[float]]], key: str) -> float:
    """Median over steps of the slowest rank's time."""
    steps = zip(*(rr[key] for rr in per_rank))
    return statistics.median(max(s) for s in steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--mib",
        type=float,
        nargs="+",
        default=[1.0, 1 / 256],
        help="MiB per batch element per rank (1 = the issue's target; 1/256 = 4 KiB, latency-bound)",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-world", type=int, default=2, help="world size of part 2")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank in part 2")
    parser.add_argument("--dim", type=int, default=64, help="model width in part 2")
    parser.add_argument("--skip-compile", action="store_true", help="only part 1")
    parser.add_argument("--skip-vmap", action="store_true", help="only part 2")
    args = parser.parse_args(argv)
    console = Console()

    table = Table(
        title=f"vmap over B={args.batch}, world {args.world} (median of {args.iters}, slowest rank)"
    )
    cols = (
        "op",
        "KiB/element",
        "vmap ms",
        "stacked ms",
        "loop ms",
        "vmap/stacked (<=1.5)",
        "loop/vmap (>=4)",
    )
    for col in cols:
        table.add_column(col, justify="right")
    with dc.LocalWorld(args.world, timeout=1800) as world:
        for mib in [] if args.skip_vmap else args.mib:
            per_rank = world.run(_vmap_rank, args.batch, mib, args.iters, args.warmup)
            for op in ("all_gather", "all_reduce"):
                v, s, lp = (_slowest(per_rank, f"{op} {k}") for k in ("vmap", "stacked", "loop"))
                kib = f"{mib * 1024:g}"
                row = (
                    f"{v * 1e3:.2f}",
                    f"{s * 1e3:.2f}",
                    f"{lp * 1e3:.2f}",
                    f"{v / s:.2f}x",
                    f"{lp / v:.2f}x",
                )
                table.add_row(op, kib, *row)
    if not args.skip_vmap:
        console.print(table)

    if not args.skip_compile:
        with dc.LocalWorld(args.compile_world, timeout=1800) as world:
            per_rank = world.run(_compile_rank, args.tokens, args.dim, args.iters, args.warmup)
        e, c = _slowest(per_rank, "eager"), _slowest(per_rank, "compiled")
        table = Table(
            title=f"fwd+bwd step, {args.tokens} tokens x {args.dim} per rank, world {args.compile_world} "
            f"(median of {args.iters}, slowest rank)"
        )
        for col in ("eager ms", "compiled ms", "compiled/eager", "compile time s", "max |grad gap|"):
            table.add_column(col, justify="right")
        compile_s = max(rr["compile_s"][0] for rr in per_rank)
        gap = max(rr["max_grad_gap"][0] for rr in per_rank)
        table.add_row(f"{e * 1e3:.3f}", f"{c * 1e3:.3f}", f"{c / e:.2f}x", f"{compile_s:.1f}", f"{gap:.2e}")
        console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
