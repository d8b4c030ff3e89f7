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
