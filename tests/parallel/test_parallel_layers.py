"""Parallel layers against their serial references: outputs and every gradient (float64,
torch's tight float64 tolerances), on worlds 2, 3 and 4; initialisation equal to the serial
layer's; state-dict round trips; validation; RNG integration; communication counts."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _shared import outcomes
from torch import nn
from torch.testing import assert_close

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm import rng
from diffcomm.accelerator import set_accelerator
from diffcomm.backend import log_comms
from diffcomm.testing import Shard, assert_matches_serial, build

# The layers' values and gradients need no real transport: this module's shared worlds are in-process
# (the same values as gloo processes: tests/runtime/test_in_process.py). A test that needs a process
# per rank says why and stays on processes.
pytestmark = pytest.mark.diffcomm_in_process


F64 = torch.float64
SEQ, BATCH = 12, 2  # 12 splits over 2, 3 and 4 ranks


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, local_worlds: Callable[..., dc.LocalWorld]) -> dc.LocalWorld:
    return local_worlds(request.param)


def _x(hidden: int) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, hidden, generator=torch.Generator().manual_seed(1), dtype=F64)


# ======================================================================================
# parity with the serial layers
# ======================================================================================


# (layer, its option, the option's value, in/out features, the specs of sharded sides)
_LINEARS = {
    "column-sharded_out": (
        P.ColumnParallelLinear,
        "gather_output",
        False,
        (5, 12),
        {"output_specs": [Shard(-1)]},
    ),
    "column-gather_output": (P.ColumnParallelLinear, "gather_output", True, (5, 12), {}),
    "row-scatter_in": (P.RowParallelLinear, "input_is_parallel", False, (12, 5), {}),
    "row-parallel_in": (
        P.RowParallelLinear,
        "input_is_parallel",
        True,
        (12, 5),
        {"input_specs": [Shard(-1)]},
    ),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(_LINEARS))
def test_column_and_row_parallel_linear_match_nn_linear(world, bias: bool, case: str) -> None:
    layer, option, value, (n_in, n_out), specs = _LINEARS[case]
    torch.manual_seed(0)
    serial = nn.Linear(n_in, n_out, bias=bias, dtype=F64)
    assert_matches_serial(
        build(functools.partial(layer.from_serial, **{option: value})), serial, _x(n_in), world=world, **specs
    )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_sequence_parallel_linears_match_nn_linear(world, bias: bool) -> None:
    torch.manual_seed(0)
    col, row = nn.Linear(5, 12, bias=bias, dtype=F64), nn.Linear(12, 5, bias=bias, dtype=F64)
    # column: sequence-sharded input -> full sequence, sharded features
    assert_matches_serial(
        build(functools.partial(P.ColumnParallelLinear.from_serial, sequence_parallel=True)),
        col,
        _x(5),
        world=world,
        input_specs=[Shard(0)],
        output_specs=[Shard(-1)],
    )
    # row: sharded features -> sequence-sharded output (its bias gradient is all-reduced)
    assert_matches_serial(
        build(
            functools.partial(P.RowParallelLinear.from_serial, input_is_parallel=True, sequence_parallel=True)
        ),
        row,
        _x(12),
        world=world,
        input_specs=[Shard(-1)],
        output_specs=[Shard(0)],
    )


# (parallel block, its serial reference, hidden size)
_BLOCKS = {
    "mlp-bias": (P.ParallelMLP, lambda: P.MLP(6, 12, bias=True, dtype=F64), 6),
    "mlp-nobias": (P.ParallelMLP, lambda: P.MLP(6, 12, bias=False, dtype=F64), 6),
    "attention-full": (P.ParallelSelfAttention, lambda: P.SelfAttention(24, num_heads=12, dtype=F64), 24),
    "attention-causal": (
        P.ParallelSelfAttention,
        lambda: P.SelfAttention(24, num_heads=12, causal=True, dtype=F64),
        24,
    ),
}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("case", list(_BLOCKS))
def test_parallel_blocks_match_serial(world, sequence_parallel: bool, case: str) -> None:
    block, make_serial, hidden = _BLOCKS[case]
    torch.manual_seed(0)
    serial = make_serial()
    spec = [Shard(0)] if sequence_parallel else None
    assert_matches_serial(
        build(functools.partial(block.from_serial, sequence_parallel=sequence_parallel)),
        serial,
        _x(hidden),
        world=world,
        input_specs=spec,
        output_specs=spec,
    )


def test_sequence_parallel_mlp_batch_first(world2) -> None:
    torch.manual_seed(0)
    serial = P.MLP(6, 12, dtype=F64)
    x = _x(6).transpose(0, 1).contiguous()  # [b, s, h]: the sequence is dim 1
    assert_matches_serial(
        build(functools.partial(P.ParallelMLP.from_serial, sequence_parallel=True, sequence_dim=1)),
        serial,
        x,
        world=world2,
        input_specs=[Shard(1)],
        output_specs=[Shard(1)],
    )


def test_ulysses_all_to_all_attention_matches_serial(local_worlds) -> None:
    def ulysses_attention(
        x: torch.Tensor, w_qkv: torch.Tensor, w_out: torch.Tensor, heads: int
    ) -> torch.Tensor:
        """Sequence-parallel attention with all_to_all (DeepSpeed-Ulysses), replicated weights."""
        s, b, h = x.shape
        d = h // heads
        qkv = (x @ w_qkv.T).reshape(s, b, heads, 3 * d)
        qkv = P.all_to_all_region(qkv, split_dim=2, concat_dim=0)  # (S, b, heads/W, 3d)
        q, k, v = qkv.reshape(*qkv.shape[:3], 3, d).permute(3, 1, 2, 0, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads/W, S, d)
        y = P.all_to_all_region(y.permute(2, 0, 1, 3), split_dim=0, concat_dim=2)  # (s, b, heads, d)
        return y.reshape(s, b, h) @ w_out.T

    torch.manual_seed(0)
    serial = P.SelfAttention(24, num_heads=12, bias=False, causal=True, dtype=F64)

    def make(s: P.SelfAttention) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(
            ulysses_attention, w_qkv=s.qkv.weight.detach(), w_out=s.proj.weight.detach(), heads=12
        )

    for n in (2, 4):
        # weights are replicated constants here: compare outputs and input gradients
        assert_matches_serial(
            build(make),
            serial,
            _x(24),
            world=local_worlds(n),
            input_specs=[Shard(0)],
            output_specs=[Shard(0)],
        )


# ======================================================================================
# initialisation and state dicts
# ======================================================================================


def test_initialisation_equals_the_serial_layers(world3) -> None:
    def init_cases() -> dict[str, bool]:
        out: dict[str, bool] = {}

        def same(parallel: P.ParallelModule, serial: nn.Module) -> bool:
            full = parallel.to_serial_state_dict()
            ref = serial.state_dict()
            return full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)

        def serial_mlp(seed: int) -> P.MLP:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return P.MLP(6, 12, dtype=F64)

        torch.manual_seed(3)
        mlp = P.MLP(6, 12, dtype=F64)
        out["mlp_seed"] = same(P.ParallelMLP(6, 12, seed=3, dtype=F64), mlp)
        torch.manual_seed(4)
        attn = P.SelfAttention(24, 12)
        out["attention_seed"] = same(P.ParallelSelfAttention(24, 12, seed=4), attn)
        torch.manual_seed(5)
        emb = nn.Embedding(12, 3)
        out["embedding_seed"] = same(P.VocabParallelEmbedding(12, 3, seed=5), emb)
        # seed=None: the default generator, consumed exactly as by the serial layers
        torch.manual_seed(6)
        col = P.ColumnParallelLinear(4, 12)
        row = P.RowParallelLinear(12, 4, bias=False)
        after_parallel = torch.rand(3)
        torch.manual_seed(6)
        lin1, lin2 = nn.Linear(4, 12), nn.Linear(12, 4, bias=False)
        out["default_generator"] = (
            same(col, lin1) and same(row, lin2) and torch.equal(after_parallel, torch.rand(3))
        )
        # from_serial -> to_serial_state_dict round trip; load_serial_state_dict
        out["round_trip"] = same(P.ParallelMLP.from_serial(mlp), mlp)
        fresh = P.ParallelMLP(6, 12, seed=99, dtype=F64)
        fresh.load_serial_state_dict(mlp.state_dict())
        out["load"] = same(fresh, mlp)
        try:
            fresh.load_serial_state_dict({"fc1.weight": mlp.fc1.weight})
            out["strict"] = False
        except KeyError as exc:
            out["strict"] = "missing keys" in str(exc) and "fc2.bias" in str(exc)
        # the generator argument: one generator drives all layers in the serial order
        g = torch.Generator().manual_seed(8)
        out["generator"] = same(P.ParallelMLP(6, 12, generator=g, dtype=F64), serial_mlp(8))
        return out

    for result in world3.run(init_cases):
        assert result == dict.fromkeys(result, True), result


def _unseeded(seeds: str) -> dict[str, str]:
    """Layers drawn with seed=None from the global generator, seeded per rank as ``seeds``
    says (``"alike"``, ``"per_rank"``); each layer's first forward (and second) outcome
    and the communications of the first forward."""
    rank = dc.get_rank()
    out: dict[str, str] = {}

    def attempt(name: str, make: Callable[[], nn.Module], x: torch.Tensor) -> None:
        torch.manual_seed(0 if seeds == "alike" else rank)
        layer = make()
        with log_comms() as log:
            try:
                layer(x)
            except dc.CrossRankMismatchError as exc:
                out[name] = f"error: {exc}"
                return
        layer(x)  # checked once: the second forward runs as it is
        out[name] = f"ok, {log.count()} comms"

    attempt("row", lambda: P.RowParallelLinear(6, 4, dtype=F64), torch.ones(2, 6, dtype=F64))
    attempt("mlp", lambda: P.ParallelMLP(8, 16, dtype=F64), torch.ones(3, 1, 8, dtype=F64))
    attempt(
        "moe",
        lambda: P.ExpertParallelMoE(8, 16, num_experts=4, k=2, shared_expert_size=8, dtype=F64),
        torch.ones(3, 8, dtype=F64),
    )
    attempt("column", lambda: P.ColumnParallelLinear(6, 4, dtype=F64), torch.ones(2, 6, dtype=F64))

    def loaded() -> nn.Module:  # drawn per rank, then loaded from one serial layer
        layer = P.RowParallelLinear(6, 4, dtype=F64)
        layer.load_serial_state_dict(_serial_row().state_dict())
        return layer

    attempt("loaded", loaded, torch.ones(2, 6, dtype=F64))
    return out


def _serial_row() -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        return nn.Linear(6, 4, dtype=F64)


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
@pytest.mark.diffcomm_in_process(False)  # per-rank global generators: one per process
def test_replicas_drawn_unseeded_must_agree_at_the_first_forward(world2) -> None:
    """seed=None draws from the global generator, which each process seeds on its own:
    the replicated parameters (a row-parallel bias, a router, a shared expert) differed
    between ranks with no error, so the "replicated" outputs did too. Now the first
    forward compares them (one fingerprint all_gather) and raises
    CrossRankMismatchError naming them and the fix; seeded alike, loaded from one
    checkpoint, or with nothing replicated (ColumnParallelLinear) the layers run."""
    for res in world2.run(_unseeded, "per_rank"):
        for name in ("row", "mlp", "moe"):
            assert res[name].startswith("error:") and "pass seed=" in res[name], (name, res[name])
        assert "(bias)" in res["row"] and "fc2.bias" in res["mlp"] and "router.weight" in res["moe"]
        # nothing replicated: no check, no communication; loaded: the check (+1) passes
        assert res["column"] == "ok, 0 comms" and res["loaded"] == "ok, 2 comms", res
    for res in world2.run(_unseeded, "alike"):
        assert all(v.startswith("ok") for v in res.values()), res


def _ids_outside(ids: list[int], debug: bool) -> str:
    emb = P.VocabParallelEmbedding(12, 3, seed=0)
    with dc.debug(debug), log_comms() as log:
        try:
            emb(torch.tensor(ids))
        except RuntimeError as exc:
            return f"{exc} | comms={log.count()}"
    return "no error"


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
@pytest.mark.parametrize("ids", [[12], [-1], [3, 100, 5]])
def test_an_id_outside_the_vocabulary_is_an_error_not_a_zero_row(world3, ids: list[int], debug: bool) -> None:
    """nn.Embedding raises IndexError for an id outside [0, num_embeddings); the parallel
    table masked it on every rank as another rank's and summed a row of zeros, silently.
    Now a RuntimeError (a device-side assert on an accelerator: no host sync), before the
    layer's reduction, and in debug mode before its cross-rank check of the ids (a local
    check before any communication: it ran after that exchange before)."""
    for msg in world3.run(_ids_outside, ids, debug):
        assert "every id must be in [0, 12) (the vocabulary size)" in msg and msg.endswith("comms=0"), msg


def _embedding_sequence_dim(dim: int) -> tuple:
    """ids ``[b=2, s=9]`` (``dim`` 1 or -1) or ``[s=9, b=2]`` (0 or -2) through a
    sequence-parallel table (the objective: the sum over ranks, the serial one over the
    whole output): this rank's output and weight gradient, and the serial ones' parts of
    this rank (the sequence chunk along the ids' ``dim``; the vocabulary shard)."""
    torch.manual_seed(0)
    serial = nn.Embedding(12, 4).double()
    emb = P.VocabParallelEmbedding.from_serial(serial, sequence_parallel=True, sequence_dim=dim)
    ids = torch.arange(18).reshape(2, 9) % 12
    if dim in (0, -2):
        ids = ids.T.contiguous()
    r, w = dc.get_rank(), dc.get_world_size()
    scale = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
    out = emb(ids)
    (out * scale).sum().backward()
    full = serial(ids)
    (full * scale).sum().backward()
    return out, full.chunk(w, dim % 2)[r], emb.weight.grad, serial.weight.grad.chunk(w)[r]


@pytest.mark.parametrize("dim", [1, -1, 0, -2])
def test_the_embeddings_sequence_dim_is_a_dimension_of_the_ids(world3, dim: int) -> None:
    """``sequence_dim`` names the ids' sequence dimension (the docs): a negative one counts
    from the ids' last. It was applied to the output, which has one more dimension (hidden):
    ids ``[b, s]`` with ``sequence_dim=-1`` reduce-scattered the hidden size, silently."""
    for out, ref, grad, ref_grad in world3.run(_embedding_sequence_dim, dim):
        assert out.shape == ref.shape == ((2, 3, 4) if dim % 2 else (3, 2, 4))
        assert_close(out, ref, rtol=1e-12, atol=0)
        assert_close(grad, ref_grad, rtol=1e-12, atol=0)


def _embedding_bad_sequence_dim(dim: int, debug: bool) -> str:
    emb = P.VocabParallelEmbedding(12, 4, seed=0, sequence_parallel=True, sequence_dim=dim)
    with dc.debug(debug), log_comms() as log:
        try:
            emb(torch.zeros(6, 2, dtype=torch.long))
        except ValueError as exc:
            return f"{exc} | comms={log.count()}"
    return "no error"


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
@pytest.mark.parametrize("dim", [2, -3])
def test_an_embedding_sequence_dim_outside_the_ids_is_an_error(world2, dim: int, debug: bool) -> None:
    """ids ``[s, b]`` with ``sequence_dim=2``: the output's hidden dimension was split between
    the ranks with no error. Now a ValueError naming the ids' range, before any communication."""
    for msg in world2.run(_embedding_bad_sequence_dim, dim, debug):
        assert "`sequence_dim` must be a dimension in [-2, 2) for a 2-dim tensor" in msg, msg
        assert msg.endswith("comms=0"), msg


def test_indivisible_sizes_and_bad_combinations_are_value_errors(world4) -> None:
    def validation_errors() -> dict[str, str]:
        cases = {
            "column_out": lambda: P.ColumnParallelLinear(4, 5),
            "row_in": lambda: P.RowParallelLinear(5, 4),
            "vocab": lambda: P.VocabParallelEmbedding(5, 3),
            "heads": lambda: P.ParallelSelfAttention(12, num_heads=6),
            "row_sp": lambda: P.RowParallelLinear(8, 4, sequence_parallel=True),
            "column_sp_gather": lambda: P.ColumnParallelLinear(
                4, 8, gather_output=True, sequence_parallel=True
            ),
            "seed_and_generator": lambda: P.ColumnParallelLinear(4, 8, seed=1, generator=torch.Generator()),
        }
        return outcomes(cases, ValueError)

    out = world4.run(validation_errors)[0]
    assert "`out_features` must be divisible by the group size 4" in out["column_out"]
    assert "`in_features` must be divisible by the group size 4" in out["row_in"]
    assert "`num_embeddings` must be divisible by the group size 4" in out["vocab"]
    assert "`num_heads` must be divisible by the group size 4" in out["heads"]
    assert "`input_is_parallel` must be True when sequence_parallel=True" in out["row_sp"]
    assert "`gather_output` must be False when sequence_parallel=True" in out["column_sp_gather"]
    assert "`seed` must be None when `generator` is given" in out["seed_and_generator"]


# ======================================================================================
# RNG: dropout on the sharded activation draws from the model-parallel stream
# ======================================================================================


def test_dropout_in_parallel_mlp_differs_across_tp_ranks(world2) -> None:
    def dropout_masks() -> dict:
        r, w = dc.get_rank(), dc.get_world_size()
        tracker = rng.get_tracker()
        saved = tracker.get_states()
        try:
            # CPU tensors: their dropout draws from the CPU generator, so the streams must be
            # swapped into the CPU accelerator's (on a GPU machine the default is cuda's)
            with set_accelerator("cpu"), torch.random.fork_rng(devices=[]):
                mlp = P.ParallelMLP(4, 16 * w, dropout=0.5, seed=0).train()
                seen: list[torch.Tensor] = []
                mlp.fc2.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach() == 0))
                x = torch.ones(3, 4)

                tracker.reset()
                try:
                    mlp(x)
                    missing = "no error"
                except RuntimeError as exc:
                    missing = str(exc)

                rng.model_parallel_seed(1234, tp_rank=r)
                mlp(x)
                rng.model_parallel_seed(1234, tp_rank=r, dp_rank=1)  # a data-parallel replica
                mlp(x)
                masks = dc.all_gather(seen[-2].float().unsqueeze(0), 0)
        finally:
            tracker.reset()
            tracker.set_states(saved)
        return {
            "differ_across_tp": all(not torch.equal(masks[0], masks[q]) for q in range(1, w)),
            "same_across_dp": torch.equal(seen[-2], seen[-1]),
            "dropped_fraction": seen[-2].float().mean().item(),
            "missing": missing,
        }

    out = world2.run(dropout_masks)
    assert out[0]["differ_across_tp"] and all(o["same_across_dp"] for o in out)
    assert 0.3 < out[0]["dropped_fraction"] < 0.7
    assert "model_parallel_seed" in out[0]["missing"]


def test_a_rank_in_eval_mode_is_named_in_debug_mode(world2) -> None:
    """A block whose ranks disagree on train() / eval() masks some shards and not others:
    no collective notices, and the output is no serial model's (silently). Debug mode
    compares the dropout in effect across the group and names it."""

    def mixed_modes() -> list[str]:
        r = dc.get_rank()
        tracker = rng.get_tracker()
        saved = tracker.get_states()
        msgs = []
        try:
            with set_accelerator("cpu"), torch.random.fork_rng(devices=[]):
                rng.model_parallel_seed(1234, tp_rank=r)
                blocks = [
                    P.ParallelMLP(4, 8, dropout=0.5, seed=0),
                    P.ParallelSelfAttention(4, 2, attention_dropout=0.5, seed=0),
                ]
                for block in blocks:
                    block.train(r == 0)
                    with dc.debug(True):
                        try:
                            block(torch.ones(3, 2, 4))
                            msgs.append("no error")
                        except dc.CrossRankMismatchError as exc:
                            msgs.append(str(exc))
                    block.eval()(torch.ones(3, 2, 4))  # the same mode everywhere: no error
        finally:
            tracker.reset()
            tracker.set_states(saved)
        return msgs

    for msgs in world2.run(mixed_modes):
        assert "parallel.ParallelMLP()" in msgs[0] and "parallel.ParallelSelfAttention()" in msgs[1], msgs
        for m in msgs:
            assert "dropout in effect (p in train(), 0 in eval()) differs (rank 0: 0.5, rank 1: 0.0)" in m, m


def _freeze_then_step(names: tuple[str, ...], frozen_on: tuple[int, ...], sequence_parallel: bool) -> dict:
    """A ParallelMLP from a seeded serial MLP, ``names`` frozen on the ranks ``frozen_on``
    (and in the serial MLP), one debug-mode SGD step: the error, or the step's distance to
    the serial model's step."""
    serial = P.MLP(4, 8, bias=True, dtype=F64)
    with torch.no_grad():
        for i, p in enumerate(serial.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=F64))
    mlp = P.ParallelMLP.from_serial(serial, sequence_parallel=sequence_parallel)
    for name in names:
        serial.get_parameter(name).requires_grad_(False)
        if dc.get_rank() in frozen_on:
            mlp.get_parameter(name).requires_grad_(False)
    x = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(9), dtype=F64)
    x_mine = x.chunk(2)[dc.get_rank()] if sequence_parallel else x  # (a sequence chunk each)
    with dc.debug(True):
        try:
            mlp(x_mine).square().sum().backward()
        except dc.CrossRankMismatchError as exc:
            return {"error": str(exc)}
    serial(x).square().sum().backward()
    for model in (serial, mlp):
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    got = mlp.to_serial_state_dict()
    want = serial.state_dict()
    return {"error": "no error", "diff": max((got[k] - want[k]).abs().max().item() for k in want)}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("name", ["fc2.bias", "fc1.weight"], ids=["replica", "shard"])
def test_a_parameter_frozen_on_one_rank_is_named_in_debug_mode(
    world2, name: str, sequence_parallel: bool
) -> None:
    """``requires_grad_(False)`` on one rank only (a replicated bias, or a shard) trained
    silently inconsistently (the replicas drifted apart), or, with sequence parallelism,
    desynced with a hint blaming the loss. Debug mode compares the flags at the forward."""
    for out in world2.run(_freeze_then_step, (name,), (0,), sequence_parallel):
        m = out["error"]
        assert f"requires_grad of `{name}` differs (rank 0: False, rank 1: True)" in m, m
        assert "parallel.ParallelMLP()" in m and "on every rank of the group" in m, m


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_parameters_frozen_on_every_rank_train_like_the_serial_model(world2, sequence_parallel: bool) -> None:
    for out in world2.run(_freeze_then_step, ("fc2.bias", "fc1.weight"), (0, 1), sequence_parallel):
        assert out["error"] == "no error"
        assert out["diff"] < 1e-12, out


# ======================================================================================
# communication per step
# ======================================================================================


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_parallel_mlp_communicates_the_analytic_count(world2) -> None:
    def comm_counts(sequence_parallel: bool) -> dict[str, int]:
        mlp = P.ParallelMLP(4, 8, seed=0, sequence_parallel=sequence_parallel)
        x = torch.randn(4, 2, 4, requires_grad=True)
        with log_comms() as log:
            mlp(x).sum().backward()
        return {op: log.count(op) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}

    tp = world2.run(comm_counts, False)[0]
    assert tp == {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    sp = world2.run(comm_counts, True)[0]
    # all_gather + reduce_scatter forward, the duals backward, + fc2's bias-gradient all_reduce
    assert sp == {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 2, "all_to_all": 0}


def test_float32_forward_is_close(world2) -> None:
    def eval_and_float32() -> float:
        torch.manual_seed(0)
        serial = P.MLP(8, 16)
        par = P.ParallelMLP.from_serial(serial).eval()
        x = torch.randn(5, 8)
        return (par(x) - serial(x)).abs().max().item()

    assert max(world2.run(eval_and_float32)) < 1e-5
    assert_close(torch.zeros(1), torch.zeros(1))


def _linear_reprs() -> list[str]:
    return [
        repr(P.ColumnParallelLinear(4, 6, seed=0)),
        repr(P.ColumnParallelLinear(4, 6, bias=False, gather_output=True, seed=0, overlap=True)),
        repr(P.RowParallelLinear(4, 6, seed=0)),
        repr(P.RowParallelLinear(4, 6, seed=0, input_is_parallel=True, sequence_parallel=True)),
    ]


def test_the_linears_repr_names_the_split_side_and_their_own_keyword(world2) -> None:
    """One ``extra_repr`` for both linears: the per-rank count sits on the split side (out
    for the column, in for the row), then the layer's own keyword."""
    assert world2.run(_linear_reprs)[1] == [
        "ColumnParallelLinear(in_features=4, out_features=6 (3 per rank), bias=True, "
        "gather_output=False, sequence_parallel=False)",
        "ColumnParallelLinear(in_features=4, out_features=6 (3 per rank), bias=False, "
        "gather_output=True, sequence_parallel=False, overlap='comm')",
        "RowParallelLinear(in_features=4 (2 per rank), out_features=6, bias=True, "
        "input_is_parallel=False, sequence_parallel=False)",
        "RowParallelLinear(in_features=4 (2 per rank), out_features=6, bias=True, "
        "input_is_parallel=True, sequence_parallel=True)",
    ]


# ======================================================================================
# column -> row by hand: the slip (a shard into a layer that expects the whole input) is
# named with its fix; ParallelModule's from_serial; a plain container's shape message
# ======================================================================================


def test_column_then_row_by_hand_names_input_is_parallel(world2) -> None:
    def rank_body() -> list[str]:
        torch.manual_seed(0)
        fc1 = P.ColumnParallelLinear(8, 16, seed=1, dtype=F64)
        x = torch.randn(12, 8, dtype=F64)
        h = fc1(x)  # (12, 8): this rank's half of 16 features
        right = P.RowParallelLinear(16, 8, seed=2, input_is_parallel=True, dtype=F64)(h)
        serial1 = nn.Linear(8, 16, dtype=F64)
        serial1.load_state_dict(fc1.to_serial_state_dict())
        assert right.shape == (12, 8)
        msgs = []
        for parallel_in, given in ((False, h), (True, serial1(x))):
            layer = P.RowParallelLinear(16, 8, seed=2, input_is_parallel=parallel_in, dtype=F64)
            try:
                layer(given)
                msgs.append("no error")
            except ValueError as exc:
                msgs.append(str(exc))
        return msgs

    for wrong_default, wrong_parallel in world2.run(rank_body):
        assert wrong_default.startswith("diffcomm.parallel.RowParallelLinear(): `x` has x.shape[-1]=8")
        assert "one rank's share" in wrong_default and "input_is_parallel=True." in wrong_default
        assert "the whole input" in wrong_parallel and "input_is_parallel=False" in wrong_parallel


# on processes: a cross-rank diagnosis (debug mode, the p2p protocol) needs per-rank state
@pytest.mark.diffcomm_in_process(False)
def test_the_copy_hint_names_input_is_parallel_with_one_period(world2) -> None:
    def rank_body() -> None:
        with dc.debug(True):
            P.scatter_to_region(torch.full((4, 6), float(dc.get_rank())))  # not replicated

    with pytest.raises(dc.RankError) as info:
        world2.run(rank_body)
    first = str(info.value).splitlines()[0]
    assert "RowParallelLinear made with input_is_parallel=True" in first, first
    assert first.endswith("first.") and ".." not in first, first


class _TwoLayers(P.ParallelModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = P.ColumnParallelLinear(hidden, 2 * hidden, seed=1, dtype=F64)
        self.fc2 = P.RowParallelLinear(2 * hidden, hidden, seed=2, input_is_parallel=True, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class _SerialTwo(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden, dtype=F64)
        self.fc2 = nn.Linear(2 * hidden, hidden, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def test_a_parallel_module_of_your_own_inherits_from_serial(world3) -> None:
    torch.manual_seed(0)
    serial = _SerialTwo(6)
    assert_matches_serial(build(lambda s: _TwoLayers.from_serial(s, 6)), serial, _x(6), world=world3)


class _ShardedMask(P.ParallelModule):
    """A layer of one's own that declares its buffer sharded: ``mask`` is this rank's
    part (dim 0) of a serial ``mask`` of ``size`` entries."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._shard_dims = {"mask": 0}
        self.register_buffer("mask", torch.ones(size // dc.get_world_size(), dtype=F64))


class _SerialWithBuffers(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden, dtype=F64)
        self.fc2 = nn.Linear(2 * hidden, hidden, dtype=F64)
        self.register_buffer("scale", torch.ones(hidden, dtype=F64))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.sharded = nn.Module()
        self.sharded.register_buffer("mask", torch.ones(2 * hidden, dtype=F64))


class _WithBuffers(P.ParallelModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = P.ColumnParallelLinear(hidden, 2 * hidden, seed=1, dtype=F64)
        self.fc2 = P.RowParallelLinear(2 * hidden, hidden, seed=2, input_is_parallel=True, dtype=F64)
        self.register_buffer("scale", torch.ones(hidden, dtype=F64))  # replicated
        self.register_buffer("scratch", torch.zeros(1), persistent=False)  # in no state dict
        self.sharded = _ShardedMask(2 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.sharded.mask) * self.scale


def test_buffers_travel_with_the_serial_state_dicts(world2) -> None:
    """A persistent buffer is loaded and gathered like a parameter: replicated unless its
    layer declares it sharded; a non-persistent one is in no state dict. (Before, buffers
    were outside the mapping: from_serial raised on the unexpected key, strict=False left
    the buffer at its initial value, to_serial_state_dict left it out.)"""

    def rank_body() -> dict[str, bool]:
        torch.manual_seed(0)
        serial = _SerialWithBuffers(6)
        serial.scale.uniform_(1, 3)
        serial.sharded.mask.uniform_(0, 1)
        x = torch.randn(4, 6, dtype=F64)
        want = serial.fc2(torch.tanh(serial.fc1(x)) * serial.sharded.mask) * serial.scale
        model = _WithBuffers.from_serial(serial, 6)
        fresh = _WithBuffers(6)
        skipped = fresh.load_serial_state_dict(serial.state_dict(), strict=False)
        typo = dict(serial.state_dict())
        typo["fc1.wieght"] = typo.pop("fc1.weight")
        misspelt = _WithBuffers(6).load_serial_state_dict(typo, strict=False)
        full = model.to_serial_state_dict()
        back = _SerialWithBuffers(6)
        result = back.load_state_dict(full)
        ref = serial.state_dict()
        return {
            "from_serial": torch.allclose(model(x), want),
            "non_strict": torch.equal(fresh.scale, serial.scale) and torch.allclose(fresh(x), want),
            "sharded_buffer": torch.equal(model.sharded.mask, serial.sharded.mask.chunk(2)[dc.get_rank()]),
            "keys": list(full) == list(ref) and "scratch" not in full,
            "values": all(torch.equal(full[k], ref[k]) for k in ref),
            "loads": not result.missing_keys and not result.unexpected_keys,
            # strict=False says what it skipped, as load_state_dict (it returned None)
            "none_skipped": not skipped.missing_keys and not skipped.unexpected_keys,
            "skipped": misspelt.missing_keys == ["fc1.weight"] and misspelt.unexpected_keys == ["fc1.wieght"],
        }

    for result in world2.run(rank_body):
        assert result == dict.fromkeys(result, True), result


class _UnevenRows(P.ParallelModule):
    """A layer of one's own whose weight rows are uneven across ranks (``sizes[r]`` on rank
    ``r``; e.g. a vocabulary head cut with ``torch.tensor_split``)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self._shard_dims = {"weight": 0}
        self.weight = nn.Parameter(torch.zeros(sizes[dc.get_rank()], 2, dtype=F64))


def _load_uneven(sizes: list[int]) -> dict[str, str]:
    serial = nn.Linear(2, sum(sizes), bias=False, dtype=F64)
    calls = {
        "load_serial_state_dict": lambda: _UnevenRows(sizes).load_serial_state_dict(serial.state_dict()),
        "from_serial": lambda: _UnevenRows.from_serial(serial, sizes),
    }
    return outcomes(calls, ValueError)


def test_uneven_shards_of_a_layer_of_ones_own_are_refused_when_loading(world3) -> None:
    """A ParallelModule's state-dict mapping cuts even shards (rank r: ``[r*n, (r+1)*n)``):
    a layer of one's own with uneven shards (``[4, 3, 3]`` of 10 rows) is a ValueError naming
    the tensor, no communication. Before, every rank loaded without an error: rank 1 got rows
    3-5 for its 4-6, rank 2 rows 6-8 for 7-9 (row 9 nowhere)."""
    for rank, out in enumerate(world3.run(_load_uneven, [4, 3, 3])):
        n = [4, 3, 3][rank]
        for key, msg in out.items():
            assert "_UnevenRows.load_serial_state_dict(): `weight` of serial shape (10, 2)" in msg, (
                key,
                msg,
            )
            assert f"{n} * 3 = {3 * n} != 10" in msg and "shards are even" in msg, (key, msg)


class _SerialTiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, dtype=F64)
        self.head = nn.Linear(4, 8, bias=False, dtype=F64)
        self.head.weight = self.emb.weight


class _TiedLM(P.ParallelModule):
    def __init__(self, replicated_head: bool = False) -> None:
        super().__init__()
        self.emb = P.VocabParallelEmbedding(8, 4, seed=0, dtype=F64)
        self.head = (
            nn.Linear(4, 8, bias=False) if replicated_head else P.ColumnParallelLinear(4, 8, bias=False)
        )
        self.head.weight = self.emb.weight  # weight tying (the same shard layout: dim 0)


def test_tied_parameters_in_the_serial_mapping(world2) -> None:
    """A parameter reachable under two names is under both in the serial mapping, as in
    torch's state dict (before: a bare KeyError 'head.weight'); names whose layers shard
    it differently are a ValueError naming both."""

    def rank_body() -> dict[str, bool]:
        torch.manual_seed(0)
        serial = _SerialTiedLM()
        model = _TiedLM.from_serial(serial)
        slices = model.serial_slices()
        full = model.to_serial_state_dict()
        back = _SerialTiedLM()
        result = back.load_state_dict(full)
        out = {
            "loaded": torch.equal(model.emb.weight, serial.emb.weight.chunk(2)[dc.get_rank()]),
            "slices": slices["emb.weight"]
            == slices["head.weight"]
            == (slice(4 * dc.get_rank(), 4 * dc.get_rank() + 4), slice(None)),
            "keys": list(full) == list(serial.state_dict()) and full["emb.weight"] is full["head.weight"],
            "round_trip": torch.equal(back.head.weight, serial.emb.weight) and not result.missing_keys,
        }
        try:
            _TiedLM(replicated_head=True).serial_slices()
            out["conflict"] = False
        except ValueError as exc:
            msg = str(exc)
            out["conflict"] = "`emb.weight` and `head.weight`" in msg and "replicated" in msg
        return out

    for result in world2.run(rank_body):
        assert result == dict.fromkeys(result, True), result


def test_a_plain_container_suggests_parallel_module_or_param_map(world2) -> None:
    class Plain(nn.Module):  # the same layers, not a ParallelModule: no serial_slices()
        def __init__(self, serial: nn.Module) -> None:
            super().__init__()
            self.fc1 = P.ColumnParallelLinear.from_serial(serial.fc1)
            self.fc2 = P.RowParallelLinear.from_serial(serial.fc2, input_is_parallel=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    with pytest.raises(AssertionError) as info:
        assert_matches_serial(build(Plain), _SerialTwo(6), _x(6), world=world2)
    msg = str(info.value)
    assert "has no serial_slices()" in msg and "ParallelModule" in msg and "param_map" in msg, msg


def _same_options_as_keywords(seed: int) -> list[bool]:
    """A layer and a block built from keywords equal those built from one LayerOptions."""
    options = P.LayerOptions(seed=seed, sequence_parallel=True, overlap="comm")
    pairs = [
        (
            P.ColumnParallelLinear(4, 6, seed=seed, sequence_parallel=True, overlap="comm"),
            P.ColumnParallelLinear(4, 6, options=options),
        ),
        (
            P.ParallelMLP(8, 16, seed=seed, sequence_parallel=True, overlap="comm"),
            P.ParallelMLP(8, 16, options=options),
        ),
        (
            P.ParallelSelfAttention(8, 4, seed=seed, sequence_parallel=True),
            P.ParallelSelfAttention(8, 4, options=P.LayerOptions(seed=seed, sequence_parallel=True)),
        ),
        (
            P.SequenceParallelLayerNorm(4, dtype=torch.float64),
            P.SequenceParallelLayerNorm(4, options=P.LayerOptions(dtype=torch.float64)),
        ),
    ]
    out = []
    for a, b in pairs:
        sa, sb = a.state_dict(), b.state_dict()
        out.append(
            sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa) and repr(a) == repr(b)
        )
    # keywords given with an options object override its fields
    out.append(
        P.ColumnParallelLinear(4, 6, options=options, sequence_parallel=False).sequence_parallel is False
    )
    norm = P.SequenceParallelLayerNorm(4, options=P.LayerOptions(dtype=torch.float64))
    out.append(norm.weight.dtype == torch.float64)
    return out


def test_layer_options_are_one_object_and_the_old_keywords_still_work(world2) -> None:
    assert world2.run(_same_options_as_keywords, 3) == [[True] * 6] * 2
    with pytest.raises(TypeError, match=r"ParallelSelfAttention\(\): unexpected keyword argument 'overlap'"):
        P.ParallelSelfAttention(8, 4, overlap=True)
    with pytest.raises(TypeError, match=r"`options.sequence_dim` must be 0 \(it does not take it\)"):
        P.ParallelSelfAttention(8, 4, options=P.LayerOptions(sequence_dim=1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'sead'"):
        P.RowParallelLinear(4, 6, sead=0)
    with pytest.raises(TypeError, match=r"SequenceParallelLayerNorm\(\): `options.seed` must be None"):
        P.SequenceParallelLayerNorm(4, options=P.LayerOptions(seed=0))


def _copies_over_a_subgroup() -> dict[str, object]:
    """copy.deepcopy and torch's AveragedModel (an EMA copy) of a ParallelMLP and of an
    ExpertParallelMoE over a group made with new_group: the copy computes what the model
    computes, over the same group, with parameters of its own."""
    import copy

    import torch.distributed as dist

    group = dist.new_group(list(range(dc.get_world_size())))
    mlp = P.ParallelMLP(4, 6, group=group, dtype=F64, seed=0)
    moe = P.ExpertParallelMoE(4, 6, 4, 2, group, dtype=F64, seed=0)
    x = torch.randn(5, 4, dtype=F64)
    out: dict[str, object] = {}
    for name, model in (("mlp", mlp), ("moe", moe)):
        twin = copy.deepcopy(model)
        ema = torch.optim.swa_utils.AveragedModel(model)
        out[name] = (
            float((twin(x) - model(x)).abs().max()),
            float((ema(x) - model(x)).abs().max()),
            all(p is not q for p, q in zip(twin.parameters(), model.parameters())),
            twin.fc1._pg is group if name == "mlp" else twin._pg is group,
        )
    return out


def test_deepcopy_keeps_the_process_group(world2) -> None:
    """A layer over a process group other than the default one could not be copied
    (torch's "cannot pickle 'ProcessGroup' object"): no EMA / AveragedModel of it."""
    for res in world2.run(_copies_over_a_subgroup):
        assert res == {"mlp": (0.0, 0.0, True, True), "moe": (0.0, 0.0, True, True)}, res


def _load_the_other_ranks_state_dict(folder: str) -> dict[str, str]:
    """Every layer saves its state dict to a file per rank; then each rank loads its own,
    the other rank's, and the other's as a plain dict (no torch metadata)."""
    import io
    from pathlib import Path

    r = dc.get_rank()
    layers = {
        "ParallelMLP": P.ParallelMLP(4, 8, seed=0, dtype=torch.float64),
        "VocabParallelEmbedding": P.VocabParallelEmbedding(6, 4, seed=0, dtype=torch.float64),
        "ExpertParallelMoE": P.ExpertParallelMoE(4, 8, 4, k=2, seed=0, dtype=torch.float64),
    }
    for name, layer in layers.items():
        buf = io.BytesIO()
        torch.save(layer.state_dict(), buf)
        (Path(folder) / f"{name}.{r}.pt").write_bytes(buf.getvalue())
    dc.all_reduce(torch.ones(1))  # every file written
    out = {}
    for name, layer in layers.items():
        own = torch.load(Path(folder) / f"{name}.{r}.pt")
        other = torch.load(Path(folder) / f"{name}.{1 - r}.pt")
        layer.load_state_dict(own)
        try:
            layer.load_state_dict(other)
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)
        layer.load_state_dict(dict(other))  # torch's metadata dropped: loads as before
        mismatch = any(not torch.equal(v, layer.state_dict()[k]) for k, v in other.items())
        out[name + " plain"] = "loaded" if not mismatch else "not loaded"
    return out


def test_another_ranks_state_dict_of_shards_is_refused(world2, tmp_path) -> None:
    """With even splits every rank's shards have the same shapes: rank 1's state dict
    loaded on rank 0 went in without an error, and the layer computed no serial model's
    output. The state dict now notes whose shards it holds (in torch's metadata, which
    ``torch.save`` keeps) and ``load_state_dict`` refuses another rank's, naming both; one
    without the note loads as before."""
    for r, out in enumerate(world2.run(_load_the_other_ranks_state_dict, str(tmp_path))):
        for name in ("ParallelMLP", "VocabParallelEmbedding", "ExpertParallelMoE"):
            assert f"holds the shards of group rank {1 - r} of 2" in out[name], (name, out[name])
            assert f"this is group rank {r} of 2" in out[name], out[name]
            assert out[name + " plain"] == "loaded", out


# --------------------------------------------------------------------------------------
# examples/tensor_parallel_llama.py against its serial block
# --------------------------------------------------------------------------------------


def _tp_llama_vs_serial(heads: int, kv_heads: int, dim: int, hidden: int) -> dict[str, float]:
    """The example's TPBlock of a serial Block (a copy: the TP block shares the norms)
    against that Block: output, loss, and every parameter's gradient against this rank's
    part of the serial one (wk / wv: the two halves of the fused wkv)."""
    import copy
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from context_parallel_llama import Block, serial_attention
    from tensor_parallel_llama import TPBlock

    r, n = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    serial = Block(dim, heads, kv_heads, hidden).double()
    tp = TPBlock(copy.deepcopy(serial))
    x = torch.randn(2, 6, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)
    y_ref = serial(x, pos, serial_attention)
    loss_ref = y_ref.pow(2).mean()
    loss_ref.backward()
    y = tp(x, pos)
    loss = y.pow(2).mean()
    loss.backward()
    out = {"output": float((y - y_ref).abs().max()), "loss": float((loss - loss_ref).abs())}
    full = {name: p.grad for name, p in serial.named_parameters()}
    half = serial.wkv.weight.shape[0] // 2
    full["wk.weight"], full["wv.weight"] = full["wkv.weight"][:half], full["wkv.weight"][half:]
    for name, p in tp.named_parameters():
        g = full[name]
        if p.shape != g.shape:  # column parallel: rows r of n; row parallel: columns r of n
            dim_ = 0 if p.shape[0] != g.shape[0] else 1
            g = g.chunk(n, dim_)[r]
        out[name] = float((p.grad - g).abs().max())
    return out


def _tp_llama_keeps_the_serial_block() -> tuple[bool, int]:
    """Whether a TPBlock keeps its serial Block alive, and the TPBlock's parameter count."""
    import gc
    import sys
    import weakref
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from context_parallel_llama import Block
    from tensor_parallel_llama import TPBlock

    serial = Block().double()
    alive = weakref.ref(serial)
    tp = TPBlock(serial)
    del serial
    gc.collect()
    return alive() is not None, sum(p.numel() for p in tp.parameters())


def test_tensor_parallel_llama_example_holds_only_its_shards(world2) -> None:
    """The TP block keeps no reference to the serial block: ``self.rope = s.rope`` (a bound
    method) kept the whole serial block alive, so each rank held its 9280 full parameters
    next to its 4672 own."""
    for alive, n in world2.run(_tp_llama_keeps_the_serial_block):
        assert not alive and n == 4672


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_llama_example_equals_its_serial_block(local_worlds, world_size: int) -> None:
    """``examples/tensor_parallel_llama.py`` (RMSNorm, RoPE, GQA, SwiGLU; q/k/v, gate and
    up column parallel, o and down row parallel, norms replicated) equals the serial
    block: output, loss and every parameter gradient (float64)."""
    sizes = (4, 2, 32, 64) if world_size == 2 else (6, 3, 36, 66)
    for errs in local_worlds(world_size).run(_tp_llama_vs_serial, *sizes):
        assert len(errs) == 11 and max(errs.values()) < 1e-12, errs


def _copies_after_a_training_step() -> dict[str, object]:
    """copy.deepcopy of an ExpertParallelMoE (and of the serial MoE) after a forward and a
    backward: its aux_loss held the step's graph, and torch's deepcopy refused it."""
    import copy

    moe = P.ExpertParallelMoE(4, 6, 4, 2, dtype=F64, seed=0)
    serial = P.MoE(4, 6, 4, 2, dtype=F64, seed=0)
    x = torch.randn(5, 4, dtype=F64)
    out: dict[str, object] = {}
    for name, model in (("moe", moe), ("serial", serial)):
        y = model(x)
        (y.square().sum() + model.aux_loss).backward()
        steps = {"forward": model(x), "backward": None}
        for when in steps:
            twin = copy.deepcopy(model)
            assert twin.aux_loss is not None and twin.aux_loss.grad_fn is None
            same_aux = bool(torch.equal(twin.aux_loss, model.aux_loss.detach()))
            same_out = float((twin(x) - model(x)).abs().max())
            with torch.no_grad():  # independent: changing the copy leaves the model alone
                before = [p.clone() for p in model.parameters()]
                for p in twin.parameters():
                    p.add_(1.0)
            untouched = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            # (torch's Parameter.__deepcopy__ copies no gradient; none is shared)
            pairs = zip(twin.parameters(), model.parameters())
            grads = all(q.grad is None or q.grad is not p.grad for q, p in pairs)
            out[f"{name} after {when}"] = (same_aux, same_out, untouched, grads)
    return out


def test_deepcopy_after_a_training_step(world2) -> None:
    """The copy of a trained MoE: equal outputs, aux loss and gradients, no shared state
    (it raised "Only Tensors created explicitly by the user ... support the deepcopy protocol")."""
    for res in world2.run(_copies_after_a_training_step):
        assert all(v == (True, 0.0, True, True) for v in res.values()), res


def _copy_of_a_layer_caching_a_parameter_view() -> str:
    """A parallel layer given a view of its own weight (a tensor with a graph that no
    forward left): torch's deepcopy refusal, not a detached copy that would stop following
    the copy's weight."""
    import copy

    layer = P.ColumnParallelLinear(4, 6, dtype=F64, seed=0)
    layer.weight_t = layer.weight.t()
    try:
        copy.deepcopy(layer)
    except RuntimeError as e:
        return str(e)
    return "copied"


def test_deepcopy_refuses_a_cached_parameter_view(world2) -> None:
    """Only what a forward leaves (a class's ``FORWARD_RESULTS``: the MoE's aux_loss) is
    copied detached; any other tensor with a graph keeps torch's refusal (it was copied
    detached, silently frozen at the original weight's value)."""
    for msg in world2.run(_copy_of_a_layer_caching_a_parameter_view):
        assert "Only Tensors created explicitly by the user" in msg, msg
