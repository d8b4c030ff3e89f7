"""How a function travels to a LocalWorld rank, keeping the user's file and line.

cloudpickle ships a function defined in ``__main__``, a notebook cell or a module
registered with ``cloudpickle.register_pickle_by_value`` *by value*: its code object is
rebuilt on the rank. cloudpickle 3.x renames every such code object's file to
``<dynamic-code>`` (a deterministic payload), so the flight recorder, the desync
diagnosis and the rank's traceback would say ``<dynamic-code>:14`` where the user wrote
``train.py:14``; and a notebook cell's source exists only in the caller's ``linecache``,
so even cloudpickle 2.x's tracebacks show no source line.

:func:`dumps` pickles with cloudpickle's own pickler, wrapping its reducer for code
objects: each code object shipped by value carries its real ``co_filename`` and is
rebuilt with it (nested code objects - inner functions, lambdas, comprehensions - are
code constants and go through the same reducer). For a file that is not on disk (a
notebook cell, ``<stdin>``), the caller's ``linecache`` lines travel too, and
:func:`loads` registers them in the rank's ``linecache``, so tracebacks show the line.
Functions pickled by reference (importable modules) are untouched: the rank imports them
and reads their files itself. Each rank's result comes back through the same pickler.

Tensors travel as torch pickles them, except their storages: torch pickles an untyped one
(the storage of a ``uint16`` / ``uint32`` / ``uint64``, ``float8_*``, ``complex32`` ...
tensor) in a form its own unpickler cannot read (``'UntypedStorage' has no attribute
'dtype'``) and a typed one of some dtypes not at all (``uint4``: "not recognized"), so a
storage travels as its bytes (a ``uint8`` storage, as ``torch.save`` writes an untyped one)
and, if typed, its dtype.

The caller's settings travel with the function (:func:`carried`, applied on the rank for
the run by :func:`applied`): what its code set with ``dc.debug`` and ``dc.timeout``
(:func:`diffcomm._config.carried`), the accelerator chosen with
:func:`~diffcomm.accelerator.set_accelerator` and the ``comm_off`` ablation switches.
What cannot take effect on a rank process is refused before the run starts, never
dropped; an open ``log_comms``, which records only its own thread, is warned of.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import pickle
import types
import warnings
from collections import ChainMap
from collections.abc import Iterator, Mapping
from typing import Any

import cloudpickle
import torch

from .. import _config
from .. import accelerator as _acc
from ..diagnostics import logger as _logger
from ..diagnostics import switches as _switches

__all__ = ["dumps", "loads", "carried", "applied"]

# cloudpickle 3.x exports ``Pickler``; 2.x ``CloudPickler`` (3.x keeps it as an alias)
_Base: Any = getattr(cloudpickle, "Pickler", None) or cloudpickle.CloudPickler
_REDUCE_CODE = _Base.dispatch_table[types.CodeType]


def _rebuild_code(make: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    """The rank side of :class:`_Pickler`'s code reducer: cloudpickle's own rebuild, then
    the real file name back (``replace`` leaves every other field as rebuilt)."""
    code = make(*args)
    if code.co_filename != filename:
        code = code.replace(co_filename=filename)
    return code


def _reduce_storage(storage: torch.UntypedStorage) -> Any:
    """An untyped storage as its bytes: a ``uint8`` typed storage over it, which torch
    pickles readably (its own form for an untyped one fails to load); it unpickles as a
    typed storage, what a tensor's rebuild takes and what ``torch.load`` gives back."""
    return torch.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True).__reduce__()


def _typed(data: torch.TypedStorage, dtype: torch.dtype) -> torch.TypedStorage:
    """The rank side of :func:`_reduce_typed`: the bytes ``data`` typed ``dtype`` again."""
    return torch.TypedStorage(wrap_storage=data._untyped_storage, dtype=dtype, _internal=True)


def _reduce_typed(storage: torch.TypedStorage) -> Any:
    """A typed storage (what a tensor of most dtypes pickles) as its untyped bytes and its
    dtype: torch's own form has no name for some dtypes (``uint4``: "not recognized")."""
    return _typed, (storage._untyped_storage, storage.dtype)


class _Pickler(_Base):
    """cloudpickle's pickler, with code objects keeping ``co_filename`` and untyped storages
    travelling as bytes; it records the files of the code it shipped in ``files``."""

    def __init__(self, file: Any, protocol: int | None = None) -> None:
        self.files: set[str] = set()
        # before __init__: the C pickler reads ``dispatch_table`` once, when initialised
        self.dispatch_table = ChainMap(
            {
                types.CodeType: self._reduce_code,
                torch.UntypedStorage: _reduce_storage,
                torch.TypedStorage: _reduce_typed,
            },
            _Base.dispatch_table,
        )
        super().__init__(file, protocol=protocol)

    def _reduce_code(self, code: types.CodeType) -> Any:
        make, args = _REDUCE_CODE(code)[:2]
        self.files.add(code.co_filename)
        return _rebuild_code, (make, args, code.co_filename)


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` for a rank: cloudpickle, with every by-value code object keeping its
    file name, plus the caller's source lines of files the rank cannot read."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    sources = {}
    for f in p.files:
        if not os.path.exists(f):
            lines = linecache.getlines(f)
            if lines:
                sources[f] = lines
    return pickle.dumps((sources, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` made, registering the shipped source lines in this
    process's ``linecache`` (so tracebacks show them) first."""
    sources, payload = pickle.loads(data)
    for f, lines in sources.items():
        # mtime None: linecache.checkcache() keeps the entry (it has no file to check)
        linecache.cache[f] = (sum(map(len, lines)), None, lines, f)
    return cloudpickle.loads(payload)


_ACCELERATOR = "set_accelerator"  # the carried selection's key (the settings' are their names)
_COMM_OFF = "comm_off"  # the carried ablation switches' key


def carried(collective_timeout: float | None) -> dict[str, Any]:
    """What a run carries from its caller to every rank, by name: the settings its code set
    (``dc.debug``, ``dc.timeout``), its ``set_accelerator`` choice and its ``comm_off``
    switches (an ablation timed around ``world.run`` holds on the ranks, which run the
    communications). An open ``log_comms`` is warned of: it records this thread only.

    ``collective_timeout``: the world's, for ranks that are processes; ``None`` for an
    in-process world (its ranks share this process: anything travels, and there is no
    timeout to set). What would not take effect on a rank process is refused here, before
    the run: ``dc.timeout(None)`` (the ranks' collectives always wait at most the world's
    ``collective_timeout``) and an :class:`~diffcomm.accelerator.Accelerator` object of
    the caller's own (it cannot be pickled; a kind's name travels).
    """
    values = _config.carried()
    switched = sorted(_switches.off())
    if switched:  # `with comm_off(...)` around a run: the ablation holds on every rank
        values[_COMM_OFF] = switched
    if _logger.logs():
        warnings.warn(
            "diffcomm: log_comms() is open around LocalWorld.run(): it records this thread's "
            "communications only, not the ranks'; open it inside the function the ranks run "
            "(and return what it recorded)",
            UserWarning,
            stacklevel=3,
        )
    chosen = _acc.selected()
    if chosen is not None:
        values[_ACCELERATOR] = chosen
    if collective_timeout is None:
        return values
    if "timeout" in values and values["timeout"] is None:
        raise ValueError(
            "LocalWorld.run(): dc.timeout() is None here (no collective timeout), which does not "
            "reach the ranks: their collectives always wait at most the world's collective_timeout "
            f"({collective_timeout:g} s). Set seconds for the run (`with dc.timeout(600): "
            "world.run(...)`) or for the world (`LocalWorld(..., collective_timeout=600)`)"
        )
    if chosen is not None and not isinstance(chosen, str):
        raise TypeError(
            f"LocalWorld.run(): set_accelerator() selected an accelerator object of its own "
            f"({type(chosen).__name__}), which cannot travel to the rank processes (a kind's name "
            "can: set_accelerator('cpu')). Select it inside the function the ranks run, or run "
            "in this process: LocalWorld(..., in_process=True)"
        )
    return values


@contextlib.contextmanager
def applied(values: Mapping[str, Any]) -> Iterator[None]:
    """The caller's settings ``values`` (from :func:`carried`) in force on this rank for the block."""
    settings = dict(values)
    chosen = settings.pop(_ACCELERATOR, None)
    switched = settings.pop(_COMM_OFF, ())
    with contextlib.ExitStack() as stack:
        stack.enter_context(_config.applied(settings))
        if chosen is not None:
            stack.enter_context(_acc.set_accelerator(chosen))
        if switched:
            stack.enter_context(_switches.comm_off(*switched))
        yield
