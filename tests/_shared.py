"""Helpers shared by several test modules (importable inside rank processes too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

T = TypeVar("T")


def outcomes(calls: dict[str, Callable[[], object]], error: type[BaseException]) -> dict[str, str]:
    """Each call's outcome by key: ``"no error"``, or the message of the ``error`` it raised
    (any other exception propagates, so a wrong error type fails the test)."""
    out = {}
    for key, call in calls.items():
        try:
            call()
            out[key] = "no error"
        except error as exc:
            out[key] = str(exc)
    return out


def check_in_batches(
    world: Any, cases: st.SearchStrategy[T], assert_ok: Callable[[Any, list[T]], None], max_examples: int
) -> None:
    """A property test: ``max_examples`` batches of three cases drawn from ``cases``, each
    batch checked by ``assert_ok(world, batch)`` (one ``world.run`` for three cases)."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.lists(cases, min_size=3, max_size=3))
    def check(batch: list[T]) -> None:
        assert_ok(world, batch)

    check()
