"""Replication types (``dc.spmd_check``): the planted-bug corpus raises at the first wrong
op naming it, every fix passes, nothing is installed while no check is active, and the
check raises nothing on correct parallel code — every layer, mapping and block of
``diffcomm.parallel``, context and expert parallelism, the pipeline runner, the notebooks'
parallel code and a Llama-style tensor-parallel model."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm.testing import spmd_corpus as corpus

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64
H = 4  # hidden size


# ======================================================================================
# the corpus
# ======================================================================================


def _bug_without_debug_mode(name: str) -> tuple[str, str] | None:
    """``corpus.run(name, False)`` with debug mode off: its cross-rank checks may catch a
    planted bug first (its fix runs in the suite's debug mode too: never refused)."""
    with dc.debug(False):
        return corpus.run(name, False)


@pytest.mark.parametrize("name", [b.name for b in corpus.BUGS])
def test_planted_bug_raises_at_its_op_and_its_fix_passes(world2: dc.LocalWorld, name: str) -> None:
    bug = next(b for b in corpus.BUGS if b.name == name)

    def body() -> tuple[object, object]:
        return _bug_without_debug_mode(name), corpus.run(name, True)

    for bad, good in world2.run(body):
        assert bad is not None, f"{name}: no error"
        kind, msg = bad
        assert kind == "SPMDTypeError", msg
        for part in bug.names:
            assert part in msg, (part, msg)
        assert good is None, good


@pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in_process"])
def test_corpus_on_three_ranks(local_worlds: Callable[..., dc.LocalWorld], in_process: bool) -> None:
    """Every bug of the corpus on 3 ranks (odd world: no even-split assumption), also in an
    in-process world, whose ranks' checks are active at once in one process (each rank's
    declarations go to its own check: once they went to the last rank's)."""

    def body() -> list[tuple[str, object, object]]:
        return [(b.name, _bug_without_debug_mode(b.name), corpus.run(b.name, True)) for b in corpus.BUGS]

    assert len(corpus.BUGS) >= 20
    for per_rank in local_worlds(3, in_process=in_process).run(body):
        for (name, bad, good), bug in zip(per_rank, corpus.BUGS, strict=True):
            assert bad is not None and bad[0] == "SPMDTypeError", (name, bad)
            assert all(part in bad[1] for part in bug.names), (name, bad)
            assert good is None, (name, good)


@pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in_process"])
def test_a_layer_made_where_a_freed_typed_layer_was_is_typed_by_its_rule(
    local_worlds: Callable[..., dc.LocalWorld], in_process: bool
) -> None:
    """A layer the check typed, dropped inside the block, and a new layer that CPython may
    put at its address (the same ``id()``): the new layer's parameters are typed by its own
    rule (a column-parallel weight is varying). The check kept the ids of the layers it had
    typed, not the layers: a new layer at a freed one's address passed for typed and its
    weight for an untyped replicated parameter. Whether an address is reused depends on the
    allocator and the garbage collector, which differ between the ranks: in
    test_corpus_on_three_ranks one rank raised where the others did not ('missing
    copy_to_region', whose LayerNorm is dropped before its ColumnParallelLinear is made) and
    the ranks desynced. Here each layer is made right after a typed one is dropped, where
    CPython reuses the address (it did on every rank before the fix)."""

    def body() -> list[tuple[str, bool]]:
        x = torch.zeros(2, H, dtype=F64)
        kinds = []
        with dc.spmd_check():
            dropped: set[int] = set()
            kept: list[nn.Module] = []  # each new layer stays alive: the next takes a new place
            for _ in range(5):
                ln = nn.LayerNorm(H, dtype=F64)
                ln(x)  # typed at its call
                dropped.add(id(ln))
                del ln
                col = par.ColumnParallelLinear(H, 2 * H, dtype=F64, seed=0)
                kinds.append((dc.spmd.type_of(dc.spmd.module(col).weight).value, id(col) in dropped))
                kept.append(col)
        return kinds

    for kinds in local_worlds(2, in_process=in_process).run(body):
        assert all(kind == "varying" for kind, _ in kinds), kinds  # (kind, at a dropped layer's id)


@pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in_process"])
def test_another_ranks_backward_does_not_reset_this_ranks_gradient_kinds(
    local_worlds: Callable[..., dc.LocalWorld], in_process: bool
) -> None:
    """A gradient kind fixed after a backward (for the next graph) stays fixed when another
    rank's backward ends later. The count of backward passes that retires the kinds of a
    graph already backpropagated was one per process: in an in-process world every rank's
    backward advanced it, so the rank that left its backward first, and fixed a kind before
    the next collective, saw it retired and missed the clash the other rank raised (it
    raised only at the gradient check on leaving: verdicts that differed between ranks)."""

    def body() -> str:
        try:
            with dc.spmd_check():
                w = nn.Parameter(torch.ones(H, H, dtype=F64))
                x = dc.spmd.varying(torch.full((3, H), 1.0 + dc.get_rank(), dtype=F64))
                (dc.all_reduce(x @ w) * x).sum().backward()  # a varying loss; a collective in backward
                _ = x @ w  # w's gradient partial: it meets a varying value
                dc.all_reduce(dc.spmd.varying(torch.ones(1)))  # a collective between
                par.copy_to_region(w)  # w's gradient replicated: a clash
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for msg in local_worlds(2, in_process=in_process).run(body):
        assert msg.startswith("diffcomm.spmd_check: parallel.copy_to_region at") and "clashes" in msg, msg


def test_error_is_a_type_error_naming_op_argument_types_and_fix(world2: dc.LocalWorld) -> None:
    def body() -> str:
        x = torch.ones(3)
        try:
            with dc.spmd_check():
                par.reduce_from_region(par.reduce_from_region(dc.spmd.varying(x)))
        except TypeError as e:
            assert isinstance(e, dc.SPMDTypeError) and issubclass(dc.SPMDTypeError, TypeError)
            return str(e)
        return "no error"

    msg = world2.run(body)[0]
    assert "parallel.reduce_from_region" in msg and "`x` is replicated" in msg, msg
    assert "expected varying or partial" in msg and "twice" in msg and "test_spmd.py:" in msg, msg


# ======================================================================================
# zero cost when off
# ======================================================================================


def test_nothing_installed_outside_a_check(world2: dc.LocalWorld) -> None:
    """Outside a check: no torch function mode, no module hook, every op's forward and
    AsyncTensor.wait / get_rank the originals; inside: all of them installed."""

    def state() -> dict[str, object]:
        from torch.nn.modules import module as M

        from diffcomm import _replication as T
        from diffcomm.ops import all_reduce as C
        from diffcomm.ops import engine as E
        from diffcomm.spmd import check as K

        return {
            "modes": len(torch.overrides._get_current_function_mode_stack()),
            "hooks": len(M._global_forward_pre_hooks),
            "forward": C._AllReduce.__dict__["forward"].__func__,
            "wait": E.AsyncTensor.__dict__["wait"],
            "get_rank": dc.get_rank,
            "hook": T.HOOK[0],
            "patched": len(K._PATCHED),
        }

    def body() -> list[bool]:
        before = state()
        with dc.spmd_check():
            inside = state()
            dc.all_reduce(dc.spmd.varying(torch.ones(2)))
        after = state()
        return [
            before == after,
            before["modes"] == 0 and before["hook"] is None and before["patched"] == 0,
            inside["modes"] == 1 and inside["hooks"] == before["hooks"] + 1,
            inside["forward"] is not before["forward"] and inside["wait"] is not before["wait"],
            type(dc.get_rank()) is int,
        ]

    for flags in world2.run(body):
        assert all(flags), flags


def test_every_op_mapping_and_layer_states_its_rule() -> None:
    from diffcomm.ops.base import CommOp, ListOp
    from diffcomm.spmd.check import typed_functions, typed_layers

    def subclasses(c: type) -> list[type]:
        return [s for d in c.__subclasses__() for s in (d, *subclasses(d))]

    # diffcomm's own ops (a user's op classes defined in this process, as
    # tests/ops/test_adding_an_op.py's, state no rule of their own)
    ops = {
        c
        for base in (CommOp, ListOp)
        for c in subclasses(base)
        if "transpose" in c.__dict__ and c.__module__.startswith("diffcomm.")
    }
    assert ops and ops <= set(typed_functions()), sorted(c.__name__ for c in ops - set(typed_functions()))
    layers = {  # (the corpus in diffcomm.testing holds users' programs, not layers)
        c
        for c in subclasses(par.ParallelModule)
        if c.__module__.startswith("diffcomm") and not c.__module__.startswith("diffcomm.testing")
    }
    bases = {par.ParallelModule, par.layers._ParallelLinear, par.blocks._Block}  # no layer of their own
    assert layers - bases <= set(typed_layers())
    assert par.ExpertParallelMoE in typed_layers()


def test_docs_table_is_generated_from_the_rules() -> None:
    """docs/spmd_types.md includes the pages the docs extension generates from the rules on
    the classes and from the corpus (never a hand-written table), and they are current."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import diffcomm_docs

    from diffcomm.spmd.check import typed_functions, typing_table

    page = (ROOT / "docs" / "spmd_types.md").read_text()
    assert "```{include} _generated/spmd_table.md" in page
    assert "```{include} _generated/spmd_corpus.md" in page
    table = diffcomm_docs.spmd_table_page()
    assert typing_table() in table
    for cls in typed_functions():  # every rule-bearing class has its row
        name = cls.__dict__.get("name") or cls.__name__
        assert name in table, name
    corpus_page = diffcomm_docs.spmd_corpus_page()
    assert all(b.name in corpus_page for b in corpus.BUGS)
    assert all(name in corpus_page for name in corpus.CORRECT)


# ======================================================================================
# no false positive: diffcomm.parallel
# ======================================================================================


def test_parallel_layers_and_blocks_pass(local_worlds: object) -> None:
    """Every layer and block of diffcomm.parallel, forward + backward under the check."""

    def layers_body() -> list[str]:
        from diffcomm import rng

        n, r = dc.get_world_size(), dc.get_rank()
        rng.model_parallel_seed(7, tp_rank=r)
        x = torch.randn(12, 2, 6, dtype=F64)  # [s, b, h], replicated
        ran = []

        def step(name: str, fn: object) -> None:
            with dc.spmd_check():
                out = fn()  # type: ignore[operator]
                (out.pow(2).mean() if dc.spmd.type_of(out) is dc.spmd.R else out.pow(2).sum()).backward()
            ran.append(name)

        kw = {"dtype": F64, "seed": 0}
        col, row = par.ColumnParallelLinear, par.RowParallelLinear

        def xs() -> torch.Tensor:  # this rank's sequence chunk, sliced inside the check: varying
            r = dc.get_rank()
            return x[r * 12 // n : (r + 1) * 12 // n]

        def h() -> torch.Tensor:  # a feature shard (per-rank data)
            return dc.spmd.varying(torch.randn(12, 2, 12 // n, dtype=F64))

        step("column", lambda: col(6, 12, **kw)(x))
        step("column gather", lambda: col(6, 12, gather_output=True, **kw)(x))
        step("column sp", lambda: col(6, 12, sequence_parallel=True, **kw)(xs()))
        step("column comm", lambda: col(6, 12, overlap="comm", **kw)(x))
        step("column ring", lambda: col(6, 12, sequence_parallel=True, overlap="ring", **kw)(xs()))
        step("row", lambda: row(12, 6, input_is_parallel=True, **kw)(h()))
        step("row scatter", lambda: row(12, 6, **kw)(torch.randn(12, 2, 12, dtype=F64)))
        step("row sp", lambda: row(12, 6, input_is_parallel=True, sequence_parallel=True, **kw)(h()))
        step(
            "row ring",
            lambda: row(12, 6, input_is_parallel=True, sequence_parallel=True, overlap="ring", **kw)(h()),
        )
        ids = torch.randint(0, 12, (12, 2))
        step("embedding", lambda: par.VocabParallelEmbedding(12, 6, **kw)(ids))
        step("embedding sp", lambda: par.VocabParallelEmbedding(12, 6, sequence_parallel=True, **kw)(ids))
        step("sp layernorm", lambda: par.SequenceParallelLayerNorm(6, dtype=F64)(xs()))
        step("mlp", lambda: par.ParallelMLP(6, 12, dtype=F64, seed=0)(x))
        step("mlp sp", lambda: par.ParallelMLP(6, 12, sequence_parallel=True, dtype=F64, seed=0)(xs()))
        step(
            "attention",
            lambda: par.ParallelSelfAttention(6 * n, n, dtype=F64, seed=0)(
                torch.randn(4, 2, 6 * n, dtype=F64)
            ),
        )
        step(
            "attention sp",
            lambda: par.ParallelSelfAttention(6 * n, n, sequence_parallel=True, dtype=F64, seed=0)(
                dc.spmd.varying(torch.randn(4, 2, 6 * n, dtype=F64))
            ),
        )

        def lm_head() -> torch.Tensor:  # embedding -> column-parallel head -> vocab-parallel loss
            emb = par.VocabParallelEmbedding(12, 6, **kw)
            head = par.ColumnParallelLinear(6, 12, **kw)
            logits = head(torch.tanh(emb(ids)))
            return par.vocab_parallel_cross_entropy(logits, ids)

        step("vocab loss", lm_head)

        def block() -> torch.Tensor:  # a Megatron transformer block with dropout
            ln1, ln2 = nn.LayerNorm(6 * n, dtype=F64), nn.LayerNorm(6 * n, dtype=F64)
            attn = par.ParallelSelfAttention(6 * n, n, dtype=F64, seed=0)
            mlp = par.ParallelMLP(6 * n, 12, dtype=F64, seed=0)
            y = torch.randn(4, 2, 6 * n, dtype=F64)
            y = y + F.dropout(attn(ln1(y)), 0.1)  # replicated dropout: the default stream
            return y + F.dropout(mlp(ln2(y)), 0.1)

        step("block", block)
        return ran

    for n in (2, 3):
        for ran in local_worlds(n).run(layers_body):  # type: ignore[operator]
            assert len(ran) == 18, ran


def test_mappings_and_collectives_pass(world2: dc.LocalWorld) -> None:
    """Every mapping in its intended use, and the core ops (and their coalesced forms)
    under the sum convention (a varying, data-parallel loss)."""

    def body() -> int:
        n = dc.get_world_size()
        w = torch.randn(4, 4, dtype=F64, requires_grad=True)
        x = torch.randn(4 * n, 4, dtype=F64, requires_grad=True)
        v = torch.randn(4, 4, dtype=F64)
        cases = [
            lambda: par.reduce_from_region(
                par.copy_to_region(x) @ dc.spmd.varying(w.detach()).requires_grad_()
            ),
            lambda: par.gather_from_region(par.scatter_to_region(x, dim=-1) * 2, dim=-1),
            lambda: par.gather_from_sequence(par.scatter_to_sequence(x) * 2),
            lambda: par.reduce_scatter_to_sequence(dc.spmd.varying(v) @ w),
            lambda: par.all_gather_from_sequence(dc.spmd.varying(v) @ w) * dc.spmd.varying(v[:1]),
            lambda: par.all_to_all_region(dc.spmd.varying(x), 0, 1),
            lambda: sum(par.reduce_from_region_coalesced([dc.spmd.varying(v) @ w, dc.spmd.varying(v) @ w])),
            lambda: sum(par.copy_to_region_coalesced([x, x * 2])) @ dc.spmd.varying(w.detach().clone()),
            # the sum convention: a varying loss
            lambda: dc.all_reduce(dc.spmd.varying(v) @ w) * dc.spmd.varying(v),
            lambda: dc.all_gather(dc.spmd.varying(v) @ w) * 2,
            lambda: dc.reduce_scatter(dc.spmd.varying(x) @ w),
            lambda: dc.broadcast(x, src=0) * dc.spmd.varying(torch.ones(1, dtype=F64)),
            lambda: dc.reduce(dc.spmd.varying(v) @ w),
            lambda: dc.scatter(x, src=0),
            lambda: dc.gather(dc.spmd.varying(v) @ w),
            lambda: dc.all_to_all(x),
            lambda: dc.shift(x) + dc.ppermute(x, [(i, (i + 1) % n) for i in range(n)]),
            lambda: dc.all_reduce(dc.spmd.varying(v) @ w, "max") * dc.spmd.varying(v),
            lambda: sum(dc.all_reduce_coalesced([dc.spmd.varying(v) @ w])) * dc.spmd.varying(v),
            lambda: sum(dc.all_gather_coalesced([dc.spmd.varying(v) @ w])) * 2,
            lambda: dc.all_reduce(dc.spmd.varying(v) @ w, async_op=True).wait() * dc.spmd.varying(v),
        ]
        for i, case in enumerate(cases):
            with dc.spmd_check():
                out = case()
                loss = out.pow(2).mean() if dc.spmd.type_of(out) is dc.spmd.R else out.pow(2).sum()
                if i >= 8 and dc.spmd.type_of(loss) is dc.spmd.R:  # the sum convention: rank 0's copy
                    loss = loss * dc.spmd.varying(torch.tensor(float(dc.get_rank() == 0), dtype=F64))
                loss.backward()
        return len(cases)

    assert world2.run(body) == [21, 21]


# ======================================================================================
# no false positive: context and expert parallelism, the pipeline runner
# ======================================================================================


def test_context_parallel_llama_block_passes(world3: dc.LocalWorld) -> None:
    """examples/context_parallel_llama.py (ring attention, both layouts) under the check."""
    examples = str(ROOT / "examples")

    def body() -> list[float]:
        if examples not in sys.path:
            sys.path.insert(0, examples)
        from context_parallel_llama import compare

        errs = []
        for layout in par.LAYOUTS:
            with dc.spmd_check():
                errs.append(max(compare(25, layout).values()))
        return errs

    for errs in world3.run(body):
        assert max(errs) < 1e-11, errs


def test_ulysses_and_usp_pass(world4: dc.LocalWorld) -> None:
    def body() -> int:
        import torch.distributed as dist

        r = dc.get_rank()
        q, k, v = (
            torch.randn(1, 4, 3, 8, dtype=F64, generator=torch.Generator().manual_seed(r + i))
            for i in range(3)
        )
        with dc.spmd_check():
            ql, kl, vl = (dc.spmd.varying(t.requires_grad_()) for t in (q, k, v))
            par.ulysses_attention(ql, kl, vl, causal=True).pow(2).sum().backward()
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ring = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ug, rg = groups[r // 2], ring[r % 2]
        full = torch.randn(1, 4, 16, 8, dtype=F64)
        for group in (None, ug, rg):
            with dc.spmd_check(group):
                ql = par.shard(full, 2, layout="zigzag", group=rg, ulysses_group=ug).requires_grad_()
                out = par.usp_attention(ql, ql, ql, ug, rg, causal=True, seq_len=16)
                out.pow(2).sum().backward()
        return 1

    assert world4.run(body) == [1, 1, 1, 1]


def test_expert_parallel_moe_passes(world2: dc.LocalWorld) -> None:
    """ExpertParallelMoE (overlapped, asynchronous dispatch) and its replicated-gradient sync."""

    def body() -> int:
        moe = par.ExpertParallelMoE(8, 16, num_experts=4, k=2, shared_expert_size=8, dtype=F64, seed=0)
        x = torch.randn(6, 8, dtype=F64, generator=torch.Generator().manual_seed(dc.get_rank()))
        with dc.spmd_check(varying=[x]):
            y = moe(x)
            (y.pow(2).sum() + moe.aux_loss).backward()
            moe.sync_replicated_grads()
        return 1

    assert world2.run(body) == [1, 1]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_pipeline_runner_passes(world2: dc.LocalWorld, schedule: str) -> None:
    def body() -> float:
        from diffcomm.pipeline import PipelineRunner, partition

        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        ).double()
        stage = partition(model, dc.get_world_size())[dc.get_rank()]
        runner = PipelineRunner(stage, schedule, loss_fn=F.mse_loss)
        x, y = torch.randn(8, 4, dtype=F64), torch.randn(8, 2, dtype=F64)
        with dc.spmd_check():
            loss = runner.step(x, y, n_micro=4)
        return float(loss) if loss is not None else 0.0

    assert len(world2.run(body)) == 2


def _w(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


class _HandTPMLP(nn.Module):
    """tanh(reduce(tanh(copy(x) W1_t^T) W2_t^T)) with W1's rows and W2's columns of tensor
    rank ``t`` (``t=None``: the whole serial layer); ``bug="partial"``: the input scaled
    by a share each rank holds of ones (declared partial), unreduced."""

    def __init__(self, seed: int, tp: object, t: int | None, bug: str | None = None) -> None:
        super().__init__()
        w1, w2, n = _w(seed, 8, H), _w(seed + 1, H, 8), 4
        self.tp, self.bug = tp, bug
        self.w1 = nn.Parameter(w1 if t is None else w1[t * n : (t + 1) * n].clone())
        self.w2 = nn.Parameter(w2 if t is None else w2[:, t * n : (t + 1) * n].clone())
        self.share = torch.full((H,), 0.5, dtype=F64)  # its sum over the 2 ranks: ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return torch.tanh(F.linear(torch.tanh(F.linear(x, self.w1)), self.w2))
        if self.bug == "partial":  # the data scaled by this rank's share of one
            return x * self.share
        h = F.linear(torch.tanh(F.linear(par.copy_to_region(x, self.tp), self.w1)), self.w2)
        return torch.tanh(par.reduce_from_region(h, self.tp))


class _SeqChunkLinear(nn.Module):
    """A plain replicated linear on this rank's sequence chunk (scatter_to_sequence /
    gather_from_sequence); ``bug="no_copy"``: its weight not taken through copy_to_region."""

    def __init__(self, seed: int, tp: object, bug: str | None = None) -> None:
        super().__init__()
        self.tp, self.bug = tp, bug
        self.lin = nn.Linear(H, H, dtype=F64)
        with torch.no_grad():
            self.lin.weight.copy_(_w(seed, H, H))
            self.lin.bias.copy_(_w(seed + 1, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return torch.tanh(self.lin(x))
        xs = par.scatter_to_sequence(x, 0, self.tp)
        if self.bug == "no_copy":
            y = self.lin(xs)
        else:
            w, b = par.copy_to_region(self.lin.weight, self.tp), par.copy_to_region(self.lin.bias, self.tp)
            y = F.linear(xs, w, b)
        return torch.tanh(par.gather_from_sequence(y, 0, self.tp))


def _tp_pipeline_step(bug: str | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A 2x2 mesh (pp, tp): two PipelineRunner stages, each with tensor-parallel layers over
    tp, one 1F1B step under ``dc.spmd_check((mesh, "tp"))``; ``bug`` planted in stage 0.
    Returns (this rank's gradient, the float64 serial one) for each of its parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm.pipeline import PipelineRunner

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    p, t = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    tp = (mesh, "tp")

    def stages(tp: object, t: int | None, bug: str | None) -> list[nn.Module]:
        head = nn.Linear(H, 2, dtype=F64)
        with torch.no_grad():
            head.weight.copy_(_w(30, 2, H))
            head.bias.copy_(_w(31, 2))
        first = _SeqChunkLinear(10, tp, bug) if bug == "no_copy" else _HandTPMLP(10, tp, t, bug)
        rest = [] if bug == "partial" else [_SeqChunkLinear(15, tp)]
        return [nn.Sequential(first, *rest), nn.Sequential(_HandTPMLP(20, tp, t), head)]

    x, y = _w(1, 8, H), _w(2, 8, 2)
    serial = stages(None, None, None)
    F.mse_loss(serial[1](serial[0](x)), y).backward()
    stage = stages(tp, t, bug)[p]
    runner = PipelineRunner(stage, "1f1b", group=(mesh, "pp"), loss_fn=F.mse_loss)
    with dc.spmd_check(tp, partial=[m.share for m in stage.modules() if isinstance(m, _HandTPMLP)]):
        for m in stage.modules():
            if isinstance(m, _HandTPMLP):
                dc.spmd.varying_parameters(m, tp)  # the shards, as the user passes the group
        runner.step(x, y, n_micro=2)
    out = []
    for (name, q), ref in zip(stage.named_parameters(), serial[p].parameters()):
        g = ref.grad
        if name.endswith("w1"):
            g = g[t * 4 : (t + 1) * 4]
        elif name.endswith("w2"):
            g = g[:, t * 4 : (t + 1) * 4]
        out.append((q.grad, g))
    return out


def test_pipeline_with_tensor_parallel_stages_on_a_2x2_mesh(world4: dc.LocalWorld) -> None:
    """PipelineRunner over pp with tensor- and sequence-parallel layers over tp in each
    stage, checked over tp: passes, every gradient the serial one. (Before,
    ``varying_parameters(m, (mesh, "tp"))`` was ignored, the group given as a (mesh, axis)
    pair: the shards stayed replicated and reduce_from_region was refused.)"""
    for per_rank in world4.run(_tp_pipeline_step, None):
        for got, want in per_rank:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("bug", "message"),
    [
        ("no_copy", "is replicated, but its gradient is partial"),
        ("partial", "is partial over the checked group .*, sent over another group"),
    ],
)
def test_pipeline_stage_with_a_replication_bug_is_refused(
    world4: dc.LocalWorld, bug: str, message: str
) -> None:
    """A plain nn.Linear on sequence chunks without copy_to_region, and a partial value sent
    to the next stage (received there as replicated: nothing sums the shares, so stage 1
    computed with half the data on each rank, and passed), in stage 0 of a TP pipeline on
    a 2x2 mesh: refused."""
    with pytest.raises(dc.RankError, match=message):
        world4.run(_tp_pipeline_step, bug)


# ======================================================================================
# no false positive: a Llama-style TP model (the notebooks, examples and docs pages:
# test_spmd_library_code.py)
# ======================================================================================


def test_llama_style_tensor_parallel_block_passes(world2: dc.LocalWorld) -> None:
    """examples/tensor_parallel_llama.py: a Llama-style decoder (RMSNorm, RoPE, GQA,
    SwiGLU) made tensor parallel; one training step under the check passes, the ranks'
    losses agree."""

    def tp_llama_body() -> float:
        sys.path.insert(0, str(ROOT / "examples"))
        from tensor_parallel_llama import make

        model = make()
        x = torch.randn(2, 6, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
        with dc.spmd_check(modules=model):
            loss = model(x, torch.arange(6)).pow(2).mean()
            loss.backward()
        return float(loss)

    losses = world2.run(tp_llama_body)
    assert losses[0] == pytest.approx(losses[1])


def test_hf_llama_tensor_parallel_passes(world2: dc.LocalWorld) -> None:
    """A tiny Hugging Face LlamaForCausalLM made tensor parallel (its attention and MLP
    projections swapped for diffcomm's layers), one step under the check."""
    pytest.importorskip("transformers")

    def body() -> float:
        from transformers import LlamaConfig, LlamaForCausalLM

        n = dc.get_world_size()
        cfg = LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).double()
        for layer in model.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(at, name, par.ColumnParallelLinear.from_serial(getattr(at, name)))
            at.o_proj = par.RowParallelLinear.from_serial(at.o_proj, input_is_parallel=True)
            for name in ("gate_proj", "up_proj"):
                setattr(mlp, name, par.ColumnParallelLinear.from_serial(getattr(mlp, name)))
            mlp.down_proj = par.RowParallelLinear.from_serial(mlp.down_proj, input_is_parallel=True)
            at.num_heads = getattr(at, "num_heads", cfg.num_attention_heads) // n
            at.config.num_attention_heads = cfg.num_attention_heads  # (shapes use -1 / head_dim)
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        with dc.spmd_check(modules=model):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return float(loss)

    losses = world2.run(body)
    assert losses[0] == pytest.approx(losses[1])


def test_default_generator_type_follows_the_evidence_at_entry(world2: dc.LocalWorld) -> None:
    """The default generator's draws: varying when its state differed between the ranks
    as the check began (unseeded processes), until it is seeded alike inside the block
    (``torch.manual_seed(0)`` or :func:`diffcomm.rng.model_parallel_seed`); replicated when
    the ranks were seeded alike before the block (the Megatron 2x bug on such data is
    still caught)."""

    def body() -> list[object]:
        out: list[object] = []
        torch.manual_seed(1 + dc.get_rank())  # before the block: the states differ
        with dc.spmd_check() as c:
            out.append(c.type_of(torch.randn(3)).value)
            dc.rng.model_parallel_seed(7, tp_rank=dc.get_rank())  # seeds it alike
            out.append(c.type_of(torch.randn(3)).value)
        torch.manual_seed(5)  # before the block: alike
        with dc.spmd_check() as c:
            out.append(c.type_of(torch.randn(3)).value)
        torch.manual_seed(5)
        try:
            with dc.spmd_check():
                x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
                dc.all_gather(x, dim=0).pow(2).sum().backward()
            out.append("no error")
        except dc.SPMDTypeError as e:
            out.append("gather_from_region" in str(e))
        return out

    for got in world2.run(body):
        assert got == ["varying", "replicated", "replicated", True], got


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"modules": None}, "modules"),
        ({"modules": [torch.nn.Linear(2, 2), 3]}, "modules"),
        ({"varying": None}, "varying"),
        ({"partial": 3}, "partial"),
        ({"varying": [torch.ones(1), "x"]}, "varying"),
    ],
)
def test_spmd_check_arguments_are_checked_by_name(kwargs: dict, arg: str) -> None:
    """``spmd_check(modules=None)`` failed with "'NoneType' object is not iterable"; a
    non-module in ``modules`` or a non-tensor in ``varying`` reached the check's internals."""
    with pytest.raises(TypeError, match=rf"diffcomm.spmd_check: argument `{arg}` must be an iterable of"):
        dc.spmd_check(**kwargs)
