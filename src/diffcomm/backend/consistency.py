"""The cross-rank consistency encoding of debug mode: a call's fields (shape, dtype, root,
...) as one int64 vector, and the message naming what differs between the ranks' vectors.

Only the encoding lives here (no communication): the backend's ``check_consistent``
gathers the vectors (one all_gather of the widths, one of the vectors padded with
:data:`PAD`) and raises :class:`~diffcomm.CrossRankMismatchError` with :func:`mismatch`'s
message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._errors import CrossRankMismatchError

__all__ = ["NOT_GIVEN", "PAD", "check_settings", "encode", "mismatch"]

#: the value a shorter vector is padded with (no field encodes a leading -7)
PAD = -7

_WORDS = {
    "shape": "x.shape",
    "dtype": "x.dtype",
    "grad": "torch.is_grad_enabled() and x.requires_grad",
    "other_dims": "x.shape without `dim` (every dim but the one concatenated along)",
}


def _in_user_words(op: str, field: str) -> str:
    """A debug-mode field's name as the user wrote it (never an internal name)."""
    if field == "other_dims" and op.startswith("all_to_all"):
        return "x.shape without `split_dim` and `concat_dim`"
    return _WORDS.get(field, field)


def _encode_field(value: Any) -> list[int]:
    """Field value -> ints: ``[kind, len, payload...]`` (kinds: int, tuple of ints, str)."""
    if isinstance(value, bool) or isinstance(value, int):
        return [0, 1, int(value)]
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, torch.Size | tuple | list):
        vals = [int(v) for v in value]
        return [1, len(vals), *vals]
    text = str(value).encode()[:64]
    return [2, len(text), *text]


def _decode_value(row: Sequence[int], i: int) -> tuple[Any, int]:
    """The field value encoded at ``row[i]`` and the index after it."""
    kind, n = row[i], row[i + 1]
    payload = row[i + 2 : i + 2 + n]
    if kind == 0:
        value: Any = payload[0] if payload else None
    elif kind == 1:
        value = tuple(payload)
    else:
        value = bytes(v % 256 for v in payload).decode(errors="replace")
    return value, i + 2 + n


def _decode_fields(row: Sequence[int]) -> dict[str, Any]:
    """A rank's fields by name, read from its own vector (a rank may pass fields another
    does not: ``precision=`` on one rank only)."""
    out: dict[str, Any] = {}
    i = 1
    for _ in range(row[0] if row else 0):
        if i + 1 >= len(row):
            break
        name, i = _decode_value(row, i)
        if i + 1 >= len(row):
            break
        out[str(name)], i = _decode_value(row, i)
    return out


def encode(fields: Mapping[str, Any]) -> list[int]:
    """``fields`` as ints: their count, then each field's name and value, sorted by name.
    The names travel: the ranks' fields are compared by name, so a field one rank passes and
    another does not (``precision=`` on one rank) is named as that field; before, the fields
    were lined up by position, and the message read precision against the next rank's shape."""
    encoded = [_encode_field(k) + _encode_field(fields[k]) for k in sorted(fields)]  # any order
    return [len(encoded)] + [v for e in encoded for v in e]


#: a field's value on a rank that did not pass it, in :func:`mismatch`'s message
NOT_GIVEN = "not given"


def mismatch(op: str, names: Sequence[str], table: Sequence[Sequence[int]]) -> str | None:
    """The error message when the ranks' vectors (``table``, one row per group rank) differ,
    naming each field that differs with every rank's value in the user's words (``names``,
    this rank's fields, first; then any only other ranks passed); ``None`` when all agree."""
    if all(row == table[0] for row in table):
        return None
    decoded = [_decode_fields(list(row)) for row in table]
    order = list(dict.fromkeys([*names, *(k for d in decoded for k in d)]))
    diffs = []
    for k in order:
        values = [d.get(k, NOT_GIVEN) for d in decoded]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            diffs.append(f"{_in_user_words(op, k)} differs ({per_rank})")
    if not diffs:
        diffs.append("argument layout differs between ranks")
    return _message(op, diffs, len(table))


def check_settings(
    op: str, shown: Sequence[tuple[str, Callable[[int], Any]]], rows: Sequence[Sequence[int]]
) -> None:
    """Raise :class:`~diffcomm.CrossRankMismatchError` with :func:`mismatch`'s message when
    the ranks' settings differ: ``rows`` holds each group rank's settings as ints (ridden
    in an exchange the op runs anyway: ``ring_attention``'s lengths, ``dispatch``'s
    counts), in the order of ``shown``, ``(name, decode)`` (``decode(int)``: the value in
    the user's words)."""
    if all(row == rows[0] for row in rows):
        return
    diffs = [
        f"{name} differs ({', '.join(f'rank {r}: {decode(row[i])}' for r, row in enumerate(rows))})"
        for i, (name, decode) in enumerate(shown)
        if any(row[i] != rows[0][i] for row in rows)
    ]
    raise CrossRankMismatchError(_message(op, diffs, len(rows)))


def _message(op: str, diffs: Sequence[str], world: int) -> str:
    return (
        f"diffcomm.{op}(): ranks called it with inconsistent arguments (group ranks "
        f"{list(range(world))}): " + "; ".join(diffs)
    )
