"""The words of the arguments many public ops share are stated once (``ops.shared_args``)."""

from __future__ import annotations

import re

import pytest

import diffcomm as dc
from diffcomm.ops.shared_args import SHARED_ARGS, shared_args

#: the public ops whose docstrings take the shared words, and which they take
TAKERS = {
    "all_reduce": ["async_op"],
    "broadcast": ["async_op"],
    "reduce": ["async_op"],
    "all_gather": ["async_op", "precision"],
    "reduce_scatter": ["async_op", "precision"],
    "gather": ["async_op"],
    "scatter": ["async_op"],
    "all_to_all": ["async_op", "precision"],
    "all_reduce_coalesced": ["async_op_list"],
    "broadcast_coalesced": ["async_op_list"],
    "all_gather_coalesced": ["async_op_list"],
    "reduce_scatter_coalesced": ["async_op_list"],
}


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("name", sorted(TAKERS))
def test_public_docstrings_carry_the_shared_words(name: str) -> None:
    doc = getattr(dc, name).__doc__
    assert doc is not None and not re.search(r": \{\w+\}$", doc, re.M), doc
    for key in TAKERS[name]:
        arg = key.removesuffix("_list")
        assert _flat(f"{arg}: {SHARED_ARGS[key]}") in _flat(doc), (name, key)


def test_shared_args_fills_and_wraps_and_names_an_unknown_placeholder() -> None:
    def f() -> None:
        """Do it.

        Args:
            async_op: {async_op}
            other: its own words.
        """

    filled = shared_args(f).__doc__
    assert filled is not None and "{async_op}" not in filled
    lines = filled.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("async_op:"))
    indent = "            "  # the placeholder's (f's docstring sits in this function)
    assert lines[at].startswith(indent + "async_op: return at once"), lines[at]
    assert lines[at + 1].startswith(indent + "    ") and len(max(lines, key=len)) <= 92, lines
    assert lines[-2].strip() == "other: its own words."

    def g() -> None:
        """Args:
        x: {no_such_words}
        """

    with pytest.raises(KeyError, match="no_such_words"):
        shared_args(g)
