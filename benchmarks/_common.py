"""What the benchmark scripts share: integer options and the timing loop.

The scripts run as ``python benchmarks/<script>.py``, so this folder is on ``sys.path``
(and a ``LocalWorld`` ships ``sys.path`` to its ranks: a rank body may call these too).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def int_options(parser: argparse.ArgumentParser, **defaults: int) -> argparse.ArgumentParser:
    """Add an integer option per keyword: ``--name`` (``_`` written ``-``) with its default.

    Returns ``parser`` (so a script can write ``int_options(ArgumentParser(...), ...)``).
    """
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return parser


def timed(fn: Callable[..., object], *args: object, calls: int, warmup: int) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn(*args)``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn(*args)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return samples
