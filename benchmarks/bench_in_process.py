"""In-process world against real processes, paired (issue 47: the user's test loop).

    python benchmarks/bench_in_process.py [--rounds 5] [--world 4] [--examples 100]

Each round times, on a ``LocalWorld(world, in_process=True)`` and on a
``LocalWorld(world)`` of real gloo processes (both started before the first round; the
order alternates from round to round):

- ``check_adjoint``: one ``world.run`` of the dot-product test of ``all_gather`` (float64);
- ``hypothesis``: a ``@given`` property test of ``--examples`` examples, each one
  ``world.run`` of ``all_reduce`` on a drawn shape compared with the sum of the ranks' inputs;
- ``assert_matches_serial``: the tensor-parallel MLP against its serial ``MLP`` (outputs,
  input and parameter gradients), float64.

Prints the median seconds of each side, the spread (min-max), and the median of the
per-round ratios processes / in-process (> 1: in-process is faster); ``--json`` adds the
rows (every round's seconds) as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from _common import int_options
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffcomm as dc
from diffcomm.parallel import MLP, ParallelMLP
from diffcomm.testing import assert_matches_serial, build, check_adjoint


def _adjoint() -> float:
    r = dc.get_rank()
    g = torch.Generator().manual_seed(r)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g)
    y = torch.randn(3 * dc.get_world_size(), 5, dtype=torch.float64, generator=g)
    return check_adjoint(lambda t: dc.all_gather(t, 0), x, y)


def _all_reduce_equals_sum(shape: tuple[int, ...]) -> bool:
    r, w = dc.get_rank(), dc.get_world_size()
    gens = [torch.Generator().manual_seed(q) for q in range(w)]
    xs = [torch.randn(shape, dtype=torch.float64, generator=g) for g in gens]
    return torch.allclose(dc.all_reduce(xs[r]), sum(xs), rtol=1e-12, atol=1e-12)


def _cases(examples: int) -> dict[str, Callable[[dc.LocalWorld], object]]:
    def adjoint(world: dc.LocalWorld) -> object:
        return world.run(_adjoint)

    @settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple))
    def prop(world: dc.LocalWorld, shape: tuple[int, ...]) -> None:
        assert all(world.run(_all_reduce_equals_sum, shape))

    torch.manual_seed(0)
    serial = MLP(8, 32, dtype=torch.float64)
    x = torch.randn(6, 2, 8, dtype=torch.float64)

    def matches(world: dc.LocalWorld) -> object:
        return assert_matches_serial(build(ParallelMLP.from_serial), serial, x, world=world)

    return {"check_adjoint": adjoint, "hypothesis": prop, "assert_matches_serial": matches}


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__.split("\n")[0]), rounds=5, world=4)
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON (last line)")
    args = parser.parse_args()
    cases = _cases(args.examples)
    worlds = {
        "in-process": dc.LocalWorld(args.world, in_process=True),
        "processes": dc.LocalWorld(args.world),
    }
    times: dict[tuple[str, str], list[float]] = {(c, k): [] for c in cases for k in worlds}
    try:
        for world in worlds.values():  # warm: imports, the fork server, first compiles
            for fn in cases.values():
                fn(world)
        for rnd in range(args.rounds):
            order = list(worlds) if rnd % 2 == 0 else list(reversed(worlds))
            for name, fn in cases.items():
                for kind in order:
                    start = time.perf_counter()
                    fn(worlds[kind])
                    times[name, kind].append(time.perf_counter() - start)
    finally:
        for world in worlds.values():
            world.close()
    print(f"world {args.world}, {args.rounds} rounds, hypothesis: {args.examples} examples")
    print(f"{'case':24} {'in-process s':>20} {'processes s':>20} {'ratio':>7}")
    rows = []
    for name in cases:
        here, real = times[name, "in-process"], times[name, "processes"]
        ratio = statistics.median(p / q for p, q in zip(real, here, strict=True))

        def cell(ts: list[float]) -> str:
            return f"{statistics.median(ts):.4f} ({min(ts):.3f}-{max(ts):.3f})"

        print(f"{name:24} {cell(here):>20} {cell(real):>20} {ratio:>6.1f}x")
        rows.append({"case": name, "in_process_s": here, "processes_s": real, "ratio": ratio})
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
