"""Sequence parallelism with one coalesced gradient reduction per step.

The replicated parameters that meet a rank-local sequence chunk (sequence-parallel
layer norms' weights and biases, sequence-parallel row-parallel biases) get per-rank
partial gradients. The outermost ``ParallelModule`` copies all of them into the region
at once (``copy_to_region_coalesced``), so a training step sums their gradients in **one**
coalesced all_reduce instead of one all_reduce per tensor. Checked: a transformer block
equals its serial reference (outputs, input gradient, every parameter's value and
gradient) and communicates the analytic count per step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm.backend import log_comms
from diffcomm.testing import Shard, assert_matches_serial, build

F64 = torch.float64
H, HEADS, FFN = 8, 4, 16


class Block(nn.Module):
    """Pre-norm transformer block (serial reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(H, dtype=F64)
        self.attn = P.SelfAttention(H, HEADS, dtype=F64)
        self.ln2 = nn.LayerNorm(H, dtype=F64)
        self.mlp = P.MLP(H, FFN, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelBlock(P.ParallelModule):
    """The same block, tensor- and sequence-parallel: input/output are sequence chunks."""

    def __init__(self, serial: Block, group=None) -> None:
        super().__init__()
        self.ln1 = P.SequenceParallelLayerNorm.from_serial(serial.ln1, group)
        self.attn = P.ParallelSelfAttention.from_serial(serial.attn, group, sequence_parallel=True)
        self.ln2 = P.SequenceParallelLayerNorm.from_serial(serial.ln2, group)
        self.mlp = P.ParallelMLP.from_serial(serial.mlp, group, sequence_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def serial_block() -> Block:
    torch.manual_seed(0)
    block = Block()
    with torch.no_grad():  # non-trivial layer-norm parameters
        for ln in (block.ln1, block.ln2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    return block


def test_sequence_parallel_block_matches_serial(world2, world4) -> None:
    for world in (world2, world4):
        n = world.world_size
        x = torch.randn(2 * n, 3, H, dtype=F64)
        assert_matches_serial(
            build(lambda s: ParallelBlock(s)),
            serial_block(),
            x,
            world=world,
            input_specs=[Shard(0)],
            output_specs=[Shard(0)],
        )


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_one_coalesced_reduction_per_step(world2) -> None:
    def step_comms(kind: str) -> dict:
        w = dc.get_world_size()
        x = torch.randn(2 * w, 3, H, dtype=F64, requires_grad=True)
        if kind == "block":
            model: nn.Module = ParallelBlock(serial_block())
        elif kind == "layer_norm":
            model = P.SequenceParallelLayerNorm(H, dtype=F64)
        else:
            model = P.ParallelMLP(H, FFN, seed=0, sequence_parallel=True, dtype=F64)
        with log_comms() as log:
            model(x).pow(2).sum().backward()
        counts = {
            op: log.count(op) for op in ("all_reduce", "all_reduce_coalesced", "all_gather", "reduce_scatter")
        }
        coalesced = [(r.nbytes, r.parts) for r in log.records if r.op == "all_reduce_coalesced"]
        return {
            "counts": counts,
            "coalesced": coalesced,
            "leftover": [m.__dict__.get("_region_copies") for m in model.modules()],
        }

    block, ln, mlp = (world2.run(step_comms, k)[0] for k in ("block", "layer_norm", "mlp"))
    # the block: 2 layer norms (weight + bias) + attn.proj.bias + mlp.fc2.bias = 6 partial
    # gradients -> ONE coalesced all_reduce of 6 * 8 float64 (one dtype: one raw call),
    # instead of 6 all_reduce. Sequence parallelism: attention and MLP each all_gather
    # forward + reduce_scatter backward (fc1/qkv input) and reduce_scatter forward +
    # all_gather backward (fc2/proj output).
    assert block["counts"] == {
        "all_reduce": 0,
        "all_reduce_coalesced": 1,
        "all_gather": 4,
        "reduce_scatter": 4,
    }
    assert block["coalesced"] == [(6 * H * 8, 1)]
    # a layer norm alone: its weight and bias in one coalesced call
    assert ln["counts"] == {"all_reduce": 0, "all_reduce_coalesced": 1, "all_gather": 0, "reduce_scatter": 0}
    assert ln["coalesced"] == [(2 * H * 8, 1)]
    # an MLP alone has one such tensor (fc2's bias): a plain all_reduce, as before
    assert mlp["counts"] == {"all_reduce": 1, "all_reduce_coalesced": 0, "all_gather": 2, "reduce_scatter": 2}
    for rec in (block, ln, mlp):
        assert all(c is None for c in rec["leftover"]), "the forward leaves no region copies behind"


def test_coalesced_region_mappings(world3) -> None:
    def copy_coalesced() -> list:
        r = dc.get_rank()
        a = torch.ones(2, requires_grad=True)
        b = torch.ones((), dtype=F64, requires_grad=True)
        a2, b2 = P.copy_to_region_coalesced([a, b])
        with log_comms() as log:
            ((a2 * (r + 1)).sum() + b2 * (r + 1)).backward()
        u = torch.full((2,), float(r + 1), requires_grad=True)
        v = torch.tensor(float(r), dtype=F64, requires_grad=True)
        s = P.reduce_from_region_coalesced([u, v])
        (s[0] * torch.tensor([3.0, 4.0]) + s[1]).sum().backward()  # identity backward
        grads = [u.grad.tolist(), v.grad.item()]
        return [
            a.grad.tolist(),
            b.grad.item(),
            [(x.op, x.parts) for x in log.records],
            [t.tolist() for t in s],
            grads,
        ]

    for a, b, log, s, grads in world3.run(copy_coalesced):
        assert a == [6.0, 6.0] and b == 6.0
        assert log == [("all_reduce_coalesced", 2)]  # float32 + float64
        assert s == [[6.0, 6.0], 3.0]
        assert grads == [[3.0, 4.0], 2.0]


def _w(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=F64)


class Penalty(nn.Module):
    """``||d<block(x), w>/dx||^2`` (serial): differentiating it runs double backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (gx,) = torch.autograd.grad((self.block(x) * _w(*x.shape)).sum(), x, create_graph=True)
        return gx.pow(2).sum()


class ParallelPenalty(P.ParallelModule):
    """The same on sequence chunks; the outermost ParallelModule (so the block's six
    partial-gradient replicas go through the coalesced region copy, and double backward
    through its conjugate, ``reduce_from_region_coalesced``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, n = dc.get_rank(), x.shape[0]
        w = _w(n * dc.get_world_size(), *x.shape[1:])[r * n : (r + 1) * n]
        (gx,) = torch.autograd.grad((self.block(x) * w).sum(), x, create_graph=True)
        return P.reduce_from_region(gx.pow(2).sum())


class NormMLPs(nn.Module):
    """Two pre-norm MLP blocks (attention has no double backward on CPU in torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H, dtype=F64), nn.LayerNorm(H, dtype=F64)
        self.mlp1 = P.MLP(H, FFN, activation="tanh", dtype=F64)
        self.mlp2 = P.MLP(H, FFN, activation="tanh", dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp1(self.ln1(x))
        return x + self.mlp2(self.ln2(x))


class ParallelNormMLPs(nn.Module):
    """Deliberately a plain ``nn.Module``: the outermost ParallelModule is the penalty."""

    def __init__(self, serial: NormMLPs) -> None:
        super().__init__()
        self.ln1 = P.SequenceParallelLayerNorm.from_serial(serial.ln1)
        self.ln2 = P.SequenceParallelLayerNorm.from_serial(serial.ln2)
        self.mlp1 = P.ParallelMLP.from_serial(serial.mlp1, sequence_parallel=True)
        self.mlp2 = P.ParallelMLP.from_serial(serial.mlp2, sequence_parallel=True)

    forward = NormMLPs.forward


def serial_norm_mlps() -> NormMLPs:
    torch.manual_seed(1)
    m = NormMLPs()
    with torch.no_grad():
        for ln in (m.ln1, m.ln2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    return m


def test_double_backward_through_the_coalesced_region_copy(world2) -> None:
    x = torch.randn(4, 2, H, dtype=F64)
    assert_matches_serial(
        build(lambda s: ParallelPenalty(ParallelNormMLPs(s.block))),
        Penalty(serial_norm_mlps()),
        x,
        world=world2,
        input_specs=[Shard(0)],
    )
