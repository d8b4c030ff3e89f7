"""diffcomm under spmd_types' checker (``spmd_types.checker.typecheck()``).

Every diffcomm Function that states a typing rule carries spmd_types' rule made from it
(``spmd_typecheck``); the eager fast path takes ``Function.apply`` while spmd_types
checks; diffcomm's layers type their parameters. So a column -> row MLP and a Llama-style
block (sequence-parallel TP attention and MLP, ring attention, the MoE layer) typecheck
with only their inputs annotated, planted bugs are caught by spmd_types' checker, and a
hand-written Megatron copy/reduce pair with an spmd_types rule passes / is caught.

spmd_types is optional: the tests that need it skip with a reason without it; the ones
about diffcomm alone (nothing imports it, every rule-bearing class carries the rule) run
either way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm._replication import PARTIAL, REPLICATED, Rule, SpmdTypesRule
from diffcomm._replication import P as P_
from diffcomm._replication import R as R_
from diffcomm._replication import V as V_

try:
    import spmd_types  # noqa: F401

    HAVE_SPMD_TYPES = True
except ImportError:
    HAVE_SPMD_TYPES = False

needs_spmd_types = pytest.mark.skipif(
    not HAVE_SPMD_TYPES, reason="spmd-types is not installed (pip install 'diffcomm[spmd-types]')"
)

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64
H, FS = 8, 16  # hidden size, sharded (feature) size: divisible by 2


# ======================================================================================
# diffcomm alone: optional, one source
# ======================================================================================


def test_import_diffcomm_does_not_import_spmd_types() -> None:
    code = (
        "import sys, diffcomm, diffcomm.parallel, diffcomm.spmd\n"
        "import torch\n"
        "x = torch.ones(2)\n"
        "assert 'spmd_types' not in sys.modules, sorted(m for m in sys.modules if 'spmd' in m)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_rule_bearing_function_carries_the_spmd_types_rule_made_from_it() -> None:
    """The single source: each class's ``spmd_typecheck`` wraps the very ``Rule`` object
    its ``spmd`` states, and its keyword-only parameters are ``forward``'s (what spmd_types
    binds); a user Function stating a diffcomm Rule gets one too."""
    import inspect

    from diffcomm.spmd.check import typed_functions

    classes = typed_functions()
    names = {c.__name__ for c in classes}
    # the families the issue names: core and coalesced collectives, mappings, fused TP,
    # vocab-parallel cross entropy, p2p, ring attention
    for expected in (
        "_AllReduce", "_AllGather", "_ReduceScatter", "_AllToAll", "_Broadcast", "_Reduce", "_Gather",
        "_Scatter", "_AllReduceList", "_AllGatherList", "_CopyToRegion", "_ReduceFromRegion",
        "_AllToAllRegion", "_ColumnComm", "_RowRing", "_VocabParallelCrossEntropy", "_Send", "_Recv",
        "_SendRecv", "_Shift", "_PPermute", "_RingAttention",
    ):  # fmt: skip
        assert expected in names, expected
    for c in classes:
        desc = c.__dict__["spmd_typecheck"]
        assert isinstance(desc, SpmdTypesRule), c
        assert desc.rule is c.__dict__["spmd"], c
        params = list(inspect.signature(c.spmd_typecheck).parameters.values())
        fwd = [p for p in inspect.signature(c.forward).parameters if p != "ctx"]
        assert [p.name for p in params[1:]] == fwd, c
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), c

    class Mine(torch.autograd.Function):
        spmd = Rule({dc.spmd.R: dc.spmd.R})

        @staticmethod
        def forward(x: torch.Tensor, group: Any) -> torch.Tensor:
            return x.view_as(x)

    assert isinstance(Mine.__dict__["spmd_typecheck"], SpmdTypesRule)


def test_without_spmd_types_the_interop_tests_skip_with_a_reason(tmp_path: Path) -> None:
    """With spmd_types made unimportable (a module of that name raising ImportError first
    on the path, inherited by the ranks), this file's spmd_types tests skip, naming the
    extra, and the others pass."""
    (tmp_path / "spmd_types.py").write_text("raise ImportError('spmd_types hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", __file__,
         "-k", "not without_spmd_types"],  # (-n 0: one process; the README's -n 2 adds two)
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    counts = re.search(r"(\d+) passed, (\d+) skipped", text)
    assert counts is not None and "failed" not in text and "error" not in text, text
    assert int(counts[1]) == 3 and int(counts[2]) >= 19, text  # 13 planted bugs among them
    assert "spmd-types is not installed (pip install 'diffcomm[spmd-types]')" in text, text


def test_fast_path_condition_follows_function_apply() -> None:
    """The eager fast path (the C++ apply) is taken while ``Function.apply`` is the plain
    classmethod, and the full ``Function.apply`` while anything else (spmd_types' checking
    descriptor) stands there."""
    from diffcomm._replication import spmd_types_checking
    from diffcomm.ops import base

    attrs = torch.autograd.Function.__dict__
    assert not spmd_types_checking(attrs)
    seen: list[type] = []
    orig = attrs["apply"]

    class Descriptor:  # what spmd_types installs while it checks, in miniature
        def __get__(self, obj: Any, cls: Any = None) -> Any:
            bound = orig.__get__(obj, cls)

            def wrapper(*args: Any) -> Any:
                seen.append(cls)
                return bound(*args)

            return wrapper

    class Double(base.FastFunction):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    x = torch.ones(2, requires_grad=True)
    Double.apply(x)
    assert seen == []
    torch.autograd.Function.apply = Descriptor()  # type: ignore[assignment,method-assign]
    try:
        assert spmd_types_checking(attrs)
        Double.apply(x)
    finally:
        torch.autograd.Function.apply = orig  # type: ignore[method-assign]
    assert seen == [Double]
    assert not spmd_types_checking(attrs)


# ======================================================================================
# helpers run on the ranks
# ======================================================================================


def _env() -> tuple[Any, Any]:
    import spmd_types as st
    import torch.distributed as dist

    return st, dist.group.WORLD


def _replicated(*shape: int, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)  # the same on every rank
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def _shard(*shape: int, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1 + dc.get_rank())  # this rank's own
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def _checked(program: Callable[[], None]) -> tuple[str, str] | None:
    """Run ``program`` under spmd_types' checker: ``None`` or (error class, message)."""
    from spmd_types.checker import typecheck

    try:
        with typecheck():
            program()
    except Exception as e:  # the class is asserted by the tests
        return type(e).__name__, str(e)
    return None


def _backward_replicated(st: Any, loss: torch.Tensor) -> None:
    loss.backward()  # a replicated objective: the loss is I in spmd_types' words


def _backward_varying(st: Any, pg: Any, loss: torch.Tensor) -> None:
    # a per-rank loss: the objective is the sum over ranks (spmd_types: V -> P)
    st.reinterpret(loss, pg, src=st.V, dst=st.P).backward()


# ======================================================================================
# no false positive: a TP MLP, a Llama-style block
# ======================================================================================


def _mlp_body() -> dict[str, str]:
    st, pg = _env()
    from spmd_types.checker import typecheck

    col = par.ColumnParallelLinear(H, FS, dtype=F64, seed=0)
    row = par.RowParallelLinear(FS, H, input_is_parallel=True, dtype=F64, seed=1)
    x = _replicated(4, H)
    with typecheck():
        st.assert_type(x, {pg: st.I})  # the only annotation: the input
        y = row(F.gelu(col(x)))
        y.pow(2).mean().backward()
    types = {
        n: repr(st.get_local_type(p)) for n, p in [*col.named_parameters("col"), *row.named_parameters("row")]
    }
    types["y"] = repr(st.get_local_type(y))
    types["x.grad"] = repr(x.grad is not None)
    return types


@needs_spmd_types
def test_column_row_mlp_typechecks(world2: dc.LocalWorld) -> None:
    for types in world2.run(_mlp_body):
        assert types["y"] == "{default_pg: I}", types
        assert types["col.weight"] == types["col.bias"] == types["row.weight"] == "{default_pg: V}", types
        assert types["row.bias"] == "{default_pg: I}", types
        assert types["x.grad"] == "True"


def _fused_body() -> dict[str, Any]:
    """The fused tensor-parallel Functions (``parallel.overlap``: the communication hidden
    behind the matmul) under spmd_types' checker: a comm-overlapped MLP on a replicated
    input, a ring-overlapped sequence-parallel MLP on a sequence chunk."""
    st, pg = _env()
    from spmd_types.checker import typecheck

    out: dict[str, Any] = {}
    col = par.ColumnParallelLinear(H, FS, overlap="comm", dtype=F64, seed=0)
    row = par.RowParallelLinear(FS, H, input_is_parallel=True, dtype=F64, seed=1)
    scol = par.ColumnParallelLinear(H, FS, sequence_parallel=True, overlap="ring", dtype=F64, seed=0)
    srow = par.RowParallelLinear(
        FS, H, input_is_parallel=True, sequence_parallel=True, overlap="ring", dtype=F64, seed=1
    )
    with typecheck():
        x = st.assert_type(_replicated(4, H), {pg: st.I})
        y = row(F.gelu(col(x)))
        y.pow(2).mean().backward()
        out["comm"] = repr(st.get_local_type(y))
        xs = st.assert_type(_shard(2, 3, H), {pg: st.V})  # (S / world, B, H)
        ys = srow(F.gelu(scol(xs)))
        _backward_varying(st, pg, ys.pow(2).sum())
        out["ring"] = repr(st.get_local_type(ys))
    out["grads"] = all(p.grad is not None for m in (col, scol, srow) for p in m.parameters())
    return out


@needs_spmd_types
def test_fused_overlapped_tensor_parallel_functions_typecheck(world2: dc.LocalWorld) -> None:
    for out in world2.run(_fused_body):
        assert out == {"comm": "{default_pg: I}", "ring": "{default_pg: V}", "grads": True}, out


def _ulysses_body() -> str:
    st, pg = _env()
    from spmd_types.checker import typecheck

    with typecheck():
        q, k, v = (st.assert_type(_shard(1, 4, 3, 8), {pg: st.V}) for _ in range(3))  # sequence chunks
        out = par.ulysses_attention(q, k, v, causal=True)
        _backward_varying(st, pg, out.pow(2).sum())
    return repr(st.get_local_type(out))


@needs_spmd_types
def test_ulysses_attention_typechecks(world2: dc.LocalWorld) -> None:
    assert world2.run(_ulysses_body) == ["{default_pg: V}"] * 2


class _LlamaStyleBlock(nn.Module):
    """Sequence-parallel TP attention (pre-norm), a context-parallel ring-attention
    sublayer (head-sharded projections re-sharded to sequence chunks with
    all_to_all_region, Ulysses-style), a sequence-parallel TP MLP and an expert-parallel
    MoE, all over one group; the residual stream is this rank's sequence chunk."""

    def __init__(self) -> None:
        super().__init__()
        ln = lambda: par.SequenceParallelLayerNorm(H, dtype=F64)
        self.norm1, self.norm2, self.norm3, self.norm4 = ln(), ln(), ln(), ln()
        self.attn = par.ParallelSelfAttention(H, 2, causal=True, sequence_parallel=True, dtype=F64, seed=0)
        self.wq, self.wk, self.wv = (
            par.ColumnParallelLinear(H, H, bias=False, sequence_parallel=True, dtype=F64, seed=3 + i)
            for i in range(3)
        )
        self.wo = par.RowParallelLinear(
            H, H, bias=False, input_is_parallel=True, sequence_parallel=True, dtype=F64, seed=6
        )
        self.mlp = par.ParallelMLP(H, 16, sequence_parallel=True, dtype=F64, seed=1)
        # with a shared expert, overlapped with the dispatch (async_op: blocking while checked)
        self.moe = par.ExpertParallelMoE(H, 16, num_experts=4, k=2, shared_expert_size=8, dtype=F64, seed=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (S / world, B, H)
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)

        def heads(t: torch.Tensor) -> torch.Tensor:  # (S, B, H/w) -> (B, heads, S/w, 2)
            return par.all_to_all_region(t.unflatten(-1, (-1, 2)), split_dim=0, concat_dim=2).permute(
                1, 2, 0, 3
            )

        a = par.ring_attention(
            heads(self.wq(h)), heads(self.wk(h)), heads(self.wv(h)), causal=True, layout="contiguous"
        )
        a = par.all_to_all_region(a.permute(2, 0, 1, 3), split_dim=2, concat_dim=0)
        x = x + self.wo(a.flatten(2))
        x = x + self.mlp(self.norm3(x))
        return x + self.moe(self.norm4(x).flatten(0, 1)).view_as(x)


def _block_body(bug: str | None = None) -> tuple[str, tuple[str, str] | None]:
    st, pg = _env()
    torch.manual_seed(0)
    block = _LlamaStyleBlock()
    x = _shard(4, 2, H)

    def program() -> None:
        st.assert_type(x, {pg: st.V})  # the only annotation: the input (a sequence chunk)
        y = block(x)
        loss = y.pow(2).sum() + block.moe.aux_loss
        _backward_varying(st, pg, loss)

    result = _checked(program)
    grads = all(p.grad is not None for p in block.parameters())
    return f"grads={grads}", result


@needs_spmd_types
def test_llama_style_block_with_ring_attention_and_moe_typechecks(world2: dc.LocalWorld) -> None:
    for grads, result in world2.run(_block_body):
        assert result is None, result
        assert grads == "grads=True"


def _ops_body() -> dict[str, str]:
    """The core, rooted, coalesced and point-to-point ops under spmd_types' checker: each
    output typed by its rule (spmd_types has no broadcast, gather, scatter or p2p)."""
    st, pg = _env()
    from spmd_types.checker import typecheck

    r, w = dc.get_rank(), dc.get_world_size()
    t: dict[str, str] = {}
    with typecheck():
        v = st.assert_type(_shard(4, 2), {pg: st.V})
        rep = st.assert_type(_replicated(4, 2), {pg: st.R})  # its gradient partial
        outs = {
            "all_reduce": dc.all_reduce(v),
            "all_gather": dc.all_gather(v),
            "reduce_scatter": dc.reduce_scatter(v),
            "all_to_all": dc.all_to_all(v),
            "broadcast": dc.broadcast(v, src=0),
            "reduce": dc.reduce(v, dst=0),
            "gather": dc.gather(v, dst=0),
            "scatter": dc.scatter(rep, src=0),
            "shift": dc.shift(v),
            "ppermute": dc.ppermute(v, [(i, (i + 1) % w) for i in range(w)]),
            "sendrecv": dc.sendrecv(v, dst=(r + 1) % w, src=(r - 1) % w),
            "all_reduce_coalesced": dc.all_reduce_coalesced([v, v * 2])[1],
        }
        if r == 0:
            outs["send"] = dc.send(v, dst=1)
        elif r == 1:
            outs["recv"] = dc.recv(src=0)
        t.update({k: repr(st.get_local_type(y)) for k, y in outs.items()})
        loss = sum(y.sum() for y in outs.values())  # (send's token too: its backward receives)
        _backward_varying(st, pg, loss)
        try:
            dc.all_reduce(st.reinterpret(v, pg, src=st.V, dst=st.P), op="max")
            t["max of P"] = "not caught"
        except st.SpmdTypeError as e:
            t["max of P"] = str(e).splitlines()[0]
    t["grad"] = repr(v.grad is not None)
    return t


@needs_spmd_types
def test_core_rooted_coalesced_and_p2p_ops_are_typed_by_their_rules(world2: dc.LocalWorld) -> None:
    for rank, t in enumerate(world2.run(_ops_body)):
        for op in ("all_reduce", "all_gather", "broadcast", "all_reduce_coalesced"):
            assert t[op] == "{default_pg: R}", (op, t[op])  # the sum convention: partial gradient
        for op in (
            "reduce_scatter",
            "all_to_all",
            "reduce",
            "gather",
            "scatter",
            "shift",
            "ppermute",
            "sendrecv",
        ):
            assert t[op] == "{default_pg: V}", (op, t[op])
        # a received value is V; send's token (0 on every rank) is R
        assert t["send" if rank == 0 else "recv"] == (
            "{default_pg: R}" if rank == 0 else "{default_pg: V}"
        ), t
        assert t["max of P"].startswith("diffcomm.all_reduce: argument 'x' is P"), t["max of P"]
        assert t["grad"] == "True"


# ======================================================================================
# planted bugs, caught by spmd_types' checker (the list in docs/spmd_types.md)
# ======================================================================================


def _col() -> par.ColumnParallelLinear:
    return par.ColumnParallelLinear(H, FS, dtype=F64, seed=0)


def _row() -> par.RowParallelLinear:
    return par.RowParallelLinear(FS, H, input_is_parallel=True, dtype=F64, seed=1)


def all_reduce_under_a_replicated_objective(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_replicated(3, H), {pg: st.I})
    s = _col()(x).sum(-1, keepdim=True)  # each rank's share of a sum over the features
    y = par.reduce_from_region(s) if fixed else dc.all_reduce(s)
    y.pow(2).mean().backward()  # a replicated loss


def all_gather_under_a_replicated_objective(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_replicated(3, H), {pg: st.I})
    h = _col()(x)
    y = par.gather_from_region(h, dim=-1) if fixed else dc.all_gather(h, dim=-1)
    y.pow(2).mean().backward()


def all_gather_from_sequence_into_a_replicated_loss(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_shard(2, H), {pg: st.V})
    y = par.gather_from_sequence(x) if fixed else par.all_gather_from_sequence(x)
    y.pow(2).mean().backward()


def missing_copy_to_region(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_replicated(3, H), {pg: st.I})  # e.g. a replicated LayerNorm's output
    w = st.assert_type(_shard(FS // 2, H), {pg: st.V})  # a column-parallel weight
    h = F.linear(par.copy_to_region(x) if fixed else x, w)
    par.gather_from_region(h).pow(2).mean().backward()


def sequence_parallel_layernorm_not_reduced(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_shard(2, H), {pg: st.V})  # this rank's sequence chunk
    if fixed:
        y = par.SequenceParallelLayerNorm(H, dtype=F64)(x)
    else:  # a replicated LayerNorm weight meets the chunk: its gradient is never summed
        w = st.assert_type(torch.ones(H, dtype=F64, requires_grad=True), {pg: st.I})
        y = F.layer_norm(x, (H,), w)
    _backward_varying(st, pg, y.pow(2).sum())


def reduce_from_region_twice(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_shard(3, FS // 2), {pg: st.V})
    y = _row()(x)  # reduces already
    y = y if fixed else par.reduce_from_region(y)
    y.pow(2).mean().backward()


def all_reduce_after_a_row_parallel_layer(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_shard(3, FS // 2), {pg: st.V})
    y = _row()(x)
    y = y if fixed else dc.all_reduce(y)
    y.pow(2).mean().backward()


def bias_added_before_the_reduction(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_shard(3, FS // 2), {pg: st.V})
    w = st.assert_type(_shard(H, FS // 2), {pg: st.V})  # a row-parallel weight
    b = st.assert_type(_replicated(H), {pg: st.I})
    y = par.reduce_from_region(F.linear(x, w)) + b if fixed else par.reduce_from_region(F.linear(x, w, b))
    y.pow(2).mean().backward()


def copy_to_region_twice(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_replicated(3, H), {pg: st.I})
    c = par.copy_to_region(x)
    c = c if fixed else par.copy_to_region(c)
    w = st.assert_type(_shard(FS // 2, H), {pg: st.V})
    par.gather_from_region(F.linear(c, w)).pow(2).mean().backward()


def copy_to_region_of_a_varying_tensor(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_shard(3, H), {pg: st.V})
    x = par.gather_from_sequence(x) if fixed else x  # replicate it first
    y = _col()(x)  # copy_to_region inside
    par.gather_from_region(y).pow(2).mean().backward()


def replicated_input_to_row_parallel(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_replicated(3, H), {pg: st.I})
    h = _col()(x) if fixed else st.assert_type(_replicated(3, FS // 2), {pg: st.I})
    _row()(h).pow(2).mean().backward()


def vocab_parallel_cross_entropy_on_whole_logits(fixed: bool) -> None:
    st, pg = _env()
    logits = _shard(4, 6) if fixed else _replicated(4, 12)
    st.assert_type(logits, {pg: st.V if fixed else st.I})
    target = st.assert_type(torch.tensor([0, 3, 5, 11]), {pg: st.I})
    par.vocab_parallel_cross_entropy(logits, target).mean().backward()


def gather_from_region_of_a_replicated_tensor(fixed: bool) -> None:
    st, pg = _env()
    x = st.assert_type(_replicated(3, H), {pg: st.I})
    h = _col()(x) if fixed else x
    par.gather_from_region(h).pow(2).mean().backward()


#: (program, a string spmd_types' error must contain)
BUGS: dict[str, tuple[Callable[[bool], None], str]] = {
    "all_reduce under a replicated objective": (all_reduce_under_a_replicated_objective, "Replicate loss"),
    "all_gather under a replicated objective": (all_gather_under_a_replicated_objective, "Replicate loss"),
    "all_gather_from_sequence into a replicated loss": (
        all_gather_from_sequence_into_a_replicated_loss,
        "Replicate loss",
    ),
    "missing copy_to_region": (missing_copy_to_region, "Invariant type"),
    "sequence-parallel LayerNorm not reduced": (sequence_parallel_layernorm_not_reduced, "Invariant type"),
    "reduce_from_region twice": (reduce_from_region_twice, "diffcomm.parallel.reduce_from_region"),
    "all_reduce after a row-parallel layer": (all_reduce_after_a_row_parallel_layer, "diffcomm.all_reduce"),
    "bias added before the reduction": (bias_added_before_the_reduction, "Invariant type"),
    "copy_to_region twice": (copy_to_region_twice, "diffcomm.parallel.copy_to_region"),
    "copy_to_region of a varying tensor": (
        copy_to_region_of_a_varying_tensor,
        "diffcomm.parallel.copy_to_region",
    ),
    "replicated input to RowParallelLinear(input_is_parallel)": (
        replicated_input_to_row_parallel,
        "Invariant type",
    ),
    "vocab-parallel cross entropy on whole logits": (
        vocab_parallel_cross_entropy_on_whole_logits,
        "diffcomm.parallel.loss.VocabParallelCrossEntropy: argument 'logits' is I",
    ),
    "gather_from_region of a replicated tensor": (
        gather_from_region_of_a_replicated_tensor,
        "diffcomm.parallel.gather_from_region",
    ),
}


def _bug_body(name: str) -> tuple[Any, Any]:
    prog = BUGS[name][0]
    with dc.debug(False):  # its cross-rank checks may catch the bug first; the fix runs in it
        bad = _checked(lambda: prog(False))
    return bad, _checked(lambda: prog(True))


@needs_spmd_types
@pytest.mark.parametrize("name", list(BUGS))
def test_planted_bug_is_caught_by_spmd_types_and_its_fix_passes(world2: dc.LocalWorld, name: str) -> None:
    want = BUGS[name][1]
    for bad, good in world2.run(_bug_body, name):
        assert bad is not None, f"{name}: not caught"
        assert bad[0] == "SpmdTypeError", bad
        assert want in bad[1], (want, bad[1])
        assert good is None, good


@needs_spmd_types
def test_bug_block_is_caught(world2: dc.LocalWorld) -> None:
    """The Llama-style block's input declared replicated (the whole sequence) instead of
    this rank's chunk: the sequence-parallel layer norm's copy_to_region'd weight meets
    an I activation."""

    def body() -> tuple[str, str] | None:
        st, pg = _env()
        torch.manual_seed(0)
        block = _LlamaStyleBlock()
        x = st.assert_type(_replicated(4, 2, H), {pg: st.I})
        return _checked(lambda: block(x))

    for result in world2.run(body):
        assert result is not None and result[0] == "SpmdTypeError", result


# ======================================================================================
# a hand-written Megatron copy / reduce pair with an spmd_types rule
# ======================================================================================


class _Copy(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region, written by hand."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None

    @staticmethod
    def spmd_typecheck(*, x: torch.Tensor, group: Any) -> Any:
        from spmd_types import I, R, rules

        return rules.reinterpret(x, group, src=I, dst=R)


class _Reduce(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region, written by hand."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.clone()
        torch.distributed.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None

    @staticmethod
    def spmd_typecheck(*, x: torch.Tensor, group: Any) -> Any:
        from spmd_types import I, P, V, get_local_type, rules
        from spmd_types.types import normalize_axis

        src = P if get_local_type(x).get(normalize_axis(group)) is P else V
        return rules.all_reduce(x, group, src=src, dst=I)


class _RuledCopy(torch.autograd.Function):
    """The same copy, its rule stated in diffcomm's vocabulary (``spmd = Rule(...)``): it
    gets spmd_types' rule made from it."""

    spmd = Rule({R_: R_}, out_grad=PARTIAL, in_grad=REPLICATED, group="group")
    forward = _Copy.forward
    backward = _Copy.backward


class _RuledReduce(torch.autograd.Function):
    spmd = Rule({V_: R_, P_: R_}, out_grad=REPLICATED, group="group")
    forward = _Reduce.forward
    backward = _Reduce.backward


def _megatron_body() -> dict[str, Any]:
    st, pg = _env()
    col = _col()
    row = _row()
    x = _replicated(3, H)

    def mlp(copy_first: bool, reduce_twice: bool, varying_input: bool, ruled: bool = False) -> None:
        copy, reduce = (_RuledCopy, _RuledReduce) if ruled else (_Copy, _Reduce)
        inp = st.assert_type(_shard(3, H) if varying_input else x, {pg: st.V if varying_input else st.I})
        h = copy.apply(inp, pg) if copy_first else inp
        h = F.gelu(F.linear(h, col.weight, col.bias))
        y = reduce.apply(F.linear(h, row.weight), pg)
        if reduce_twice:
            y = reduce.apply(y, pg)
        (y + row.bias).pow(2).mean().backward()

    st.assert_type(col.weight, {pg: st.V})
    st.assert_type(col.bias, {pg: st.V})
    st.assert_type(row.weight, {pg: st.V})
    st.assert_type(row.bias, {pg: st.I})
    return {
        "correct": _checked(lambda: mlp(True, False, False)),
        "copy missing": _checked(lambda: mlp(False, False, False)),
        "reduced twice": _checked(lambda: mlp(True, True, False)),
        "copy of a varying input": _checked(lambda: mlp(True, False, True)),
        "ruled: correct": _checked(lambda: mlp(True, False, False, ruled=True)),
        "ruled: copy missing": _checked(lambda: mlp(False, False, False, ruled=True)),
        "ruled: reduced twice": _checked(lambda: mlp(True, True, False, ruled=True)),
        "ruled: copy of a varying input": _checked(lambda: mlp(True, False, True, ruled=True)),
        "with diffcomm's ops": _checked(
            lambda: (
                (row(F.gelu(col(st.assert_type(_replicated(3, H), {pg: st.I})))) + 0).pow(2).mean().backward()
            )
        ),
    }


@needs_spmd_types
def test_hand_written_megatron_pair_with_an_spmd_types_rule(world2: dc.LocalWorld) -> None:
    for res in world2.run(_megatron_body):
        assert res["correct"] is None, res["correct"]
        assert res["with diffcomm's ops"] is None, res["with diffcomm's ops"]
        assert res["ruled: correct"] is None, res["ruled: correct"]
        for misuse in ("copy missing", "reduced twice", "copy of a varying input"):
            for key in (misuse, f"ruled: {misuse}"):
                assert res[key] is not None and res[key][0] == "SpmdTypeError", (key, res[key])
        assert "_RuledReduce: argument 'x' is I" in res["ruled: reduced twice"][1]
        assert "_RuledCopy: argument 'x' is V" in res["ruled: copy of a varying input"][1]


@needs_spmd_types
def test_debug_modes_own_checks_are_invisible_to_spmd_types(world2: dc.LocalWorld) -> None:
    """Debug mode's replication check of a mapping computes a fingerprint of the typed
    tensor; under spmd_types' checker that arithmetic raised SpmdTypeError ("args[1]
    missing axis default_pg") on a correct program. It runs with spmd_types paused."""
    with dc.debug(True):
        for res in world2.run(_megatron_body):
            assert res["correct"] is None, res["correct"]
            assert res["with diffcomm's ops"] is None, res["with diffcomm's ops"]
            assert res["copy missing"] is not None and res["copy missing"][0] == "SpmdTypeError"


# ======================================================================================
# the example mixing both libraries
# ======================================================================================


@needs_spmd_types
def test_example_with_spmd_types_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "with_spmd_types.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "spmd_types: the mixed model typechecks" in out.stdout, out.stdout
    assert "spmd_types caught" in out.stdout, out.stdout


# ======================================================================================
# all ranks in one process: spmd_types' process-wide patches, counted
# ======================================================================================


def _spmd_types_patches() -> tuple[Any, ...]:
    """What spmd_types' checker patches process-wide while a thread checks (``Function.apply``,
    vmap's ``_flat_vmap``, the module backward hooks' set-up)."""
    from torch._functorch import vmap as functorch_vmap
    from torch.utils import hooks as torch_hooks

    bh = torch_hooks.BackwardHook
    return (
        torch.autograd.Function.__dict__["apply"],
        functorch_vmap._flat_vmap,
        bh.__dict__["setup_input_hook"],
        bh.__dict__["setup_output_hook"],
    )


def _put_back(saved: tuple[Any, ...]) -> None:
    from torch._functorch import vmap as functorch_vmap
    from torch.utils import hooks as torch_hooks

    torch.autograd.Function.apply = saved[0]
    functorch_vmap._flat_vmap = saved[1]
    torch_hooks.BackwardHook.setup_input_hook = saved[2]
    torch_hooks.BackwardHook.setup_output_hook = saved[3]


@needs_spmd_types
def test_in_process_ranks_inside_spmd_types_checker_at_once_equal_real_processes(
    world2: dc.LocalWorld,
) -> None:
    """The ranks of an in-process world are threads that hand over inside a collective, so
    both are inside ``typecheck()`` at once. spmd_types installs its process-wide patches
    per entering thread (its FIXME: no count): the second rank wrapped the first's
    ``Function.apply`` patch again (every Function typed twice on rank 1: the correct MLP
    passed on rank 0 and was refused on rank 1, "Invariant cannot mix with V", then the
    world desynced), and the first to leave removed the others under the second. diffcomm
    counts them for an in-process world: the verdicts, types and values equal real
    processes', and every patch is gone after the run."""
    saved = _spmd_types_patches()
    try:
        with dc.LocalWorld(2, in_process=True) as inproc:
            for body in (_mlp_body, _fused_body, _ulysses_body):
                assert inproc.run(body) == world2.run(body), body.__name__
            for name in BUGS:  # each planted bug caught, its fix passed, as on processes
                assert inproc.run(_bug_body, name) == world2.run(_bug_body, name), name
        left = _spmd_types_patches()
    finally:
        _put_back(saved)
    assert left == saved, "spmd_types' patches left installed after the in-process run"


@needs_spmd_types
def test_debug_mode_inside_spmd_types_checker_on_in_process_ranks(
    local_worlds: Callable[..., dc.LocalWorld],
) -> None:
    """Debug mode's cross-rank field check (a layer's forward hook compares whether its
    parameters need grad) inside spmd_types' checker on in-process ranks: the checker
    typed the check's raw all_gather of field codes and refused it ("tensor has no type
    for axis"), so the correct TP MLP raised in debug mode only."""
    with dc.debug(True):
        for types in local_worlds(2, in_process=True).run(_mlp_body):
            assert types["y"] == "{default_pg: I}", types


@needs_spmd_types
def test_debug_mode_size_check_inside_spmd_types_checker_on_in_process_ranks(
    local_worlds: Callable[..., dc.LocalWorld],
) -> None:
    """Ulysses attention's uneven all_to_all in debug mode inside spmd_types' checker, on
    in-process ranks: debug mode's exchange of the split sizes (host integers) was typed by
    the checker and refused ("tensor has no type for axis")."""
    inproc = local_worlds(2, in_process=True)
    with dc.debug(False):
        want = inproc.run(_ulysses_body)
    with dc.debug(True):
        assert inproc.run(_ulysses_body) == want


def _all_to_all_received_sizes_body() -> tuple[str, list[float], list[float]]:
    """An all_to_all given only its input split sizes (the received sizes exchanged as
    host integers) inside spmd_types' checker: the output's type, values and gradient."""
    st, pg = _env()
    from spmd_types.checker import typecheck

    r = dc.get_rank()
    with typecheck():
        x = st.assert_type(torch.arange(4.0, dtype=F64).add(10 * r).requires_grad_(), {pg: st.V})
        y = dc.all_to_all(x, 0, 0, input_split_sizes=[1 + r, 3 - r])
        _backward_varying(st, pg, (y * y).sum())
    assert x.grad is not None
    return repr(st.get_local_type(y)), y.tolist(), x.grad.tolist()


@needs_spmd_types
def test_all_to_all_received_sizes_inside_spmd_types_checker_on_in_process_ranks(
    world2: dc.LocalWorld, local_worlds: Callable[..., dc.LocalWorld]
) -> None:
    """The received sizes' exchange (host integers, no program data) runs with the checker
    paused: on in-process ranks the checker typed its raw all_to_all and refused it ("tensor
    has no type for axis") where real processes ran the correct program."""
    with dc.debug(False):
        want = world2.run(_all_to_all_received_sizes_body)
        assert local_worlds(2, in_process=True).run(_all_to_all_received_sizes_body) == want
    assert want == [
        ("{default_pg: V}", [0.0, 10.0, 11.0], [0.0, 2.0, 4.0, 6.0]),
        ("{default_pg: V}", [1.0, 2.0, 3.0, 12.0, 13.0], [20.0, 22.0, 24.0, 26.0]),
    ]


def _ring_attention_lengths_body() -> tuple[str, float]:
    """Ring attention with no ``seq_len`` (its lengths checked equal: an exchange of host
    integers) inside spmd_types' checker: the output's type and its sum."""
    st, pg = _env()
    from spmd_types.checker import typecheck

    with typecheck():
        q, k, v = (st.assert_type(_shard(1, 2, 4, 8), {pg: st.V}) for _ in range(3))  # sequence chunks
        out = par.ring_attention(q, k, v, causal=True)
        _backward_varying(st, pg, out.pow(2).sum())
    return repr(st.get_local_type(out)), float(out.detach().sum())


@needs_spmd_types
def test_ring_attention_lengths_check_inside_spmd_types_checker_on_in_process_ranks(
    world2: dc.LocalWorld, local_worlds: Callable[..., dc.LocalWorld]
) -> None:
    """The lengths' exchange (``exchange_sizes``: host integers) runs with the checker
    paused: on in-process ranks the checker typed its raw all_gather and refused it
    ("all_gather_single: tensor has no type for axis") where real processes ran."""
    with dc.debug(False):
        want = world2.run(_ring_attention_lengths_body)
        assert local_worlds(2, in_process=True).run(_ring_attention_lengths_body) == want
    assert [t for t, _ in want] == ["{default_pg: V}"] * 2


def _coalesced_body() -> list[str]:
    """A coalesced all_reduce and all_gather inside spmd_types' checker: the results' types."""
    st, pg = _env()
    from spmd_types.checker import typecheck

    with typecheck():
        xs = [st.assert_type(_shard(4, 3), {pg: st.V}) for _ in range(2)]
        ys = [*dc.all_reduce_coalesced(xs), *dc.all_gather_coalesced(xs, 0)]
    return [repr(st.get_local_type(y)) for y in ys]


@needs_spmd_types
def test_debug_mode_coalesced_check_inside_spmd_types_checker_on_in_process_ranks(
    world2: dc.LocalWorld, local_worlds: Callable[..., dc.LocalWorld]
) -> None:
    """Debug mode's check of a coalesced list (the shapes' codes: host integers) runs with
    the checker paused: on in-process ranks it refused their raw all_gather ("all_gather_single:
    tensor has no type for axis") where real processes ran the correct program."""
    with dc.debug(True):
        want = world2.run(_coalesced_body)
        assert local_worlds(2, in_process=True).run(_coalesced_body) == want
    assert want == [["{default_pg: R}"] * 4] * 2


def _avg_of_invariant_body(op: str, coalesced: bool = False) -> tuple[Any, list[float], list[float], Any]:
    st, pg = _env()

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        return dc.all_reduce_coalesced([t], op=op)[0] if coalesced else dc.all_reduce(t, op=op)

    x = _replicated(3, H)
    serial = (8 * x.detach()).flatten().tolist()  # d/dx sum((2x)^2), the loss counted once

    def program() -> None:
        y = reduce(st.assert_type(x, {pg: st.I}) * 2, op)  # the mean of equal values
        y.pow(2).sum().backward()

    ok = _checked(program)
    got = x.grad.flatten().tolist() if x.grad is not None else []
    r = _replicated(3, H)
    bad = _checked(lambda: reduce(st.assert_type(r, {pg: st.R}), op).sum().backward())
    return ok, got, serial, bad


@needs_spmd_types
@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_all_reduce_avg_of_an_invariant_value_typechecks(world2: dc.LocalWorld, op: str) -> None:
    """``all_reduce(op="avg")`` of a replicated value is an identity whose backward
    averages the gradient (``max`` / ``min`` too: every rank ties): with an ``I`` input (a
    whole gradient) its gradient is the serial one and ``dc.spmd_check`` passes it;
    spmd_types' checker refused it (diffcomm's translated rule only took ``V`` / ``P``). An
    ``R`` input requiring grad stays refused, as ``dc.spmd_check`` refuses it."""
    for ok, got, serial, bad in world2.run(_avg_of_invariant_body, op):
        assert ok is None, ok
        assert got == pytest.approx(serial, rel=1e-12)
        assert bad is not None and bad[0] == "SpmdTypeError" and "expected I" in bad[1], bad


@needs_spmd_types
@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_all_reduce_coalesced_avg_of_an_invariant_value_typechecks(world2: dc.LocalWorld, op: str) -> None:
    """``all_reduce_coalesced`` is ``all_reduce`` per element under spmd_types' checker too:
    its ``op="avg"`` (max, min) of an ``I`` value was refused ("expected V or P")."""
    for ok, got, serial, bad in world2.run(_avg_of_invariant_body, op, True):
        assert ok is None, ok
        assert got == pytest.approx(serial, rel=1e-12)
        assert bad is not None and bad[0] == "SpmdTypeError" and "expected I" in bad[1], bad
