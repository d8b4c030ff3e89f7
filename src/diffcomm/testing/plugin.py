"""pytest plugin (auto-loaded via the ``pytest11`` entry point): shared local worlds.

Fixtures:

``local_worlds`` (session)
    ``local_worlds(n, backend="gloo")`` returns a :class:`~diffcomm.LocalWorld` of ``n``
    ranks, started on first use and shared by every test of the session, so multi-rank
    tests cost one ``run()`` each, not a process start-up each.
``world1`` .. ``world4``
    Shorthands for ``local_worlds(1)`` ... ``local_worlds(4)``.
``inproc_worlds`` (session), ``inproc_world1`` .. ``inproc_world4``
    The same, with every rank a thread of the test process
    (``LocalWorld(n, in_process=True)``, docs/in_process.md): for correctness tests that
    need no real transport.

Marker: ``@pytest.mark.diffcomm_in_process`` (on a test, a class, or a module's
``pytestmark``): the test's shared worlds (``local_worlds(n)``, ``world1`` .. ``world4``)
are in-process; ``@pytest.mark.diffcomm_in_process(False)`` on a test of a marked module
keeps it on real processes (the closest marker wins).

Options: ``--diffcomm-timeout SECONDS`` (the ranks' collective timeout, default 30);
``--diffcomm-in-process`` (every shared world of the session in-process, ``local_worlds``
and ``world1`` .. ``world4`` included: a quick run of a suite whose tests need no real
transport; the default is real processes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from diffcomm.runtime.world import LocalWorld


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("diffcomm")
    group.addoption(
        "--diffcomm-timeout",
        type=float,
        default=30.0,
        help="collective timeout (seconds) of the shared LocalWorld ranks",
    )
    group.addoption(
        "--diffcomm-in-process",
        action="store_true",
        default=False,
        help="run every shared LocalWorld in-process (all ranks threads of the test process)",
    )


_MARKER = "diffcomm_in_process"
_MARKED: list[bool] = [False]  # the running test's marker (read by the session's factory)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{_MARKER}(on=True): the test's shared LocalWorlds run in-process (diffcomm)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker(_MARKER)
    _MARKED[0] = marker is not None and bool(marker.args[0] if marker.args else True)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _MARKED[0] = False


@pytest.fixture(scope="session")
def local_worlds(request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalWorld]]:
    """Factory of session-scoped LocalWorlds, one per (world size, backend)."""
    worlds: dict[tuple[int, str, bool], LocalWorld] = {}
    timeout = request.config.getoption("--diffcomm-timeout")
    everything_in_process = request.config.getoption("--diffcomm-in-process")

    def get(n: int, backend: str = "gloo", in_process: bool | None = None) -> LocalWorld:
        """``in_process=None``: as the running test's marker says (real processes unmarked)."""
        in_process = (_MARKED[0] if in_process is None else in_process) or everything_in_process
        key = (n, backend, in_process)
        if key not in worlds:
            # (an in-process world has no timeouts: given one, it warns that it does not apply)
            timeouts = {} if in_process else {"collective_timeout": timeout, "timeout": 300}
            worlds[key] = LocalWorld(n, backend=backend, in_process=in_process, **timeouts)
        return worlds[key]

    yield get
    for w in worlds.values():
        w.close()


def _world_fixture(n: int) -> Any:
    """The fixture ``world{n}``: ``local_worlds(n)``."""

    def world(local_worlds: Callable[..., LocalWorld]) -> LocalWorld:
        return local_worlds(n)

    world.__doc__ = f"The shared {n}-rank LocalWorld (``local_worlds({n})``)."
    return pytest.fixture(name=f"world{n}")(world)


world1, world2, world3, world4 = (_world_fixture(n) for n in (1, 2, 3, 4))


@pytest.fixture(scope="session")
def inproc_worlds(local_worlds: Callable[..., LocalWorld]) -> Callable[[int], LocalWorld]:
    """``inproc_worlds(n)``: the shared in-process world of ``n`` ranks."""
    return lambda n: local_worlds(n, in_process=True)


def _inproc_fixture(n: int) -> Any:
    def world(local_worlds: Callable[..., LocalWorld]) -> LocalWorld:
        return local_worlds(n, in_process=True)

    world.__doc__ = f"The shared in-process {n}-rank LocalWorld (``LocalWorld({n}, in_process=True)``)."
    return pytest.fixture(name=f"inproc_world{n}")(world)


inproc_world1, inproc_world2, inproc_world3, inproc_world4 = (_inproc_fixture(n) for n in (1, 2, 3, 4))
