"""``pipeline.add_aux_loss`` and ``parallel.SequenceParallelRMSNorm`` under spmd_types'
checker (``spmd_types.checker.typecheck()``), each verdict against a float64 serial
reference: a program whose gradients match serial passes, one that does not is refused
by spmd_types (as ``dc.spmd_check`` refuses it: tests/spmd/test_spmd_aux_norms.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _shared import tp_aux_serial, tp_aux_term
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm.pipeline import add_aux_loss

pytest.importorskip("spmd_types", reason="spmd-types is not installed (pip install 'diffcomm[spmd-types]')")

F64 = torch.float64
H, FF, S = 4, 6, 6  # hidden, inner (divisible by 2), sequence (divisible by 2)
TOL, WRONG = 1e-10, 1e-6


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _d(a: torch.Tensor | None, b: torch.Tensor) -> float:
    return float("inf") if a is None else float((a - b).abs().max())


def _tp_aux(kind: str) -> float:
    """A column -> tanh -> row MLP with an auxiliary loss attached to its output: of the
    reduced output (``ok``), of the output summed by ``dc.all_reduce`` (``all_reduce``:
    R, its gradient summed over the ranks again), or this rank's share of a sum
    (``varying``). Returns the largest gradient difference from serial."""
    import spmd_types as st
    import torch.distributed as dist

    pg, r, w = dist.group.WORLD, dc.get_rank(), dc.get_world_size()
    n = FF // w
    x, w1, w2, g1, g2 = tp_aux_serial(kind, H, FF)
    a = st.assert_type(w1[r * n : (r + 1) * n].clone().requires_grad_(), {pg: st.V})
    b = st.assert_type(w2[:, r * n : (r + 1) * n].clone().requires_grad_(), {pg: st.V})
    xi = st.assert_type(x.clone(), {pg: st.I})
    h = torch.tanh(par.copy_to_region(xi) @ a.T)
    o = par.reduce_from_region(h @ b.T)
    aux = tp_aux_term(kind, o, h, b, FF)
    add_aux_loss(o, 0.5 * aux).sum().backward()
    return max(_d(a.grad, g1[r * n : (r + 1) * n]), _d(b.grad, g2[:, r * n : (r + 1) * n]))


def _sp_rmsnorm(kind: str) -> float:
    """An RMSNorm on this rank's sequence chunk, a sequence-parallel column -> gelu -> row
    MLP, the sequence gathered for a replicated loss: ``sp`` a SequenceParallelRMSNorm,
    ``plain`` an nn.RMSNorm whose weight is declared replicated (I) by the user."""
    import spmd_types as st
    import torch.distributed as dist

    pg = dist.group.WORLD
    torch.manual_seed(0)
    norm_s, fc1_s, fc2_s = nn.RMSNorm(H, dtype=F64), nn.Linear(H, FF, dtype=F64), nn.Linear(FF, H, dtype=F64)
    with torch.no_grad():
        norm_s.weight.copy_(1 + 0.1 * _randn(H, seed=3))
    xs = _randn(S, H, seed=7)
    if kind == "sp":
        norm: nn.Module = par.SequenceParallelRMSNorm.from_serial(norm_s)
    else:
        norm = nn.RMSNorm(H, dtype=F64)
        norm.load_state_dict(norm_s.state_dict())
        st.assert_type(norm.weight, {pg: st.I})
    col = par.ColumnParallelLinear.from_serial(fc1_s, sequence_parallel=True)
    row = par.RowParallelLinear.from_serial(fc2_s, input_is_parallel=True, sequence_parallel=True)
    x = st.assert_type(xs.clone().requires_grad_(), {pg: st.I})
    y = par.gather_from_sequence(row(F.gelu(col(norm(par.scatter_to_sequence(x))))))
    y.pow(2).mean().backward()
    xr = xs.clone().requires_grad_()
    fc2_s(F.gelu(fc1_s(norm_s(xr)))).pow(2).mean().backward()
    return max(_d(x.grad, xr.grad), _d(norm.weight.grad, norm_s.weight.grad))


PROGRAMS: dict[str, tuple[Callable[[], float], str | None]] = {
    # name: (program, None if correct else a string spmd_types' error must contain)
    "tp_aux_of_reduced_output": (lambda: _tp_aux("ok"), None),
    "tp_aux_through_all_reduce": (lambda: _tp_aux("all_reduce"), "add_aux_loss: argument 'aux' is R"),
    "tp_aux_varying_share": (lambda: _tp_aux("varying"), None),
    "sp_rmsnorm": (lambda: _sp_rmsnorm("sp"), None),
    "plain_rmsnorm_on_chunks": (lambda: _sp_rmsnorm("plain"), "Invariant type"),
}


def _run(name: str) -> tuple[float, str | None]:
    """This rank's (truth, verdict): the plain run's largest gradient difference from
    serial (spmd_types' annotations are inert outside its checker), and spmd_types'
    error (``None``: it passed)."""
    from spmd_types.checker import typecheck

    fn = PROGRAMS[name][0]
    truth = fn()
    try:
        with typecheck():
            fn()
    except Exception as e:  # spmd_types' SpmdTypeError (asserted below)
        return truth, f"{type(e).__name__}: {e}"
    return truth, None


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_spmd_types_verdict_matches_the_serial_truth(name: str, world2: dc.LocalWorld) -> None:
    want = PROGRAMS[name][1]
    results: list[Any] = world2.run(_run, name)
    for rank, (truth, err) in enumerate(results):
        if want is None:
            assert truth < TOL, f"{name} rank {rank}: the correct program is {truth} off serial"
            assert err is None, f"{name} rank {rank}: a correct program refused: {err}"
        else:
            assert truth > WRONG, f"{name} rank {rank}: the planted bug is not wrong ({truth})"
            assert err is not None and err.startswith("SpmdTypeError"), f"{name} rank {rank}: passed"
            assert want in err, err
