"""Saving, resharding and restoring diffcomm-parallel models: the serial state dict across
world sizes, ``torch.distributed.checkpoint`` through ``parallel.dcp_state_dict``
(``dcp.save(model.state_dict())`` wrote one rank's shard per key, and every rank loaded
that one, with no error), and optimizer state. Every value against a float64 serial model."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _shared import load_serial_refusal
from torch import nn
from torch.testing import assert_close

import diffcomm as dc
from diffcomm import parallel as P

# Values need no real transport (DCP runs over the in-process world's process group); the one
# test on gloo processes says so.
pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64
H, FFN, VOCAB, HEADS, SEQ = 24, 48, 24, 12, 12  # every split size divides by 1, 2, 3 and 4


class Serial(nn.Module):
    """The serial model: embedding, MLP, causal attention, a linear head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, H, dtype=F64)
        self.mlp = P.MLP(H, FFN, dtype=F64)
        self.attn = P.SelfAttention(H, HEADS, causal=True, dtype=F64)
        self.head = nn.Linear(H, VOCAB, dtype=F64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.mlp(x)
        return self.head(x + self.attn(x))


class Parallel(P.ParallelModule):
    """Its tensor-parallel twin (every layer kind), over ``group``."""

    def __init__(self, serial: Serial, group: object = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        sp = {"sequence_parallel": sequence_parallel}
        self.emb = P.VocabParallelEmbedding.from_serial(serial.emb, group, **sp)
        self.mlp = P.ParallelMLP.from_serial(serial.mlp, group, **sp)
        self.attn = P.ParallelSelfAttention.from_serial(serial.attn, group, **sp)
        if sequence_parallel:  # the head gathers the sequence, the output stays sharded
            self.head = P.ColumnParallelLinear.from_serial(serial.head, group, **sp)
        else:
            self.head = P.ColumnParallelLinear.from_serial(serial.head, group, gather_output=True)
        self.sequence_parallel = sequence_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = Serial.forward(self, ids)  # type: ignore[arg-type]
        if self.sequence_parallel:  # (s, b, vocab / world) -> the whole output, every rank
            y = P.gather_from_region(y, -1, self.head._pg)
        return y


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ, 2), generator=torch.Generator().manual_seed(5))


def _sgd_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One SGD step on the replicated loss; returns the output before it."""
    y = model(ids)
    y.pow(2).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    return y.detach()


def _save_after_a_step(path: str) -> dict[str, torch.Tensor]:
    model = Parallel(Serial(0))
    _sgd_step(model, _ids())
    dcp.save(P.dcp_state_dict(model), checkpoint_id=path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load_and_step(path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    model = Parallel(Serial(1))  # other weights: everything must come from the checkpoint
    dcp.load(P.dcp_state_dict(model), checkpoint_id=path)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    y = _sgd_step(model, _ids())
    return loaded, model.to_serial_state_dict(), y


@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "gloo_processes"])
def test_dcp_round_trip_restores_every_ranks_shards(
    in_process: bool, local_worlds: Callable[..., dc.LocalWorld], tmp_path: Path
) -> None:
    """TP=2: ``dcp.save(model.state_dict())`` wrote one rank's copy of each key (DCP reads a
    plain tensor as replicated), and loading it gave rank 0 rank 1's shards of 3 of its 9
    sharded tensors and rank 1 rank 0's of 6 (the embedding, the MLP's, the attention's and
    the head's), with no error. Through ``dcp_state_dict`` every rank gets its own."""
    world = local_worlds(2, in_process=in_process)
    saved = world.run(_save_after_a_step, str(tmp_path))
    loaded = [r[0] for r in world.run(_load_and_step, str(tmp_path))]
    for rank in range(2):
        assert loaded[rank].keys() == saved[rank].keys()
        for k in saved[rank]:
            assert torch.equal(loaded[rank][k], saved[rank][k]), (rank, k)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (the serial load, no_dist)
def test_dcp_checkpoint_loads_at_every_size(
    inproc_worlds: Callable[[int], dc.LocalWorld], tmp_path: Path
) -> None:
    """Saved at TP=2 after one step, loaded at TP 1, 3 and 4 and into the serial model: the
    serial model's weights, outputs and next step (float64)."""
    serial, ids = Serial(0), _ids()
    _sgd_step(serial, ids)
    after_one = {k: v.clone() for k, v in serial.state_dict().items()}
    y_ref = _sgd_step(serial, ids)
    after_two = serial.state_dict()

    inproc_worlds(2).run(_save_after_a_step, str(tmp_path))
    for n in (1, 3, 4):
        for _loaded, full, y in inproc_worlds(n).run(_load_and_step, str(tmp_path)):
            assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
            assert full.keys() == after_two.keys()
            for k in after_two:
                assert_close(full[k], after_two[k], rtol=1e-12, atol=1e-12, msg=f"TP={n} {k}")

    into = Serial(1).state_dict()
    dcp.load(into, checkpoint_id=str(tmp_path), no_dist=True)
    for k in after_one:
        assert_close(into[k], after_one[k], rtol=1e-12, atol=1e-12, msg=k)


def _serial_after_a_step(sequence_parallel: bool) -> dict[str, torch.Tensor]:
    model = Parallel(Serial(0), sequence_parallel=sequence_parallel)
    _sgd_step(model, _ids())
    return model.to_serial_state_dict()


def _serial_load_and_step(
    full: dict[str, torch.Tensor], sequence_parallel: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = Parallel(Serial(1), sequence_parallel=sequence_parallel)
    model.load_serial_state_dict(full)
    y = _sgd_step(model, _ids())
    return model.to_serial_state_dict(), y


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sequence_parallel"])
def test_serial_state_dict_loads_at_every_size(
    sequence_parallel: bool, inproc_worlds: Callable[[int], dc.LocalWorld]
) -> None:
    """The serial flow: one step at TP=2, ``to_serial_state_dict``, ``load_serial_state_dict``
    at TP 1, 3 and 4: the serial model's weights, outputs and next step (float64)."""
    serial, ids = Serial(0), _ids()
    _sgd_step(serial, ids)
    after_one = {k: v.clone() for k, v in serial.state_dict().items()}
    y_ref = _sgd_step(serial, ids)
    after_two = serial.state_dict()
    full = inproc_worlds(2).run(_serial_after_a_step, sequence_parallel)[0]
    for k in after_one:
        assert_close(full[k], after_one[k], rtol=1e-12, atol=1e-12, msg=k)
    for n in (1, 3, 4):
        for got, y in inproc_worlds(n).run(_serial_load_and_step, full, sequence_parallel):
            assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
            for k in after_two:
                assert_close(got[k], after_two[k], rtol=1e-12, atol=1e-12, msg=f"TP={n} {k}")


def _moe_save(path: str) -> None:
    torch.manual_seed(0)
    serial = P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64)
    dcp.save(P.dcp_state_dict(P.ExpertParallelMoE.from_serial(serial)), checkpoint_id=path)


def _moe_load(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    moe = P.ExpertParallelMoE.from_serial(P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64))
    dcp.load(P.dcp_state_dict(moe), checkpoint_id=path)
    return moe.to_serial_state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_of_expert_parallel_moe_holds_the_serial_experts(
    inproc_worlds: Callable[[int], dc.LocalWorld], tmp_path: Path
) -> None:
    """An ``ExpertParallelMoE``'s local ``experts.0`` is another serial expert on each rank:
    its checkpoint keys are the serial names, so EP=2 loads at EP=3 and into the serial MoE."""
    torch.manual_seed(0)
    serial = P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64).state_dict()
    inproc_worlds(2).run(_moe_save, str(tmp_path))
    for full in inproc_worlds(3).run(_moe_load, str(tmp_path)):
        assert full.keys() == serial.keys()
        for k in serial:
            assert torch.equal(full[k], serial[k]), k
    torch.manual_seed(1)
    into = P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64).state_dict()
    dcp.load(into, checkpoint_id=str(tmp_path), no_dist=True)
    for k in serial:
        assert torch.equal(into[k], serial[k]), k


def _mesh_save(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dcp.save(P.dcp_state_dict(Parallel(Serial(0), (mesh, "tp"))), checkpoint_id=path)


def _tp4_load(path: str) -> dict[str, torch.Tensor]:
    model = Parallel(Serial(1))
    dcp.load(P.dcp_state_dict(model), checkpoint_id=path)
    return model.to_serial_state_dict()


def test_dcp_on_a_2x2_mesh_loads_at_tp4(
    inproc_worlds: Callable[[int], dc.LocalWorld], tmp_path: Path
) -> None:
    """Layers over the ``tp`` axis of a (dp=2, tp=2) mesh: each shard is written once (the
    two data-parallel replicas hold the same), and the checkpoint loads at TP=4."""
    serial = Serial(0).state_dict()
    world = inproc_worlds(4)
    world.run(_mesh_save, str(tmp_path))
    for full in world.run(_tp4_load, str(tmp_path)):
        for k in serial:
            assert torch.equal(full[k], serial[k]), k


def test_dcp_state_dict_refuses_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"dcp_state_dict\(\): `module` must be an nn.Module"):
        P.dcp_state_dict({"weight": torch.zeros(2)})  # type: ignore[arg-type]


def _moe_with_an_expert_buffer() -> None:
    torch.manual_seed(0)
    moe = P.ExpertParallelMoE.from_serial(P.MoE(H, 8, 4, k=2, dtype=F64))
    moe.experts[0].register_buffer("scale", torch.ones(1, dtype=F64))
    P.dcp_state_dict(moe)


def test_dcp_state_dict_refuses_an_expert_buffer(inproc_world2: dc.LocalWorld) -> None:
    """A persistent buffer of a local expert has no serial name: under ``experts.0.scale``
    every rank would write its own expert's value to one key."""
    with pytest.raises(dc.RankError, match=r"`experts.0.scale` is a buffer of an ExpertParallelMoE's expert"):
        inproc_world2.run(_moe_with_an_expert_buffer)


def _moe_load_serial_directly(strict: bool) -> tuple[str, bool]:
    torch.manual_seed(1)
    moe = P.ExpertParallelMoE.from_serial(P.MoE(H, 8, 4, k=2, dtype=F64))
    torch.manual_seed(0)
    serial = P.MoE(H, 8, 4, k=2, dtype=F64).state_dict()
    try:
        moe.load_state_dict(serial, strict=strict)
    except RuntimeError as e:
        return str(e), True
    mine = moe.to_serial_state_dict()
    return "no error", all(torch.equal(mine[k], serial[k]) for k in serial)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_load_state_dict_of_a_serial_moe_is_refused(strict: bool, inproc_world2: dc.LocalWorld) -> None:
    """A serial MoE's state dict passed to an ExpertParallelMoE's ``load_state_dict``: its
    ``experts.0``, ``experts.1`` have this rank's shapes, so with ``strict=False`` rank 1 took
    the serial experts 0, 1 for its 2, 3 (its output that of another MoE), no error. Now every
    rank refuses, naming load_serial_state_dict, with or without strict."""
    for message, _ in inproc_world2.run(_moe_load_serial_directly, strict):
        assert "holds 2 experts on this rank (experts.0..1), but the state dict has experts.2..3" in message
        assert "load_serial_state_dict" in message, message


class _SerialMoEBlock(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mlp = P.MLP(H, FFN, dtype=F64)
        self.moe = P.MoE(H, 8, 6, k=2, shared_expert_size=8, dtype=F64)


class _MoEBlock(P.ParallelModule):
    """A model of one's own holding a tensor-parallel MLP and an ExpertParallelMoE."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        serial = _SerialMoEBlock(seed)
        self.mlp = P.ParallelMLP.from_serial(serial.mlp)
        self.moe = P.ExpertParallelMoE.from_serial(serial.moe)


def _moe_block_round_trip(
    full: dict[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    saved = _MoEBlock(0).to_serial_state_dict()
    model = _MoEBlock(1)
    model.load_serial_state_dict(full if full is not None else saved)
    return saved, model.moe.to_serial_state_dict()


def test_serial_state_dict_of_a_model_holding_an_expert_parallel_moe(
    inproc_worlds: Callable[[int], dc.LocalWorld],
) -> None:
    """A ``ParallelModule`` holding an ``ExpertParallelMoE`` took the MoE's tensors for
    replicas: at EP=2 ``to_serial_state_dict`` returned rank 1's experts 3..5 as
    ``moe.experts.0..2`` (and no experts 3..5), and ``load_serial_state_dict`` refused the
    serial experts 3..5 as unexpected keys (with ``strict=False``, rank 1 loaded experts
    0..2 for its 3..5, silently). Now the MoE maps its own: the serial model's state dict
    both ways, at EP 2 and 3."""
    serial = _SerialMoEBlock(0).state_dict()
    for n in (2, 3):
        for saved, moe in inproc_worlds(n).run(_moe_block_round_trip, serial):
            assert saved.keys() == serial.keys()
            for k in serial:
                assert torch.equal(saved[k], serial[k]), (n, k)
            for k, v in moe.items():
                assert torch.equal(v, serial[f"moe.{k}"]), (n, k)


def _serial_state_dict_with_an_expert_buffer(load: bool) -> None:
    torch.manual_seed(0)
    serial = P.MoE(H, 8, 4, k=2, dtype=F64)
    moe = P.ExpertParallelMoE.from_serial(serial)
    for expert in moe.experts:  # a running statistic of each expert
        expert.register_buffer("scale", torch.full((1,), 2.0 + dc.get_rank(), dtype=F64))
    if load:
        moe.load_serial_state_dict(serial.state_dict())
    else:
        moe.to_serial_state_dict()


@pytest.mark.parametrize("load", [False, True], ids=["to_serial", "load_serial"])
def test_serial_state_dict_refuses_an_expert_buffer(load: bool, inproc_world2: dc.LocalWorld) -> None:
    """A persistent buffer of a local expert: ``to_serial_state_dict`` held the experts'
    parameters only and dropped it (no ``experts.*.scale`` key; a round trip reset every
    expert's 2.0 / 3.0 to the fresh model's), with no error, where ``dcp_state_dict``
    refuses it. Now both serial-state-dict methods refuse it too, naming the buffer."""
    with pytest.raises(dc.RankError, match=r"`experts.0.scale` is a persistent buffer of an expert"):
        inproc_world2.run(_serial_state_dict_with_an_expert_buffer, load)


# ======================================================================================
# optimizer state
# ======================================================================================


# eps=1e-3: the attention's key bias has a zero gradient in exact arithmetic (softmax ignores
# a per-query constant); Adam's default eps would turn its rounding noise (1e-18) into steps of
# size lr, different in every layout
ADAM = {"lr": 0.01, "eps": 1e-3}


def _adam_steps(model: nn.Module, adam: torch.optim.Optimizer, steps: int) -> torch.Tensor:
    for _ in range(steps):
        y = model(_ids())
        y.pow(2).sum().backward()
        adam.step()
        adam.zero_grad()
    return y.detach()


def _adam_save(path: str) -> None:
    model = Parallel(Serial(0))
    adam = torch.optim.Adam(model.parameters(), **ADAM)
    _adam_steps(model, adam, 2)
    state = {"model": P.dcp_state_dict(model), "optim": P.dcp_optimizer_state(model, adam)}
    dcp.save(state, checkpoint_id=path)


def _adam_load_and_step(path: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = Parallel(Serial(1))
    adam = torch.optim.Adam(model.parameters(), lr=0.5, eps=1e-3)  # the saved lr must come back
    state = {"model": P.dcp_state_dict(model), "optim": P.dcp_optimizer_state(model, adam)}
    dcp.load(state, checkpoint_id=path)
    y = _adam_steps(model, adam, 1)
    return model.to_serial_state_dict(), y


def test_dcp_optimizer_state_reshards_adam_moments(
    inproc_worlds: Callable[[int], dc.LocalWorld], tmp_path: Path
) -> None:
    """Adam's moments are shards like their parameters: saved at TP=2 after two steps,
    loaded with a fresh Adam at TP 1, 3 and 4, the third step equals the serial float64
    model's third Adam step (weights and output)."""
    serial = Serial(0)
    adam = torch.optim.Adam(serial.parameters(), **ADAM)
    _adam_steps(serial, adam, 2)
    y_ref = _adam_steps(serial, adam, 1)
    after = serial.state_dict()

    inproc_worlds(2).run(_adam_save, str(tmp_path))
    for n in (1, 3, 4):
        for full, y in inproc_worlds(n).run(_adam_load_and_step, str(tmp_path)):
            assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
            for k in after:
                assert_close(full[k], after[k], rtol=1e-12, atol=1e-12, msg=f"TP={n} {k}")


def _steps_without_a_bias_gradient(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """Steps in which the head's bias gets no gradient (as a branch not taken): it has no
    optimizer state after them."""
    for _ in range(steps):
        model(_ids()).pow(2).sum().backward()
        model.head.bias.grad = None
        opt.step()
        opt.zero_grad()


def _save_with_a_stateless_parameter(path: str, kind: str) -> None:
    model = Parallel(Serial(0))
    opt = _OPTIMIZERS[kind](model.parameters())
    _steps_without_a_bias_gradient(model, opt, 2)
    assert model.head.bias not in opt.state
    dcp.save(
        {"model": P.dcp_state_dict(model), "optim": P.dcp_optimizer_state(model, opt)}, checkpoint_id=path
    )


def _load_with_a_stateless_parameter(
    path: str, kind: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor, bool]:
    model = Parallel(Serial(1))
    opt = _OPTIMIZERS[kind](model.parameters())
    dcp.load(
        {"model": P.dcp_state_dict(model), "optim": P.dcp_optimizer_state(model, opt)}, checkpoint_id=path
    )
    stateless = not opt.state.get(model.head.bias)
    y = _adam_steps(model, opt, 1)  # (every parameter gets a gradient now)
    return model.to_serial_state_dict(), y, stateless


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, **ADAM),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.5),
}


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_dcp_optimizer_state_of_a_parameter_without_state(
    kind: str, inproc_worlds: Callable[[int], dc.LocalWorld], tmp_path: Path
) -> None:
    """A parameter without a gradient before the save has no optimizer state. Before, the
    load into a fresh optimizer failed (torch's "Missing key in checkpoint state_dict:
    optim.state.head.bias.momentum_buffer", as torch's own get_optimizer_state_dict does);
    tolerating the missing keys alone would keep the fresh optimizer's made-up state for it
    (Adam's step 1: another bias correction). Now it loads with no state for it, as saved:
    the next step (TP=2 -> 3) equals the serial float64 model's."""
    serial = Serial(0)
    opt = _OPTIMIZERS[kind](serial.parameters())
    _steps_without_a_bias_gradient(serial, opt, 2)
    y_ref = _adam_steps(serial, opt, 1)
    after = serial.state_dict()
    inproc_worlds(2).run(_save_with_a_stateless_parameter, str(tmp_path), kind)
    for full, y, stateless in inproc_worlds(3).run(_load_with_a_stateless_parameter, str(tmp_path), kind):
        assert stateless
        assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        for k in after:
            assert_close(full[k], after[k], rtol=1e-12, atol=1e-12, msg=k)


def test_dcp_optimizer_state_refuses_a_non_optimizer() -> None:
    with pytest.raises(
        TypeError, match=r"dcp_optimizer_state\(\): `optimizer` must be a torch.optim.Optimizer"
    ):
        P.dcp_optimizer_state(nn.Linear(2, 2), {"lr": 0.1})  # type: ignore[arg-type]


def _moe_adam_steps(moe: nn.Module, adam: torch.optim.Optimizer, steps: int) -> torch.Tensor:
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(2), dtype=F64)
    if isinstance(moe, P.ExpertParallelMoE):
        x = x.chunk(dc.get_world_size())[dc.get_rank()]  # this rank's tokens
    for _ in range(steps):
        y = moe(x)
        y.pow(2).sum().backward()
        if isinstance(moe, P.ExpertParallelMoE):
            moe.sync_replicated_grads()
        adam.step()
        adam.zero_grad()
    return y.detach()


def _moe_adam_save(path: str) -> None:
    torch.manual_seed(0)
    moe = P.ExpertParallelMoE.from_serial(P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64))
    adam = torch.optim.Adam(moe.parameters(), **ADAM)
    _moe_adam_steps(moe, adam, 2)
    dcp.save({"model": P.dcp_state_dict(moe), "optim": P.dcp_optimizer_state(moe, adam)}, checkpoint_id=path)


def _moe_adam_load_and_step(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    moe = P.ExpertParallelMoE.from_serial(P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64))
    adam = torch.optim.Adam(moe.parameters(), **ADAM)
    dcp.load({"model": P.dcp_state_dict(moe), "optim": P.dcp_optimizer_state(moe, adam)}, checkpoint_id=path)
    _moe_adam_steps(moe, adam, 1)
    return moe.to_serial_state_dict()


def test_dcp_optimizer_state_of_expert_parallel_moe(
    inproc_worlds: Callable[[int], dc.LocalWorld], tmp_path: Path
) -> None:
    """The experts' Adam moments under the experts' serial names: saved at EP=2, loaded at
    EP=3, the next step equals the serial MoE's."""
    torch.manual_seed(0)
    serial = P.MoE(H, 8, 12, k=2, shared_expert_size=8, dtype=F64)
    adam = torch.optim.Adam(serial.parameters(), **ADAM)
    _moe_adam_steps(serial, adam, 3)
    after = serial.state_dict()
    inproc_worlds(2).run(_moe_adam_save, str(tmp_path))
    for full in inproc_worlds(3).run(_moe_adam_load_and_step, str(tmp_path)):
        for k in after:
            assert_close(full[k], after[k], rtol=1e-12, atol=1e-12, msg=k)


def _adam_per_rank_round_trip() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = Parallel(Serial(0))
    adam = torch.optim.Adam(model.parameters(), **ADAM)
    _adam_steps(model, adam, 2)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": adam.state_dict()}, blob)
    model = Parallel(Serial(1))
    adam = torch.optim.Adam(model.parameters(), lr=0.5, eps=1e-3)
    saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    model.load_state_dict(saved["model"])
    adam.load_state_dict(saved["optim"])
    y = _adam_steps(model, adam, 1)
    return model.to_serial_state_dict(), y


def test_per_rank_optimizer_state_restores_on_the_same_layout(inproc_world2: dc.LocalWorld) -> None:
    """The flow without DCP (docs/parallel.md): each rank saves its model and optimizer
    state dicts and loads its own on the same layout; the next Adam step equals the serial
    model's third."""
    serial = Serial(0)
    adam = torch.optim.Adam(serial.parameters(), **ADAM)
    _adam_steps(serial, adam, 2)
    y_ref = _adam_steps(serial, adam, 1)
    after = serial.state_dict()
    for full, y in inproc_world2.run(_adam_per_rank_round_trip):
        assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        for k in after:
            assert_close(full[k], after[k], rtol=1e-12, atol=1e-12, msg=k)


def _fully_sharded_tp() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mlp = P.ParallelMLP(8, 16, seed=0, group=(mesh, "tp"))
    fully_shard(mlp, mesh=mesh["dp"])
    try:
        P.dcp_state_dict(mlp)
    except TypeError as e:
        return str(e)
    return "no error"


def test_dcp_state_dict_refuses_fsdp2_over_tensor_parallel_shards(inproc_world4: dc.LocalWorld) -> None:
    """FSDP2's ``fully_shard`` over the ``dp`` axis makes each tensor-parallel shard a DTensor
    whose global shape is the shard's ((8, 8) for the serial (16, 8)): DCP would keep one
    tensor-parallel rank's copy. ``dcp_state_dict`` says so instead of torch's "local_tensor
    argument only accepts torch.Tensor"."""
    for message in inproc_world4.run(_fully_sharded_tp):
        assert message.startswith("diffcomm.parallel.dcp_state_dict(): `fc1.weight` is a shard of a"), message
        assert "fully_shard" in message and "not supported yet" in message, message


def test_dcp_state_dict_under_local_tensor_mode_is_refused() -> None:
    """Under torch's ``LocalTensorMode`` one program stands for every rank: ``dcp.save``
    of its shards failed in torch ("LocalTensor does not support MPMD operations like
    gather"); now diffcomm's refusal names the call and the in-process world instead."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from diffcomm.backend.local_tensor import LocalTensorModeError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with LocalTensorMode(2):
            layer = P.ColumnParallelLinear(4, 6, seed=0, dtype=F64)
            with pytest.raises(
                LocalTensorModeError, match=r"`parallel.dcp_state_dict` under torch's LocalTensorMode"
            ):
                P.dcp_state_dict(layer)
            with pytest.raises(LocalTensorModeError, match=r"`parallel.dcp_optimizer_state` under"):
                P.dcp_optimizer_state(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    finally:
        dist.destroy_process_group()


# ======================================================================================
# load_serial_state_dict: the whole serial shape
# ======================================================================================


def _load_serial(kind: str) -> str:
    layer: P.ParallelModule
    if kind.startswith("embedding"):
        layer = P.VocabParallelEmbedding(24, 6, seed=1, dtype=F64)
        rows = 32 if kind == "embedding-larger" else 20
        sd = {"weight": torch.randn(rows, 6, dtype=F64)}
    else:  # the weight fits, the bias (sharded by the column layer, replicated by the row) does not
        cls = P.ColumnParallelLinear if kind == "column-bias" else P.RowParallelLinear
        layer = cls(4, 6, seed=1, dtype=F64)
        sd = {"weight": torch.randn(6, 4, dtype=F64), "bias": torch.randn(8, dtype=F64)}
    return load_serial_refusal(layer, sd, ValueError)


@pytest.mark.parametrize(
    ("kind", "key", "serial", "want"),
    [
        ("embedding-larger", "weight", "(32, 6)", "(24, 6)"),
        ("embedding-smaller", "weight", "(20, 6)", "(24, 6)"),
        ("column-bias", "bias", "(8,)", "(6,)"),
        ("row-bias", "bias", "(8,)", "(6,)"),
    ],
)
def test_load_serial_state_dict_checks_the_whole_serial_shape(
    kind: str, key: str, serial: str, want: str, inproc_world2: dc.LocalWorld
) -> None:
    """Only this rank's cut was compared with its shard: a 32-row serial embedding (a padded
    vocabulary) loaded into a 24-row TP=2 layer on both ranks with no error (rows 24-31
    dropped), and so did an 8-element bias into a 6-feature column-parallel layer (elements
    6, 7 dropped); a 20-row embedding failed on rank 1 only (torch's narrow error); a row
    layer's replicated bias that does not fit raised after the weight had been copied. Now
    every rank raises, naming the serial shapes, before any copy."""
    for message in inproc_world2.run(_load_serial, kind):
        assert f"load_serial_state_dict(): `{key}` of serial shape {serial} does not fit" in message, message
        assert f"a serial tensor of shape {want}" in message and message.endswith("untouched=True"), message


def _moe_load_misfit() -> str:
    torch.manual_seed(0)
    serial = P.MoE(4, 6, 4, k=1, dtype=F64).state_dict()
    serial["experts.3.fc2.bias"] = torch.zeros(5, dtype=F64)  # rank 1's last expert: 4 features
    moe = P.ExpertParallelMoE(4, 6, num_experts=4, k=1, seed=3, dtype=F64)
    return load_serial_refusal(moe, serial, ValueError)


def test_expert_parallel_load_serial_state_dict_checks_before_copying(inproc_world2: dc.LocalWorld) -> None:
    """A serial expert tensor that does not fit raised on the rank holding that expert only
    (rank 0 loaded), after the router and the earlier experts had been copied (rank 1's
    layer half loaded); now every rank checks every expert, before any copy."""
    for message in inproc_world2.run(_moe_load_misfit):
        assert "`state_dict` must be 'experts.3.fc2.bias' of shape (4,), got (5,)" in message, message
        assert message.endswith("untouched=True"), message


# ------------------------------------------------------------- dropout across save / resume


class _Dropped(nn.Module):
    """MLP and attention with dropout on their shards (the "model-parallel" stream) and a
    residual dropout on the full activation (the default generator)."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        opts = P.LayerOptions(seed=0, dtype=F64)
        self.mlp = P.ParallelMLP(H, FFN, dropout=0.3, options=opts)
        self.attn = P.ParallelSelfAttention(H, HEADS, attention_dropout=0.3, options=opts)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from diffcomm import rng

        run = (lambda f, *a: rng.checkpoint(f, *a)) if self.recompute else (lambda f, *a: f(*a))
        x = torch.nn.functional.dropout(x + run(self.mlp, x), 0.3)
        return x + run(self.attn, x)


def _dropped_steps(model: nn.Module, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x = torch.randn(SEQ, 2, H, dtype=F64, generator=torch.Generator().manual_seed(s))
        loss = model(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses


def _dropout_resume(restore: bool) -> tuple[list[float], list[float], float]:
    """Steps 0..5 uninterrupted; then 0..2, save (model + RNG state), a new job resumes
    (rng.checkpoint on) and runs 3..5. Returns both runs' losses of 3..5 and the largest
    parameter difference."""
    from diffcomm import rng

    rng.model_parallel_seed(11, tp_rank=dc.get_rank())
    whole = _Dropped(recompute=False)
    losses = _dropped_steps(whole, range(6))[3:]
    rng.model_parallel_seed(11, tp_rank=dc.get_rank())
    first = _Dropped(recompute=False)
    _dropped_steps(first, range(3))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "rng": rng.get_tracker().state_dict()}, buf)
    torch.manual_seed(123)  # the new job
    rng.model_parallel_seed(11, tp_rank=dc.get_rank())
    resumed = _Dropped(recompute=True)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed.load_state_dict(saved["model"])
    if restore:
        rng.get_tracker().load_state_dict(saved["rng"])
    got = _dropped_steps(resumed, range(3, 6))
    off = max((a - b).abs().max().item() for a, b in zip(whole.parameters(), resumed.parameters()))
    return losses, got, off


def test_dropout_resumes_bit_for_bit_with_the_rng_state_dict(inproc_world2: dc.LocalWorld) -> None:
    """TP=2, float64, dropout on shards and on the full activation, recomputed by
    rng.checkpoint after the resume: restoring rng.get_tracker().state_dict() makes steps
    3..5 equal the uninterrupted run's, bit for bit. Without it the resumed job draws the
    masks of step 0 again (model_parallel_seed starts the streams afresh): losses 1.4751 /
    1.5207 / 1.3474 for 1.5786 / 1.4823 / 1.4474, parameters 1.0e-2 off, no error."""
    for losses, got, off in inproc_world2.run(_dropout_resume, True):
        assert got == losses
        assert off == 0.0
    for losses, got, off in inproc_world2.run(_dropout_resume, False):
        assert got != losses and off > 0
