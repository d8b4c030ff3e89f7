"""Pipeline stages and checkpoints: a stage's state dict names its tensors as the serial
model does, so the stages of one model never share a key.

``torch.distributed.checkpoint`` writes one copy of a plain tensor saved under the same
key by several ranks (it takes it for a replica). The stages used to name their layers
from 0 (``nn.Sequential(*layers)``): every stage's first layer was ``0.weight``, so a
checkpoint of a 2-stage pipeline kept one stage's weights under each key, and a resumed
run loaded stage 0's weights into stage 1 — where the shapes allow, with no error. Named
as in the serial model (as torch.distributed.pipelining keeps the model's names), the
stages' keys are disjoint slices of the serial state dict: the checkpoint holds the whole
model and loads at any number of stages, or into the serial model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import diffcomm as dc
from diffcomm.pipeline import partition

pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(4, 4, dtype=F64) for _ in range(6)])


def _save_then_load(path: str, n_stages: int, load_stages: int) -> dict[str, float]:
    """Each rank saves its stage of model 0 with DCP; a model with other weights (seed 1)
    loads the checkpoint cut into ``load_stages`` stages (or whole: 1); the largest
    difference to model 0's serial weights, per key this rank loaded."""
    r = dc.get_rank()
    saved = partition(_model(0), n_stages)
    dcp.save(saved[r].state_dict(), checkpoint_id=path)
    serial = _model(0).state_dict()
    into = partition(_model(1), load_stages) if load_stages > 1 else [_model(1)]
    target = into[r % load_stages]
    sd = target.state_dict()
    dcp.load(sd, checkpoint_id=path)
    target.load_state_dict(sd)
    return {k: float((v - serial[k]).abs().max()) for k, v in target.state_dict().items()}


@pytest.mark.parametrize("load_stages", [2, 1], ids=["same_stages", "serial"])
def test_a_checkpoint_of_pipeline_stages_holds_every_stage(
    inproc_world2: dc.LocalWorld, tmp_path: Path, load_stages: int
) -> None:
    """Saved at 2 stages, loaded at 2 stages (resume) and into the serial model: every
    weight is model 0's. Before: at 2 stages rank 1 loaded stage 0's first layers' weights
    into its own (their keys were the same, 0.weight ...), silently; into the serial model
    the later layers' keys were missing."""
    for rank, diffs in enumerate(inproc_world2.run(_save_then_load, str(tmp_path / "ckpt"), 2, load_stages)):
        assert diffs and max(diffs.values()) == 0.0, (rank, diffs)


def test_stage_state_dicts_are_slices_of_the_serial_one() -> None:
    """Each stage's keys are the serial model's keys of its layers, the stages' keys are
    disjoint and together the serial state dict; positions still index the stage."""
    model = _model(0)
    stages = partition(model, 3)
    keys = [list(s.state_dict()) for s in stages]
    assert sorted(k for ks in keys for k in ks) == sorted(model.state_dict())
    assert len({k for ks in keys for k in ks}) == sum(len(ks) for ks in keys)
    assert stages[1][0] is model[int(next(iter(stages[1]._modules)))]
    x = torch.randn(3, 4, dtype=F64)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, model(x))


def _serial_mlps(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8, dtype=F64),
        nn.GELU(),
        nn.Linear(8, 4, dtype=F64),
        nn.Linear(4, 8, dtype=F64),
        nn.GELU(),
        nn.Linear(8, 4, dtype=F64),
    )


def _pp_tp_to_serial(path: str) -> float:
    """A 2 (pp) x 2 (tp) model of two tensor-parallel MLPs, cut into 2 stages; each rank
    saves ``dcp_state_dict`` of its stage; the serial model loads the checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm import parallel as par

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp = mesh.get_group("tp")
    ser = _serial_mlps(0)
    model = nn.Sequential(
        par.ColumnParallelLinear.from_serial(ser[0], group=tp),
        nn.GELU(),
        par.RowParallelLinear.from_serial(ser[2], group=tp, input_is_parallel=True),
        par.ColumnParallelLinear.from_serial(ser[3], group=tp),
        nn.GELU(),
        par.RowParallelLinear.from_serial(ser[5], group=tp, input_is_parallel=True),
    )
    stage = partition(model, 2, balance=[3, 3])[mesh.get_local_rank("pp")]
    dcp.save(par.dcp_state_dict(stage), checkpoint_id=path)
    target = _serial_mlps(1)
    sd = target.state_dict()
    dcp.load(sd, checkpoint_id=path)
    target.load_state_dict(sd)
    return max(float((v - ser.state_dict()[k]).abs().max()) for k, v in target.state_dict().items())


def test_pipeline_and_tensor_parallel_stages_checkpoint_into_the_serial_model(
    inproc_world4: dc.LocalWorld, tmp_path: Path
) -> None:
    """pp x tp = 2 x 2: every rank saves its stage's shards under the serial names
    (``dcp_state_dict``); the serial model loads the whole, exactly. (Before, both stages'
    first layers were `0.weight`: one stage's shards were lost.)"""
    assert inproc_world4.run(_pp_tp_to_serial, str(tmp_path / "ckpt")) == [0.0] * 4
