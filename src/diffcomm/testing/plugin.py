"""pytest plugin (auto-loaded via the ``pytest11`` entry point): shared local worlds.

Fixtures:

``local_worlds`` (session)
    ``local_worlds(n, backend="gloo")`` returns a :class:`~diffcomm.LocalWorld` of ``n``
    ranks, started on first use and shared by every test of the session, so multi-rank
    tests cost one ``run()`` each, not a process start-up each.
``world1`` .. ``world4``
    Shorthands for ``local_worlds(1)`` ... ``local_worlds(4)``.

Options: ``--diffcomm-timeout SECONDS`` (the ranks' collective timeout, default 30).
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


@pytest.fixture(scope="session")
def local_worlds(request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalWorld]]:
    """Factory of session-scoped LocalWorlds, one per (world size, backend)."""
    worlds: dict[tuple[int, str], LocalWorld] = {}
    timeout = request.config.getoption("--diffcomm-timeout")

    def get(n: int, backend: str = "gloo") -> LocalWorld:
        key = (n, backend)
        if key not in worlds:
            worlds[key] = LocalWorld(n, backend=backend, collective_timeout=timeout, timeout=300)
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
