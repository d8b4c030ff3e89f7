"""torch.func over the parallel layers: ``functional_call`` with parameters of the wrong
shape (the serial model's whole tensors) refused, ensembles (``stack_module_state`` +
``vmap``) and per-example gradients (``vmap`` over ``grad``) equal to the serial float64
model's, and the expert-parallel MoE under ``vmap`` refused with a message (its routing
is data-dependent)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

import diffcomm as dc
from diffcomm import parallel as P

pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64
S, B, H = 4, 2, 8


def _pair(kind: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(serial, this rank's parallel twin), float64."""
    torch.manual_seed(seed)
    if kind == "column":
        ser: torch.nn.Module = torch.nn.Linear(H, 2 * H, dtype=F64)
        return ser, P.ColumnParallelLinear.from_serial(ser)
    if kind == "row":
        ser = torch.nn.Linear(2 * H, H, dtype=F64)
        return ser, P.RowParallelLinear.from_serial(ser, input_is_parallel=True)
    if kind == "embedding":
        ser = torch.nn.Embedding(8, H, dtype=F64)
        return ser, P.VocabParallelEmbedding.from_serial(ser)
    if kind == "mlp_sp":
        ser = P.MLP(H, 2 * H, dtype=F64)
        return ser, P.ParallelMLP.from_serial(ser, sequence_parallel=True)
    ser = P.SelfAttention(H, 4, dtype=F64)
    return ser, P.ParallelSelfAttention.from_serial(ser)


def _serial_params_refused(kind: str) -> str:
    ser, par = _pair(kind)
    # (the row-parallel layer's input: this rank's share, H of the 2H features)
    x = torch.randint(0, 8, (S, B)) if kind == "embedding" else torch.randn(S, B, H, dtype=F64)
    try:
        y = functional_call(par, dict(ser.named_parameters()), (x,))
    except ValueError as e:
        return f"ValueError: {e}"
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return f"no error: output {tuple(y.shape)}, serial {tuple(ser(x).shape)}"


@pytest.mark.parametrize("kind", ["column", "row", "embedding", "attention"])
def test_functional_call_with_the_serial_parameters_is_refused(
    inproc_world2: dc.LocalWorld, kind: str
) -> None:
    """A sharded layer handed the serial model's whole tensors by functional_call: before,
    a ColumnParallelLinear returned the whole output (16 features) as its shard of 8 on
    every rank, a VocabParallelEmbedding looked its own range's ids up in the first rows of
    the whole table (2.4 off the serial output), a RowParallelLinear failed in torch's
    matmul ("mat1 and mat2 shapes cannot be multiplied") and a ParallelSelfAttention told
    to use input_is_parallel=False (wrong advice). Now a ValueError naming the parameter,
    the shard's shape and serial_slices(), before any communication."""
    for msg in inproc_world2.run(_serial_params_refused, kind):
        assert msg.startswith("ValueError:"), msg
        assert "is the whole serial tensor" in msg and "serial_slices()" in msg, msg


def _ensemble_and_per_example(kind: str) -> dict[str, float]:
    """Worst differences against the serial float64 models: an ensemble of 3 (stacked
    parameters, vmap) and per-example gradients (vmap over grad w.r.t. the parameters)."""
    r, n = dc.get_rank(), dc.get_world_size()
    sp = kind == "mlp_sp"  # input (and output) a sequence chunk

    def mine(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(n, dim)[r] if sp else t

    pairs = [_pair(kind, s) for s in range(3)]
    sers, pars = zip(*pairs)
    g = torch.Generator().manual_seed(1)
    ids = kind == "embedding"
    x = (
        torch.randint(0, 8, (3, S, B), generator=g)
        if ids
        else torch.randn(3, S, B, H, dtype=F64, generator=g)
    )
    cot = torch.randn(3, S, B, H, dtype=F64, generator=g)
    worst: dict[str, float] = {}
    params, buffers = stack_module_state(list(pars))
    base = copy.deepcopy(pars[0]).to("meta")
    y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(
        params, buffers, mine(x[0], 0)
    )
    want = torch.stack([mine(s(x[0]), 0) for s in sers])
    worst["ensemble"] = float((y - want).abs().max())

    ser, par = pairs[0]

    def loss(
        module: torch.nn.Module, p: dict[str, torch.Tensor], x: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        return (functional_call(module, p, (x,)) * c).sum()

    own = {k: v.detach() for k, v in par.named_parameters()}
    got = vmap(grad(lambda p, x, c: loss(par, p, x, c)), in_dims=(None, 0, 0))(own, mine(x, 1), mine(cot, 1))
    full = {k: v.detach() for k, v in ser.named_parameters()}
    ref = vmap(grad(lambda p, x, c: loss(ser, p, x, c)), in_dims=(None, 0, 0))(full, x, cot)
    for name, index in par.serial_slices().items():
        worst[name] = float((got[name] - ref[name][(slice(None), *index)]).abs().max())
    return worst


@pytest.mark.parametrize("kind", ["embedding", "mlp_sp", "attention"])
def test_ensembles_and_per_example_gradients_equal_the_serial_models(
    inproc_world2: dc.LocalWorld, kind: str
) -> None:
    """stack_module_state + vmap over parallel layers and vmap over grad w.r.t. a layer's
    parameter dict. Before, per-example gradients of a VocabParallelEmbedding (ids batched)
    failed inside torch: "Batching rule not implemented for aten::_assert_async.msg" (the
    vocabulary range check); now its ids are checked on the unbatched tensor."""
    for worst in inproc_world2.run(_ensemble_and_per_example, kind):
        assert len(worst) >= 2 and max(worst.values()) < 1e-12, worst


def _moe_under_vmap(how: str) -> str:
    r, n = dc.get_rank(), dc.get_world_size()
    mods = [P.ExpertParallelMoE.from_serial(P.MoE(H, 2 * H, 4, seed=s, dtype=F64)) for s in range(2)]
    x = torch.randn(2, 2 * n, H, dtype=F64, generator=torch.Generator().manual_seed(1))[:, 2 * r : 2 * r + 2]
    try:
        if how == "ensemble":
            params, buffers = stack_module_state(mods)
            vmap(lambda p, b: functional_call(mods[0], (p, b), (x[0],)))(params, buffers)
        else:
            own = {k: v.detach() for k, v in mods[0].named_parameters()}
            vmap(grad(lambda p, x: functional_call(mods[0], p, (x,)).sum()), in_dims=(None, 0))(own, x)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("how", ["ensemble", "per_example"])
def test_expert_parallel_moe_under_vmap_is_refused(inproc_world2: dc.LocalWorld, how: str) -> None:
    """The MoE's routing is data-dependent (each batch element its own split sizes), so
    one all_to_all cannot serve a vmap's batch. Before, vmap failed with a misleading
    "`expert_index` must be expert ids in [0, 4), got ids out of range"; now a ValueError
    naming vmap and the way out, before any communication."""
    for msg in inproc_world2.run(_moe_under_vmap, how):
        assert "ExpertParallelMoE" in msg and "batched by torch.func.vmap" in msg and "Loop over" in msg, msg
