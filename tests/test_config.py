"""Settings: read once from the environment, validated with the legal values in the message,
settable, and restored by a ``with`` block."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import diffcomm as dc
from diffcomm import _config
from diffcomm._config import (
    ACCELERATOR,
    ALLOW_OVERSUBSCRIBE,
    DEBUG,
    FLIGHT,
    FLIGHT_SIZE,
    RANK_START,
    TIMEOUT,
    Setting,
)

SETTINGS = (DEBUG, TIMEOUT, ACCELERATOR, FLIGHT, FLIGHT_SIZE, ALLOW_OVERSUBSCRIBE, RANK_START)


@pytest.fixture(autouse=True)
def _isolated_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from an environment without DIFFCOMM_* and leaves things as they were."""
    saved = [(s.value, s.loaded) for s in SETTINGS]
    for s in SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
        s.reload()
    yield
    for s, (value, loaded) in zip(SETTINGS, saved):
        s.value, s.loaded = value, loaded


def _from_env(monkeypatch: pytest.MonkeyPatch, setting: Setting[Any], raw: str) -> Any:
    monkeypatch.setenv(setting.env, raw)
    setting.reload()
    return setting.get()


def test_defaults_without_environment() -> None:
    assert dc.settings() == {
        "debug": False,
        "timeout": None,
        "accelerator": None,
        "flight": True,
        "flight_size": 1024,
        "allow_oversubscribe": False,
        "progress": None,
        "rank_start": "fork",
    }
    assert dc.debug() is False and dc.timeout() is None


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("true", True), (" YES ", True), ("On", True), ("0", False), ("off", False), ("", False)],
)
def test_debug_parses_booleans(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    assert _from_env(monkeypatch, DEBUG, raw) is value


@pytest.mark.parametrize(
    ("raw", "value"), [("30", 30.0), ("2.5", 2.5), (" 1e-1 ", 0.1), ("none", None), ("", None)]
)
def test_timeout_parses_seconds(monkeypatch: pytest.MonkeyPatch, raw: str, value: float | None) -> None:
    assert _from_env(monkeypatch, TIMEOUT, raw) == value


@pytest.mark.parametrize(("raw", "value"), [("cpu", "cpu"), ("CUDA", "cuda"), (" xpu ", "xpu"), ("", None)])
def test_accelerator_parses_names(monkeypatch: pytest.MonkeyPatch, raw: str, value: str | None) -> None:
    assert _from_env(monkeypatch, ACCELERATOR, raw) == value


@pytest.mark.parametrize(
    ("setting", "raw", "match"),
    [
        (
            DEBUG,
            "maybe",
            r"DIFFCOMM_DEBUG='maybe' is not a boolean; use one of 1/0, true/false, yes/no, on/off",
        ),
        (DEBUG, "2", r"DIFFCOMM_DEBUG='2' is not a boolean; use one of 1/0"),
        (TIMEOUT, "soon", r"DIFFCOMM_TIMEOUT='soon' is not a number of seconds \(e.g. 30 or 2.5\)"),
        (TIMEOUT, "0", r"DIFFCOMM_TIMEOUT='0' must be a positive number of seconds"),
        (TIMEOUT, "-3", r"DIFFCOMM_TIMEOUT='-3' must be a positive number of seconds"),
        (TIMEOUT, "nan", r"DIFFCOMM_TIMEOUT='nan' must be a positive number of seconds"),
        (TIMEOUT, "inf", r"DIFFCOMM_TIMEOUT='inf' must be a finite number of seconds \(none: no timeout\)"),
        (
            ACCELERATOR,
            "tpu",
            r"DIFFCOMM_ACCELERATOR='tpu' is not a known accelerator; "
            r"legal values: \('cpu', 'cuda', 'mps', 'xpu'\)",
        ),
        (
            RANK_START,
            "thread",
            r"DIFFCOMM_RANK_START='thread' is not a way to start a rank; use 'fork' or 'spawn'",
        ),
    ],
)
def test_bad_environment_values_list_legal_values(
    monkeypatch: pytest.MonkeyPatch, setting: Setting[Any], raw: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _from_env(monkeypatch, setting, raw)


def test_environment_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _from_env(monkeypatch, TIMEOUT, "7") == 7.0
    monkeypatch.setenv("DIFFCOMM_TIMEOUT", "9")
    assert TIMEOUT.get() == 7.0, "cached until reload()"
    TIMEOUT.reload()
    assert TIMEOUT.get() == 9.0


def test_setter_applies_at_once_and_with_block_restores() -> None:
    dc.debug(True)  # plain call: stays on
    assert dc.debug() is True
    with dc.debug(False):
        assert dc.debug() is False
        with dc.debug(True):
            assert dc.debug() is True
        assert dc.debug() is False
    assert dc.debug() is True
    with dc.timeout(2.5):
        assert dc.timeout() == 2.5 and dc.settings()["timeout"] == 2.5
    assert dc.timeout() is None


def test_with_block_restores_after_an_exception() -> None:
    with pytest.raises(KeyError, match="inside"), dc.timeout(4):
        assert dc.timeout() == 4.0
        raise KeyError("inside")
    assert dc.timeout() is None


def test_setters_accept_strings_like_the_environment() -> None:
    with dc.debug("yes"):  # type: ignore[arg-type]
        assert dc.debug() is True
    with dc.timeout("1.5"):
        assert dc.timeout() == 1.5
    with ACCELERATOR.set("CPU"):
        assert ACCELERATOR.get() == "cpu"
    assert ACCELERATOR.get() is None


def test_timeout_converts_ints_and_allows_none() -> None:
    with dc.timeout(3):
        assert dc.timeout() == 3.0 and isinstance(dc.timeout(), float)
        with dc.timeout(None):
            assert dc.timeout() is None
        assert dc.timeout() == 3.0


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: dc.debug(1), TypeError, "debug must be a bool, got int"),
        (lambda: dc.debug("perhaps"), ValueError, "debug='perhaps' is not a boolean; use one of 1/0"),
        (lambda: dc.timeout(0), ValueError, "timeout must be a positive number of seconds or None, got 0"),
        (lambda: dc.timeout(-1.0), ValueError, "timeout must be a positive number of seconds or None"),
        (
            lambda: dc.timeout(True),
            ValueError,
            "timeout must be a positive number of seconds or None, got True",
        ),
        (lambda: dc.timeout([1]), ValueError, r"got \[1\]"),
        (
            lambda: dc.timeout(float("nan")),
            ValueError,
            "timeout must be a positive number of seconds or None, got nan",
        ),
        (
            lambda: dc.timeout(float("inf")),  # (a LocalWorld then ended in an OverflowError)
            ValueError,
            "timeout must be a finite number of seconds or None, got inf",
        ),
        (lambda: dc.timeout("never"), ValueError, r"timeout='never' is not a number of seconds"),
        (lambda: ACCELERATOR.set("tpu"), ValueError, r"legal values: \('cpu', 'cuda', 'mps', 'xpu'\)"),
        (lambda: RANK_START.set(1), TypeError, "rank_start must be the str 'fork' or 'spawn', got int"),
        (lambda: RANK_START.set("forkserver"), ValueError, "rank_start='forkserver' is not a way to start"),
    ],
)
def test_bad_values_set_in_code_are_rejected(call: Any, error: type[Exception], match: str) -> None:
    before = dc.settings()
    with pytest.raises(error, match=match):
        call()
    assert dc.settings() == before, "a rejected value changes nothing"


def test_repr_of_restore_shows_the_current_value() -> None:
    with dc.timeout(5) as restore:
        assert repr(restore) == "<timeout=5.0>"


def test_module_docstring_lists_every_setting() -> None:
    doc = _config.__doc__ or ""
    for s in SETTINGS:
        assert f"``{s.name}``" in doc and f"``{s.env}``" in doc


@pytest.mark.parametrize(("raw", "value"), [("1024", 1024), (" 8 ", 8), ("1", 1)])
def test_flight_size_parses_counts(monkeypatch: pytest.MonkeyPatch, raw: str, value: int) -> None:
    assert _from_env(monkeypatch, FLIGHT_SIZE, raw) == value


@pytest.mark.parametrize(("raw", "match"), [("0", "must be >= 1"), ("many", "is not an integer")])
def test_flight_size_rejects_bad_values(monkeypatch: pytest.MonkeyPatch, raw: str, match: str) -> None:
    with pytest.raises(ValueError, match=rf"DIFFCOMM_FLIGHT_SIZE={raw!r} {match}"):
        _from_env(monkeypatch, FLIGHT_SIZE, raw)


def test_flight_switch_parses_booleans_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _from_env(monkeypatch, FLIGHT, "off") is False
    assert _from_env(monkeypatch, ALLOW_OVERSUBSCRIBE, "yes") is True
    monkeypatch.delenv("DIFFCOMM_FLIGHT")
    monkeypatch.delenv("DIFFCOMM_ALLOW_OVERSUBSCRIBE")
    FLIGHT.reload()
    ALLOW_OVERSUBSCRIBE.reload()
    with FLIGHT.set(False):
        assert dc.settings()["flight"] is False
    assert dc.settings()["flight"] is True
    with pytest.raises(ValueError, match="flight_size must be an int >= 1"):
        FLIGHT_SIZE.set(0)


def test_the_fast_read_agrees_with_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """``s.value if s.loaded else s.get()`` (the hot paths' read, no call once loaded) is
    ``get()`` in every state: unread, read from the environment, set, restored, reloaded."""

    def fast(s: Setting[Any]) -> Any:
        return s.value if s.loaded else s.get()

    monkeypatch.setenv(TIMEOUT.env, "7")
    TIMEOUT.reload()
    assert not TIMEOUT.loaded and fast(TIMEOUT) == 7.0 and TIMEOUT.loaded and TIMEOUT.value == 7.0
    with dc.timeout(3):
        assert fast(TIMEOUT) == TIMEOUT.get() == 3.0
    assert fast(TIMEOUT) == TIMEOUT.get() == 7.0
    monkeypatch.setenv(TIMEOUT.env, "9")
    TIMEOUT.reload()
    assert fast(TIMEOUT) == TIMEOUT.get() == 9.0
