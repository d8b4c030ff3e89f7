"""``torch.compile`` of diffcomm's parallel layers and blocks (not of single ops:
tests/ops/test_compile.py): values and every gradient equal the serial float64 model's, and
the seam checks of the layers' forward still fire under compile (parallel/_seams.py, the
first-forward check of unseeded replicas)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import diffcomm as dc
from diffcomm import parallel as P

# Values and gradients need no real transport: the in-process world (same values as gloo
# processes, tests/runtime/test_in_process.py). Its ranks share dynamo's code cache; each
# rank's default group is guarded (its own object), so each rank compiles its own graph.
pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64
S, B, H = 4, 2, 8  # sequence, batch, hidden: splits over 2 ranks


def _serial_and_parallel(kind: str) -> tuple[torch.nn.Module, torch.nn.Module, bool]:
    """(serial model, this rank's parallel model of it, whether its input is a sequence
    chunk); float64, seeded alike on every rank."""
    torch.manual_seed(0)
    if kind in ("mlp", "mlp_sp"):
        ser: torch.nn.Module = P.MLP(H, 2 * H, dtype=F64)
        return ser, P.ParallelMLP.from_serial(ser, sequence_parallel=kind == "mlp_sp"), kind == "mlp_sp"
    if kind == "mlp_sp_ring":
        ser = P.MLP(H, 2 * H, dtype=F64)
        return ser, P.ParallelMLP.from_serial(ser, sequence_parallel=True, overlap=True), True
    if kind == "attention_sp":
        ser = P.SelfAttention(H, 4, dtype=F64)
        return ser, P.ParallelSelfAttention.from_serial(ser, sequence_parallel=True), True
    ser = torch.nn.Sequential(torch.nn.Linear(H, 2 * H, dtype=F64), torch.nn.Linear(2 * H, H, dtype=F64))
    ring = {"sequence_parallel": True, "overlap": "ring"} if kind == "column_row_ring" else {}
    par = torch.nn.Sequential(
        P.ColumnParallelLinear.from_serial(ser[0], **ring),
        P.RowParallelLinear.from_serial(ser[1], input_is_parallel=True, **ring),
    )
    return ser, par, bool(ring)


def _compiled_vs_serial(kind: str, backend: str) -> dict[str, float]:
    """Two steps of a compiled parallel model against the serial one: the worst difference
    of the outputs, the input gradients and every parameter gradient (this rank's part of
    the serial one)."""
    ser, par, chunked = _serial_and_parallel(kind)
    compiled = torch.compile(par, backend=backend)
    r, n = dc.get_rank(), dc.get_world_size()
    g = torch.Generator().manual_seed(1)
    worst: dict[str, float] = {}

    def note(key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        worst[key] = max(worst.get(key, 0.0), float((a - b).abs().max()))

    for _ in range(2):
        x = torch.randn(S, B, H, dtype=F64, generator=g, requires_grad=True)
        cot = torch.randn(S, B, H, dtype=F64, generator=g)
        xr = x.detach().chunk(n)[r].clone() if chunked else x.detach().clone()
        xr.requires_grad_(True)
        for m in (ser, par):
            m.zero_grad()
        y_ser = ser(x)
        (y_ser * cot).sum().backward()
        y = compiled(xr)
        (y * (cot.chunk(n)[r] if chunked else cot)).sum().backward()
        note("out", y, y_ser.chunk(n)[r] if chunked else y_ser)
        note("x.grad", xr.grad, x.grad.chunk(n)[r] if chunked else x.grad)
        serial_grads = {k: p.grad for k, p in ser.named_parameters()}
        for name, index in par.serial_slices().items() if isinstance(par, P.ParallelModule) else []:
            note(name, dict(par.named_parameters())[name].grad, serial_grads[name][index])
        if not isinstance(par, P.ParallelModule):
            for i, layer in enumerate(par):
                for name, index in layer.serial_slices().items():
                    note(f"{i}.{name}", getattr(layer, name).grad, serial_grads[f"{i}.{name}"][index])
    return worst


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", ["mlp", "mlp_sp", "attention_sp", "column_row"])
def test_compiled_parallel_layers_equal_the_serial_model(
    inproc_world2: dc.LocalWorld, kind: str, backend: str
) -> None:
    """Before, ``torch.compile`` of any ParallelModule failed at its first call with
    ``InternalTorchDynamoError: AttributeError: 'dict' object has no attribute 'node'``
    (the forward pre-hook read a parameter's ``__dict__`` to mark it for the optimizer
    check, which dynamo cannot trace); now outputs and gradients equal the serial model's."""
    torch._dynamo.reset()
    for worst in inproc_world2.run(_compiled_vs_serial, kind, backend):
        assert len(worst) > 3 and max(worst.values()) < 1e-12, worst


def _adafactor_after_compiled_steps() -> str:
    model = torch.compile(P.ParallelMLP(H, 2 * H, seed=0, dtype=F64), backend="eager")
    model(torch.ones(S, B, H, dtype=F64)).sum().backward()
    try:
        torch.optim.Adafactor(model.parameters()).step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_model_only_run_compiled_still_refuses_a_reducing_optimizer(inproc_world2: dc.LocalWorld) -> None:
    """The shards are marked for the optimizer check when the layer registers them, not
    only in an eager forward (which a compiled model never runs: dynamo cannot trace the
    mark). Before, the compiled forward itself failed (see above)."""
    torch._dynamo.reset()
    for msg in inproc_world2.run(_adafactor_after_compiled_steps):
        assert (
            "torch.optim.Adafactor" in msg and "shard of the serial `ColumnParallelLinear.weight`" in msg
        ), msg


def _unseeded_compiled(fullgraph: bool) -> str:
    torch.manual_seed(dc.get_rank())  # each rank's global generator its own: replicas differ
    model = torch.compile(P.ParallelMLP(H, 2 * H, dtype=F64), backend="eager", fullgraph=fullgraph)
    try:
        model(torch.ones(S, B, H, dtype=F64))
    except dc.CrossRankMismatchError as e:
        return f"CrossRankMismatchError: {e}"
    except torch._dynamo.exc.Unsupported as e:
        return f"Unsupported: {e}"
    return "no error"


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-break", "fullgraph"])
def test_a_compiled_unseeded_layer_checks_its_replicas(inproc_world2: dc.LocalWorld, fullgraph: bool) -> None:
    """The first forward of a layer drawn from the global generator checks that its
    replicated parameters agree across ranks. Under compile the check was skipped ("the
    flags stay for the first eager forward", which a compiled model never runs): ranks
    seeded differently trained a model that is no serial model's shards, with no error.
    Now the check runs eagerly at the first compiled call (a graph break); with
    ``fullgraph=True`` dynamo refuses it, saying what to do."""
    torch._dynamo.reset()
    for msg in inproc_world2.run(_unseeded_compiled, fullgraph):
        if fullgraph:
            assert msg.startswith("Unsupported:") and "give the layer seed=" in msg, msg
        else:
            assert msg.startswith("CrossRankMismatchError:") and "fc2.bias" in msg, msg


@pytest.mark.diffcomm_in_process(False)  # (in-process the ring runs the blocking mappings anyway)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", ["mlp_sp_ring", "column_row_ring"])
def test_compiled_ring_overlap_layers_equal_the_serial_model(
    world2: dc.LocalWorld, kind: str, backend: str
) -> None:
    """``overlap="ring"`` (sequence parallel; ``ParallelMLP(overlap=True)``) under
    torch.compile. Before, the first compiled call failed with ``AttributeError:
    'TraceableBackend' object has no attribute 'batch_p2p'`` (the ring's hops do not
    trace); now the traced graph gets the blocking all_gather / reduce_scatter, with the
    serial model's values and gradients."""
    torch._dynamo.reset()
    for worst in world2.run(_compiled_vs_serial, kind, backend):
        assert len(worst) > 3 and max(worst.values()) < 1e-12, worst


def _compiled_vs_eager(kind: str, backend: str, fullgraph: bool) -> str | float:
    """Worst difference of a compiled ring attention / expert-parallel MoE from eager
    (output and every gradient, two compiled calls), or the error."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(dc.get_rank() + 1)
    if kind == "moe":
        moe = P.ExpertParallelMoE(H, 2 * H, 4, seed=0, dtype=F64)
        fn, params = moe, list(moe.parameters())
        args = [torch.randn(5, H, dtype=F64, generator=g).requires_grad_()]
    else:
        fn, params = (lambda q, k, v: P.ring_attention(q, k, v, causal=True)), []
        args = [torch.randn(1, 4, S, H, dtype=F64, generator=g).requires_grad_() for _ in range(3)]

    def step(f: Any) -> list[torch.Tensor]:
        for t in args + params:
            t.grad = None
        y = f(*args)
        (y * torch.randn(y.shape, dtype=F64, generator=torch.Generator().manual_seed(7))).sum().backward()
        return [y.detach()] + [t.grad for t in args + params]

    want = step(fn)
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)
    try:
        got = step(compiled) and step(compiled)
    except torch._dynamo.exc.Unsupported as e:
        return f"Unsupported: {e}"
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "processes"])
@pytest.mark.parametrize("kind", ["ring_attention", "moe"])
def test_compiled_ring_attention_and_moe_equal_eager(
    inproc_world2: dc.LocalWorld, world2: dc.LocalWorld, kind: str, in_process: bool
) -> None:
    """Before, a compiled ring_attention failed with ``AttributeError: 'TraceableBackend'
    object has no attribute 'batch_p2p'`` (processes) or ``RuntimeError: No backend type
    associated with device type cpu`` (in-process); a compiled ExpertParallelMoE with
    ``InternalTorchDynamoError`` (its forward read a parameter's ``__dict__``) or the same
    RuntimeError (the routing counts' exchange in a resumed frame). Now ring attention and
    the routing plan run eagerly between the graphs: the values and gradients of eager."""
    world = inproc_world2 if in_process else world2
    for worst in world.run(_compiled_vs_eager, kind, "aot_eager", False):
        assert worst == 0.0, worst


def test_fullgraph_ring_attention_says_what_to_do(inproc_world2: dc.LocalWorld) -> None:
    """With fullgraph=True the graph break is refused with the reason and the way out."""
    for msg in inproc_world2.run(_compiled_vs_eager, "ring_attention", "eager", True):
        assert isinstance(msg, str) and "ring_attention" in msg and "ulysses_attention" in msg, msg


def _fullgraph_mappings_in_debug_mode() -> list[float]:
    """A copy forward, an identity backward and a ColumnParallelLinear, compiled with
    ``fullgraph=True`` in debug mode: the largest difference from eager, per case."""
    torch.manual_seed(0)  # the same input on every rank: replicated
    x = torch.randn(4, 8, dtype=F64)
    lin = P.ColumnParallelLinear(8, 8, dtype=F64, seed=0)
    cases = (
        lambda a: P.copy_to_region(a) * 2,
        lambda a: P.reduce_from_region(a * 1).square().sum(),
        lin,
    )
    diffs = []
    with dc.debug(True):
        for fn in cases:
            torch._dynamo.reset()
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            yc = torch.compile(fn, backend="aot_eager", fullgraph=True)(xc)
            ye = fn(xe)
            yc.sum().backward()
            ye.sum().backward()
            diffs.append(max(float((yc - ye).abs().max()), float((xc.grad - xe.grad).abs().max())))
    return diffs


def test_debug_mode_compiles_the_mappings_fullgraph(inproc_world2: dc.LocalWorld) -> None:
    """Debug mode's replicated check is skipped in compiled code (as its field check is,
    docs/transforms.md). It ran there, and its torch.func switch failed dynamo
    ("Attempted to call function marked as skipped"): a copy_to_region, a
    reduce_from_region's backward or a ColumnParallelLinear compiled with
    ``fullgraph=True`` only outside debug mode."""
    for diffs in inproc_world2.run(_fullgraph_mappings_in_debug_mode):
        assert max(diffs) <= 1e-12, diffs
