"""Shared test configuration.

Hypothesis: under CI (``CI`` set) examples are derandomized, so a CI run is reproducible;
locally they are random, so every developer run explores new examples. The shared
``LocalWorld`` fixtures come from the ``diffcomm.testing.plugin`` pytest plugin.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from hypothesis import settings

from diffcomm import _lifecycle

# The suite starts a few hundred fresh interpreters (ranks, the command line, benchmarks,
# notebook kernels). Where the environment sets PYTHONDONTWRITEBYTECODE, none of them
# keeps the bytecode it compiles, so each recompiled diffcomm (~0.2 s of CPU apiece):
# the suite's subprocesses write and reuse it, as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The Ctrl-C tests send SIGINT to programs that must behave as in a terminal. A runner that
# starts pytest with SIGINT ignored (a background job of a non-interactive shell, nohup)
# would hand SIG_IGN down to every child, and those programs would never see the Ctrl-C:
# the suite's processes get a terminal's handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


_FIRST = ("tests/test_notebooks.py", "tests/test_docs.py")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items) -> Iterator[None]:
    """The order the two workers take the tests in.

    - The notebooks, then the docs build, as one ``xdist_group`` (kept on one worker by
      ``--dist loadgroup``; marked before pytest-xdist's own hook reads the marks), first:
      the docs render the notebooks that test_notebooks.py executed (with their real
      plots) instead of bare code cells, and the other worker runs the rest meanwhile
      instead of waiting for this minute-long group at the end of the run.
    - The tests marked ``waits`` (most of their time a rank or a clock is waited for: a
      collective timeout, a desync diagnosis) spread evenly over the rest, after pytest's
      own ordering by fixtures: the workers take neighbouring tests at the same time, so a
      waiting test runs beside computing ones instead of beside another waiting one (in
      file order the flight recorder's desync scenarios ran on both workers at once, the
      machine 60 % idle).
    """
    first = ("tests/test_notebooks.py", "tests/test_docs.py")
    for item in items:
        if item.nodeid.startswith(first):
            item.add_marker(pytest.mark.xdist_group("notebooks_then_docs"))
    yield
    grouped = sorted(
        (item for item in items if item.nodeid.startswith(first)),
        key=lambda item: next(i for i, f in enumerate(first) if item.nodeid.startswith(f)),
    )
    rest = [item for item in items if not item.nodeid.startswith(first)]
    waiting = [item for item in rest if item.get_closest_marker("waits") is not None]
    computing = [item for item in rest if item.get_closest_marker("waits") is None]
    stride = max(1, len(computing) // (len(waiting) + 1))
    spread: list[pytest.Item] = []
    for i, item in enumerate(computing):
        if i and i % stride == 0 and waiting:
            spread.append(waiting.pop(0))
        spread.append(item)
    items[:] = grouped + spread + waiting


@pytest.fixture(autouse=True)
def _each_test_is_a_program() -> None:
    """Every test is a program of its own in this process too (as each ``LocalWorld.run``
    is on its ranks): what one test's program recorded (the context-parallel layouts it
    used) does not make another test's unplaced sequence ambiguous."""
    _lifecycle.program_start()
