"""diffcomm's parallel layers inside the rest of a PyTorch training stack, against a serial
float64 model trained on the concatenated batch (docs/parallel.md, "In a training stack"):
parametrizations of a sharded weight refused before any communication, and the
shard-aware weight norm of the docs equal to torch's on the serial weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _shared import assert_refused_before_communicating, refusal_messages
from torch import nn

import diffcomm as dc

F64 = torch.float64


# ======================================================================================
# parametrizations of a sharded weight
# ======================================================================================


def _parametrized_calls() -> list[str]:
    from torch.nn.utils import parametrizations as PZ
    from torch.nn.utils import parametrize, prune

    from diffcomm import parallel as par

    class Double(nn.Module):  # elementwise: right on a shard, unknown to the bookkeeping
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    def col() -> nn.Module:
        return par.ColumnParallelLinear(8, 6, seed=0, dtype=F64)

    def row() -> nn.Module:
        return par.RowParallelLinear(6, 8, seed=0, dtype=F64)

    x8, x6 = torch.ones(3, 8, dtype=F64), torch.ones(3, 6, dtype=F64)
    mlp = par.ParallelMLP(8, 6, seed=0, dtype=F64)
    PZ.weight_norm(mlp.fc2, "weight", dim=0)  # inside a block: named by its path
    return refusal_messages(
        [
            lambda: PZ.weight_norm(row(), "weight", dim=0)(x6),  # the norm over the split dim
            lambda: PZ.weight_norm(col(), "weight", dim=1)(x8),
            lambda: PZ.weight_norm(col(), "weight", dim=0)(x8),  # right on a shard, refused too
            lambda: PZ.spectral_norm(col(), "weight")(x8),
            lambda: PZ.orthogonal(row(), "weight")(x6),
            lambda: torch.nn.utils.weight_norm(row(), "weight", dim=0)(x6),  # the hook-based ones
            lambda: torch.nn.utils.spectral_norm(col(), "weight")(x8),
            lambda: prune.l1_unstructured(col(), "weight", amount=0.5)(x8),
            lambda: parametrize.register_parametrization(row(), "weight", Double())(x6),
            lambda: mlp(x8),
            lambda: PZ.weight_norm(col(), "weight", dim=1).serial_slices(),
            lambda: PZ.weight_norm(row(), "weight", dim=0).to_serial_state_dict(),
        ]
    )


@pytest.mark.diffcomm_in_process
def test_parametrized_shard_refused_before_communicating(world2) -> None:
    """Before, each of these ran without an error: ``weight_norm(dim=0)`` of a
    ``RowParallelLinear`` normalised each rank's half row (output off by up to 0.38 from the
    serial weight-normed layer after one SGD step), ``spectral_norm`` divided by the
    shard's largest singular value (output off by 0.31 at once), ``orthogonal`` made the
    shard orthogonal (off by 2.2), and ``grad_norm`` took the new parameters for replicas
    (off by 1.3-6.1 even for an elementwise parametrization)."""
    shard = r"ValueError: .*`{}` is this rank's shard \(dim {}\) of the serial `weight`.*no longer holds it"
    assert_refused_before_communicating(
        world2.run(_parametrized_calls),
        [shard.format("weight", 1), shard.format("weight", 0), shard.format("weight", 0)]
        + [shard.format("weight", 0), shard.format("weight", 1), shard.format("weight", 1)]
        + [shard.format("weight", 0), shard.format("weight", 0), shard.format("weight", 1)]
        + [shard.format("fc2.weight", 1), shard.format("weight", 0), shard.format("weight", 1)],
    )


class _WeightNormedRow(nn.Module):
    """docs/parallel.md's recipe, as printed there: weight norm over the split input dim
    of a ``RowParallelLinear`` (``dim=0`` of ``weight_norm``: one norm per output row),
    the norm taken over the whole row."""

    def __init__(self, row: nn.Module, group: object = None) -> None:
        super().__init__()
        self.row, self.group = row, group
        v = row.weight.detach()
        self.g = nn.Parameter(dc.all_reduce(v.square().sum(1, keepdim=True), group=group).sqrt())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from diffcomm import parallel

        v = self.row.weight
        norm = dc.all_reduce(v.square().sum(1, keepdim=True), group=self.group).sqrt()
        w = parallel.copy_to_region(self.g, self.group) * v / norm
        return torch.func.functional_call(self.row, {"weight": w}, (x,))


def _weight_norm_recipe() -> float:
    from torch.nn.utils import parametrizations as PZ

    from diffcomm import parallel as par

    torch.manual_seed(0)
    ser = nn.Linear(6, 4, dtype=F64)
    row = par.RowParallelLinear.from_serial(ser)
    PZ.weight_norm(ser, "weight", dim=0)
    mine = _WeightNormedRow(row)
    opt = torch.optim.SGD(mine.parameters(), lr=0.5, momentum=0.9)
    sopt = torch.optim.SGD(ser.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    worst, cols = 0.0, row.serial_slices()["weight"]
    for _ in range(2):
        x, t = torch.randn(5, 6, dtype=F64, generator=g), torch.randn(5, 4, dtype=F64, generator=g)
        opt.zero_grad()
        sopt.zero_grad()
        loss = F.mse_loss(mine(x), t)
        ref = F.mse_loss(ser(x), t)
        loss.backward()
        ref.backward()
        opt.step()
        sopt.step()
        worst = max(worst, float((loss - ref).abs()))
        pz = ser.parametrizations.weight
        worst = max(worst, float((mine.g - pz.original0).abs().max()))
        worst = max(worst, float((row.weight - pz.original1[cols]).abs().max()))
        worst = max(worst, float((row.bias - ser.bias).abs().max()))
    return worst


@pytest.mark.diffcomm_in_process
@pytest.mark.parametrize("n", [2, 3])
def test_weight_norm_over_the_split_dim_recipe_matches_serial(local_worlds, n: int) -> None:
    """The docs' workaround: weight norm over the split dim with the norm over the whole
    row, after two SGD steps equal to torch's weight_norm of the serial layer."""
    assert max(local_worlds(n).run(_weight_norm_recipe)) < 1e-12
