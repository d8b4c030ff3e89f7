"""``diffcomm.parallel.grad_norm`` / ``clip_grad_norm_`` against torch's clipping of the
serial float64 model (docs/parallel.md, "Gradient clipping and loss scaling"): the same
total norm on every rank and every gradient clipped by the serial factor — a ParallelMLP,
a sequence-parallel block (layer norm + MLP), an ExpertParallelMoE, worlds 2 and 3, norms
2, inf and 1, a ParallelMLP in DDP; ``sync_found_inf``: a GradScaler's skip decision the
same on every rank; bad input refused before any communication."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _shared import assert_refused_before_communicating, refusal_messages
from torch import nn

import diffcomm as dc

pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64
INF = float("inf")


class _SerialBlock(nn.Module):
    def __init__(self) -> None:
        from diffcomm.parallel import MLP

        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(6, dtype=F64), MLP(6, 12, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln(x))


def _trained(kind: str) -> tuple[nn.Module, nn.Module, dict[str, str], dict[str, Any]]:
    """``(parallel, serial, serial name of each parameter, its serial slice)`` after one
    backward of the same loss (a ParallelMLP, a sequence-parallel block whose layer norm's
    and fc2 bias's gradients meet sequence chunks, or an ExpertParallelMoE with a shared
    expert, its replicated gradients synced)."""
    from diffcomm import parallel as par

    r, w = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    if kind == "mlp":
        ser: nn.Module = par.MLP(6, 12, dtype=F64)
        mod: nn.Module = par.ParallelMLP.from_serial(ser)
        x = torch.randn(5, 6, dtype=F64)
        x_mine = x
    elif kind == "sequence_parallel":
        ser = _SerialBlock()
        mod = nn.Sequential(
            par.SequenceParallelLayerNorm.from_serial(ser.ln),
            par.ParallelMLP.from_serial(ser.mlp, sequence_parallel=True),
        )
        x = torch.randn(2 * w, 3, 6, dtype=F64)
        x_mine = x.chunk(w)[r]
    else:
        ser = par.MoE(6, 8, num_experts=6, k=2, shared_expert_size=4, dtype=F64)
        mod = par.ExpertParallelMoE.from_serial(ser)
        x = torch.randn(4 * w, 6, dtype=F64)
        x_mine = x.chunk(w)[r]
    mod(x_mine).pow(2).sum().backward()
    ser(x).pow(2).sum().backward()
    if kind == "moe":
        mod.sync_replicated_grads()
        return mod, ser, mod.serial_names(), mod.serial_slices()
    slices = {n: (slice(None),) * p.dim() for n, p in mod.named_parameters()}
    inner = mod[1] if kind == "sequence_parallel" else mod
    prefix = "1." if kind == "sequence_parallel" else ""
    slices.update({prefix + n: s for n, s in inner.serial_slices().items()})
    serial_module = {"0": "ln", "1": "mlp"}  # (the Sequential's children: the serial block's)
    names = {n: f"{serial_module[n[0]]}{n[1:]}" if prefix else n for n in slices}
    return mod, ser, names, slices


def _clipped(kind: str, norm_type: float, max_norm: float) -> dict[str, float]:
    from diffcomm import parallel as par

    mod, ser, names, slices = _trained(kind)
    total = par.clip_grad_norm_(mod, max_norm, norm_type=norm_type)
    ref = torch.nn.utils.clip_grad_norm_(ser.parameters(), max_norm, norm_type=norm_type)
    serial = dict(ser.named_parameters())
    grads = max(
        float((p.grad - serial[names[n]].grad[slices[n]]).abs().max())  # type: ignore[index, operator]
        for n, p in mod.named_parameters()
    )
    return {"norm": float((total - ref).abs() / ref), "grads": grads, "clipped": float(ref > max_norm)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["mlp", "sequence_parallel", "moe"])
def test_clip_grad_norm_is_the_serial_models(local_worlds, world: int, kind: str) -> None:
    for norm_type in (2.0, INF, 1.0):
        for res in local_worlds(world).run(_clipped, kind, norm_type, 0.05):
            assert res["clipped"] == 1.0  # the factor is < 1: the test compares a clipping
            assert res["norm"] < 1e-12 and res["grads"] < 1e-12, (norm_type, res)


def _torch_clip_on_shards() -> tuple[float, float, float]:
    """torch's clip_grad_norm_ on a ParallelMLP: this rank's norm, the serial norm, and
    this rank's fc2.bias (a replica) after clipping."""

    mod, ser, _, _ = _trained("mlp")
    norm = torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.05)
    ref = torch.nn.utils.clip_grad_norm_(ser.parameters(), 0.05)
    return float(norm), float(ref), float(mod.fc2.bias.grad[0])  # type: ignore[union-attr, index]


def test_torch_clip_grad_norm_on_shards_is_silently_wrong(world2) -> None:
    """What the functions are for (docs/parallel.md): torch's clipping sees this rank's
    shards: a norm that is not the serial one and differs by rank, so the replicated
    bias's replicas are scaled differently."""
    (n0, ref, b0), (n1, _, b1) = world2.run(_torch_clip_on_shards)
    assert abs(n0 - ref) > 1e-3 and abs(n0 - n1) > 1e-3 and abs(b0 - b1) > 1e-6


def _unsynced_moe_in_debug() -> str:
    from diffcomm import parallel as par

    torch.manual_seed(0)
    moe = par.ExpertParallelMoE(6, 8, num_experts=4, k=2, dtype=F64, seed=0)
    moe(torch.randn(5, 6, dtype=F64) + dc.get_rank()).pow(2).sum().backward()
    with dc.debug(True):
        try:
            par.clip_grad_norm_(moe, 1.0)
        except dc.CrossRankMismatchError as exc:
            return str(exc)
    return "no error"


def test_debug_mode_names_unsynced_replicated_grads(world2) -> None:
    for msg in world2.run(_unsynced_moe_in_debug):
        assert "replicated parameters' gradients" in msg and "sync_replicated_grads" in msg, msg


def _nonfinite() -> list[str]:
    from diffcomm import parallel as par

    mod, _, _, _ = _trained("mlp")
    mod.fc1.weight.grad[0, 0] = float("nan")  # type: ignore[index, union-attr]
    out = []
    for flag in (False, True):
        try:
            out.append(str(float(par.clip_grad_norm_(mod, 1.0, error_if_nonfinite=flag))))
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def test_error_if_nonfinite_raises_on_every_rank(world2) -> None:
    """A nan on rank 0 only: the total norm is nan on every rank, and every rank raises."""
    for plain, raised in world2.run(_nonfinite):
        assert plain == "nan" and "error_if_nonfinite=False" in raised


def _bad_calls() -> list[str]:
    import torch.distributed as dist

    from diffcomm import parallel as par

    other = dist.new_group(list(range(dc.get_world_size())))
    mlp = par.ParallelMLP(4, 6, seed=0)
    col = par.ColumnParallelLinear(4, 6, group=other, seed=1)
    # an expert tensor-parallel over the world inside an MoE expert-parallel over a group of
    # one (orthogonal: a TP expert over the MoE's own ranks is refused when built)
    alone = [dist.new_group([r]) for r in range(dc.get_world_size())][dc.get_rank()]
    nested = par.ExpertParallelMoE(
        4, 6, 1, 1, alone, experts=[par.ParallelMLP(4, 6, group=other, seed=2)], seed=0
    )
    return refusal_messages(
        [
            lambda: par.clip_grad_norm_(list(mlp.parameters()), 1.0),
            lambda: par.grad_norm(mlp, group=other),
            lambda: par.grad_norm(nn.ModuleList([mlp, col])),
            lambda: par.clip_grad_norm_(mlp, "1"),
            lambda: par.grad_norm(mlp, 0),
            lambda: par.grad_norm(mlp, "two"),
            lambda: par.grad_norm(nested),
            lambda: par.clip_grad_norm_(mlp, 1.0, pipeline_group=dist.group.WORLD),  # the layers' own
        ]
    )


def test_bad_input_refused_before_communicating(world2) -> None:
    assert_refused_before_communicating(
        world2.run(_bad_calls),
        [
            r"TypeError: .*`module` must be the model, an nn.Module .*`model.parameters\(\)`.*got list",
            r"ValueError: .*`group` must be the group of every parallel layer in `module`",
            r"ValueError: .*`module` must be a model whose parallel layers share one group",
            r"TypeError: .*`max_norm` must be a float",
            r"ValueError: .*`norm_type` must be a positive float or inf, got 0",
            r"TypeError: .*`norm_type` must be a positive float or inf, got 'two'",
            r"ValueError: .*`module` must be a model whose parameters are each split over one group, "
            r"got `experts.0.fc1.weight` split by `experts.0.fc1` and again by `ExpertParallelMoE`",
            r"ValueError: .*`pipeline_group` must be the group over the pipeline's stages, not the layers'",
        ],
    )


def _ddp_step() -> dict[str, float]:
    """World 4 as a 2 x 2 mesh: a ParallelMLP over the ``tp`` axis in torch's
    DistributedDataParallel over ``dp``, each replica its own batch, then clipping; against
    the serial MLP's gradient of the replicas' mean loss, clipped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from diffcomm import parallel as par

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ser = par.MLP(4, 6, dtype=F64)
    model = par.ParallelMLP.from_serial(ser, group=(mesh, "tp"))
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    xs = torch.randn(2, 5, 4, dtype=F64)
    ddp(xs[mesh.get_local_rank("dp")]).pow(2).sum().backward()
    for x in xs:
        ser(x).pow(2).sum().div(2).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    total = par.clip_grad_norm_(ddp, 0.05, group=(mesh, "tp"))
    ref = torch.nn.utils.clip_grad_norm_(ser.parameters(), 0.05)
    slices, serial = model.serial_slices(), dict(ser.named_parameters())
    out = {"norm": float((total - ref).abs())}
    for n, p in model.named_parameters():
        out[n] = float((p.grad - serial[n].grad[slices[n]]).abs().max())  # type: ignore[index, operator]
        out[n + " clipped"] = float(before[n].abs().max() - p.grad.abs().max())  # type: ignore[union-attr]
    return out


@pytest.mark.diffcomm_in_process(False)  # torch's DistributedDataParallel: real process groups
def test_under_ddp_over_the_other_mesh_axis(world4) -> None:
    for res in world4.run(_ddp_step):
        assert all(v < 1e-12 for k, v in res.items() if not k.endswith("clipped")), res
        assert all(v > 0 for k, v in res.items() if k.endswith("clipped")), res


def _scaled_steps(sync: bool) -> dict[str, Any]:
    """Two fp16-autocast steps of a ParallelMLP with torch's GradScaler; in the first an
    overflow (inf) in rank 0's fc1 shard only, as the serial model's gradient would hold."""
    from diffcomm import parallel as par

    torch.manual_seed(0)
    mod = par.ParallelMLP(4, 6, seed=0)
    start = mod.fc2.bias.detach().clone()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    out: dict[str, Any] = {"skipped": []}
    for step in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mod(torch.randn(5, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if dc.get_rank() == 0 and step == 0:
            mod.fc1.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.unscale_(opt)
        if sync:
            out["skipped"].append(par.sync_found_inf(scaler, opt))
        scaler.step(opt)
        scaler.update()
        out[f"bias{step}"] = mod.fc2.bias.detach().clone()
        out[f"scale{step}"] = scaler.get_scale()
    out["start"] = start
    return out


def _scaled_steps_debug(sync: bool, debug: bool) -> dict[str, Any]:
    with dc.debug(debug):
        return _scaled_steps(sync)


def test_torch_grad_scaler_on_shards_skips_on_one_rank_only(world2) -> None:
    """What sync_found_inf is for: torch's GradScaler finds the overflow on rank 0 only,
    which skips its step and halves its scale while rank 1 steps: the replicated fc2.bias
    and the scales differ between the ranks — silently outside debug mode (pinned off:
    the suite also runs under DIFFCOMM_DEBUG=1); debug mode finds the replicas apart in
    the next step's backward (the identity backward's incoming gradient differs)."""
    r0, r1 = world2.run(_scaled_steps_debug, False, False)
    assert (r0["scale0"], r1["scale0"]) == (2.0**15, 2.0**16)
    assert not torch.equal(r0["bias1"], r1["bias1"])
    with pytest.raises(dc.RankError, match="CrossRankMismatchError"):
        world2.run(_scaled_steps_debug, False, True)


def test_sync_found_inf_skips_on_every_rank(world2) -> None:
    """With sync_found_inf every rank skips the overflowing step (the parameters stay
    as they were, as the serial model's would) and halves its scale, then every rank takes
    the next step: replicas and scales stay equal."""
    r0, r1 = world2.run(_scaled_steps, True)
    for r in (r0, r1):
        assert r["skipped"] == [True, False] and (r["scale0"], r["scale1"]) == (2.0**15, 2.0**15)
        assert torch.equal(r["bias0"], r["start"]) and not torch.equal(r["bias1"], r["start"])
    assert torch.equal(r0["bias1"], r1["bias1"])


def _bad_scaler_calls() -> list[str]:
    from diffcomm import parallel as par

    mod = par.ParallelMLP(4, 6, seed=0)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    return refusal_messages(
        [
            lambda: par.sync_found_inf(object(), opt),
            lambda: par.sync_found_inf(scaler, opt),  # unscale_ not called
        ]
    )


def test_sync_found_inf_refuses_before_communicating(world2) -> None:
    assert_refused_before_communicating(
        world2.run(_bad_scaler_calls),
        [
            r"TypeError: .*`scaler` must be a torch.amp.GradScaler, got object",
            r"ValueError: .*`optimizer` must be an optimizer scaler.unscale_\(\) ran for .*call "
            r"scaler.unscale_\(optimizer\) first",
        ],
    )


class _SerialLM(nn.Module):
    """A tiny LM: embedding (tied to the head), a scale of its own, attention, MLP."""

    def __init__(self) -> None:
        from diffcomm.parallel import MLP, SelfAttention

        super().__init__()
        self.emb = nn.Embedding(8, 4, dtype=F64)
        self.scale = nn.Parameter(torch.full((4,), 1.5, dtype=F64))
        self.att, self.mlp = SelfAttention(4, 2, dtype=F64), MLP(4, 8, dtype=F64)
        self.head = nn.Linear(4, 8, bias=False, dtype=F64)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).unsqueeze(1) * self.scale
        h = h + self.att(h)
        return self.head(h + self.mlp(h))


def _lm_of_your_own() -> dict[str, float]:
    """The tiny LM as a ParallelModule of your own over a group made with new_group (its
    own `scale` replicated, the container naming no group), against the serial LM."""
    import torch.distributed as dist

    from diffcomm import parallel as par

    class ParallelLM(par.ParallelModule):
        def __init__(self, serial: _SerialLM, group: Any) -> None:
            super().__init__()
            self.emb = par.VocabParallelEmbedding.from_serial(serial.emb, group=group)
            self.scale = nn.Parameter(serial.scale.detach().clone())
            self.att = par.ParallelSelfAttention.from_serial(serial.att, group=group)
            self.mlp = par.ParallelMLP.from_serial(serial.mlp, group=group)
            self.head = par.ColumnParallelLinear.from_serial(serial.head, group=group)
            self.head.weight = self.emb.weight

        forward = _SerialLM.forward

    group = dist.new_group(list(range(dc.get_world_size())))
    torch.manual_seed(0)
    serial = _SerialLM()
    model = ParallelLM(serial, group)
    ids, target = torch.randint(0, 8, (5,)), torch.randint(0, 8, (5, 1))
    par.vocab_parallel_cross_entropy(model(ids), target, group=group).backward()
    F.cross_entropy(serial(ids).reshape(-1, 8), target.reshape(-1)).backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in serial.parameters()])  # type: ignore[misc]
    return {
        "default group": float((par.grad_norm(model) - ref).abs()),
        "group=": float((par.clip_grad_norm_(model, 1e-3, group=group) - ref).abs()),
    }


def test_a_model_of_your_own_with_tied_vocab_layers(world2) -> None:
    """A tied embedding/head (one parameter, counted once), a replicated parameter of the
    container (which names no group: it was taken for a layer over the default group, a
    ValueError 'over different groups'), attention and MLP over a new_group group."""
    for res in world2.run(_lm_of_your_own):
        assert all(v < 1e-12 for v in res.values()), res


def _pipeline_stage_clipped() -> dict[str, float]:
    """World 4 as a 2 x 2 mesh: stage s (the ``pp`` axis) holds serial block s as a
    ParallelMLP over ``tp``; the loss is the serial model's (block 1 after block 0), each
    stage's gradient computed as a pipeline would; clipped by the whole model's norm."""
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm import parallel as par

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    blocks = [par.MLP(4, 6, dtype=F64), par.MLP(4, 6, dtype=F64)]
    serial = nn.Sequential(*blocks)
    x = torch.randn(5, 4, dtype=F64)
    serial(x).pow(2).sum().backward()
    mine = par.ParallelMLP.from_serial(blocks[stage], group=(mesh, "tp"))
    h = blocks[0](x).detach().requires_grad_(stage == 1)
    if stage == 0:  # the gradient stage 1 sends back: d loss / d h
        h1 = h.clone().requires_grad_()
        blocks[1](h1).pow(2).sum().backward(inputs=[h1])
        mine(x).backward(h1.grad)
    else:
        mine(h).pow(2).sum().backward()
    whole = par.grad_norm(mine, group=(mesh, "tp"), pipeline_group=(mesh, "pp"))
    alone = par.grad_norm(mine, group=(mesh, "tp"))
    total = par.clip_grad_norm_(mine, 0.05, group=(mesh, "tp"), pipeline_group=(mesh, "pp"))
    ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05)
    slices, ser = mine.serial_slices(), dict(blocks[stage].named_parameters())
    grads = max(float((p.grad - ser[n].grad[slices[n]]).abs().max()) for n, p in mine.named_parameters())  # type: ignore[index, operator]
    return {
        "norm": float((total - ref).abs()),
        "whole": float((whole - ref).abs()),
        "grads": grads,
        "alone": float((alone - ref).abs()),
    }


def test_a_pipeline_stage_clips_by_the_whole_models_norm(local_worlds) -> None:
    """Each stage holds other parameters: ``pipeline_group`` sums the stages' parts, so
    every rank clips by the serial model's norm (without it, each stage's own norm: no
    serial clipping)."""
    for res in local_worlds(4).run(_pipeline_stage_clipped):
        assert res["whole"] < 1e-12 and res["norm"] < 1e-12 and res["grads"] < 1e-12, res
        assert res["alone"] > 1e-3, res  # a stage's own norm is not the model's


def _stage_without_gradients(frozen: bool, debug: bool = False) -> dict[str, Any]:
    """A 3-stage float64 pipeline whose middle stage has no parameters (two activations),
    or whose first stage is frozen: that stage has no gradient to take a dtype from."""
    import copy

    import torch.distributed as dist

    from diffcomm import parallel as par
    from diffcomm.pipeline import PipelineRunner, partition

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Tanh(), nn.Linear(4, 2)).double()
    if frozen:
        model[0].requires_grad_(False)
    serial = copy.deepcopy(model)
    stage = partition(model, 3, balance=[1, 2, 1])[dist.get_rank()]
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    PipelineRunner(stage, "1f1b", loss_fn=F.mse_loss).step(x, y, n_micro=2)
    F.mse_loss(serial(x), y).backward()
    with dc.debug(debug):
        norm = par.grad_norm(stage, pipeline_group=dist.group.WORLD)
        total = par.clip_grad_norm_(stage, 0.1, pipeline_group=dist.group.WORLD)
    ref = torch.nn.utils.clip_grad_norm_([p for p in serial.parameters() if p.requires_grad], 0.1)
    return {"dtypes": {norm.dtype, total.dtype}, "err": max(float((t - ref).abs()) for t in (norm, total))}


@pytest.mark.parametrize("frozen", [False, True])
def test_a_pipeline_stage_without_gradients_sums_in_the_others_dtype(local_worlds, frozen: bool) -> None:
    """A stage with no gradient (no parameters, or frozen) took float32 zeros on the CPU into
    the stages' float64 all_reduce: gloo aborted the process ("receives more bytes than it
    expects"); in one process that rank returned a float32 norm (0.6078450679779053 for the
    serial 0.6078450641133442). Now every rank returns the serial float64 norm."""
    for res in local_worlds(3).run(_stage_without_gradients, frozen):
        assert res["dtypes"] == {torch.float64} and res["err"] < 1e-12, res


def test_debug_mode_accepts_a_plain_pipeline(local_worlds) -> None:
    """Debug mode checks that the replicated parameters' gradients agree over the layers'
    group; a pipeline of plain modules has none, and the check compared the stages'
    different parameters over the world: every plain pipeline's grad_norm(pipeline_group=)
    raised in debug mode (CrossRankMismatchError, shapes (16,) and (30,), for a 2-stage MLP;
    here the middle stage had nothing to check and the others' check desynced). Now a
    stage's own parameters are checked over no group, and the norm is the serial one."""
    for res in local_worlds(3).run(_stage_without_gradients, False, True):
        assert res["dtypes"] == {torch.float64} and res["err"] < 1e-12, res


def _half_precision_norm() -> dict[str, float]:
    """A float16 ParallelMLP whose gradient norm is above 256 (its square above float16's
    65504), clipped at 1e4 (no clipping), against the serial float64 MLP."""
    from diffcomm import parallel as par

    torch.manual_seed(0)
    ser = par.MLP(8, 16, dtype=F64)
    mod = par.ParallelMLP.from_serial(ser).half()
    x = torch.randn(5, 8, dtype=F64)
    mod(x.half()).float().pow(2).sum().mul(40).backward()
    ser(x).pow(2).sum().mul(40).backward()
    before = [p.grad.clone() for p in mod.parameters()]  # type: ignore[union-attr]
    ref = torch.nn.utils.get_total_norm([p.grad for p in ser.parameters()])  # type: ignore[misc]
    total = par.clip_grad_norm_(mod, 1e4)
    return {
        "ref": float(ref),
        "norm": float((total.double() - ref).abs() / ref),
        "changed": max(float((p.grad - b).abs().max()) for p, b in zip(mod.parameters(), before)),  # type: ignore[operator]
        "float16": float(total.dtype == torch.float16),
    }


def test_a_float16_models_norm_above_256_is_not_inf(world2) -> None:
    """The squares of a float16 model's norms were summed (and all-reduced) in float16:
    a norm above 256 overflowed, inf (the serial 312.84, torch's clipping of the float16
    serial gradients 312.75), and clipping at 1e4 zeroed every gradient. Now the parts
    are summed in float64, and the norm returned in float16, as torch's."""
    for res in world2.run(_half_precision_norm):
        assert res["ref"] > 256 and res["norm"] < 1e-3 and res["changed"] == 0.0, res
        assert res["float16"] == 1.0, res


def _nan_on_one_rank(norm_type: float) -> list[str]:
    """A ParallelMLP whose fc1 shard holds a nan on the last rank only: the total norm
    and ``error_if_nonfinite``."""
    from diffcomm import parallel as par

    mod, _, _, _ = _trained("mlp")
    if dc.get_rank() == dc.get_world_size() - 1:
        mod.fc1.weight.grad[0, 0] = float("nan")  # type: ignore[index, union-attr]
    out = [str(float(par.grad_norm(mod, norm_type)))]
    try:
        par.clip_grad_norm_(mod, 1.0, norm_type, error_if_nonfinite=True)
        out.append("no error")
    except RuntimeError as exc:
        out.append(str(exc))
    return out


@pytest.mark.diffcomm_in_process(False)  # gloo's all_reduce max
@pytest.mark.parametrize("norm_type", [INF, 2.0])
def test_a_nan_on_the_last_rank_only_makes_the_inf_norm_nan(local_worlds, norm_type: float) -> None:
    """torch's max of the serial model's norms is nan when one is; gloo's all_reduce max
    drops a nan held by a rank other than the first: the inf-norm was 2.75 on every rank
    (for the serial nan) and error_if_nonfinite=True raised nowhere. Now nan on every rank."""
    for norm, raised in local_worlds(3).run(_nan_on_one_rank, norm_type):
        assert norm == "nan" and "error_if_nonfinite=False" in raised, (norm, raised)
