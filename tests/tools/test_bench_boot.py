"""``benchmarks/bench_boot.py``'s measured program stays a correct one: its first
``dc.spmd_check`` step (issue 47's "first checked step") raised on real processes, every
rank's default generator being its own (the replicas and the input differed: the check
refused it, rightly), so the benchmark stopped with a traceback. Run here on the suite's
kept real-process world: no fresh interpreter, nothing timed."""

from __future__ import annotations

import sys

from _shared import BENCHMARKS

import diffcomm as dc

sys.path.insert(0, str(BENCHMARKS))

from bench_boot import _checked_step


def test_bench_boots_checked_step_passes_the_check_on_real_ranks(world2: dc.LocalWorld) -> None:
    assert world2.run(_checked_step) == [None, None]
