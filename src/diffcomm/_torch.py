"""Every torch internal diffcomm reads, in one place, behind a name that says what it is.

diffcomm leans on a few private parts of torch (``torch._C``, ``distributed_c10d._world``,
``torch._functorch``, ``_functional_collectives``, private methods of ``ProcessGroup``).
They live here and nowhere else, so a torch upgrade that moves one breaks one module, and
a reader sees the whole dependence on one page. Each name is either the torch object
itself (an alias: free to call on the hot path) or a small function.

Two reads are written at their sites on purpose, each a plain attribute of an object
named here, on a path every op runs (a call costs several times the read, and they are
read a few times per op): the default group ``C10D._default_pg`` (other readers call
:func:`default_pg`) and the forward-AD level ``FORWARD_AD._current_level`` (other readers
call :func:`forward_ad_level`). Whether torch.compile is at work is asked of one function,
:func:`compiling`, everywhere.

Layer: a core module (beside ``_config`` and ``_errors``); it imports only torch.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.abc
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.parametrize
import torch.utils.checkpoint

# Size: ~700 lines, over the ~600 guideline: every read of torch's internals lives in
# this one module (tests/test_layout.py), so it grows with each internal diffcomm needs.

__all__ = [
    "C10D",
    "default_pg",
    "coalescing_state",
    "set_pg_timeout",
    "default_store",
    "pg_method",
    "pg_device_backend",
    "functional_collectives",
    "compiling",
    "run_eagerly_under_compile",
    "when_dynamo_loads",
    "compiler_disable",
    "disable_methods_when_dynamo_loads",
    "FORWARD_AD",
    "tree_map_only",
    "transforms_active",
    "forward_ad_level",
    "only_grad_transform",
    "c_apply",
    "unwrap_if_dead",
    "functorch_unwrapped",
    "vmap_batched",
    "disabled_torch_function_impl",
    "FLASH_ATTENTION_CPU",
    "FLASH_ATTENTION_CPU_BACKWARD",
    "mps_initial_seed",
    "assert_async",
    "not_a_view",
    "active_ddp",
    "dispatch_modes",
    "outside_checkpoint_caching",
    "saved_in_checkpoint",
    "is_fake",
    "IncompatibleKeys",
    "PRINT_OPTS",
    "AUTOGRAD_GLOBALS",
    "global_hooks",
    "PER_USE_HOOKS",
]

#: ``assert_async(condition, message)``: raise ``RuntimeError(message)`` unless the 0-dim
#: bool tensor ``condition`` is true, without a host sync on an accelerator (a device-side
#: assert there, as ``nn.Embedding``'s index check); traced by torch.compile.
assert_async: Callable[[torch.Tensor, str], None] = torch._assert_async

#: ``IncompatibleKeys(missing_keys, unexpected_keys)``: the named tuple (and its repr)
#: ``nn.Module.load_state_dict`` returns; the serial state-dict loaders return it too.
IncompatibleKeys = torch.nn.modules.module._IncompatibleKeys

#: torch's print options (``torch.set_printoptions`` sets this one object's fields in place)
PRINT_OPTS: Any = torch._tensor_str.PRINT_OPTS

#: torch's autograd switches that are module globals, one per process, each rebound by its
#: module (``global``): ``(module, name, fresh process's value)``. The context managers
#: ``torch.utils.checkpoint.set_checkpoint_early_stop`` / ``set_checkpoint_debug_enabled``
#: keep their flag in one; ``torch.nn.utils.parametrize.cached()`` its depth and its cache
#: of computed tensors.
AUTOGRAD_GLOBALS: tuple[tuple[Any, str, Callable[[], Any]], ...] = (
    (torch.utils.checkpoint, "_enable_checkpoint_early_stop", lambda: None),
    (torch.utils.checkpoint, "_checkpoint_debug_enabled", lambda: None),
    (torch.nn.utils.parametrize, "_cache_enabled", lambda: 0),
    (torch.nn.utils.parametrize, "_cache", dict),
)


def not_a_view(out: Any, x: Any) -> Any:
    """``out`` itself, or — when it is a plain tensor that is a view (``out._base``) of a
    buffer the op made (the bytes of a received message, a gathered buffer moved to
    ``dim``) — an alias of the same memory that is not a view. torch refuses an in-place
    change of an autograd Function's output that is a view (its view+inplace logic would
    replace the Function's backward), so without this ``dc.recv(...).relu_()`` or
    ``dc.all_gather(x, dim=1).mul_(2)`` raised where the same code on any torch result
    works. A view of the input ``x`` is kept as it is (autograd must see that aliasing;
    diffcomm's results never alias their input)."""
    if type(out) is torch.Tensor:
        base = out._base
        if base is not None and base is not x and base is not getattr(x, "_base", None):
            alias = torch.empty(0, dtype=out.dtype, device=out.device)
            return alias.set_(out.untyped_storage(), out.storage_offset(), out.size(), out.stride())
    return out


# ---------------------------------------------------------------- torch.distributed (c10d)

#: torch's one record of the process groups (``distributed_c10d._world``; ``None`` in a
#: build without distributed). ``C10D._default_pg`` is the default group or ``None``; torch
#: keeps it there since 2.0 (we require 2.6).
C10D: Any = dist.distributed_c10d._world if dist.is_available() else None


def default_pg() -> Any:
    """The default process group, or ``None`` before ``init_process_group``."""
    return C10D._default_pg if C10D is not None else None


def coalescing_state() -> dict[Any, Any]:
    """torch's record of the groups inside a ``dist._coalescing_manager`` block (one dict
    for the life of the process; torch mutates it)."""
    state: dict[Any, Any] = C10D.pg_coalesce_state
    return state


def set_pg_timeout(seconds: float, group: Any = None) -> None:
    """Set ``group``'s (``None``: the default group's) collective timeout to ``seconds``.
    torch sets it only on nccl and gloo (it warns and does nothing elsewhere): a group on
    another backend (an in-process world's ``inproc``, mpi, ...) keeps its own."""
    backend = str(dist.get_backend(group))
    if "nccl" not in backend and "gloo" not in backend:
        return
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def pg_timeout(group: Any = None) -> float | None:
    """``group``'s (``None``: the default group's) collective timeout in seconds, as its
    backend holds it now; ``None`` where no backend of the group tells it."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        for device in pg._device_types:
            options = getattr(pg._get_backend(device), "options", None)
            if options is not None and getattr(options, "_timeout", None) is not None:
                return float(options._timeout.total_seconds())
    except Exception:  # a backend without readable options
        pass
    return None


def default_store() -> Any:
    """The key-value store of the default group."""
    return dist.distributed_c10d._get_default_store()


def pg_method(public: str, private: str) -> Callable[..., Any]:
    """``ProcessGroup``'s method ``public``, or ``private`` in a torch without it (e.g.
    ``all_gather_single`` / ``_allgather_base``): the direct calls under the hottest ops."""
    method: Callable[..., Any] = getattr(dist.ProcessGroup, public, None) or getattr(
        dist.ProcessGroup, private
    )
    return method


def pg_device_backend(pg: Any, device: torch.device) -> Any:
    """The backend object ``pg`` runs tensors on ``device`` with (its ``name()``)."""
    return pg._get_backend(device)


def functional_collectives() -> types.ModuleType:
    """``torch.distributed._functional_collectives`` (imported on first use: it is slow to
    import and only ``torch.compile`` and the benchmark need it)."""
    import torch.distributed._functional_collectives as funcol

    return funcol


# ---------------------------------------------------------------- torch.compile

_COMPILER: Any = torch.compiler


def compiling() -> bool:
    """Whether torch.compile or torch.export is at work: dynamo tracing, or a compile
    session (AOTAutograd tracing a backward) or an export running Python code. The one
    compile check of diffcomm (``torch.compiler.is_compiling()``'s answer).

    One Python frame and an attribute read, for the hot path, which asks it several times
    per forward + backward (``is_compiling()`` is two frames: it asks
    ``torch.jit.is_scripting()`` first, ~0.5k machine instructions). Eagerly it reads
    ``is_compiling()``'s own flag, which torch holds ``True`` for a whole compile session.
    Dynamo does not trace it: marked a constant result, it is called once while tracing
    (the flag is set then, so ``True``) and folded into the graph with no guard (a traced
    read of the flag would guard on it and recompile on every call).
    """
    return _COMPILER._is_compiling_flag


def swap_compiling_flag(value: bool) -> bool:
    """Set torch's process-wide compile-session flag (:func:`compiling`'s answer); the old
    value. An in-process world swaps it with its run lock: each rank's own."""
    old, _COMPILER._is_compiling_flag = bool(_COMPILER._is_compiling_flag), value
    return old


def dynamo_compiling_here() -> bool:
    """Whether the calling thread holds dynamo's (one per process) compile lock."""
    lock: Any = getattr(sys.modules.get(_DYNAMO + ".convert_frame"), "compile_lock", None)
    return bool(lock._is_owned()) if hasattr(lock, "_is_owned") else False


def run_eagerly_under_compile(code: Any) -> None:
    """Dynamo never compiles a frame of ``code``, nor any frame it calls, as a frame of its
    own (what it does to every Python frame that eager code runs while a compiled function
    is active, after a graph break): they run eagerly. No wrapper, so no cost per call
    (``torch.compiler.disable`` wraps: ~1 us). Tracing that *inlines* the function (dynamo
    at work on a caller) is not affected. A torch without per-code strategies: no-op.
    Applied when dynamo loads (:func:`when_dynamo_loads`)."""

    def mark() -> None:
        ef: Any = torch._dynamo.eval_frame
        if hasattr(ef, "set_code_exec_strategy") and hasattr(ef, "FrameExecStrategy"):
            skip = ef.FrameAction.SKIP
            ef.set_code_exec_strategy(code, ef.FrameExecStrategy(skip, skip))

    when_dynamo_loads(mark)


# ------------------------------------------- dynamo's marks, applied when dynamo loads
#
# Dynamo (``torch._dynamo``, the tracer behind ``torch.compile``) takes longer to import
# than the rest of diffcomm together: ``import torch`` does not load it, and any call of
# ``torch.compiler.disable`` / ``assume_constant_result`` does (1.2 s of a 3.7 s
# ``import torch, diffcomm`` on this project's 2-core machine). Nothing can be compiled
# before dynamo is imported, so diffcomm puts its marks for dynamo (what to run eagerly,
# what is a constant) on its functions when dynamo loads: at once if it is already
# imported, else right after its module has run (a one-shot import hook, below). An
# eager-only program never loads it, and its ops skip ``disable``'s wrapper (~1 us).

_DYNAMO = "torch._dynamo"
#: the marks still to apply, by the module whose import applies them
_MARKS: dict[str, list[Callable[[], None]]] = {}


def _loaded(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def when_loaded(name: str, mark: Callable[[], None]) -> None:
    """Call ``mark()`` once the module ``name`` is imported: now if it is, else right after
    its module has run (a one-shot import hook, before anything can use it)."""
    if _loaded(name):
        mark()
        return
    _MARKS.setdefault(name, []).append(mark)
    if not any(isinstance(f, _ImportHook) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook(name))


def when_dynamo_loads(mark: Callable[[], None]) -> None:
    """Call ``mark()`` once ``torch._dynamo`` is imported: now if it is, else right after
    its import (before anything can be compiled)."""
    when_loaded(_DYNAMO, mark)


def _mark_all(name: str) -> None:
    marks = _MARKS.get(name, [])
    while marks:
        marks.pop(0)()


class _ImportHook(importlib.abc.MetaPathFinder):
    """A one-shot finder for the module ``name``: when it is imported, the finder leaves
    ``sys.meta_path``, finds the module's spec as the import system would, and has its
    loader run the pending marks once the module has run (the module, its loader and its
    spec otherwise untouched)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader: Any = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:  # pragma: no cover - a loader without exec_module
            return spec

        def exec_then_mark(module: types.ModuleType) -> None:
            exec_module(module)
            if module.__name__ == name:  # (a loader shared with its submodules)
                vars(loader).pop("exec_module", None)  # the loader's own method again
                _mark_all(name)

        loader.exec_module = exec_then_mark
        return spec


def compiler_disable(fn: Callable[..., Any], reason: str | None = None) -> Callable[..., Any]:
    """``fn`` as ``torch.compiler.disable(fn, reason=reason)`` (run eagerly under compile:
    a graph break, refused by ``fullgraph=True`` with ``reason``) once dynamo has loaded,
    and ``fn`` itself until then (nothing can be compiling). A wrapper that calls one or
    the other: one frame (~0.1 us) instead of ``disable``'s ~1 us while dynamo is not
    loaded. Dynamo tracing the wrapper inlines it and meets the disabled function."""
    target = [fn]

    def mark() -> None:
        target[0] = _COMPILER.disable(fn, reason=reason)

    @functools.wraps(fn)
    def eager_under_compile(*args: Any, **kwargs: Any) -> Any:
        return target[0](*args, **kwargs)

    when_dynamo_loads(mark)
    return eager_under_compile


def disable_methods_when_dynamo_loads(name: str, *classes: type) -> None:
    """Replace each class's own classmethod ``name`` by its ``torch.compiler.disable``'d
    self when dynamo loads (no wrapper before: for methods on every op's path)."""

    def mark() -> None:
        for cls in classes:
            fn = cls.__dict__[name].__func__
            setattr(cls, name, classmethod(_COMPILER.disable(fn)))

    when_dynamo_loads(mark)


def _mark_compiling_constant() -> None:
    # Dynamo does not trace ``compiling``: it calls it once while tracing and folds the
    # answer (True) into the graph with no guard (see :func:`compiling`).
    _COMPILER.assume_constant_result(compiling)


when_dynamo_loads(_mark_compiling_constant)


# ---------------------------------------------------------------- autograd and functorch

#: ``torch.autograd.forward_ad``; ``FORWARD_AD._current_level`` is the innermost dual level.
FORWARD_AD: Any = torch.autograd.forward_ad

#: ``torch.utils._pytree.tree_map_only``: map ``fn`` over the leaves of a type in a pytree.
from torch.utils._pytree import tree_map_only  # noqa: E402

#: Whether a functorch transform (vmap, grad, jvp, ...) is active: the C function itself.
transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active

#: The C++ ``autograd.Function.apply``, called as ``c_apply(cls, *args)`` (skips the
#: Python-level ``Function.apply`` where nothing needs it).
c_apply: Callable[..., Any] = torch._C._FunctionBase.__dict__["apply"]

#: The ``__torch_function__`` that turns torch-function dispatch off for a subclass.
disabled_torch_function_impl: Any = torch._C._disabled_torch_function_impl


def forward_ad_level() -> int:
    """The innermost forward-mode AD level (``fwAD.dual_level()``); -1 outside any."""
    level: int = FORWARD_AD._current_level
    return level


def _unwrap_dead_wrappers(t: Any) -> Any:  # pragma: no cover - older torch
    from torch._functorch.utils import unwrap_dead_wrappers

    return unwrap_dead_wrappers((t,))[0]


_unwrap_if_dead: Callable[[Any], Any]
try:
    from torch._C._functorch import unwrap_if_dead as _c_unwrap_if_dead

    _unwrap_if_dead = _c_unwrap_if_dead
except ImportError:  # pragma: no cover - older torch
    _unwrap_if_dead = _unwrap_dead_wrappers


#: ``t`` unwrapped if it is a functorch wrapper whose level has ended (a tensor that
#: escaped its transform); anything else unchanged.
unwrap_if_dead: Callable[[Any], Any] = _unwrap_if_dead


def only_grad_transform() -> bool:
    """Whether the active functorch transform is a single ``grad``/``vjp`` level (levels
    count from 1 at the outermost, so a grad at level 1 is alone). Call only while
    :func:`transforms_active`."""
    from torch._C._functorch import TransformType, peek_interpreter_stack
    from torch._functorch.pyfunctorch import coerce_cinterpreter

    level = coerce_cinterpreter(peek_interpreter_stack())
    return bool(level.key() == TransformType.Grad and level.level() == 1)


def in_backward() -> bool:
    """Whether this thread runs inside the autograd engine (a backward pass, including a
    ``torch.utils.checkpoint`` recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def functorch_unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its functorch wrappers (every vmap/grad/jvp level)."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def vmap_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by a ``torch.func.vmap`` at any of its functorch levels."""
    from torch._C._functorch import get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(t):
        if is_batchedtensor(t):
            return True
        t = get_unwrapped(t)
    return False


# ---------------------------------------------------------------- kernels

#: torch's fused CPU attention kernel (flash attention for CPU) and its backward, or
#: ``None`` in a torch without them (ring attention then takes its unfused path).
FLASH_ATTENTION_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_ATTENTION_CPU_BACKWARD: Any = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)

# ---------------------------------------------------------------- devices


def mps_initial_seed() -> int:
    """The initial seed of the default MPS generator."""
    return int(torch.mps._get_default_mps_generator().initial_seed())


# ---------------------------------------------------------------- one process, all ranks

#: torch's local-tensor package (``LocalTensorMode``): a mode can be on only once imported.
LOCAL_TENSOR_MODULE = "torch.distributed._local_tensor"
FAKE_TENSOR_MODULE = "torch._subclasses.fake_tensor"


def is_fake(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``FakeTensor`` (``torch._subclasses.FakeTensorMode``: shape and
    dtype, no values). Asked only of a tensor subclass; with the module not yet imported
    no fake tensor exists."""
    fake = sys.modules.get(FAKE_TENSOR_MODULE)
    return fake is not None and isinstance(x, fake.FakeTensor)


def local_tensor_mode_on() -> bool:
    """Whether a ``LocalTensorMode`` is on (this process's, or this thread's under
    ``LocalRunnerMode``)."""
    lt = sys.modules.get(LOCAL_TENSOR_MODULE)
    if lt is None:
        return False
    return bool(lt._PROCESS_LOCAL_TENSOR_MODE or getattr(lt._THREAD_LOCAL_TENSOR_MODE, "value", None))


@contextlib.contextmanager
def local_tensor_mode_off() -> Iterator[None]:
    """A ``with`` block where tensors are plain again if a ``LocalTensorMode`` is on: for
    a value every simulated rank computes alike (a full weight drawn from one seeded
    generator: under the mode each rank would draw the generator's next values)."""
    if not local_tensor_mode_on():
        yield
        return
    mode = local_tensor_api().local_tensor_mode()
    with mode.disable():
        yield


def functorch_off() -> Any:
    """A ``with`` block where torch.func's transforms do not see the tensors made (torch's
    ``_DisableFuncTorch``): for a per-rank constant made under ``LocalTensorMode`` inside
    ``torch.func.jvp`` — one made at the transform's level fails when mixed with its
    tensors, inside torch ("Cannot access data pointer of Tensor that doesn't have
    storage"), while one made outside the level is a constant, as it should be."""
    return torch._C._DisableFuncTorch()


def every_rank(x: Any) -> Any:
    """``x`` as every simulated rank's tensor (a ``LocalTensor`` holding ``x`` on each) if
    a ``LocalTensorMode`` is on and ``x`` is plain, else ``x``: a plain tensor is every
    rank's for ordinary ops, but ``narrow`` at a per-rank offset needs the ``LocalTensor``."""
    if not local_tensor_mode_on() or not isinstance(x, torch.Tensor) or hasattr(x, "_local_tensors"):
        return x
    lt = local_tensor_api()
    mode = lt.local_tensor_mode()
    return lt.LocalTensor({r: x for r in mode.ranks})


def local_tensor_api() -> Any:
    """torch's local-tensor package (imported on first use; only read while a mode is on)."""
    import torch.distributed._local_tensor as lt

    return lt


def local_group_instances(group: Any) -> list[list[int]]:
    """The global ranks of every copy of ``group`` under ``LocalTensorMode``, each list in
    group-rank order: torch's fake process group stands for one group of each shape, and
    its local collectives run it once per copy (``_prepare_collective_groups``)."""
    from torch.distributed._local_tensor import _c10d

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    ranks, offsets, _ = _c10d._prepare_collective_groups(pg)
    return [[o + r for r in ranks] for o in offsets]


def local_int(value: Any, rank: int) -> int:
    """``value`` (an int, or a ``SymInt`` holding one int per simulated rank) on ``rank``."""
    lt = local_tensor_api()
    node = getattr(value, "node", None)
    if node is None:
        return int(value)
    return int(lt._int_on_rank(node, rank))


def completed_work(result: Any) -> Any:
    """A c10d ``Work`` that is already complete with ``result`` (a Python process group's
    reply)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    c10d: Any = torch._C._distributed_c10d
    return c10d._create_work_from_future(fut)


#: torch's global hook registries (one per process, ``{handle id: hook}``): the module hooks
#: of ``torch.nn.modules.module.register_module_*_hook`` and the optimizer step hooks of
#: ``torch.optim.optimizer.register_optimizer_step_*_hook``
_GLOBAL_HOOKS = (
    (
        "torch.nn.modules.module",
        (
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_backward_pre_hooks",
            "_global_backward_hooks",
            "_global_buffer_registration_hooks",
            "_global_module_registration_hooks",
            "_global_parameter_registration_hooks",
        ),
    ),
    ("torch.optim.optimizer", ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")),
)


#: the modules of torch's tools that register global hooks for one use (an instance's
#: ``with`` block: ``torch.utils.module_tracker.ModuleTracker``, so ``FlopCounterMode``;
#: ``torch.distributed._tools.mod_tracker.ModTracker``, so ``MemTracker`` and
#: ``CommDebugMode``), unlike torch's hooks registered once per process (torch.profiler's
#: optimizer hook): a use's hooks are the user's
PER_USE_HOOKS = ("torch.utils.module_tracker", "torch.distributed._tools.", "torch.distributed.tensor.debug.")


def global_hooks() -> Iterator[tuple[str, dict[int, Any]]]:
    """torch's process-wide hook registries: ``(name, {handle id: hook})`` (a module not
    imported yet holds none)."""
    for module, names in _GLOBAL_HOOKS:
        owner = sys.modules.get(module)
        for name in names if owner is not None else ():
            yield name, getattr(owner, name)


def profiler_enabled() -> bool:
    """Whether torch's autograd profiler (``torch.profiler``) records in this process."""
    return bool(torch._C._autograd._profiler_enabled())


def set_thread_isolation(on: bool) -> None:
    """Make torch's C++ registry of process-group names one per thread (``on``) or one per
    process (torch's default): threads that each join a world of their own."""
    c10d: Any = torch._C._distributed_c10d
    c10d._set_thread_isolation_mode(on)


def world_record_class() -> type:
    """The class of torch's record of the process groups (``C10D``)."""
    return dist.distributed_c10d._World


def base_setup_context() -> Any:
    """``torch.autograd.Function``'s own ``setup_context`` (the unoverridden one, on its
    private base ``_SingleLevelFunction``): a Function whose ``setup_context`` is this one
    takes ``ctx`` as ``forward``'s first argument."""
    return inspect.getattr_static(torch.autograd.function._SingleLevelFunction, "setup_context")


def grad_scaler_found_inf(scaler: Any, optimizer: Any) -> tuple[dict[Any, torch.Tensor], torch.device] | None:
    """The ``{device: found_inf}`` flags ``scaler.unscale_(optimizer)`` recorded (what
    ``scaler.step`` and ``scaler.update`` read: a nonzero flag skips the step and lowers
    the scale) — the dict itself, torch's private per-optimizer state, to write in place —
    and the scaler's device; ``None`` when ``unscale_`` has not run for ``optimizer``
    since the last ``update()``."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states.get(id(optimizer))
    if state is None or state["stage"] is not OptState.UNSCALED:
        return None
    found: dict[Any, torch.Tensor] = state["found_inf_per_device"]
    return found, torch.device(scaler._device)


def active_ddp() -> tuple[Any, Any, frozenset[str]] | None:
    """``(module, process group, names of the parameters it ignores)`` of torch's
    ``DistributedDataParallel`` whose forward is running in this thread (what TorchDynamo
    asks it too: ``_get_active_ddp_module``, set while DDP runs its module's forward);
    ``None`` outside one (or under DDP's Python reducer, which does not set it)."""
    ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return None
    return ddp.module, ddp.process_group, frozenset(getattr(ddp, "parameters_to_ignore", ()))


#: ``dispatch_modes()``: how many ``TorchDispatchMode``\ s are active in this thread (a C
#: call; 0 almost always), read before every raw op.
dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack


def outside_checkpoint_caching(run: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``run(*args)`` (a raw c10d op) with the dispatch modes of selective activation
    checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) taken
    off the top of this thread's mode stack for the call.

    Those modes see every op and, for one the user's policy saves, return the forward's
    cached outputs in the recomputation instead of running it. diffcomm's raw ops are
    c10d's in-place ops writing into a buffer made anew in each run: a cached c10d op
    left the recomputation's buffer unwritten (uninitialised memory: gradients off by
    1e32, no error). Hidden from the modes, the communication runs again in the
    recomputation, on every rank alike, as under a policy that recomputes it."""
    from torch.utils import checkpoint as ckpt
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

    sac = (ckpt._CachingTorchDispatchMode, ckpt._CachedTorchDispatchMode)
    stack = _get_current_dispatch_mode_stack()
    n = 0
    while n < len(stack) and isinstance(stack[-1 - n], sac):
        n += 1
    if n == 0:
        return run(*args)
    with contextlib.ExitStack() as popped:
        for _ in range(n):
            popped.enter_context(_pop_mode_temporarily())
        return run(*args)


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}  # autograd node class -> its _raw_saved_* names
_HOLDER: list[type] = []  # torch.utils.checkpoint._Holder, once looked up


def saved_in_checkpoint(node: Any) -> bool:
    """Whether autograd ``node`` saved a tensor for backward inside a non-reentrant
    activation checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``):
    torch packed it as a ``torch.utils.checkpoint._Holder`` (read off the saved tensor
    without unpacking it, so nothing is recomputed), which each backward call (each graph
    task) fills by running the checkpointed forward again."""
    if not _HOLDER:
        from torch.utils import checkpoint as ckpt

        _HOLDER.append(getattr(ckpt, "_Holder", type("_NoHolder", (), {})))  # (another torch: none)
    holder = _HOLDER[0]
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    for name in names:
        try:
            saved = getattr(node, name)
        except RuntimeError:  # (a freed graph)
            continue
        for s in saved if isinstance(saved, (tuple, list)) else (saved,):
            if isinstance(getattr(s, "data", None), holder):
                return True
    return False
