"""Where diffcomm meets torch's DTensor. A DTensor is one global tensor; diffcomm's ops,
mappings and layers act on each rank's own plain tensor. Every entry point given a DTensor
raises a ``TypeError`` naming itself and the argument, and saying what to pass
(``x.to_local()``, ``v.full_tensor()``), before any communication: never the local shard
read as if global, nor torch's "mixed torch.Tensor and DTensor" from deep inside.
(Checkpoints through DCP, which reads shards as DTensors: tests/parallel/test_checkpointing.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _shared import load_serial_refusal
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import diffcomm as dc
from diffcomm import parallel as P

pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64


def _dtensor(local: torch.Tensor, shard: int | None = None) -> DTensor:
    mesh = init_device_mesh("cpu", (dc.get_world_size(),))
    return DTensor.from_local(local, mesh, [Replicate() if shard is None else Shard(shard)])


def _partial(local: torch.Tensor) -> DTensor:
    mesh = init_device_mesh("cpu", (dc.get_world_size(),))
    return DTensor.from_local(local, mesh, [Partial()])


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


# (the call given a DTensor, the name its error must start with, the argument)
_CALLS: dict[str, tuple[Callable[[], Any], str, str]] = {
    "all_reduce": (lambda: dc.all_reduce(_dtensor(_x(2, 3), 0)), "all_reduce", "x"),
    "all_gather": (lambda: dc.all_gather(_dtensor(_x(2, 3))), "all_gather", "x"),
    "compat.all_reduce": (lambda: dc.compat.all_reduce(_dtensor(_x(2, 3))), "all_reduce", "x"),
    # the coalesced ops took DTensors through their list check (torch's dispatch then
    # ran them as global tensors): see test_coalesced_ops_refuse_a_dtensor
    "all_reduce_coalesced": (
        lambda: dc.all_reduce_coalesced([_x(2), _partial(_x(2))]),
        "all_reduce_coalesced",
        "tensors[1]",
    ),
    "all_gather_coalesced": (
        lambda: dc.all_gather_coalesced([_dtensor(_x(2, 3))]),
        "all_gather_coalesced",
        "tensors[0]",
    ),
    "broadcast_coalesced": (
        lambda: dc.broadcast_coalesced([_dtensor(_x(2, 3), 0)]),
        "broadcast_coalesced",
        "tensors[0]",
    ),
    "reduce_scatter_coalesced": (
        lambda: dc.reduce_scatter_coalesced([_dtensor(_x(2, 3), 0)]),
        "reduce_scatter_coalesced",
        "tensors[0]",
    ),
    "send": (lambda: dc.send(_dtensor(_x(2)), 1 - dc.get_rank()), "send", "x"),
    "copy_to_region": (lambda: P.copy_to_region(_dtensor(_x(2, 4))), "parallel.copy_to_region", "x"),
    "gather_from_region": (
        lambda: P.gather_from_region(_dtensor(_x(2, 4), 1)),
        "parallel.gather_from_region",
        "x",
    ),
    "ColumnParallelLinear": (
        lambda: P.ColumnParallelLinear(4, 6, seed=0, dtype=F64)(_dtensor(_x(3, 4))),
        "parallel.copy_to_region",
        "x",
    ),
    "RowParallelLinear": (
        lambda: P.RowParallelLinear(4, 6, seed=0, dtype=F64)(_dtensor(_x(3, 4))),
        "parallel.scatter_to_region",
        "x",
    ),
    "VocabParallelEmbedding": (
        lambda: P.VocabParallelEmbedding(8, 4, seed=0)(_dtensor(torch.tensor([[1, 5]]))),
        "parallel.VocabParallelEmbedding",
        "ids",
    ),
    "ExpertParallelMoE": (
        lambda: P.ExpertParallelMoE(4, 6, num_experts=2, k=1, seed=0, dtype=F64)(_dtensor(_x(3, 4), 0)),
        "parallel.ExpertParallelMoE",
        "x",
    ),
    "shard": (lambda: P.shard(_dtensor(_x(1, 2, 8, 4)), 2), "parallel.shard", "x"),
    "ring_attention": (
        lambda: P.ring_attention(*[_dtensor(_x(1, 2, 4, 4), 2)] * 3),
        "parallel.ring_attention",
        "q",
    ),
    "vocab_parallel_cross_entropy": (
        lambda: P.vocab_parallel_cross_entropy(_dtensor(_x(3, 4), 1), torch.tensor([0, 1, 2])),
        "parallel.vocab_parallel_cross_entropy",
        "logits",
    ),
}


def _raises(name: str) -> str:
    call, _, _ = _CALLS[name]
    try:
        call()
    except TypeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("name", list(_CALLS))
def test_dtensor_input_is_a_type_error_naming_the_call(name: str, inproc_world2: dc.LocalWorld) -> None:
    """ExpertParallelMoE raised torch's RuntimeError "aten.mm.default got mixed
    torch.Tensor and DTensor" from its router, naming neither the layer nor ``x``."""
    _, op, arg = _CALLS[name]
    for message in inproc_world2.run(_raises, name):
        assert message.startswith(f"diffcomm.{op}(): `{arg}` must be a plain torch.Tensor"), message
        assert "to_local()" in message and "a DTensor with placements" in message


def _load_dtensor_state_dict(kind: str) -> str:
    torch.manual_seed(0)
    if kind == "moe":
        serial: torch.nn.Module = P.MoE(4, 6, 4, k=1, dtype=F64)
        layer: Any = P.ExpertParallelMoE(4, 6, num_experts=4, k=1, seed=3, dtype=F64)
    else:
        serial = torch.nn.Linear(4, 6, dtype=F64)
        layer = P.ColumnParallelLinear(4, 6, seed=3, dtype=F64)
    sd = {k: _dtensor(v.detach()) for k, v in serial.state_dict().items()}
    return load_serial_refusal(layer, sd, TypeError)


@pytest.mark.parametrize("kind", ["column", "moe"])
def test_load_serial_state_dict_of_dtensors_names_the_key(kind: str, inproc_world2: dc.LocalWorld) -> None:
    """A serial state dict holding DTensors (torch's tensor parallelism, DCP's
    ``get_model_state_dict``) failed inside ``copy_`` with torch's RuntimeError "mixed
    torch.Tensor and DTensor", after some keys had been copied, naming no key; now a
    TypeError naming the key and ``full_tensor()`` before anything is copied."""
    for message in inproc_world2.run(_load_dtensor_state_dict, kind):
        assert "load_serial_state_dict(): `state_dict[" in message, message
        assert "full_tensor()" in message and message.endswith("untouched=True"), message


def _coalesced_of_dtensors() -> dict[str, Any]:
    r = dc.get_rank()
    local = torch.full((2,), float(r + 1), dtype=F64)
    got: dict[str, Any] = {}
    for name, make in (("Shard(0)", lambda: _dtensor(local, 0)), ("Partial", lambda: _partial(local))):
        try:
            y = dc.all_reduce_coalesced([make()])[0]
            got[name] = y.full_tensor().tolist() if isinstance(y, DTensor) else y.tolist()
        except TypeError as e:
            got[name] = str(e)
    return got


def test_coalesced_ops_refuse_a_dtensor(inproc_world2: dc.LocalWorld) -> None:
    """``all_reduce_coalesced`` of a DTensor returned a DTensor, neither the per-rank sum
    (ranks' locals [1, 1] and [2, 2]: [3, 3]) nor the rule's refusal: of a ``Partial``
    (global value [3, 3]) it returned [6, 6], of a ``Shard(0)`` (global [1, 1, 2, 2]) the
    global [3, 3, 3, 3]. The single-tensor ops refused both; the list check let any
    ``torch.Tensor`` subclass through. Now the same TypeError, naming ``tensors[i]``."""
    for got in inproc_world2.run(_coalesced_of_dtensors):
        for name, message in got.items():
            assert isinstance(message, str), (name, message)
            want = "diffcomm.all_reduce_coalesced(): `tensors[0]` must be a plain torch.Tensor"
            assert message.startswith(want), message


def _replicated_hand_over() -> dict[str, Any]:
    """x.grad / serial (mean ratio) after a diffcomm result is made a Replicate() DTensor,
    and |w.grad - serial| for a Replicate() weight handed to diffcomm, each the plain way
    and the documented way (docs/convention.md, "Handing tensors to and from DTensor")."""
    n, r = dc.get_world_size(), dc.get_rank()
    mesh = init_device_mesh("cpu", (n,))
    xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(10 + i), dtype=F64) for i in range(n)]
    w = torch.randn(3, 2 * n, generator=torch.Generator().manual_seed(99), dtype=F64)
    serial_x = [x.clone().requires_grad_() for x in xs]
    serial_w = w.clone().requires_grad_()
    (torch.cat(serial_x) @ serial_w).pow(2).sum().backward()
    got: dict[str, Any] = {}
    makers = {
        "all_gather": lambda x: dc.all_gather(x),
        "gather_from_region": lambda x: P.gather_from_region(x, 0),
    }
    for name, make in makers.items():
        x = xs[r].clone().requires_grad_()
        y = DTensor.from_local(make(x), mesh, [Replicate()])
        wd = DTensor.from_local(w.chunk(n, 1)[r].clone(), mesh, [Shard(1)]).requires_grad_()
        (y @ wd).to_local().pow(2).sum().backward()  # the ranks' objectives: one serial loss
        got[name] = (x.grad / serial_x[r].grad).mean().item()
    # a replicated weight: each rank's objective through an all_reduce of its own rows
    c = [torch.randn(2, 1, generator=torch.Generator().manual_seed(40 + i), dtype=F64) for i in range(n)]
    serial_w.grad = None
    ys = sum(x @ serial_w for x in xs)
    sum((ys * ci).sum() for ci in c).backward()
    for name, grad_placements in (("to_local", None), ("to_local_partial", [Partial()])):
        wd = DTensor.from_local(w.clone(), mesh, [Replicate()]).requires_grad_()
        local = wd.to_local() if grad_placements is None else wd.to_local(grad_placements=grad_placements)
        (dc.all_reduce(xs[r] @ local) * c[r]).sum().backward()
        got[name] = (wd.grad.full_tensor() - serial_w.grad).abs().max().item()
    got["refusal"] = _raises("all_gather")
    return got


@pytest.mark.parametrize("n", [2, 3])
def test_replicated_dtensor_hand_over_gets_the_serial_gradient(n: int, local_worlds: Any) -> None:
    """torch's DTensor reads a Replicate() gradient as the one global value's, diffcomm sums
    the ranks' objectives. The refusal said "pass x.to_local() ... rebuild with
    DTensor.from_local": done plainly, a replicated weight's gradient was each rank's own
    share and an all_gather result made Replicate() got ``world`` x the serial gradient
    (3.0 at world 3). The refusal now names ``grad_placements=[Partial()]`` and the
    mapping to use; both documented ways give the serial gradient."""
    for got in local_worlds(n, in_process=True).run(_replicated_hand_over):
        assert got["gather_from_region"] == pytest.approx(1.0, abs=1e-12)
        assert got["to_local_partial"] < 1e-12
        assert got["all_gather"] == pytest.approx(float(n), abs=1e-12)  # the pitfall, documented
        assert got["to_local"] > 1e-3
        assert "x.to_local(grad_placements=[Partial()])" in got["refusal"], got["refusal"]
        assert "gather_from_region" in got["refusal"], got["refusal"]
