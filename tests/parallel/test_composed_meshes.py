"""Two parallelisms composed on a 2 x 2 DeviceMesh, each against the float64 serial model
of the whole program (same weights, same data): outputs and every parameter gradient,
mapped back with ``serial_slices()``.

- pipeline x tensor parallel: the pipeline over the ``pp`` axis, each stage a residual
  ParallelMLP / ParallelSelfAttention over ``tp`` (with sequence parallelism: the stage's
  activation differs per tp rank, so tp rank i of stage 0 must feed tp rank i of stage 1);
  a plain, a zero-bubble and a V schedule. In process (values and gradients equal real
  processes', tests/runtime/test_local_tensor.py and test_in_process.py; the probe behind
  this file also ran them on gloo processes: the same to 4.4e-16).
- context parallel x tensor parallel: heads split over ``tp`` (column/row-parallel
  projections), the sequence over ``cp`` (ring zigzag causal, Ulysses), GQA; in process.

Groups are given as ``(DeviceMesh, axis)`` in one place and as the axis's ProcessGroup in
another, within one program.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm.parallel import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear
from diffcomm.parallel.blocks import MLP, SelfAttention
from diffcomm.pipeline import PipelineRunner

F64 = torch.float64
H = 8


class _Residual(nn.Module):
    """``x + block(x)`` on ``(b, s, h)``; an attention block sees ``(s, b, h)``."""

    def __init__(self, block: nn.Module, seq_first: bool) -> None:
        super().__init__()
        self.block, self.seq_first = block, seq_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_first:
            return x + self.block(x.transpose(0, 1)).transpose(0, 1)
        return x + self.block(x)


class _Edges(nn.Module):
    """A part of the sequence-parallel model: the first one keeps this rank's sequence
    chunk, the last one gathers the sequence back (replicated-objective mappings)."""

    def __init__(self, part: nn.Module, tp: object, first: bool, last: bool) -> None:
        super().__init__()
        self.part, self.tp, self.first, self.last = part, tp, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = P.scatter_to_sequence(x, 1, self.tp) if self.first else x
        x = self.part(x)
        return P.gather_from_sequence(x, 1, self.tp) if self.last else x


def _pipeline_tp(schedule: str, n_micro: int, sp: bool) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp, pp = mesh.get_group("tp"), (mesh, "pp")  # one axis by its group, one by the mesh
    s = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    parts = [
        _Residual(MLP(H, 16, activation="tanh", dtype=F64), False),
        _Residual(SelfAttention(H, 4, causal=True, dtype=F64), True),
        _Residual(MLP(H, 16, activation="tanh", dtype=F64), False),
        _Residual(SelfAttention(H, 4, dtype=F64), True),
    ]
    ref = nn.Sequential(*copy.deepcopy(parts))

    def parallel(i: int) -> tuple[nn.Module, nn.Module]:
        part = copy.deepcopy(parts[i])
        if isinstance(part.block, MLP):
            kw = {"sequence_parallel": True, "sequence_dim": 1} if sp else {}
            part.block = ParallelMLP.from_serial(part.block, tp, **kw)
        else:
            part.block = ParallelSelfAttention.from_serial(part.block, (mesh, "tp"), sequence_parallel=sp)
        return (_Edges(part, tp, i == 0, i == 3) if sp else part), part.block

    ids = [s, 3 - s] if schedule == "zbv" else [2 * s, 2 * s + 1]
    built = [parallel(i) for i in ids]
    stage = [m for m, _ in built] if schedule == "zbv" else nn.Sequential(*(m for m, _ in built))
    runner = PipelineRunner(stage, schedule, group=pp, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * n_micro, 6, H, dtype=F64, generator=g)
    y = torch.randn(2 * n_micro, 6, H, dtype=F64, generator=g)
    loss = runner.step(x, y, n_micro=n_micro)
    ref_loss = sum(F.mse_loss(ref(a), b) for a, b in zip(x.chunk(n_micro), y.chunk(n_micro))) / n_micro
    ref_loss.backward()  # type: ignore[union-attr]
    worst = abs(float(loss) - float(ref_loss))
    for i, (_, block) in zip(ids, built):
        serial = dict(ref[i].block.named_parameters())
        for name, index in block.serial_slices().items():
            got = dict(block.named_parameters())[name].grad
            worst = max(worst, float((got - serial[name].grad[index]).abs().max()))
    return worst


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_pipeline_of_tensor_parallel_stages_matches_serial(
    local_worlds: Callable[..., dc.LocalWorld], schedule: str, sp: bool
) -> None:
    for n_micro in (2, 3):
        errs = local_worlds(4, in_process=True).run(_pipeline_tp, schedule, n_micro, sp)
        assert max(errs) < 1e-12, (n_micro, errs)


def _cp_tp(kind: str, kv_heads: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp, tp = (mesh, "cp"), mesh.get_group("tp")
    b, s, heads, d = 2, 8, 4, H // 4
    g = torch.Generator().manual_seed(0)
    lin = [nn.Linear(H, n * d, dtype=F64) for n in (heads, kv_heads, kv_heads, heads)]
    for m in lin:
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, dtype=F64, generator=g) / 2)
    x = torch.randn(b, s, H, dtype=F64, generator=g)
    cot = torch.randn(b, s, H, dtype=F64, generator=g)

    def split(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(b, t.shape[1], n, d).transpose(1, 2)

    # the serial program
    xs = x.clone().requires_grad_()
    q, k, v = split(lin[0](xs), heads), split(lin[1](xs), kv_heads), split(lin[2](xs), kv_heads)
    rep = heads // kv_heads
    o = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
    )
    ys = lin[3](o.transpose(1, 2).reshape(b, s, H))
    (ys * cot).sum().backward()
    # heads over tp, the sequence over cp
    cols = [ColumnParallelLinear.from_serial(m, tp) for m in lin[:3]]
    row = RowParallelLinear.from_serial(lin[3], (mesh, "tp"), input_is_parallel=True)
    layout = {"layout": "zigzag"} if kind == "ring" else {}
    xl = P.shard(x, dim=1, group=cp, **layout).requires_grad_()
    ql, kl, vl = (split(c(xl), n // 2) for c, n in zip(cols, (heads, kv_heads, kv_heads)))
    if kind == "ring":
        ol = P.ring_attention(ql, kl, vl, cp, causal=True, layout="zigzag")
    else:
        ol = P.ulysses_attention(ql, kl, vl, mesh.get_group("cp"), causal=True)
    yl = row(ol.transpose(1, 2).reshape(b, xl.shape[1], H // 2))
    (yl * P.shard(cot, dim=1, group=cp, **layout)).sum().backward()
    worst = float((yl.detach() - P.shard(ys.detach(), dim=1, group=cp, **layout)).abs().max())
    worst = max(worst, float((xl.grad - P.shard(xs.grad, dim=1, group=cp, **layout)).abs().max()))
    for par, ser in zip([*cols, row], lin, strict=True):
        serial = dict(ser.named_parameters())
        for name, index in par.serial_slices().items():
            summed = dc.all_reduce(dict(par.named_parameters())[name].grad, "sum", cp)  # cp's shares
            worst = max(worst, float((summed - serial[name].grad[index]).abs().max()))
    return worst


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_context_parallel_of_tensor_parallel_heads_matches_serial(
    local_worlds: Callable[..., dc.LocalWorld], kind: str, kv_heads: int
) -> None:
    errs = local_worlds(4, in_process=True).run(_cp_tp, kind, kv_heads)
    assert max(errs) < 1e-11, errs
