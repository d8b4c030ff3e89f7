"""The words for the arguments many public ops share, stated once.

A public op's docstring names such an argument with a placeholder for its words,
``async_op: {async_op}``, and the function is decorated with :func:`shared_args`, which
writes the words in (wrapped under the argument, at import: ``help()``, the docs and
``__doc__`` read the full text; nothing runs per call). A change to what ``async_op=True``
means is then made here, once, not in a dozen docstrings.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SHARED_ARGS", "shared_args"]

#: placeholder name -> the words a docstring's ``<arg>: {<placeholder>}`` line stands for
SHARED_ARGS: dict[str, str] = {
    "async_op": (
        "return at once an :class:`~diffcomm.AsyncTensor` that waits for the communication "
        "on first use (``.wait()`` returns the finished tensor); values and gradients equal "
        "the blocking op's, and the backward is asynchronous too (``docs/async.md``)."
    ),
    "async_op_list": (
        "return at once a list of :class:`~diffcomm.AsyncTensor` that wait for the one "
        "communication on first use; values and gradients equal the blocking op's, and the "
        "backward is asynchronous too (``docs/async.md``)."
    ),
    "precision": (
        "a :class:`~diffcomm.Precision` (wire dtype, accumulation dtype, fp8 block size, "
        "backward settings): quantize, communicate, dequantize; the backward is the adjoint "
        "in the backward settings (``docs/precision.md``)."
    ),
}

_PLACEHOLDER = re.compile(r"^( *)(\w+): \{(\w+)\}$", re.M)
_F = TypeVar("_F", bound=Callable[..., object])


def _words(match: re.Match[str]) -> str:
    indent, arg, key = match.groups()
    if key not in SHARED_ARGS:
        raise KeyError(f"diffcomm: no shared words {key!r} for argument {arg!r} (see SHARED_ARGS)")
    return textwrap.fill(
        SHARED_ARGS[key],
        width=92,
        initial_indent=f"{indent}{arg}: ",
        subsequent_indent=indent + "    ",
        break_on_hyphens=False,
    )


def shared_args(fn: _F) -> _F:
    """Write the shared words into ``fn``'s docstring (its ``<arg>: {<name>}`` lines);
    returns ``fn`` itself. An unknown name is a ``KeyError`` at import."""
    if fn.__doc__:
        fn.__doc__ = _PLACEHOLDER.sub(_words, fn.__doc__)
    return fn
