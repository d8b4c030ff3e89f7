"""``assert_matches_serial``: a parallel layer against its single-device reference.

The parallel side is differentiated under the **replicated objective** of
:mod:`diffcomm.parallel` (Megatron-style tensor/sequence parallelism): one loss, the same
on every rank. The kit makes that loss ``sum_k <out_k, w_k>`` with fixed random
cotangents ``w_k`` drawn for the *serial* outputs; a replicated parallel output gets the
whole ``w_k`` on every rank, a sharded one this rank's chunk of it. Then every gradient
of the parallel program must be the matching part of the serial gradient.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import backend as B
from .._errors import CrossRankMismatchError
from ..backend import args as A
from ..ops import collectives
from ..parallel._check import check_replicated
from ..runtime.world import LocalWorld
from .checks import GradientWatch, _changed, strided

__all__ = ["Shard", "build", "assert_matches_serial"]

_MISSING = object()


@dataclass(frozen=True)
class Shard:
    """Placement of a tensor split evenly along ``dim`` (rank ``r`` holds chunk ``r``).

    ``None`` in a spec list means *replicated*: every rank holds the whole tensor.
    """

    dim: int

    def index(self, shape: Sequence[int], rank: int, world: int) -> tuple[slice, ...]:
        """The slices of a full tensor of ``shape`` that rank ``rank`` holds."""
        dim = self.dim % len(shape)
        if shape[dim] % world != 0:
            raise ValueError(
                f"diffcomm.testing.Shard({self.dim}): size {shape[dim]} of dim {dim} (shape "
                f"{tuple(shape)}) does not divide by the group size {world}"
            )
        n = shape[dim] // world
        index = [slice(None)] * len(shape)
        index[dim] = slice(rank * n, (rank + 1) * n)
        return tuple(index)


class build:  # used like a function
    """Build the parallel (or serial) side inside each rank, where the process group exists.

    ``factory`` takes no argument, or one: the serial module/function (already built),
    so ``build(ParallelMLP.from_serial)`` shards the serial reference passed next to it.

    Example::

        assert_matches_serial(build(ParallelMLP.from_serial), MLP(8, 32, dtype=torch.float64),
                              torch.randn(4, 2, 8, dtype=torch.float64), world=world2)
    """

    def __init__(self, factory: Callable[..., Any]) -> None:
        if not callable(factory):
            raise TypeError(
                f"diffcomm.testing.build(): `factory` must be callable, got {type(factory).__name__}"
            )
        self.factory = factory

    def make(self, serial: Any = _MISSING) -> Any:
        """Call the factory (with ``serial`` if it takes a required positional argument)."""
        if serial is _MISSING:
            return self.factory()
        try:
            params = inspect.signature(self.factory).parameters.values()
            wants = any(
                p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                for p in params
            )
        except (TypeError, ValueError):
            wants = False
        return self.factory(serial) if wants else self.factory()

    def __repr__(self) -> str:
        return f"build({getattr(self.factory, '__qualname__', self.factory)!r})"


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _specs(specs: Sequence[Shard | None] | None, n: int, arg: str) -> list[Shard | None]:
    if specs is None:
        return [None] * n
    specs = list(specs)
    if len(specs) != n:
        raise A.arg_error("testing.assert_matches_serial", arg, f"a list of {n} specs (None or Shard)", specs)
    for s in specs:
        if s is not None and not isinstance(s, Shard):
            raise A.arg_error(
                "testing.assert_matches_serial", arg, "None or Shard(dim) entries", s, TypeError
            )
    return specs


def _part(t: Tensor, spec: Shard | None, rank: int, world: int) -> Tensor:
    return t if spec is None else t[spec.index(t.shape, rank, world)]


def _differentiable(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


def _close(what: str, actual: Tensor | None, expected: Tensor | None, rtol: Any, atol: Any) -> str | None:
    if actual is None and expected is None:
        return None
    if actual is None:
        actual = torch.zeros_like(expected)  # type: ignore[arg-type]
    if expected is None:
        expected = torch.zeros_like(actual)
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol)
    except AssertionError as exc:
        body = "\n      ".join(str(exc).strip().splitlines()[:6])
        return f"{what}:\n      {body}"
    return None


def _gradients(
    roots: list[tuple[Tensor, Tensor]],
    inputs: Sequence[Any],
    params: Mapping[str, Tensor],
    retain_graph: bool = False,
) -> tuple[list[Tensor | None], dict[str, Tensor | None]]:
    """The gradients of ``roots`` (outputs with their cotangents): of each differentiable
    input, in order, and of each trainable parameter by name (a frozen parameter,
    ``requires_grad=False``, has none: it is compared by value only)."""
    train = [n for n, t in params.items() if t.requires_grad]
    ins = [t for t in inputs if _differentiable(t)]
    leaves = ins + [params[n] for n in train]
    grads: list[Tensor | None] = [None] * len(leaves)
    if roots:
        grads = list(
            torch.autograd.grad(
                [o for o, _ in roots],
                leaves,
                [c for _, c in roots],
                allow_unused=True,
                retain_graph=retain_graph,
            )
        )
    return grads[: len(ins)], dict(zip(train, grads[len(ins) :]))


def _compare_on_rank(
    parallel_fn: Any,
    serial_fn: Any,
    inputs: Any,
    input_specs: Sequence[Shard | None] | None,
    output_specs: Sequence[Shard | None] | None,
    param_map: Mapping[str, tuple[str, Any]] | None,
    rtol: float | None,
    atol: float | None,
    group: A.GroupLike,
    seed: int,
) -> list[str]:
    """Run both sides on this rank; return the failures (empty: all matched)."""
    op = "testing.assert_matches_serial"
    pg = A.resolve_group(group, op)
    rank = B.get_backend().rank(pg)
    if isinstance(serial_fn, build):
        serial_fn = serial_fn.make()
    if isinstance(parallel_fn, build):
        parallel_fn = parallel_fn.make(serial_fn)
    if callable(inputs) and not isinstance(inputs, Tensor):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inputs = inputs()
    inputs = _as_tuple(inputs)
    in_specs = _specs(input_specs, len(inputs), "input_specs")

    for i, t in enumerate(inputs):
        if isinstance(t, Tensor):
            try:
                check_replicated(t, op, f"inputs[{i}]", "Pass the same full inputs on every rank.", pg)
            except CrossRankMismatchError as exc:
                raise ValueError(f"diffcomm.{op}(): {exc}") from None
    # two calls of both sides, each compared: a program wrong only from its second call on
    # (state kept across calls: a flag set, a cache filled on the first) passed. Every rank
    # runs both (the collectives of the second call are SPMD); the second call's failures
    # are reported where the first had none.
    args = (parallel_fn, serial_fn, inputs, in_specs, output_specs, param_map, rtol, atol, pg, seed)
    failures = _compare_call(*args)
    again = _compare_call(*args)
    prefix = f"rank {rank}: "
    return failures or [f"rank {rank} (second call): {m.removeprefix(prefix)}" for m in again]


def _compare_call(
    parallel_fn: Any,
    serial_fn: Any,
    inputs: tuple[Any, ...],
    in_specs: list[Shard | None],
    output_specs: Sequence[Shard | None] | None,
    param_map: Mapping[str, tuple[str, Any]] | None,
    rtol: float | None,
    atol: float | None,
    pg: Any,
    seed: int,
) -> list[str]:
    """One call of both sides on this rank, compared; the failures (empty: all matched)."""
    backend = B.get_backend()
    world, rank = backend.world_size(pg), backend.rank(pg)
    failures: list[str] = []

    # ---- serial reference -------------------------------------------------------------
    s_in = [
        t.detach().clone().requires_grad_(True)
        if _differentiable(t)
        else (t.clone() if isinstance(t, Tensor) else t)
        for t in inputs
    ]
    s_params = dict(serial_fn.named_parameters()) if isinstance(serial_fn, nn.Module) else {}
    with torch.enable_grad():
        s_out = _as_tuple(serial_fn(*s_in))
        out_specs = _specs(output_specs, len(s_out), "output_specs")
        cot = []
        for k, o in enumerate(s_out):
            gen = torch.Generator().manual_seed(seed + 7919 * (k + 1))
            cot.append(
                torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
                if _differentiable(o)
                else None
            )
        s_roots = [(o, c) for o, c in zip(s_out, cot) if c is not None and o.requires_grad]
        s_grads, s_param_grads = _gradients(s_roots, s_in, s_params)
    s_in_grads = dict(zip([i for i, t in enumerate(s_in) if _differentiable(t)], s_grads))

    # ---- parallel side ----------------------------------------------------------------
    p_in = [
        _part(t, spec, rank, world).detach().clone().requires_grad_(True)
        if _differentiable(t)
        else (_part(t, spec, rank, world).clone() if isinstance(t, Tensor) else t)
        for t, spec in zip(inputs, in_specs)
    ]
    p_params = dict(parallel_fn.named_parameters()) if isinstance(parallel_fn, nn.Module) else {}
    with torch.enable_grad():
        p_out = _as_tuple(parallel_fn(*p_in))
        if len(p_out) != len(s_out):
            return [f"rank {rank}: parallel_fn returned {len(p_out)} outputs, serial_fn {len(s_out)}"]
        p_roots = []
        for k, (o, c, spec) in enumerate(zip(p_out, cot, out_specs)):
            expected = _part(s_out[k], spec, rank, world)
            msg = (
                _close(f"rank {rank}: output {k}", o, expected, rtol, atol)
                if o.shape == expected.shape
                else (
                    f"rank {rank}: output {k} has shape {tuple(o.shape)}, expected {tuple(expected.shape)}"
                    f" (serial {tuple(s_out[k].shape)}, spec {spec})"
                )
            )
            if msg:
                failures.append(msg)
            if c is not None and o.requires_grad:
                c = _part(c, spec, rank, world).clone()  # its own: the serial's is not touched
                # a wrong shape is reported above; backward still runs (with zeros) so every
                # rank runs the collectives of the backward pass (the SPMD rule)
                p_roots.append((o, c if c.shape == o.shape else torch.zeros_like(o)))
        # twice: with the cotangents as given and with the same values laid out
        # non-contiguously (a backward wrong only for a strided gradient is a classic
        # silent bug); the watch tells whether a backward changed a gradient it received
        watch = GradientWatch([o for o, _ in p_roots])
        p_grads, p_param_grads = _gradients(p_roots, p_in, p_params, retain_graph=True)
        strided_roots = [(o, strided(c)) for o, c in p_roots]
        p_grads_nc, p_param_grads_nc = _gradients(strided_roots, p_in, p_params)
    if bool(watch.changed()):
        failures.append(
            f"rank {rank}: a backward of parallel_fn modified a gradient it received in place (autograd "
            "may hand the same gradient tensor to another backward: it must stay unchanged)"
        )
    for i, t in enumerate(inputs):
        if isinstance(t, Tensor) and bool(_changed(p_in[i].detach(), _part(t, in_specs[i], rank, world))):
            failures.append(f"rank {rank}: parallel_fn modified inputs[{i}] in place")
    p_in_idx = [i for i, t in enumerate(p_in) if _differentiable(t)]
    for i, g, g_nc in zip(p_in_idx, p_grads, p_grads_nc):
        s_grad_in = s_in_grads.get(i)
        want = None if s_grad_in is None else _part(s_grad_in, in_specs[i], rank, world)
        where = "" if in_specs[i] is None else f" (this rank's {in_specs[i]} chunk)"
        msg = _close(f"rank {rank}: gradient of inputs[{i}]{where}", g, want, rtol, atol) or _close(
            f"rank {rank}: gradient of inputs[{i}]{where}{_NC}", g_nc, want, rtol, atol
        )
        if msg:
            failures.append(msg)

    # ---- parameters: values and gradients ---------------------------------------------
    slices = parallel_fn.serial_slices() if hasattr(parallel_fn, "serial_slices") else {}
    names = parallel_fn.serial_names() if hasattr(parallel_fn, "serial_names") else {}
    partial = set(parallel_fn.partial_gradients()) if hasattr(parallel_fn, "partial_gradients") else set()
    covered: set[str] = set()
    for name, p in p_params.items():
        g, g_nc = p_param_grads.get(name), p_param_grads_nc.get(name)
        if name in partial:  # a per-rank share of the gradient (sum convention): sum it
            g, g_nc = (
                collectives.all_reduce(torch.zeros_like(p) if h is None else h.detach(), "sum", pg)
                for h in (g, g_nc)
            )
        if param_map is not None and name in param_map:
            s_name, index = param_map[name]
        else:
            s_name, index = names.get(name, name), slices.get(name, (...,))
        if s_name not in s_params:
            failures.append(
                f"rank {rank}: parallel parameter {name!r} has no serial counterpart {s_name!r} "
                f"(serial parameters: {sorted(s_params)}); pass param_map"
            )
            continue
        covered.add(s_name)
        index = index if isinstance(index, tuple) else (index,)
        s_value, s_grad = s_params[s_name].detach()[index], s_param_grads.get(s_name)
        label = f"parameter {name!r} (serial {s_name!r}{_fmt_index(index)})"
        if s_value.shape != p.shape:
            hint = ""
            if not slices and (param_map is None or name not in param_map):
                hint = (
                    f": `parallel_fn` ({type(parallel_fn).__name__}) has no serial_slices(), so its "
                    "parameters were compared with the whole serial ones; make the container a "
                    "subclass of diffcomm.parallel.ParallelModule instead of nn.Module (its "
                    "serial_slices() names each shard), or pass param_map={name: (serial_name, index)}"
                )
            failures.append(
                f"rank {rank}: {label} has shape {tuple(p.shape)}, serial slice {tuple(s_value.shape)}{hint}"
            )
            continue
        want_grad = None if s_grad is None else s_grad[index]
        for msg in (
            _close(f"rank {rank}: value of {label}", p, s_value, rtol, atol),
            _close(f"rank {rank}: gradient of {label}", g, want_grad, rtol, atol)
            or _close(f"rank {rank}: gradient of {label}{_NC}", g_nc, want_grad, rtol, atol),
        ):
            if msg:
                failures.append(msg)
    failures += _compare_buffers(parallel_fn, serial_fn, param_map, slices, names, rank, rtol, atol)
    # a serial parameter that takes part in the serial computation but that no parallel
    # parameter stands for: its gradient was never compared (a parallel model missing a
    # trainable parameter, e.g. a bias left out, which starts at zero, passed)
    # (over every rank: an expert-parallel rank stands for its own experts only). A
    # parallel_fn that is no module has no parameters to compare: its weights are constants
    if not isinstance(parallel_fn, nn.Module):
        return failures
    if s_params:
        mine = torch.tensor([float(n in covered) for n in s_params], dtype=torch.float64)
        covered = {n for n, c in zip(s_params, collectives.all_reduce(mine, "max", pg).tolist()) if c}
    for s_name in s_params:
        if s_name not in covered and s_param_grads.get(s_name) is not None:
            failures.append(
                f"rank {rank}: serial parameter {s_name!r} has no parallel counterpart (it has a "
                "gradient, which nothing was compared with: the parallel model would not train it); "
                "add it to the parallel model, or map a parallel parameter to it with param_map"
            )
    return failures


#: the label of a gradient from the second backward (the cotangents strided)
_NC = " (with the cotangents non-contiguous: the same values, strided)"


def _compare_buffers(
    parallel_fn: Any,
    serial_fn: Any,
    param_map: Mapping[str, tuple[str, Any]] | None,
    slices: Mapping[str, Any],
    names: Mapping[str, str],
    rank: int,
    rtol: float | None,
    atol: float | None,
) -> list[str]:
    """The buffers (running statistics, counters ...) after the forward: each parallel
    buffer against the serial one it stands for (named as a parameter is: ``param_map``,
    ``serial_names()`` / ``serial_slices()``, else the same name), where that one exists
    and has its shape. A buffer with no serial twin of its shape (a cache of the parallel
    layout) is not compared."""
    if not (isinstance(parallel_fn, nn.Module) and isinstance(serial_fn, nn.Module)):
        return []
    s_buffers = dict(serial_fn.named_buffers())
    failures = []
    for name, b in parallel_fn.named_buffers():
        if param_map is not None and name in param_map:
            s_name, index = param_map[name]
        else:
            s_name, index = names.get(name, name), slices.get(name, (...,))
        if s_name not in s_buffers:
            continue
        index = index if isinstance(index, tuple) else (index,)
        try:
            want = s_buffers[s_name].detach()[index]
        except (IndexError, TypeError, RuntimeError):
            continue
        if want.shape != b.shape:
            continue
        msg = _close(
            f"rank {rank}: value of buffer {name!r} (serial {s_name!r}{_fmt_index(index)}) after the forward",
            b,
            want,
            rtol,
            atol,
        )
        if msg:
            failures.append(msg)
    return failures


def _fmt_index(index: tuple[Any, ...]) -> str:
    if index in ((...,), ()):
        return ""
    parts = []
    for s in index:
        if isinstance(s, slice):
            parts.append(f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}")
        else:
            parts.append(repr(s))
    return "[" + ", ".join(parts) + "]"


def assert_matches_serial(
    parallel_fn: Callable[..., Any] | build,
    serial_fn: Callable[..., Any] | build,
    inputs: Any,
    world: LocalWorld | None = None,
    *,
    input_specs: Sequence[Shard | None] | None = None,
    output_specs: Sequence[Shard | None] | None = None,
    param_map: Mapping[str, tuple[str, Any]] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    group: A.GroupLike = None,
    seed: int = 0,
) -> None:
    """Assert a parallel program computes its serial reference's outputs and gradients.

    Every rank runs the serial reference on the full inputs and the parallel program on
    its part of them, backpropagates the same random cotangents (the replicated
    objective, see the module docstring) and compares

    * every output (a ``Shard`` output with this rank's chunk of the serial one);
    * the gradient of every floating-point input (a ``Shard`` input: its chunk);
    * for an ``nn.Module`` ``parallel_fn``: the **value and gradient of every
      parameter** against the matching part of the serial parameter — the part is
      ``param_map[name] = (serial_name, index)`` if given, else the module's
      ``serial_slices()[name]`` (every :class:`diffcomm.parallel.ParallelModule` has it),
      else the whole serial parameter of the same name (a replicated parameter). A
      module's ``serial_names()`` (``ExpertParallelMoE``: local expert ``i`` is the serial
      ``experts.{rank * E / world + i}``) gives the serial name, and the gradients of the
      parameters its ``partial_gradients()`` names (per-rank shares under the sum
      convention) are summed over ``group`` before the comparison. Every serial
      parameter that has a gradient must be stood for by a parallel parameter on some
      rank (else the parallel model would not train it: a failure naming it); a frozen
      parameter (``requires_grad=False``) is compared by value;
    * when both are modules, every parallel **buffer** after the forward against the
      serial buffer it stands for (named as a parameter is), where that exists with its
      shape.

    Both sides are called twice, each call compared (a program wrong only from its second
    call on fails, "rank r (second call): ..."). In each call the parallel backward runs
    twice: with the cotangents as given and with the same
    values strided (a backward wrong only for a non-contiguous gradient fails). A
    parallel program that changes an input, or a backward a gradient it receives, in
    place fails too.

    Args:
        parallel_fn: callable or module (``build(factory)`` to create it inside the ranks).
        serial_fn: callable or module, the single-device reference (``build`` allowed).
        inputs: a tensor, a tuple of inputs, or a zero-argument callable returning them
            (called inside each rank under ``torch.manual_seed(seed)``). Full (serial)
            inputs, the same on every rank (checked).
        world: a :class:`~diffcomm.LocalWorld`: run on all its ranks and raise one
            ``AssertionError`` summarising every rank's failures. ``None``: call this on
            every rank yourself (it raises on the ranks that fail).
        input_specs: per input, ``None`` (the parallel side gets the full input) or
            ``Shard(dim)`` (it gets this rank's chunk along ``dim``).
        output_specs: per output, ``None`` (replicated: equal to the serial output on
            every rank) or ``Shard(dim)``.
        param_map: ``{parallel_name: (serial_name, index)}`` overrides; ``index`` is
            anything ``serial_param[index]`` accepts (e.g. a tuple of slices).
        rtol, atol: tolerances of ``torch.testing.assert_close`` (``None``: its defaults for
            the dtype; use float64 for tight checks).
        group: the tensor-parallel group.
        seed: seeds the cotangents (and ``inputs`` when it is a callable).

    Raises:
        AssertionError: listing every mismatch, with rank, what, and the difference.
        ValueError: inputs differing between ranks, bad specs.

    Example::

        from diffcomm.parallel import MLP, ParallelMLP
        from diffcomm.testing import assert_matches_serial, build

        def test_tp_mlp(world2):
            torch.manual_seed(0)
            serial = MLP(8, 32, dtype=torch.float64)
            x = torch.randn(6, 2, 8, dtype=torch.float64)
            assert_matches_serial(build(ParallelMLP.from_serial), serial, x, world=world2)
    """
    args = (parallel_fn, serial_fn, inputs, input_specs, output_specs, param_map, rtol, atol, group, seed)
    if world is None:
        failures = _compare_on_rank(*args)
        if failures:
            raise AssertionError(
                f"diffcomm.testing.assert_matches_serial: {len(failures)} mismatch(es):\n  "
                + "\n  ".join(failures)
            )
        return
    if not isinstance(world, LocalWorld):
        raise A.arg_error(
            "testing.assert_matches_serial", "world", "a LocalWorld or None", type(world).__name__, TypeError
        )
    per_rank = world.run(_compare_on_rank, *args)
    failures = [f for fs in per_rank for f in fs]
    if failures:
        ranks = [r for r, fs in enumerate(per_rank) if fs]
        raise AssertionError(
            f"diffcomm.testing.assert_matches_serial: {len(failures)} mismatch(es) on rank(s) {ranks} "
            f"of {world.world_size}:\n  " + "\n  ".join(failures)
        )
