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

import diffcomm as dc
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

    One ``xdist_group`` (kept on one worker by ``--dist loadgroup``, which hands out the
    largest group first; marked before pytest-xdist's own hook reads the marks) holds, in
    this order:

    - the notebooks, then the docs build: the docs render the notebooks that
      test_notebooks.py executed (with their real plots) instead of bare code cells;
    - the tests marked ``waits`` (most of their time a rank or a clock is waited for: a
      collective timeout, a desync diagnosis), one after another.

    So what leaves a core idle runs on one worker, one at a time, and never two timeouts
    at once. (Spread over the order instead, two still met: the workers do not keep pace.
    The idle core-seconds are about the same either way, ~55 of ~530 CPU-seconds: a
    waiting test idles one core beside a computing one, or two beside another waiting
    one for half as long. A third worker fills them but costs ~40 CPU-seconds of its own
    ranks: the same wall time on two cores, 316 s and 317 s on 2026-12-03.)
    """
    first = ("tests/test_notebooks.py", "tests/test_docs.py")

    def place(item: pytest.Item) -> int:
        path = next((i for i, f in enumerate(first) if item.nodeid.startswith(f)), None)
        return path if path is not None else len(first) if item.get_closest_marker("waits") else -1

    for item in items:
        if place(item) >= 0:
            item.add_marker(pytest.mark.xdist_group("serial"))
    yield
    grouped = sorted((item for item in items if place(item) >= 0), key=place)
    items[:] = grouped + [item for item in items if place(item) < 0]


@pytest.fixture(autouse=True)
def _each_test_is_a_program() -> None:
    """Every test is a program of its own in this process too (as each ``LocalWorld.run``
    is on its ranks): what one test's program recorded (the context-parallel layouts it
    used) does not make another test's unplaced sequence ambiguous."""
    _lifecycle.program_start()


@pytest.fixture
def debug_off() -> Iterator[None]:
    """Debug mode pinned off for the test (``@pytest.mark.usefixtures("debug_off")``), on
    its ranks too (``LocalWorld.run`` passes the caller's setting): for a test that counts
    communications or pins an error that debug mode's own cross-rank checks add to or
    catch first. The suite also runs under ``DIFFCOMM_DEBUG=1``."""
    with dc.debug(False):
        yield
