"""Asynchronous communication: one communication engine per process, and a tensor that
waits for its communication on first use.

**The engine.** A daemon thread runs communication jobs **one at a time, in the order
they were launched** (a FIFO queue). Every raw op a job runs goes through the backend's
one entry point as usual (comms logger, comm-off switches, flight recorder, the
``DIFFCOMM_TIMEOUT`` diagnosis), with the launching thread's labels, logs and switches.
While jobs are queued or running, a *blocking* diffcomm op issued by another thread is
queued behind them (the backend's entry point asks :func:`_order_hook`), so the
order in which a process issues communication to the backend is always its program
order, whatever mixes of blocking and asynchronous ops it uses. That is the first of the
ordering rules in ``docs/async.md``:

1. *Launch order is program order, and it must be the same on every rank* (the SPMD
   rule, as for blocking ops). The engine never reorders.
2. *Wait order is free.* Waiting (or first use) never issues communication, so ranks may
   consume results in different orders.
3. *Do not wait inside the engine* (a job that waits for a later job deadlocks the
   process); diffcomm's own jobs never do.

**The tensor.** :class:`AsyncTensor` is a wrapper tensor subclass with the shape, dtype
and device of the result. It holds the job's :class:`Handle`; under
``__torch_dispatch__`` every operation on it first waits for the job, then runs on the
finished tensor (so a result can never be read early). ``.wait()`` returns the finished
tensor (still connected to autograd). :func:`launch` is the differentiable bridge: a
``torch.autograd.Function`` whose forward launches the raw op and returns an
:class:`AsyncTensor`, and whose backward calls a given differentiable function of the
gradient — the asynchronous dual — so the dual is launched as soon as autograd reaches
the node and its result is again an :class:`AsyncTensor`, waited where the gradient is
consumed.

Dependencies import downward: this module sits above the backend and below the
collectives.
"""

from __future__ import annotations

# Size: ~860 lines, over the ~600 guideline: the engine, the tensor that waits and the
# differentiable bridge share one protocol (a job's handle, its result's versions, the
# copies of the inputs a job reads, the in-place checks of what a backward reads); split, each part
# would reach into the others' privates.
import contextlib
import contextvars
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _config, _lifecycle, _torch
from .. import backend as B
from .._replication import spmd_types_checking
from .._torch import tree_map_only
from ..accelerator import get_accelerator
from ..backend.in_process import current_hub

__all__ = [
    "AsyncTensor",
    "Handle",
    "launch",
    "submit",
    "wait",
    "wait_all",
    "available",
    "engine_busy",
    "async_if",
]


# ======================================================================================
# handles and the engine
# ======================================================================================


class Handle:
    """One launched job: ``done()``, ``wait()`` (its result, or its exception re-raised).

    ``versions``: the ``_version`` of the result (a tuple of them for a tuple result) as
    the job left it — what an in-place modification of the result is measured against."""

    __slots__ = ("_event", "_result", "_error", "name", "versions", "_lock", "_copies", "_copied")

    def __init__(self, name: str) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.name = name
        self.versions: Any = None
        self._lock = threading.Lock()
        # copies of the result asked for by later jobs launched while this one was pending
        # (see :func:`_snapshot`): ``(index or None, box)``, filled by :meth:`_copy_result`
        self._copies: list[tuple[int | None, list[Any]]] = []
        self._copied = False

    def _copy_result(self) -> None:
        """Fill the copies later jobs asked for, before anyone can be handed the result
        (called by the job's thread once the result exists, before the event is set)."""
        with self._lock:
            for i, box in self._copies:
                r = self._result if i is None else self._result[i]
                box.append(r.detach().clone())
            self._copies.clear()
            self._copied = True

    def _ask_copy(self, i: int | None) -> list[Any] | None:
        """A box that will hold a copy of the result (of element ``i``) as the job leaves
        it; ``None`` when the result exists already (or the job failed): copy it now."""
        with self._lock:
            if self._copied or self._event.is_set():
                return None
            box: list[Any] = []
            self._copies.append((i, box))
            return box

    def done(self) -> bool:
        """Whether the job has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self) -> Any:
        """Block until the job finished; return its result or re-raise its error."""
        if _ENGINE.on_engine_thread() and not self._event.is_set():
            raise RuntimeError(
                f"diffcomm: the communication engine waited for {self.name!r}, which runs after the "
                "current job (a job must never wait for a later one: it would deadlock the process)"
            )
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        return f"Handle({self.name!r}, done={self.done()})"


_NO_STREAM = contextlib.nullcontext()


class _Engine:
    """The process's communication thread: runs jobs one at a time in launch order."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Handle, Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self.pending = 0  # jobs queued or running

    def on_engine_thread(self) -> bool:
        return self._ident is not None and threading.get_ident() == self._ident

    def submit(self, fn: Callable[[], Any], name: str) -> Handle:
        """Queue ``fn`` (run with the caller's diffcomm labels, logs and switches). On an
        in-process rank it runs at once on the caller's thread (the ranks take turns:
        nothing to overlap): the handle is done, the result the same AsyncTensor."""
        handle = Handle(name)
        if current_hub() is not None:
            was, _MODE.on = getattr(_MODE, "on", False), False  # (a job's ops never launch)
            try:
                with torch.no_grad():
                    handle._result = fn()
                handle.versions = _versions_of(handle._result)
                handle._copy_result()
            except BaseException as err:  # re-raised by Handle.wait, as on the engine
                handle._error = err
            finally:
                _MODE.on = was
            handle._event.set()
            return handle
        # the job runs on this thread's device and stream: its work is queued after
        # what this thread queued before the launch (a side stream included), and
        # "the current device" means the same in the job
        acc = get_accelerator()
        stream = acc.started_stream()
        # (and under the caller's inference mode: a job writes into tensors the caller made,
        # which are inference tensors inside torch.inference_mode, writable only there)
        inference = torch.is_inference_mode_enabled()
        on = acc if stream is not None else None
        state = (contextvars.copy_context(), B.comm_state(), on, stream, inference)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="diffcomm-comm", daemon=True)
                self._thread.start()
                self._ident = self._thread.ident
            self.pending += 1
        self._q.put((fn, handle, state))
        return handle

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        while True:
            item = self._q.get()
            if item is None:  # stop(): everything queued before it has run
                return
            fn, handle, (ctx, comm, acc, stream, inference) = item
            B.adopt_comm_state(comm)
            try:
                with (
                    torch.inference_mode(inference),
                    torch.no_grad(),
                    acc.stream_context(stream) if acc is not None else _NO_STREAM,
                ):
                    handle._result = ctx.run(fn)
                    handle.versions = _versions_of(handle._result)
                    handle._copy_result()  # (on the job's stream)
            except BaseException as err:  # re-raised by Handle.wait on the caller
                handle._error = err
            finally:
                B.adopt_comm_state(None)
                del fn, item, ctx, stream
                with self._lock:
                    self.pending -= 1
                handle._event.set()

    def call(self, fn: Callable[[], Any], name: str) -> Any:
        """Run ``fn`` on the engine after everything queued, and wait for it."""
        return self.submit(fn, name).wait()

    def stop(self, timeout: float) -> None:
        """Let the queued jobs finish, then end the thread and join it (a later
        :meth:`submit` starts a new one). ``timeout`` bounds the join: a job blocked in a
        communication ends within the group's timeout."""
        with self._lock:
            thread = self._thread
            if thread is None or not thread.is_alive() or self.on_engine_thread():
                return
            self._q.put(None)
        thread.join(timeout)


_ENGINE = _Engine()


def _ver(t: Tensor) -> int:
    """``t._version``; 0 for an inference tensor (``torch.inference_mode``), which has no
    version counter to read (torch tracks no in-place change of it either)."""
    return 0 if t.is_inference() else t._version


def _versions_of(result: Any) -> Any:
    """``Handle.versions`` of a job's result."""
    if isinstance(result, Tensor):
        return _ver(result)
    if isinstance(result, (tuple, list)):
        return tuple(_ver(r) if isinstance(r, Tensor) else None for r in result)
    return None


def submit(fn: Callable[[], Any], name: str = "job") -> Handle:
    """Launch ``fn`` on the communication engine (after every job launched before it)."""
    return _ENGINE.submit(fn, name)


def engine_busy() -> bool:
    """Whether jobs are queued or running."""
    return _ENGINE.pending > 0


def wait_all() -> None:
    """Block until every job launched so far has finished (errors stay with their handles)."""
    if _ENGINE.pending and not _ENGINE.on_engine_thread():
        _ENGINE.submit(lambda: None, "wait_all")._event.wait()


def _order_hook() -> bool:
    """Asked by the backend before every raw op: must it run on the engine (queued behind
    the pending jobs) to keep this process's communication in program order?"""
    return _ENGINE.pending > 0 and not _ENGINE.on_engine_thread()


B.set_order_hook(_order_hook, _ENGINE.call, _ENGINE)


def _stop(group: Any, exiting: bool) -> None:
    # the engine serves every group of the process: any group's end drains it
    _ENGINE.stop((_config.TIMEOUT.get() or 30.0) + 2.0)


_lifecycle.on_destroy("async engine", _stop)
# A LocalWorld rank's function that returned with an asynchronous op still pending: the
# rank waits for it before reporting, so an op the other ranks never launched is a desync
# of this run, named as such (it returned "ok", and the op paired with a peer's first op
# of the next run: a wrong value there and a diagnosis that blamed the next run).
_lifecycle.on_program_end("async engine", wait_all)
_FUNCTION_ATTRS = torch.autograd.Function.__dict__  # (see _replication.spmd_types_checking)


def available() -> bool:
    """Whether ``async_op=True`` can return an :class:`AsyncTensor` here.

    Not while ``torch.compile`` traces or a ``torch.func`` transform / forward-mode AD
    level is active: those see through tensors to their values, so there the asynchronous
    ops run blocking and return plain tensors (same values and gradients). Nor while
    spmd_types' checker is active (it types each op as it is applied).
    """
    return not (
        _torch.compiling()
        or _torch.transforms_active()
        or _torch.forward_ad_level() >= 0
        or spmd_types_checking(_FUNCTION_ATTRS)
    )


# ======================================================================================
# the tensor that waits on first use
# ======================================================================================


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


class AsyncTensor(Tensor):
    """The result of an asynchronous op: waits for its communication on first use.

    It has the shape, dtype and device of the finished tensor, which is contiguous, so it
    can be passed around (and into other asynchronous ops) without waiting. Any operation on it — arithmetic,
    indexing, printing, ``.tolist()`` / ``.item()`` / ``.numpy()``, autograd using it —
    first waits for the communication (``__torch_dispatch__``) and then runs on the
    finished tensor; its results are plain tensors.

    ``wait()`` returns the finished tensor (connected to autograd like the async tensor
    was); ``done()`` says whether the communication has completed.
    """

    _handle: Handle
    _elem: Tensor | None

    @staticmethod
    def __new__(cls, handle: Handle, shape: Any, dtype: torch.dtype, device: torch.device) -> AsyncTensor:
        shape = tuple(int(s) for s in shape)
        r = Tensor._make_wrapper_subclass(
            cls, shape, strides=_contiguous_strides(shape), dtype=dtype, device=device, requires_grad=False
        )
        r._handle = handle
        r._elem = None
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    __torch_function__ = _torch.disabled_torch_function_impl

    def _finished(self) -> Tensor:
        if self._elem is None:
            spans = B.current_spans()
            if spans is not None and not self._handle.done():  # the timeline shows the wait
                t0 = time.perf_counter()
                self._handle._event.wait()
                who = threading.current_thread().name
                spans.append(("wait", self._handle.name, who, t0, time.perf_counter()))
            elem = self._handle.wait()
            if not isinstance(elem, Tensor) or tuple(elem.shape) != tuple(self.shape):
                raise RuntimeError(
                    f"diffcomm: asynchronous {self._handle.name} produced "
                    f"{getattr(elem, 'shape', type(elem))}, expected shape {tuple(self.shape)} "
                    "(an internal error; please report it)"
                )
            self._elem = elem
        return self._elem

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any, expected_type: Any = Tensor) -> Any:
        """The finished tensor, where a compiled backward expects a plain tensor.

        An asynchronous op's backward returns its gradient as an ``AsyncTensor``; when
        that gradient flows into the backward of a ``torch.compile``'d graph (the op ran
        eagerly between compiled graphs), AOTAutograd asks the tangent to become the plain
        tensor it traced with, and without this it raised "we guessed its metadata
        incorrectly" (``test_an_asynchronous_gradient_flows_into_a_compiled_backward``)."""
        return self.wait() if expected_type is Tensor else None  # (wait keeps its autograd history)

    def done(self) -> bool:
        """Whether the communication has completed (never blocks)."""
        return self._elem is not None or self._handle.done()

    def _born(self) -> int:
        """The finished tensor's ``_version`` as its job left it (the job has run)."""
        return int(self._handle.versions)

    def wait(self) -> Tensor:
        """Block until the communication finished; return the finished (plain) tensor.

        The returned tensor carries this tensor's autograd history: gradients flow through
        it exactly as through the asynchronous tensor. It shares this tensor's version
        counter (``detach()`` of it: an alias, as the blocking op's result is one tensor),
        so a change in place through either is refused by a backward that saved the other
        (the finished tensor's own counter stayed unmoved by a change through the tensor
        returned here: ``z = y * y; y.wait().add_(1)`` backpropagated the changed values
        where the blocking op raises autograd's in-place error).
        """
        self._finished()
        if self.requires_grad and torch.is_grad_enabled():
            return _Wait.apply(self)
        return self.detach()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub declares it an instance method
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if torch.Tag.inplace_view in func.tags and args and isinstance(args[0], AsyncTensor):
            # (t_, unsqueeze_, transpose_, resize_ ...: the wrapper's shape was fixed at the
            # launch; changed underneath it, .shape and autograd would read the old one)
            raise RuntimeError(
                f"diffcomm: {func.__name__.split('.')[0]}() changes the shape of the asynchronous "
                f"{args[0]._handle.name} result in place, which an AsyncTensor cannot follow; use the "
                f"out-of-place form ({func.__name__.split('.')[0].rstrip('_')}()), or call .wait() "
                "first and change the tensor it returns"
            )
        args, kwargs = tree_map_only(AsyncTensor, AsyncTensor._finished, (args, kwargs or {}))
        return func(*args, **kwargs)

    # Methods that return no tensor never reach ``__torch_dispatch__`` (torch refuses them for
    # a subclass, formats the wrapper, or reads the wrapper's missing storage): they wait
    # here. ``np.asarray`` calls ``numpy()``.
    def tolist(self) -> Any:
        return self._finished().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if self.requires_grad and not force:  # as for a plain tensor
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        return self._finished().numpy(force=force)

    def data_ptr(self) -> int:  # the wrapper has no storage (its own pointer reads 0)
        return self._finished().data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._finished().untyped_storage()

    # The DLPack protocol (``np.from_dlpack``, ``torch.from_dlpack``, jax, cupy) exported
    # the wrapper, which has no storage: numpy read whatever lay at its pointer (values like
    # 4.7e-310 instead of 3.0), torch refused it as unallocated. Export the finished tensor.
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._finished().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._finished().__dlpack_device__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        """A plain copy of the finished tensor (as pickling gives); torch's own raised for a
        wrapper subclass. As for a plain tensor, only a leaf can be deep-copied."""
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                "protocol at the moment.  If you were attempting to deepcopy a module, this may be "
                "because of a torch.nn.utils.weight_norm usage, see "
                "https://github.com/pytorch/pytorch/pull/103001"
            )
        out = self._finished().detach().clone().requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:  # a plain 0-dim tensor formats its value
            return self._finished().__format__(format_spec)
        return super().__format__(format_spec)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"AsyncTensor({self._finished()!r}, {self._handle.name})"

    def __reduce_ex__(self, proto: Any) -> Any:  # pickling (e.g. returned from a rank) waits
        return self.wait().detach().__reduce_ex__(proto)


class _Wait(torch.autograd.Function):
    """``AsyncTensor.wait()`` under autograd: the finished tensor, identity backward."""

    @staticmethod
    def forward(ctx: Any, a: AsyncTensor) -> Tensor:
        return a.detach()  # (the finished tensor; see AsyncTensor.wait)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


def wait(x: Any) -> Any:
    """``x.wait()`` for an :class:`AsyncTensor`; any other value is returned as is.

    (Portable code calls this: where an asynchronous op had to run blocking — under
    ``torch.compile`` or a ``torch.func`` transform — its result is a plain tensor.)
    """
    return x.wait() if isinstance(x, AsyncTensor) else x


# ======================================================================================
# the differentiable bridge
# ======================================================================================


def _plain(t: Tensor) -> Tensor:
    """A tensor argument as a job sees it: an earlier async result is finished by now
    (jobs run in launch order), so this never blocks on the engine thread."""
    return t._finished() if isinstance(t, AsyncTensor) else t


def _stamp(t: Tensor) -> tuple[int, int | None]:
    """``t``'s version now and, for an :class:`AsyncTensor` already waited for, its finished
    tensor's (``None``: not handed out yet, so still as its job leaves it). Both count: an
    in-place op on the AsyncTensor bumps the wrapper's version, one on what ``.wait()``
    returned the finished tensor's."""
    if isinstance(t, AsyncTensor):
        return _ver(t), (_ver(t._elem) if t._elem is not None else None)
    return _ver(t), None


def _changed(t: Tensor, stamp: tuple[int, int | None]) -> tuple[int, int] | None:
    """``(expected, now)`` of the first version of ``t`` that moved since ``stamp``, or
    ``None`` (``t``'s job, if it is an AsyncTensor, has run: called in a later job or in
    backward)."""
    version, inner = stamp
    if _ver(t) != version:
        return version, _ver(t)
    if isinstance(t, AsyncTensor):
        expected = t._born() if inner is None else inner
        now = _ver(t._finished())
        if now != expected:
            return expected, now
    return None


def _snapshot(t: Tensor) -> Callable[[], Tensor]:
    """The value ``t`` has now, for a job that reads it later: the job sends what the
    blocking op would have sent at the launch, whatever the caller does to ``t`` meanwhile.

    A plain tensor is copied now. An earlier op's :class:`AsyncTensor` still pending is
    copied by its own job as it finishes, before anyone can be handed (and change) the
    finished tensor; one already finished is copied now. (Reading the input when the job
    ran, as before, sent a value that depended on timing: a rank that changed its input
    before its job ran skipped the op, and its peers paired their op with its next one —
    an all_reduce returned 2 + 10 instead of 2 + 1 —, and a change while the job ran
    reached the peers' results, e.g. -6 instead of 2 from a reduce_scatter.)"""
    if isinstance(t, AsyncTensor) and t._elem is None:
        h = t._handle
        handle, i = (h.handle, h.i) if isinstance(h, _Part) else (h, None)
        box = handle._ask_copy(i)
        if box is not None:
            return lambda: box[0] if box else t._finished()  # (empty: the job failed; re-raised)
        if handle._error is not None:
            return t._finished  # (re-raised where the later job runs, as before)
    copy = _plain(t).detach().clone()
    return lambda: copy


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        name: str,
        raw: Callable[[Tensor], Tensor],
        meta: tuple[tuple[int, ...], torch.dtype, torch.device],
        backward: Callable[[Tensor], Tensor] | None,
        private: bool,
    ) -> Tensor:
        ctx.backward_fn = backward
        ctx.x_meta = (tuple(x.shape), x.dtype)
        return AsyncTensor(_submit_read(x, name, raw, private), *meta)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        if ctx.backward_fn is None:
            raise RuntimeError("diffcomm: this asynchronous op has no backward")
        return ctx.backward_fn(g), None, None, None, None, None


def _contiguous(t: Any) -> Any:
    """A job's result as its :class:`AsyncTensor` describes it: contiguous (the wrapper's
    strides are fixed at the launch, before the result exists; an op may return a view,
    e.g. ``all_gather`` along dim 1), so ``stride()`` / ``is_contiguous()`` read before and
    after the wait agree, and ``view`` works on what the wrapper calls contiguous."""
    return t.contiguous() if isinstance(t, Tensor) and not t.is_contiguous() else t


def _reader(x: Tensor, private: bool) -> Callable[[], Tensor]:
    """What a job calls to read its input ``x``: ``x`` as it is now (:func:`_snapshot`), or,
    ``private`` (``x`` is diffcomm's own and nothing changes it before the job ran), ``x``
    itself, read in place."""
    return (lambda: _plain(x)) if private else _snapshot(x)


def _submit_read(x: Tensor, name: str, raw: Callable[[Tensor], Tensor], private: bool) -> Handle:
    """Submit ``raw`` of ``x`` as it is now (see :func:`_reader`)."""
    read = _reader(x, private)

    def job() -> Tensor:
        return _contiguous(raw(read().detach()))

    return _ENGINE.submit(job, name)


def launch(
    x: Tensor,
    name: str,
    raw: Callable[[Tensor], Tensor],
    shape: Any,
    backward: Callable[[Tensor], Tensor] | None = None,
    dtype: torch.dtype | None = None,
    private: bool = False,
) -> AsyncTensor:
    """Launch ``raw(x)`` on the engine and return its :class:`AsyncTensor` at once.

    Args:
        x: the input (a plain tensor or an earlier op's :class:`AsyncTensor`).
        name: the op, for messages (``"all_reduce(sum)"``).
        raw: non-differentiable function run on the engine thread, under ``no_grad``,
            with the finished ``x``; returns a new tensor of ``shape``.
        shape: the result's shape (known before the communication runs).
        backward: differentiable function of the output gradient returning the input
            gradient — the asynchronous dual, e.g. ``lambda g: all_reduce(g, async_op=True)``.
            ``None``: no gradient flows (``x`` must not require grad).
        dtype: the result's dtype (default ``x.dtype``).
        private: ``x`` is diffcomm's own and is not changed before the job ran (a ring
            hop the caller waits for, a gradient computed for the launch): the job reads
            it in place. Otherwise it reads a copy made at the launch (:func:`_snapshot`).

    Returns:
        An :class:`AsyncTensor`; with ``backward`` and ``x.requires_grad`` it is part of
        the autograd graph.
    """
    meta = (tuple(int(s) for s in shape), dtype or x.dtype, x.device)
    if backward is None or not (x.requires_grad and torch.is_grad_enabled()):
        return AsyncTensor(_submit_read(x, name, raw, private), *meta)
    return _Launch.apply(x, name, raw, meta, backward, private)


# ======================================================================================
# asynchronous autograd Functions: ``async_op=True`` of the collectives
# ======================================================================================

_MODE = threading.local()
#: How many threads are inside an :class:`async_mode` block now: while it is 0 (always,
#: in code that never asks for ``async_op=True``) the ops skip :func:`launching`.
ACTIVE = [0]
_ACTIVE_LOCK = threading.Lock()


class async_mode:  # used like a function
    """Within the block, applying a registered Function launches it asynchronously.

    The public ops wrap their ``apply`` in it when ``async_op=True``; an asynchronous
    op's backward runs its Function's own backward rule inside it, so the dual op the
    rule applies is launched asynchronously too (thread-local: the engine thread's jobs
    never launch).
    """

    __slots__ = ("old",)

    def __enter__(self) -> None:
        self.old = getattr(_MODE, "on", False)
        _MODE.on = True
        with _ACTIVE_LOCK:
            ACTIVE[0] += 1

    def __exit__(self, *exc: object) -> None:
        _MODE.on = self.old
        with _ACTIVE_LOCK:
            ACTIVE[0] -= 1


_NO_ASYNC = contextlib.nullcontext()


def async_if(async_op: bool) -> Any:
    """``with`` block around a public op's ``apply``: with ``async_op=True`` the op's
    Function is launched on the communication engine, where that is possible (not under
    ``torch.func`` / ``torch.compile``: then it runs blocking)."""
    return async_mode() if async_op and available() else _NO_ASYNC


def launching(cls: type) -> bool:
    """Whether ``cls.apply`` should launch asynchronously now (see :class:`async_mode`):
    the op states its ``out_shape`` (the registry's :func:`~diffcomm.ops.registry.verify`
    requires it of every op of an asynchronous family)."""
    return getattr(_MODE, "on", False) and getattr(cls, "out_shape", None) is not None and available()


class _Part:
    """Element ``i`` of a job returning a tuple (a coalesced op's outputs)."""

    __slots__ = ("handle", "i", "name")

    def __init__(self, handle: Handle, i: int) -> None:
        self.handle, self.i, self.name = handle, i, handle.name

    @property
    def _event(self) -> threading.Event:
        return self.handle._event

    def done(self) -> bool:
        return self.handle.done()

    def wait(self) -> Any:
        return self.handle.wait()[self.i]

    @property
    def versions(self) -> Any:
        return self.handle.versions[self.i]


def _inplace_error(what: str, name: str, versions: tuple[int, int]) -> RuntimeError:
    return RuntimeError(
        f"diffcomm: one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} of asynchronous {name} is at version {versions[1]}; expected "
        f"version {versions[0]} instead (its backward reads it: do not modify it in place before "
        "backward, or modify a clone)"
    )


class _Ctx:
    """The autograd context a Function's ``setup_context`` / ``backward`` see when an
    asynchronous op replays them (plain attributes; saved tensors kept as given)."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[Any, ...] = ()
        self.materialize_grads = True

    def save_for_backward(self, *ts: Any) -> None:
        self.saved_tensors = ts

    def save_for_forward(self, *ts: Any) -> None:
        pass

    def mark_non_differentiable(self, *ts: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


class _LaunchFn(torch.autograd.Function):
    """``cls.apply(*args)`` asynchronously: forward launches ``cls.forward(*args)`` on the
    engine and returns :class:`AsyncTensor` outputs; backward replays ``cls``'s
    ``setup_context`` and ``backward`` on a :class:`_Ctx` inside :class:`async_mode`."""

    @staticmethod
    def forward(
        ctx: Any,
        cls: type[torch.autograd.Function],
        args: tuple[Any, ...],
        pos: tuple[int, ...],
        *tensors: Tensor,
    ) -> Any:
        shapes = cls.shapes_for(args)  # type: ignore[attr-defined]  # the op's out_shape
        multi = isinstance(shapes, list)
        name = getattr(cls, "name", "") or cls.__name__.lstrip("_")
        # the inputs as they are now (the job runs later), also in an asynchronous op's
        # backward: the gradient autograd hands its dual may be the caller's own tensor
        # (``grad_outputs=v``, one a tensor hook kept), changed before the job ran (read in
        # place, ``grad(y, x, v); v.fill_(100)`` sent 100s: x's gradient 102 or 200 for 3)
        reads = [_snapshot(a) if isinstance(a, Tensor) else None for a in args]

        def job() -> Any:
            plain = tuple(a if r is None else r().detach() for a, r in zip(args, reads, strict=True))
            out = cls.forward(*plain)
            return tuple(_contiguous(o) for o in out) if multi else _contiguous(out)

        handle = _ENGINE.submit(job, name)
        first = tensors[0]
        if multi:
            dtypes = [t.dtype for t in tensors]
            outs: Any = tuple(
                AsyncTensor(_Part(handle, i), s, dtypes[i], first.device) for i, s in enumerate(shapes)
            )
        else:
            outs = AsyncTensor(handle, shapes, first.dtype, first.device)
        ctx.cls, ctx.args, ctx.pos, ctx.handle, ctx.name = cls, args, pos, handle, name
        if multi:
            nondiff = [o for o in outs if not (o.dtype.is_floating_point or o.dtype.is_complex)]
            if nondiff:
                ctx.mark_non_differentiable(*nondiff)
        if not isinstance(ctx, _NoCtx):
            _save_what_backward_reads(ctx, cls, args, outs)
        return outs

    @staticmethod
    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        cls, args, pos = ctx.cls, ctx.args, ctx.pos
        outs = ctx.handle.wait()  # finished long ago: backward runs after the forward's use
        _check_what_backward_reads(ctx, outs)
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        c = _Ctx(needs)
        cls.setup_context(c, args, outs)
        with async_mode():
            grads = cls.backward(c, *gs)
        if not isinstance(grads, tuple):
            grads = (grads,)
        return (None, None, None, *(grads[i] for i in pos))


def _save_what_backward_reads(ctx: Any, cls: Any, args: tuple[Any, ...], outs: Any) -> None:
    """Save on ``ctx`` the inputs and outputs ``cls``'s backward rule reads (what its
    ``setup_context`` saves: max / min / product keep both), so that autograd's saved-tensor
    check refuses them modified in place, as for the blocking op. Backward replays the
    rule on the finished tensors, which autograd does not see: :func:`_check_what_backward_reads`
    checks those against the versions their jobs left (``Handle.versions``) or, for an
    input already waited for, noted here."""
    probe = _Ctx(tuple(isinstance(a, Tensor) and a.requires_grad for a in args))
    cls.setup_context(probe, args, outs)  # (reads no values of outs: only their shapes)
    read = probe.saved_tensors
    outs = outs if isinstance(outs, tuple) else (outs,)
    ctx.outs_read = tuple(i for i, o in enumerate(outs) if any(t is o for t in read))
    # each output's version counter (shared by what ``.wait()`` returns and its views),
    # read again in backward: under saved-tensor hooks autograd checks no versions
    ctx.outs_watched = tuple((i, weakref.ref(outs[i]), _ver(outs[i])) for i in ctx.outs_read)
    # (every input read, plain ones too: under saved-tensor hooks autograd checks no
    # versions, and the rule is replayed on the inputs themselves, not the hook's copies)
    ctx.args_read = tuple(
        (i, _stamp(a)) for i, a in enumerate(args) if isinstance(a, Tensor) and any(t is a for t in read)
    )
    kept = tuple(t for t in read if any(t is o for o in (*outs, *args)))
    ctx.saved_some = bool(kept)  # (else nothing to check: a linear op may backward twice)
    if kept:
        ctx.save_for_backward(*kept)


def _check_what_backward_reads(ctx: Any, outs: Any) -> None:
    """Refuse, as autograd does for a blocking op, a backward whose rule would read an input or
    output modified in place since the forward: through the tensors themselves (autograd's
    check of the saved tensors), or through the finished tensor ``.wait()`` returned."""
    if not ctx.saved_some:
        return
    try:
        ctx.saved_tensors  # noqa: B018  # (unpacking is autograd's version check)
    except RuntimeError as err:
        raise RuntimeError(f"diffcomm: asynchronous {ctx.name}: {err}") from None
    finished = outs if isinstance(outs, tuple) else (outs,)
    born = ctx.handle.versions if isinstance(outs, tuple) else (ctx.handle.versions,)
    for i in ctx.outs_read:
        if _ver(finished[i]) != born[i]:
            raise _inplace_error(f"output {i} (through .wait())", ctx.name, (born[i], _ver(finished[i])))
    for i, ref, version in ctx.outs_watched:
        out = ref()
        if out is not None and _ver(out) != version:
            raise _inplace_error(f"output {i} (or .wait()'s alias of it)", ctx.name, (version, _ver(out)))
    for i, stamp in ctx.args_read:
        moved = _changed(ctx.args[i], stamp)
        if moved is not None:
            raise _inplace_error(f"input {i}", ctx.name, moved)


def launch_fn(cls: type[torch.autograd.Function], args: tuple[Any, ...]) -> Any:
    """``cls.apply(*args)`` launched on the engine (outputs: :class:`AsyncTensor`)."""
    pos = tuple(i for i, a in enumerate(args) if isinstance(a, Tensor))
    tensors = tuple(args[i] for i in pos)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _LaunchFn.apply(cls, args, pos, *tensors)
    with torch.no_grad():
        return _LaunchFn.forward(_NoCtx(), cls, args, pos, *tensors)


class _NoCtx:
    """Stand-in context when no gradient is recorded."""

    def mark_non_differentiable(self, *ts: Any) -> None:
        pass
