"""Settings: read once from the environment, validated with the legal values in the message,
settable, and restored by a ``with`` block."""

from __future__ import annotations

import datetime
import re
import warnings
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
    saved = [dict(vars(s)) for s in SETTINGS]  # value, loaded, in_code
    for s in SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
        s.reload()
    yield
    for s, state in zip(SETTINGS, saved):
        vars(s).update(state)


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


def test_timeout_takes_a_timedelta_as_seconds() -> None:
    """``init_process_group`` takes a ``datetime.timedelta``; ``dc.timeout`` refused one."""
    with dc.timeout(datetime.timedelta(seconds=2.5)):
        assert dc.timeout() == 2.5 and isinstance(dc.timeout(), float)
    assert dc.timeout() is None
    for bad in (datetime.timedelta(0), datetime.timedelta(seconds=-1)):
        with pytest.raises(ValueError, match=re.escape(f"positive number of seconds or None, got {bad!r}")):
            dc.timeout(bad)
    assert dc.timeout() is None


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


# ------------------------------------------------------ the environment, checked at a start


@pytest.mark.parametrize(
    ("env", "raw", "match"),
    [
        # read on a rank only at its first op (a RankError then), or by nothing at all on
        # gloo ranks (the accelerator): before, silently ignored
        ("DIFFCOMM_ACCELERATOR", "tpu", r"DIFFCOMM_ACCELERATOR='tpu' is not a known accelerator"),
        ("DIFFCOMM_FLIGHT", "maybe", r"DIFFCOMM_FLIGHT='maybe' is not a boolean"),
        ("DIFFCOMM_FLIGHT_SIZE", "abc", r"DIFFCOMM_FLIGHT_SIZE='abc' is not an integer"),
        ("DIFFCOMM_RANK_START", "thread", r"DIFFCOMM_RANK_START='thread' is not a way to start a rank"),
    ],
)
@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "processes"])
def test_a_malformed_variable_is_refused_when_a_world_starts(
    monkeypatch: pytest.MonkeyPatch, env: str, raw: str, match: str, in_process: bool
) -> None:
    """Every ``DIFFCOMM_*`` setting is parsed when a ``LocalWorld`` starts, before any rank:
    a malformed one is a ValueError naming it, also one that nothing reads there."""
    monkeypatch.setenv(env, raw)
    with pytest.raises(ValueError, match=match):
        dc.LocalWorld(2, in_process=in_process)


def test_an_unknown_diffcomm_variable_is_warned_of_naming_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A misspelled ``DIFFCOMM_TIMOUT=5`` changed nothing, silently; now a world's start
    warns of it (once per process), naming ``DIFFCOMM_TIMEOUT``; a name like no setting is
    warned of without a guess; diffcomm's own ``DIFFCOMM_FAULT_DIR`` is no mistake."""
    monkeypatch.setattr(_config, "_WARNED", set())
    monkeypatch.setenv("DIFFCOMM_TIMOUT", "5")
    monkeypatch.setenv("DIFFCOMM_COLOUR", "1")
    monkeypatch.setenv("DIFFCOMM_FAULT_DIR", "/tmp")
    with pytest.warns(UserWarning) as record:
        dc.LocalWorld(2, in_process=True).close()
    said = sorted(str(w.message) for w in record if "no diffcomm setting" in str(w.message))
    assert len(said) == 2, said
    assert said[0].startswith(
        "diffcomm: the environment variable DIFFCOMM_COLOUR is no diffcomm setting and is ignored ("
    )
    assert said[1].startswith(
        "diffcomm: the environment variable DIFFCOMM_TIMOUT is no diffcomm setting and is ignored; "
        "did you mean DIFFCOMM_TIMEOUT?"
    )
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dc.LocalWorld(2, in_process=True).close()  # once per process


def test_a_setting_set_in_code_is_carried_also_where_it_equals_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``with dc.timeout(60)`` under ``DIFFCOMM_TIMEOUT=60`` travels to the ranks, whose
    ``DIFFCOMM_TIMEOUT`` is the world's ``collective_timeout`` (before: nothing travelled,
    and the ranks silently kept the world's); the ``with`` block's end takes it back."""
    monkeypatch.setenv(TIMEOUT.env, "60")
    TIMEOUT.reload()
    assert _config.carried() == {}
    with dc.timeout(60):
        assert _config.carried() == {"timeout": 60.0}
        with dc.debug(False):
            assert _config.carried() == {"timeout": 60.0, "debug": False}
        assert _config.carried() == {"timeout": 60.0}
    assert _config.carried() == {}
