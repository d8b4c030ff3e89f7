"""The cost of ``dc.spmd_check``: one training step with the check on vs off.

Two models, each one step = ``zero_grad`` + forward + loss + backward (+ the gradient
check when on), on ``LocalWorld(world)`` (gloo, CPU, one thread per rank):

* ``tp_mlp``: the TP MLP example (``parallel.ParallelMLP``: fc1 column-parallel, fc2
  row-parallel) on ``[seq, batch, hidden]`` activations, replicated loss;
* ``llama_block``: ``examples/tensor_parallel_llama.py`` (RMSNorm, RoPE, grouped-query
  attention, SwiGLU; q/k/v/gate/up column-parallel, o/down row-parallel).

**Paired interleaved rounds**: each round times ``--steps`` steps eager and ``--steps``
steps checked (the check entered once per step, as a user would), the order alternating
between rounds; reported per model: the median step time of each, and the median and
spread (min, max) of the per-round ratio checked / eager. With the check off nothing is
installed, so "eager" is the plain program.

Usage::

    python benchmarks/bench_spmd.py                       # world 2, 12 rounds
    python benchmarks/bench_spmd.py --world 2 --rounds 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import int_options

import diffcomm as dc
from diffcomm import parallel as par

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
#: the models' sizes (each an integer option ``--name``; ``_`` written ``-``)
MODEL = dict(hidden=512, ffn=2048, seq=256, batch=2, dim=256, heads=8, kv_heads=4, llama_hidden=1024)


def _models(cfg: dict[str, int]) -> dict[str, Any]:
    """name -> (model, step function taking the model)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from tensor_parallel_llama import make

    torch.manual_seed(0)
    mlp = par.ParallelMLP(cfg["hidden"], cfg["ffn"], seed=0)
    x_mlp = torch.randn(cfg["seq"], cfg["batch"], cfg["hidden"], requires_grad=True)
    llama = make(cfg["dim"], cfg["heads"], cfg["kv_heads"], cfg["llama_hidden"], dtype=torch.float32)
    x_llama = torch.randn(cfg["batch"], cfg["seq"], cfg["dim"])
    pos = torch.arange(cfg["seq"])

    def mlp_step() -> None:
        mlp.zero_grad(set_to_none=True)
        mlp(x_mlp).pow(2).mean().backward()

    def llama_step() -> None:
        llama.zero_grad(set_to_none=True)
        llama(x_llama, pos).pow(2).mean().backward()

    return {"tp_mlp": mlp_step, "llama_block": llama_step}


def _rank(cfg: dict[str, int], rounds: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    models = _models(cfg)

    def run(step: Any, checked: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            if checked:
                with dc.spmd_check():
                    step()
            else:
                step()
        return (time.perf_counter() - t0) / steps

    out: dict[str, Any] = {}
    for name, step in models.items():
        run(step, False), run(step, True)  # warm-up (both paths)
        eager, checked = [], []
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            times = {c: run(step, c) for c in order}
            eager.append(times[False])
            checked.append(times[True])
        ratios = [c / e for c, e in zip(checked, eager)]
        out[name] = {
            "eager_ms": 1e3 * statistics.median(eager),
            "checked_ms": 1e3 * statistics.median(checked),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def main() -> None:
    ap = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), world=2, rounds=12)
    ap.add_argument(
        "--steps", type=int, default=3, help="steps per timing (each round: one eager, one checked)"
    )
    int_options(ap, **MODEL)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cfg = {name: getattr(a, name) for name in MODEL}
    with dc.LocalWorld(a.world) as world:
        res = world.run(_rank, cfg, a.rounds, a.steps)
    report = {"world": a.world, "rounds": a.rounds, "steps": a.steps, "config": cfg, "rank0": res[0]}
    print(f"world {a.world}, {a.rounds} paired rounds of {a.steps} steps (rank 0)")
    print(f"{'model':12s} {'eager ms':>9s} {'checked ms':>11s} {'ratio median':>13s} {'[min, max]':>16s}")
    for name, r in res[0].items():
        print(
            f"{name:12s} {r['eager_ms']:9.2f} {r['checked_ms']:11.2f} {r['ratio_median']:13.3f} "
            f"  [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]"
        )
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
