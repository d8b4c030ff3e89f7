"""``dc.spmd_check`` on programs using ``pipeline.add_aux_loss`` and
``parallel.SequenceParallelRMSNorm`` (and a plain ``nn.RMSNorm`` on sequence chunks).

Each program ``fn(checked)`` runs on every rank twice: plain, returning the largest
difference of its gradients from a **float64 serial reference** (so its label is
verified: a correct program matches, a buggy one does not), and inside
``dc.spmd_check``: a correct program must pass, a buggy one raise ``SPMDTypeError``
naming the cause.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _shared import tp_aux_serial, tp_aux_term
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm.pipeline import add_aux_loss

F64 = torch.float64
H, FF, S = 4, 6, 6  # hidden, inner (divisible by 2 and 3), sequence (divisible by 2 and 3)
TOL, WRONG = 1e-10, 1e-6


@contextlib.contextmanager
def _check(checked: bool) -> Iterator[None]:
    if checked:
        with dc.spmd_check():
            yield
    else:
        yield


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _d(a: torch.Tensor | None, b: torch.Tensor) -> float:
    return float("inf") if a is None else float((a - b).abs().max())


# ============================================================ add_aux_loss in a TP program


def _tp_aux(checked: bool, kind: str) -> float:
    """A column -> tanh -> row MLP (by hand, replicated objective) whose output carries an
    auxiliary loss: of the reduced output (``ok``), of the output reduced with the
    sum-convention ``dc.all_reduce`` (``all_reduce``: its backward sums the aux's gradient
    over the ranks, world-size times too large), or of this rank's share of the inner
    activation's square sum (``varying``: a sum over the ranks, the serial aux)."""
    r, w = dc.get_rank(), dc.get_world_size()
    n = FF // w
    x, w1, w2, g1, g2 = tp_aux_serial(kind, H, FF)
    a = w1[r * n : (r + 1) * n].clone().requires_grad_()
    b = w2[:, r * n : (r + 1) * n].clone().requires_grad_()
    with _check(checked):
        dc.spmd.varying(a), dc.spmd.varying(b)
        h = torch.tanh(par.copy_to_region(x) @ a.T)
        o = par.reduce_from_region(h @ b.T)
        aux = tp_aux_term(kind, o, h, b, FF)
        add_aux_loss(o, 0.5 * aux).sum().backward()
    return max(_d(a.grad, g1[r * n : (r + 1) * n]), _d(b.grad, g2[:, r * n : (r + 1) * n]))


def _dp_regulariser(checked: bool) -> float:
    """Data parallel: a per-rank loss and a replicated weight's square attached as an
    auxiliary loss (a term of every rank's objective), gradients averaged over the ranks:
    the mean of the ranks' losses plus the aux, once."""
    r, w = dc.get_rank(), dc.get_world_size()
    xs = [_randn(3, H, seed=10 + q) for q in range(w)]
    ws = _randn(H, 2, seed=4).requires_grad_()
    (sum((x @ ws).pow(2).mean() for x in xs) / w + 0.1 * ws.pow(2).sum()).backward()
    p = ws.detach().clone().requires_grad_()
    with _check(checked):
        x = dc.spmd.varying(xs[r].clone())
        out = add_aux_loss(x @ p, 0.1 * p.pow(2).sum())
        out.pow(2).mean().backward()
        p.grad = dc.all_reduce(p.grad, op="avg")
    return _d(p.grad, ws.grad)


# ============================================================ RMSNorm on sequence chunks


def _sp_rmsnorm(checked: bool, kind: str) -> float:
    """An RMSNorm on this rank's sequence chunk, then a sequence-parallel column -> gelu ->
    row MLP, the sequence gathered for a replicated loss. ``sp``: the norm is a
    SequenceParallelRMSNorm; ``plain``: an nn.RMSNorm whose weight gradient nobody sums
    (each rank's chunk's share); ``plain_summed``: the same, summed by hand after backward;
    ``sp_summed_again``: a SequenceParallelRMSNorm whose (already summed) gradient is
    all-reduced once more; ``after_gather``: a plain nn.RMSNorm on the gathered
    (replicated) output."""
    torch.manual_seed(0)
    norm_s, fc1_s, fc2_s = nn.RMSNorm(H, dtype=F64), nn.Linear(H, FF, dtype=F64), nn.Linear(FF, H, dtype=F64)
    with torch.no_grad():
        norm_s.weight.copy_(1 + 0.1 * _randn(H, seed=3))
    xs = _randn(S, H, seed=7)
    sp_norm = kind.startswith("sp")
    norm = par.SequenceParallelRMSNorm.from_serial(norm_s) if sp_norm else nn.RMSNorm(H, dtype=F64)
    if not sp_norm:
        norm.load_state_dict(norm_s.state_dict())
    col = par.ColumnParallelLinear.from_serial(fc1_s, sequence_parallel=True)
    row = par.RowParallelLinear.from_serial(fc2_s, input_is_parallel=True, sequence_parallel=True)
    with _check(checked):
        x = xs.clone().requires_grad_()
        if kind == "after_gather":
            y = norm(par.gather_from_sequence(row(F.gelu(col(par.scatter_to_sequence(x))))))
        else:
            y = par.gather_from_sequence(row(F.gelu(col(norm(par.scatter_to_sequence(x))))))
        y.pow(2).mean().backward()
        if kind in ("plain_summed", "sp_summed_again"):
            norm.weight.grad = dc.all_reduce(norm.weight.grad)
    xr = xs.clone().requires_grad_()
    if kind == "after_gather":
        norm_s(fc2_s(F.gelu(fc1_s(xr)))).pow(2).mean().backward()
    else:
        fc2_s(F.gelu(fc1_s(norm_s(xr)))).pow(2).mean().backward()
    return max(_d(x.grad, xr.grad), _d(norm.weight.grad, norm_s.weight.grad))


PROGRAMS: dict[str, tuple[Callable[[bool], float], str | None]] = {
    # name: (program, None if correct else a regex the checker's message must match)
    "tp_aux_of_reduced_output": (lambda c: _tp_aux(c, "ok"), None),
    "tp_aux_through_all_reduce": (lambda c: _tp_aux(c, "all_reduce"), r"add_aux_loss.*all_reduce"),
    "tp_aux_varying_share": (lambda c: _tp_aux(c, "varying"), None),
    "dp_regulariser_as_aux": (_dp_regulariser, None),
    "sp_rmsnorm": (lambda c: _sp_rmsnorm(c, "sp"), None),
    "plain_rmsnorm_on_chunks": (lambda c: _sp_rmsnorm(c, "plain"), r"weight.*SequenceParallelRMSNorm"),
    "plain_rmsnorm_summed_by_hand": (lambda c: _sp_rmsnorm(c, "plain_summed"), None),
    "sp_rmsnorm_summed_again": (lambda c: _sp_rmsnorm(c, "sp_summed_again"), r"all_reduce"),
    "plain_rmsnorm_after_gather": (lambda c: _sp_rmsnorm(c, "after_gather"), None),
}


def _run_both(name: str) -> tuple[Any, str | None]:
    """This rank's (truth, checker): the plain run's largest gradient difference, and the
    checked run's error message (``None``: it passed)."""
    fn = PROGRAMS[name][0]
    truth = fn(False)
    try:
        fn(True)
        return truth, None
    except dc.SPMDTypeError as exc:
        return truth, str(exc)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_verdict_matches_the_serial_truth(name: str, world: int, local_worlds: Callable[..., Any]) -> None:
    pattern = PROGRAMS[name][1]
    for rank, (truth, err) in enumerate(local_worlds(world).run(_run_both, name)):
        if pattern is None:
            assert truth < TOL, f"{name} rank {rank}: the correct program is {truth} off serial"
            assert err is None, f"{name} rank {rank}: a correct program refused: {err}"
        else:
            assert truth > WRONG, f"{name} rank {rank}: the planted bug is not wrong ({truth})"
            assert err is not None, f"{name} rank {rank}: the planted bug passed the check"
            assert re.search(pattern, err, re.S), err


# ============================================================ a compiled region in a check


def _compiled_block_in_check() -> float:
    """A compiled block (a linear and a nonlinearity, ``aot_eager``) on replicated values
    inside a check: traced by torch.compile, its ops are not typed (docs/spmd_types.md,
    Limits), and it runs: gradients equal eager's. (Its outputs come out untyped, so
    replicated: a compiled region fed per-rank values is not typed right, see Limits.)"""

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w.T
        return torch.tanh(h) * h

    compiled = torch.compile(block, backend="aot_eager")
    x, w = _randn(3, H, seed=0), _randn(H, H, seed=1)
    grads = []
    for fn, checked in ((block, False), (compiled, True)):
        p = w.clone().requires_grad_()
        with _check(checked):
            fn(x, p).pow(2).sum().backward()
        grads.append(p.grad)
    return _d(grads[1], grads[0])


def test_compiled_region_passes_through_the_check(world2: dc.LocalWorld) -> None:
    # Before, dynamo traced the check's __torch_function__ into the compiled region and
    # failed inside it (InternalTorchDynamoError: 'dict' object has no attribute 'node'),
    # so a compiled pipeline stage under dc.spmd_check crashed instead of passing through.
    assert max(world2.run(_compiled_block_in_check)) < 1e-12
