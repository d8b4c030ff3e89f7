"""The command line's op names: each family home's first literal ``__all__``, read as data."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffcomm.tools import op_names


def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> Path:
    """A package folder whose ``ops/p2p.py`` is ``source`` (the reader looks there)."""
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "p2p.py").write_text(source)
    monkeypatch.setattr(op_names, "_PACKAGE", tmp_path)
    return tmp_path / "ops" / "p2p.py"


def test_the_first_literal_list_is_read_without_importing_the_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first ``__all__`` list is the family's ops (a later ``+=`` adds tables); a
    ``]`` in a comment inside it does not end it; the home is not run (it would raise)."""
    _home(
        tmp_path,
        monkeypatch,
        '"""Mentions __all__ = [ in its docstring, not at a line start."""\n'
        "raise RuntimeError('imported')\n"
        "__all__: list[str] = [\n"
        '    "send",  # a comment with ] in it\n'
        '    "recv",\n'
        "]\n"
        '__all__ += ["OPS"]\n',
    )
    assert op_names.family_ops("p2p") == ["send", "recv"]


@pytest.mark.parametrize(
    "source",
    [
        "OPS = ['send']\n",  # no __all__
        "__all__ = ['send'] + EXTRA\n",  # not a literal list
        "__all__ = [\n    'send',\n",  # never completed
        "__all__ = ['send', 3]\n",  # not strings
    ],
)
def test_a_home_without_a_literal_list_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    path = _home(tmp_path, monkeypatch, source)
    with pytest.raises(
        RuntimeError, match="no literal `__all__ = \\[...\\]` list of the 'p2p' family's ops"
    ) as err:
        op_names.family_ops("p2p")
    assert str(path) in str(err.value)


def test_an_unknown_family_is_a_value_error_naming_the_argument() -> None:
    with pytest.raises(
        ValueError, match="family: expected one of collective, p2p, coalesced, mapping, got 'nope'"
    ):
        op_names.family_ops("nope")
