"""diffcomm and spmd_types in one model (``docs/with_spmd_types.md``).

A tensor-parallel MLP whose first half is diffcomm's ``ColumnParallelLinear`` (its
``copy_to_region`` and its sharded weight) and whose second half is written with
spmd_types' own API (a sharded weight annotated ``V`` and ``spmd_types.all_reduce``
with ``src=P, dst=I``). Run on two local ranks:

1. the mixed model under ``spmd_types.checker.typecheck()``: it typechecks (diffcomm's
   Functions carry spmd_types' rules; its layer types its own parameters), and its output
   and gradients equal the serial MLP's;
2. the same model with a planted bug in the spmd_types half (``dst=R``: the reduction's
   backward would all-reduce a gradient every rank already holds whole): spmd_types'
   checker catches it;
3. the diffcomm-only version of the model under each checker: ``dc.spmd_check`` and
   ``spmd_types.checker.typecheck()`` both pass it.

Needs ``pip install 'diffcomm[spmd-types]'``. Run: ``python examples/with_spmd_types.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import diffcomm as dc
from diffcomm import parallel as par

H, FFN = 8, 16


class MixedMLP(nn.Module):
    """``x -> gelu(x W1^T + b1) W2^T``: W1 column-parallel (diffcomm), W2 row-parallel
    (spmd_types)."""

    def __init__(self, serial: nn.Sequential, bug: bool = False) -> None:
        import spmd_types as spmd
        import torch.distributed as dist

        super().__init__()
        self.pg = dist.group.WORLD
        self.up = par.ColumnParallelLinear.from_serial(serial[0])  # diffcomm: shards of W1, b1
        rank, world = dc.get_rank(), dc.get_world_size()
        cols = serial[2].weight.detach().chunk(world, dim=1)[rank]
        self.down = nn.Parameter(cols.clone())  # spmd_types: this rank's columns of W2
        spmd.assert_type(self.down, {self.pg: spmd.V})
        self.bug = bug

    def forward(self, x: Tensor) -> Tensor:
        import spmd_types as spmd

        h = F.gelu(self.up(x))  # diffcomm's layer: V (this rank's hidden units)
        y = spmd.reinterpret(F.linear(h, self.down), self.pg, src=spmd.V, dst=spmd.P)  # partial sums
        return spmd.all_reduce(y, self.pg, src=spmd.P, dst=spmd.R if self.bug else spmd.I)


def mixed() -> dict[str, object]:
    import spmd_types as spmd
    from spmd_types.checker import typecheck

    torch.manual_seed(0)  # the same serial MLP on every rank
    serial = nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H, bias=False))
    x = torch.randn(4, H)
    out: dict[str, object] = {}

    model = MixedMLP(serial)
    xin = x.clone().requires_grad_()
    with typecheck():
        spmd.assert_type(xin, {model.pg: spmd.I})  # the model's only annotation: its input
        y = model(xin)
        y.pow(2).mean().backward()
    out["type"] = str(spmd.get_local_type(y))
    xs = x.clone().requires_grad_()
    ys = serial(xs)
    ys.pow(2).mean().backward()
    out["output error"] = (y - ys).abs().max().item()
    out["input gradient error"] = (xin.grad - xs.grad).abs().max().item()

    buggy = MixedMLP(serial, bug=True)
    try:
        with typecheck():
            xb = spmd.assert_type(x.clone().requires_grad_(), {buggy.pg: spmd.I})
            buggy(xb).pow(2).mean().backward()
        out["bug"] = None
    except spmd.SpmdTypeError as e:
        out["bug"] = str(e).splitlines()[0]
    return out


def each_checker() -> dict[str, object]:
    """The diffcomm-only MLP, checked by diffcomm's checker and by spmd_types'."""
    import spmd_types as spmd
    import torch.distributed as dist
    from spmd_types.checker import typecheck

    def model() -> nn.Module:
        return nn.Sequential(
            par.ColumnParallelLinear(H, FFN, seed=0),
            nn.GELU(),
            par.RowParallelLinear(FFN, H, input_is_parallel=True, seed=1),
        )

    x = torch.randn(4, H, generator=torch.Generator().manual_seed(0))  # alike on every rank
    with dc.spmd_check():  # replicated unless declared: x needs no annotation
        model()(x).pow(2).mean().backward()
    with typecheck():
        xi = spmd.assert_type(x.clone(), {dist.group.WORLD: spmd.I})  # spmd_types: its input's type
        model()(xi).pow(2).mean().backward()
    return {"dc.spmd_check": "passes", "spmd_types": "passes"}


if __name__ == "__main__":
    with dc.LocalWorld(2) as world:
        res = world.run(mixed)[0]
        assert res["output error"] < 1e-6 and res["input gradient error"] < 1e-6, res  # type: ignore[operator]
        print(f"spmd_types: the mixed model typechecks; output {res['type']}, equal to the serial MLP's")
        errs = res["output error"], res["input gradient error"]
        print("  (output error {:.1e}, input gradient error {:.1e})".format(*errs))
        assert res["bug"] is not None, "the planted bug was not caught"
        print(f"spmd_types caught the planted dst=R: {res['bug']}")
        print("the diffcomm-only MLP:", world.run(each_checker)[0])
