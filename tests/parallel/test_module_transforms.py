"""nn.Module transformations applied to diffcomm's parallel layers, and what survives them:
dtype/device conversions (also under torch's ``__future__`` flags that make new
``Parameter`` objects), ``reset_parameters``, whole-module pickling.

Ground truth: the serial float64 model, or the refusal that the layer makes without the
transformation.
"""

from __future__ import annotations

import pytest
import torch

import diffcomm as dc
from diffcomm import parallel as P

F64 = torch.float64


def _lbfgs_after_conversion(flag: str) -> str:
    """``model.double()`` under one of torch's conversion flags, then the first
    ``LBFGS.step(closure)``: refused (the shard marks survive the conversion) or stepped."""
    setter = getattr(torch.__future__, f"set_{flag}_module_params_on_conversion")
    setter(True)
    try:
        model = P.ParallelMLP(4, 8, seed=0).double()
    finally:
        setter(False)
    x = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=3)

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    try:
        lbfgs.step(closure)
    except ValueError as e:
        return "refused" if "LBFGS" in str(e) else str(e)
    return "stepped"


@pytest.mark.parametrize("flag", ["overwrite", "swap"])
def test_conversions_keep_the_shard_marks(flag: str, world2: dc.LocalWorld) -> None:
    """``.double()`` under ``set_overwrite_module_params_on_conversion(True)`` (new
    Parameters) or ``set_swap_module_params_on_conversion(True)`` (each one's ``__dict__``
    swapped) dropped the marks the optimizer check reads: the first ``LBFGS.step(closure)``
    (checked before its closure runs the forward that marks again) stepped the shards,
    with no error, a step the serial model's LBFGS does not take."""
    assert world2.run(_lbfgs_after_conversion, flag) == ["refused"] * 2


def _reset_after_own_draws() -> str:
    """A seeded ``RowParallelLinear`` reset with ``reset_parameters()`` after each rank
    drew its own numbers from the global generator: its next forward."""
    layer = P.RowParallelLinear(4, 6, seed=0, dtype=F64)
    torch.manual_seed(100 + dc.get_rank())  # (each process's generator in its own state)
    layer.reset_parameters()
    try:
        layer(torch.ones(3, 4, dtype=F64))
    except dc.CrossRankMismatchError as e:
        return "refused" if "bias" in str(e) else str(e)
    return f"ran: bias[0] {float(layer.bias[0]):.4f}"


def test_reset_parameters_checks_the_replicas(world2: dc.LocalWorld) -> None:
    """``reset_parameters()`` (``None``: the global generator, as ``nn.Linear``'s) of a
    seeded layer left no first-forward check: after each rank had drawn its own numbers,
    the replicated bias of a ``RowParallelLinear`` was 0.26 on rank 0 and 0.41 on rank 1
    (element 0) and every "replicated" output after it differed, with no error."""
    assert world2.run(_reset_after_own_draws) == ["refused"] * 2


def _meta_init_then_reset() -> dict[str, float]:
    """The meta-device flow on a ``SequenceParallelLayerNorm`` + ``ParallelMLP``:
    built on the meta device, ``to_empty``, then every module's ``reset_parameters`` after
    ``torch.manual_seed(7)``; the largest difference from the serial ``LayerNorm`` + ``MLP``
    put through the same flow."""
    from torch import nn

    def reset_all(model: nn.Module) -> nn.Module:
        model.to_empty(device="cpu")
        with torch.no_grad():  # what uninitialised memory may hold
            for p in model.parameters():
                p.fill_(float("nan"))
        torch.manual_seed(7)
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        return model

    with torch.device("meta"):
        par = nn.Sequential(P.SequenceParallelLayerNorm(4, dtype=F64), P.ParallelMLP(4, 8, dtype=F64))
        serial = nn.Sequential(nn.LayerNorm(4, dtype=F64), P.MLP(4, 8, dtype=F64))
    reset_all(par)
    reset_all(serial)
    got = {f"0.{k}": v for k, v in par[0].state_dict().items()}
    got |= {f"1.{k}": v for k, v in par[1].to_serial_state_dict().items()}
    want = serial.state_dict()
    assert got.keys() == want.keys()
    return {k: float((got[k] - want[k]).abs().max()) for k in want}


def test_meta_init_then_reset_parameters_is_the_serial_init(inproc_world2: dc.LocalWorld) -> None:
    """``SequenceParallelLayerNorm`` had no ``reset_parameters``: after ``to_empty`` the
    usual loop over the modules skipped it, leaving uninitialised memory (nan here) where
    the serial ``nn.LayerNorm`` was reset to ones and zeros. The linears were right."""
    for diffs in inproc_world2.run(_meta_init_then_reset):
        assert diffs == dict.fromkeys(diffs, 0.0), diffs


def _pickle_whole() -> list[str]:
    """``torch.save`` of whole parallel modules (and of a plain container of one)."""
    import io

    from torch import nn

    out = []
    for model in (
        P.ParallelMLP(4, 8, seed=0),
        nn.Sequential(P.VocabParallelEmbedding(8, 4, seed=0)),
        P.ExpertParallelMoE(4, 8, 4, 2, seed=0),
    ):
        try:
            torch.save(model, io.BytesIO())
        except TypeError as e:
            out.append("refused" if "state_dict" in str(e) else str(e))
        else:
            out.append("saved")
    return out


def test_whole_module_pickling_is_refused_clearly(inproc_world2: dc.LocalWorld) -> None:
    """``torch.save(model)`` of a parallel model failed inside pickle with
    ``AttributeError: Can't pickle local object 'guard_shard_loading.<locals>.note'``; it
    is a ``TypeError`` naming the layer and the state-dict ways to save it."""
    assert inproc_world2.run(_pickle_whole) == [["refused"] * 3] * 2
