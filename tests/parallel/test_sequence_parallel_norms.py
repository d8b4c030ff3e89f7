"""Norms inside sequence-parallel regions: the replicated weight meets a sequence chunk,
so its gradient must be summed over the group (``SequenceParallelRMSNorm``), and a plain
``nn.LayerNorm`` / ``nn.RMSNorm`` there, whose partial gradient nothing sums, is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diffcomm as dc
from diffcomm import parallel as P

F64 = torch.float64
H = 6


def _serial() -> tuple[nn.RMSNorm, P.MLP]:
    torch.manual_seed(0)
    norm = nn.RMSNorm(H, dtype=F64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm, P.MLP(H, 2 * H, dtype=F64)


class _Block(P.ParallelModule):
    """A pre-norm residual block, sequence parallel: ``x + mlp(norm(x))`` on a chunk."""

    def __init__(self, norm: nn.Module, mlp: P.MLP, batch_first: bool) -> None:
        super().__init__()
        self.norm = norm
        self.mlp = P.ParallelMLP.from_serial(mlp, sequence_parallel=True, sequence_dim=int(batch_first))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _sp_rms_step(plain: bool, batch_first: bool) -> dict[str, Any]:
    """One SGD step of the block on this rank's chunk (of a transposed, non-contiguous
    input when batch-first) against the serial block on the whole sequence."""
    norm, mlp = _serial()
    sp_norm = nn.RMSNorm(H, dtype=F64) if plain else P.SequenceParallelRMSNorm.from_serial(norm)
    if plain:
        sp_norm.load_state_dict(norm.state_dict())
    block = _Block(sp_norm, mlp, batch_first)
    dim = int(batch_first)
    x = torch.randn(2, 6, H, dtype=F64).transpose(0, 1)  # [s, b, h], non-contiguous
    if batch_first:
        x = x.transpose(0, 1)
    n, r = dc.get_world_size(), dc.get_rank()
    try:
        y = block(x.chunk(n, dim)[r])
    except ValueError as exc:
        return {"refused": str(exc)}
    P.gather_from_sequence(y, dim).square().sum().backward()
    (x + mlp(norm(x))).square().sum().backward()
    opt, sopt = torch.optim.SGD(block.parameters(), lr=0.1), torch.optim.SGD([norm.weight], lr=0.1)
    opt.step(), sopt.step()
    return {
        "grad": float((sp_norm.weight.grad - norm.weight.grad).abs().max()),
        "weight": float((sp_norm.weight - norm.weight).abs().max()),
    }


@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_parallel_rms_norm_sums_its_weight_gradient(world3, batch_first: bool) -> None:
    """At world 3 (also batch-first, from a non-contiguous input) the RMS norm's weight
    gradient and its SGD step equal the serial ones on every rank."""
    for res in world3.run(_sp_rms_step, False, batch_first):
        assert res["grad"] < 1e-12 and res["weight"] < 1e-12, res


def test_a_plain_norm_in_a_sequence_parallel_model_is_refused(world3) -> None:
    """A plain nn.RMSNorm on sequence chunks kept each rank's partial gradient: 1.3 to 1.7
    off the serial one at world 3, different on every rank, no error (debug mode too).
    Now the model's forward refuses it, naming the module and the layer to use."""
    for res in world3.run(_sp_rms_step, True, False):
        msg = res.get("refused", "")
        assert "`norm` is a plain nn.RMSNorm" in msg and "SequenceParallelRMSNorm" in msg, res


def _plain_layer_norm_refused() -> str:
    torch.manual_seed(0)
    block = _Block(nn.LayerNorm(H, dtype=F64), P.MLP(H, 2 * H, dtype=F64), False)
    try:
        block(torch.randn(2, 2, H, dtype=F64))
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_plain_layer_norm_names_the_sequence_parallel_layer_norm(world2) -> None:
    for msg in world2.run(_plain_layer_norm_refused):
        assert "plain nn.LayerNorm" in msg and "SequenceParallelLayerNorm.from_serial" in msg, msg


def _frozen_or_tensor_parallel_norm() -> float:
    """Not refused: a plain norm in a model without sequence parallelism (it sees the
    whole replicated sequence), or a frozen one."""
    norm, mlp = _serial()

    class TP(P.ParallelModule):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = norm, P.ParallelMLP.from_serial(mlp)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.norm(x))

    x = torch.randn(4, 2, H, dtype=F64)
    out = TP()(x)
    frozen = nn.RMSNorm(H, dtype=F64).requires_grad_(False)
    _Block(frozen, mlp, False)(x.chunk(dc.get_world_size())[dc.get_rank()])
    return float(F.mse_loss(out, x + mlp(norm(x))))


def test_plain_norms_without_sequence_parallelism_or_frozen_still_run(world2) -> None:
    for err in world2.run(_frozen_or_tensor_parallel_norm):
        assert err < 1e-20, err


def _layer_norm_without_bias() -> float:
    torch.manual_seed(0)
    serial = nn.LayerNorm(H, bias=False, dtype=F64)
    norm = P.SequenceParallelLayerNorm.from_serial(serial)
    x = torch.randn(3, H, dtype=F64)
    return float((norm(x) - serial(x)).abs().max())


def test_sequence_parallel_layer_norm_without_bias(world2) -> None:
    """``bias=False`` (from an ``nn.LayerNorm(h, bias=False)``) raised KeyError "attribute
    'bias' already exists" in the constructor."""
    for err in world2.run(_layer_norm_without_bias):
        assert err == 0.0, err


class _NormsOnly(P.ParallelModule):
    """Two norms on this rank's sequence chunk, no layer with ``sequence_parallel=True``:
    ``norm2(norm1(x))``."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm1, norm2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.norm1(x))


def _norms_only_step(plain: bool) -> dict[str, Any]:
    """A SequenceParallelLayerNorm then an RMS norm (plain, or sequence parallel) on this
    rank's chunk, against the serial pair on the whole sequence."""
    torch.manual_seed(0)
    ln, rms = nn.LayerNorm(H, dtype=F64), nn.RMSNorm(H, dtype=F64)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
        ln.weight.uniform_(0.5, 1.5)
    second = nn.RMSNorm(H, dtype=F64) if plain else P.SequenceParallelRMSNorm.from_serial(rms)
    second.load_state_dict(rms.state_dict())
    model = _NormsOnly(P.SequenceParallelLayerNorm.from_serial(ln), second)
    x = torch.randn(6, 2, H, dtype=F64)
    cot = torch.randn(6, 2, H, dtype=F64)
    n, r = dc.get_world_size(), dc.get_rank()
    try:
        y = model(x.chunk(n)[r])
    except ValueError as exc:
        return {"refused": str(exc)}
    (y * cot.chunk(n)[r]).sum().backward()
    (rms(ln(x)) * cot).sum().backward()
    return {"refused": "", "grad": float((second.weight.grad - rms.weight.grad).abs().max())}


def test_a_plain_norm_next_to_a_sequence_parallel_norm_is_refused(world2) -> None:
    """The only layer on sequence chunks a SequenceParallelLayerNorm (no
    ``sequence_parallel=True`` anywhere): the plain nn.RMSNorm after it on the same chunks
    kept each rank's partial weight gradient, silently. Now refused, naming the layer."""
    for res in world2.run(_norms_only_step, True):
        msg = res["refused"]
        assert "`norm2` is a plain nn.RMSNorm" in msg and "SequenceParallelRMSNorm" in msg, res


def test_sequence_parallel_norms_only_run_and_equal_serial(world2) -> None:
    """The same model with both norms sequence parallel is not refused, and the RMS
    norm's weight gradient is the serial one."""
    for res in world2.run(_norms_only_step, False):
        assert res["refused"] == "" and res["grad"] < 1e-12, res


# --------------------------------------------------------------------------------------
# any other replicated parameter on sequence chunks (docs/parallel.md)
# --------------------------------------------------------------------------------------


class _PreThenSP(P.ParallelModule):
    """A plain ``nn.Linear`` on this rank's sequence chunk, then an SP ``ParallelMLP``;
    ``summed``: the linear's parameters taken through ``copy_to_region`` (the docs' recipe)."""

    def __init__(self, pre: nn.Linear, mlp: P.MLP, summed: bool) -> None:
        super().__init__()
        self.pre, self.summed = pre, summed
        self.mlp = P.ParallelMLP.from_serial(mlp, sequence_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.summed:
            w, b = P.copy_to_region(self.pre.weight), P.copy_to_region(self.pre.bias)
            return self.mlp(F.linear(x, w, b))
        return self.mlp(self.pre(x))


def _plain_linear_on_chunks(summed: bool, debug: bool) -> float | str:
    import copy

    torch.manual_seed(0)
    pre, mlp = nn.Linear(8, 8, dtype=torch.float64), P.MLP(8, 12, dtype=torch.float64)
    model = _PreThenSP(copy.deepcopy(pre), mlp, summed)
    x = torch.randn(6, 2, 8, dtype=torch.float64)
    mlp(pre(x)).pow(2).sum().backward()  # the serial model (the sum over ranks' chunks)
    try:
        with dc.debug(debug):
            model(x.chunk(dc.get_world_size())[dc.get_rank()]).pow(2).sum().backward()
            P.grad_norm(model)
    except dc.CrossRankMismatchError as exc:
        return str(exc)
    assert model.pre.weight.grad is not None and pre.weight.grad is not None
    return float((model.pre.weight.grad - pre.weight.grad).abs().max())


def test_a_plain_linear_on_sequence_chunks_needs_copy_to_region(world3) -> None:
    """A plain ``nn.Linear`` inside a sequence-parallel model is not refused (unlike a plain
    norm: a module cannot tell a chunk from the gathered sequence), and its weight gradient
    is each rank's partial sum (0.38-0.86 off the serial one at world 3, no error; debug
    mode's check in ``grad_norm`` names it). Through ``copy_to_region``, as docs/parallel.md
    says, it equals the serial gradient."""
    plain = world3.run(_plain_linear_on_chunks, False, False)
    assert all(isinstance(d, float) and d > 0.1 for d in plain), plain
    for msg in world3.run(_plain_linear_on_chunks, False, True):
        assert "replicated parameters' gradients should be the same on every rank" in str(msg), msg
    assert max(world3.run(_plain_linear_on_chunks, True, False)) < 1e-12
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "parallel.md").read_text().split())
    assert "F.linear(x, parallel.copy_to_region(self.pre.weight, group)" in text
