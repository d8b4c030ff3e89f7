"""diffcomm's parallel layers inside the rest of a PyTorch training stack, against a serial
float64 model trained on the concatenated batch, the loss the mean over it
(docs/parallel.md, "In a training stack"): parametrizations of a sharded weight refused
before any communication, and the docs' shard-aware weight norm equal to torch's on the
serial weight; torch's DDP (find_unused_parameters, no_sync, gradient_as_bucket_view,
static_graph), ZeroRedundancyOptimizer and FSDP2 over the data-parallel axis of a 2 x 2
mesh with a ParallelMLP, a sequence-parallel block and an ExpertParallelMoE inside;
clipping and GradScaler's skip decision there; activation checkpointing of every kind of
layer, attention and MoE, both variants, overlapped and asynchronous communication."""

from __future__ import annotations

import re
from typing import Any

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


# ======================================================================================
# torch's data parallelism over the other axis of a 2 x 2 mesh (real process groups)
# ======================================================================================

H, S, B = 8, 8, 2


class _SerialBlock(nn.Module):
    """A pre-norm transformer block: the serial reference of ``_SequenceParallelBlock``."""

    def __init__(self) -> None:
        from diffcomm import parallel as par

        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(H, dtype=F64), par.SelfAttention(H, 4, dtype=F64)
        self.ln2, self.mlp = nn.LayerNorm(H, dtype=F64), par.MLP(H, 16, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _sp_block_class() -> type:
    from diffcomm import parallel as par

    class _SequenceParallelBlock(par.ParallelModule):
        """``_SerialBlock`` with sequence parallelism over ``tp`` (input and output the
        whole sequence, replicated); ``ckpt``: how each sublayer is called."""

        def __init__(self, tp: object = None, ckpt: object = None) -> None:
            super().__init__()
            self.tp, self.ckpt = tp, ckpt
            kw = {"group": tp, "dtype": F64}
            self.ln1 = par.SequenceParallelLayerNorm(H, **kw)
            self.attn = par.ParallelSelfAttention(H, 4, sequence_parallel=True, seed=0, **kw)
            self.ln2 = par.SequenceParallelLayerNorm(H, **kw)
            self.mlp = par.ParallelMLP(H, 16, sequence_parallel=True, seed=0, **kw)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            call = self.ckpt or (lambda f, *a: f(*a))
            x = par.scatter_to_sequence(x, 0, self.tp)
            x = x + call(self.attn, self.ln1(x))
            x = x + call(self.mlp, self.ln2(x))
            return par.gather_from_sequence(x, 0, self.tp)

    return _SequenceParallelBlock


def _models(kind: str, tp: object) -> tuple[nn.Module, nn.Module]:
    """``(serial, this rank's parallel model)`` of one kind, the same weights."""
    from diffcomm import parallel as par

    torch.manual_seed(0)
    if kind == "mlp":
        ser: nn.Module = par.MLP(H, 16, dtype=F64)
        return ser, par.ParallelMLP.from_serial(ser, group=tp)
    if kind == "block":
        ser = _SerialBlock()
        return ser, _sp_block_class().from_serial(ser, tp)
    ser = par.MoE(H, 6, 4, 2, shared_expert_size=5, activation="tanh", dtype=F64, seed=3)
    return ser, par.ExpertParallelMoE.from_serial(ser, tp)


def _worst_param(par_model: nn.Module, ser: nn.Module) -> float:
    """The largest difference of a parameter from its part of the serial one."""
    from torch.distributed.tensor import DTensor

    slices = par_model.serial_slices()
    names = par_model.serial_names() if hasattr(par_model, "serial_names") else {}
    serial = dict(ser.named_parameters())
    worst = 0.0
    for n, p in par_model.named_parameters():
        mine = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        worst = max(worst, float((mine - serial[names.get(n, n)].detach()[slices[n]]).abs().max()))
    return worst


def _train(kind: str, wrap: str, accum: int) -> float:
    """Two SGD-with-momentum steps of a model of diffcomm layers over the ``tp`` axis of a
    (dp, tp) = 2 x 2 mesh, data-parallel over ``dp`` by ``wrap`` (DDP with options, ZeRO,
    FSDP2), ``accum`` micro-batches per step (``no_sync`` under DDP); against the serial
    model on the concatenated batch, the loss the mean over it. The worst difference of
    the losses and parameters. The MoE's ``tp`` axis is its expert-parallel group, each
    rank with its own tokens (half of its data-parallel replica's)."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_pg, dp, tp = mesh.get_group("dp"), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    ser, par = _models(kind, (mesh, "tp"))
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model: nn.Module = fully_shard(par, mesh=mesh["dp"])
    else:
        options = {
            "": {},
            "unused": {"find_unused_parameters": True},
            "view": {"gradient_as_bucket_view": True},
            "static": {"static_graph": True},
        }
        model = DDP(par, process_group=dp_pg, **options[wrap[4:] if wrap != "zero" else ""])
    if wrap == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=dp_pg, lr=0.1, momentum=0.9
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(ser.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(2):
        xs = torch.randn(accum, 2, S, B, H, dtype=F64, generator=g)  # [micro, dp replica, S, B, H]
        ts = torch.randn(accum, 2, S, B, H, dtype=F64, generator=g)
        opt.zero_grad()
        serial_opt.zero_grad()
        for m in range(accum):
            x, t = torch.cat(list(xs[m]), 1), torch.cat(list(ts[m]), 1)  # the global batch
            xl, tl = xs[m, dp], ts[m, dp]
            if kind == "moe":  # tokens: each dp replica's, batch-major; each ep rank half of them
                x, t = (a.transpose(0, 1).reshape(-1, H) for a in (x, t))
                xl, tl = (a.transpose(0, 1).reshape(-1, H).chunk(2)[tp] for a in (xl, tl))
            ref = F.mse_loss(ser(x), t) / accum
            ref.backward()
            if wrap == "fsdp2":  # FSDP2's accumulation: no reduce-scatter but the last's
                model.set_requires_gradient_sync(m == accum - 1)  # type: ignore[operator]
            quiet = model.no_sync() if m < accum - 1 and wrap != "fsdp2" else contextlib.nullcontext()
            with quiet:  # type: ignore[attr-defined]
                loss = F.mse_loss(model(xl), tl) / accum / (2 if kind == "moe" else 1)
                loss.backward()
            # the global batch's mean: each replica's over its tensor-parallel group (the MoE's
            # ranks hold their halves' shares) averaged over the data-parallel replicas
            mean = dc.all_reduce(loss.detach(), "sum") / (2 if kind == "moe" else 4)
            worst = max(worst, float((mean - ref.detach()).abs()))
        if kind == "moe":
            par.sync_replicated_grads()
        opt.step()
        serial_opt.step()
        worst = max(worst, _worst_param(par, ser))
    return worst


_STACK = [
    ("mlp", "ddp:", 2),
    ("mlp", "ddp:unused", 2),
    ("mlp", "ddp:view", 2),
    ("mlp", "ddp:static", 1),
    ("block", "ddp:", 2),
    ("block", "ddp:unused", 1),
    ("block", "ddp:view", 2),
    ("block", "ddp:static", 1),
    ("moe", "ddp:", 2),
    ("moe", "ddp:unused", 1),
    ("moe", "ddp:view", 2),
    ("moe", "ddp:static", 1),
    ("mlp", "zero", 1),
    ("block", "zero", 2),
    ("mlp", "fsdp2", 1),
    ("block", "fsdp2", 2),
    ("moe", "fsdp2", 2),
]


def _stack() -> dict[str, float]:
    return {f"{k} {w} x{a}": _train(k, w, a) for k, w, a in _STACK}


@pytest.mark.diffcomm_in_process(False)  # torch's DDP, ZeRO and FSDP2: real process groups
def test_data_parallel_wrappers_over_the_other_mesh_axis_match_serial(world4) -> None:
    for res in world4.run(_stack):
        assert max(res.values()) < 1e-10, res


def _clip_and_scale(wrap: str) -> dict[str, float]:
    """The sequence-parallel block over ``tp``, data-parallel over ``dp`` (DDP or FSDP2,
    whose gradients are DTensors sharded over ``dp``), with torch's GradScaler: one scaled
    backward, ``unscale_``, ``sync_found_inf``, ``clip_grad_norm_``, the step; against
    torch's clipping of the serial model on the concatenated batch. Then a step with an
    inf in rank 3's gradient shard only: skipped on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from diffcomm import parallel as par

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    ser, mine = _models("block", (mesh, "tp"))
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model: nn.Module = fully_shard(mine, mesh=mesh["dp"])
    else:
        model = DDP(mine, process_group=mesh.get_group("dp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    serial_opt = torch.optim.SGD(ser.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    g = torch.Generator().manual_seed(1)
    out = {}
    for step in range(2):
        xs, ts = (torch.randn(2, S, B, H, dtype=F64, generator=g) for _ in range(2))
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(xs[dp]), ts[dp])).backward()
        if step == 1 and dc.get_rank() == 3:  # an overflow in one rank's shard only
            grad = next(iter(mine.parameters())).grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        skipped = par.sync_found_inf(scaler, opt)
        if step == 0:
            serial_opt.zero_grad()
            F.mse_loss(ser(torch.cat(list(xs), 1)), torch.cat(list(ts), 1)).backward()
            ref = torch.nn.utils.clip_grad_norm_(ser.parameters(), 0.05)
            out["norm"] = float((par.clip_grad_norm_(model, 0.05, group=(mesh, "tp")) - ref).abs())
            serial_opt.step()
        before = _worst_param(mine, ser)
        scaler.step(opt)
        scaler.update()
        out[f"skipped {step}"] = float(skipped)
        out[f"params {step}"] = _worst_param(mine, ser)
        out["unchanged"] = before
    out["scale"] = scaler.get_scale()
    return out


@pytest.mark.diffcomm_in_process(False)
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_clipping_and_loss_scaling_under_data_parallel_wrappers(world4, wrap: str) -> None:
    """Before, ``clip_grad_norm_`` / ``grad_norm`` of an FSDP2 model raised a TypeError from
    an internal all_reduce (its per-parameter norms were DTensors); now the serial norm
    (to 1e-12) and the serial clipped step; a one-rank overflow skips the step on all."""
    for res in world4.run(_clip_and_scale, wrap):
        assert res["norm"] < 1e-12 and res["params 0"] < 1e-10, res
        assert res["skipped 0"] == 0 and res["skipped 1"] == 1, res
        assert res["params 1"] == res["unchanged"] and res["scale"] == 4.0, res


def _moe_synced_twice_under_fsdp2(calls: int) -> float:
    """An ExpertParallelMoE over ``tp`` in FSDP2 over ``dp`` (its gradients DTensors), two
    accumulated backwards, ``sync_replicated_grads()`` called ``calls`` times: the router's
    gradient against the serial MoE's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    ser, mine = _models("moe", (mesh, "tp"))
    model: Any = fully_shard(mine, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(1)
    for m in range(2):
        x, t = (torch.randn(2, 8, H, dtype=F64, generator=g) for _ in range(2))
        model.set_requires_gradient_sync(m == 1)
        F.mse_loss(model(x[dp].chunk(2)[tp]), t[dp].chunk(2)[tp]).div(4).backward()
        F.mse_loss(ser(x.reshape(-1, H)), t.reshape(-1, H)).div(2).backward()
    for _ in range(calls):
        mine.sync_replicated_grads()
    return float((mine.router.weight.grad.full_tensor() - ser.router.weight.grad).abs().max())


@pytest.mark.diffcomm_in_process(False)
def test_sync_replicated_grads_twice_under_fsdp2_sums_once(world4) -> None:
    """A DTensor gradient was summed by every call: a second call with nothing between
    counted the router's gradient once per rank again (0.045 off serial here), where
    plain gradients are summed once. Now an unchanged DTensor gradient is left alone."""
    for calls in (1, 2):
        for err in world4.run(_moe_synced_twice_under_fsdp2, calls):
            assert err < 1e-12, (calls, err)


# ======================================================================================
# activation checkpointing: the recomputation re-runs the communication
# ======================================================================================


def _grads(fn: object, inputs: list[torch.Tensor], params: list[torch.Tensor], weight: torch.Tensor) -> list:
    """``[output, input grads..., param grads...]`` of ``<fn(*inputs), weight>``."""
    for p in params:
        p.grad = None
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*ins)  # type: ignore[operator]
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in ins] + [p.grad.clone() for p in params]


def _apart(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _save_matmuls_and_communication(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    """A selective-checkpointing policy that saves the matmuls' and c10d's outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default) or "c10d" in str(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(reentrant: bool) -> dict[str, float]:
    """Each kind of layer under ``torch.utils.checkpoint`` (world 2: tensor, sequence,
    context and expert parallelism over the world) against its serial float64 reference,
    or (dropout, asynchronous ops) the same program without checkpointing."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from diffcomm import parallel as par
    from diffcomm import rng

    ck = functools.partial(checkpoint, use_reentrant=reentrant)
    r, out = dc.get_rank(), {}
    gen = torch.Generator().manual_seed(2)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=F64, generator=gen)

    x, wx = rand(S, B, H), rand(S, B, H)
    mlps = [("mlp", False, False), ("mlp comm", False, "comm"), ("mlp sp", True, False)]
    for name, sp, overlap in [*mlps, ("mlp sp ring", True, "ring")]:
        ser, mlp = _models("mlp", None)
        mlp = par.ParallelMLP.from_serial(ser, sequence_parallel=sp, overlap=overlap)

        def f(x: torch.Tensor, mlp: nn.Module = mlp, sp: bool = sp) -> torch.Tensor:
            y = ck(mlp, par.scatter_to_sequence(x, 0) if sp else x)
            return par.gather_from_sequence(y, 0) if sp else y

        ser_grads = _grads(ser, [x], list(ser.parameters()), wx)
        slices, named = mlp.serial_slices(), dict(ser.named_parameters())
        ref = ser_grads[:2] + [named[n].grad[slices[n]] for n, _ in mlp.named_parameters()]
        out[name] = _apart(_grads(f, [x], list(mlp.parameters()), wx), ref)
    for inner in (False, True):
        ser, blk = _models("block", None)
        if inner:  # each sublayer checkpointed inside the block's forward (its region copies)
            blk.ckpt = ck
        ser_grads = _grads(ser, [x], list(ser.parameters()), wx)
        slices, named = blk.serial_slices(), dict(ser.named_parameters())
        ref = ser_grads[:2] + [named[n].grad[slices[n]] for n, _ in blk.named_parameters()]
        got = _grads(blk if inner else functools.partial(ck, blk), [x], list(blk.parameters()), wx)
        out[f"block {'inner' if inner else 'whole'}"] = _apart(got, ref)
    q, k, v, wq = (rand(1, 4, 8, 4) for _ in range(4))
    whole = functools.partial(F.scaled_dot_product_attention, is_causal=True)
    serial = _grads(whole, [q, k, v], [], wq)
    if not reentrant:  # selective checkpointing, its policy saving the communication too
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        for sp in (False, True):
            ser, mlp = _models("mlp", None)
            mlp = par.ParallelMLP.from_serial(ser, sequence_parallel=sp)
            sac = functools.partial(create_selective_checkpoint_contexts, _save_matmuls_and_communication)

            def g(x: torch.Tensor, mlp: nn.Module = mlp, sp: bool = sp, sac: object = sac) -> torch.Tensor:
                y = checkpoint(
                    mlp, par.scatter_to_sequence(x, 0) if sp else x, use_reentrant=False, context_fn=sac
                )
                return par.gather_from_sequence(y, 0) if sp else y

            ser_grads = _grads(ser, [x], list(ser.parameters()), wx)
            slices, named = mlp.serial_slices(), dict(ser.named_parameters())
            ref = ser_grads[:2] + [named[n].grad[slices[n]] for n, _ in mlp.named_parameters()]
            out[f"mlp sp={sp} selective"] = _apart(_grads(g, [x], list(mlp.parameters()), wx), ref)
    for attend, layout in [(par.ring_attention, "zigzag"), (par.ulysses_attention, "contiguous")]:
        # layout named: the reentrant variant recomputes from detached inputs (no placement)
        attention = functools.partial(ck, functools.partial(attend, causal=True, layout=layout))
        shards = [par.shard(t, layout=layout) for t in (q, k, v, wq)]
        mine = _grads(attention, shards[:3], [], shards[3])
        out[attend.__name__] = _apart(mine, [par.shard(t, layout=layout) for t in serial])
    placed = [par.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v)]
    try:  # no layout=: the reentrant recomputation's detached inputs carry no placement
        ck(functools.partial(par.ring_attention, causal=True), *placed).sum().backward()
        out["placement kept"] = 1.0 if reentrant else 0.0
    except ValueError as exc:
        out["placement kept"] = 0.0 if reentrant and "use_reentrant=True" in str(exc) else 1.0
    for cap, overlap in [(None, False), (None, True), (1.0, False)]:
        ser = par.MoE(
            H, 6, 4, 2, capacity_factor=cap, shared_expert_size=5, activation="tanh", dtype=F64, seed=3
        )
        moe = par.ExpertParallelMoE.from_serial(ser, overlap_shared=overlap)
        tokens, wt = rand(12, H), rand(12, H)
        ser_grads = _grads(ser, [tokens], list(ser.parameters()), wt)
        mine = _grads(
            functools.partial(ck, moe), [tokens.chunk(2)[r]], list(moe.parameters()), wt.chunk(2)[r]
        )
        moe.sync_replicated_grads()
        mine[2:] = [p.grad for p in moe.parameters()]
        named, names = dict(ser.named_parameters()), moe.serial_names()
        ref = [ser_grads[0].chunk(2)[r], ser_grads[1].chunk(2)[r]]
        ref += [named[names[n]].grad for n, _ in moe.named_parameters()]
        out[f"moe capacity={cap} overlap={overlap}"] = _apart(mine, ref)
    w = rand(H, H).requires_grad_()

    def gathered(x: torch.Tensor) -> torch.Tensor:
        y = dc.all_gather(x @ w, 0, async_op=True)
        z = dc.all_reduce(x.sin(), async_op=True)
        return y.wait().tanh().sum(0) * z.wait().sum(0)

    xa, wa = rand(4, H), rand(H)
    out["async ops"] = _apart(
        _grads(functools.partial(ck, gathered), [xa], [w], wa), _grads(gathered, [xa], [w], wa)
    )
    rng.model_parallel_seed(5, tp_rank=r)
    for name, layer in [
        ("mlp dropout", par.ParallelMLP(H, 16, seed=0, dropout=0.5, dtype=F64)),
        ("attention dropout", par.ParallelSelfAttention(H, 4, seed=0, attention_dropout=0.5, dtype=F64)),
    ]:
        states, cpu = rng.get_tracker().get_states(), torch.get_rng_state()
        replaying = functools.partial(rng.checkpoint, layer, use_reentrant=reentrant)
        replayed = _grads(replaying, [x], list(layer.parameters()), wx)
        rng.get_tracker().set_states(states)
        torch.set_rng_state(cpu)
        out[name] = _apart(replayed, _grads(layer, [x], list(layer.parameters()), wx))
        try:  # torch's own checkpoint would draw other masks in the recomputation: refused
            _grads(functools.partial(ck, layer), [x], list(layer.parameters()), wx)
            out[name + " torch"] = 1.0
        except RuntimeError as exc:
            out[name + " torch"] = 0.0 if "drawn from during backward" in str(exc) else 1.0
    return out


@pytest.mark.diffcomm_in_process(False)  # overlapped and asynchronous ops: a communication thread
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_matches_serial(world2, reentrant: bool) -> None:
    for res in world2.run(_checkpointed, reentrant):
        assert max(res.values()) < 1e-12, res


def _ddp_over_the_shards() -> list[str]:
    """torch's DDP with its default group (the world) around a model whose layers are
    sharded over the ``tp`` axis of a 2 x 2 mesh: the forward refuses, before any of
    diffcomm's communication; over the ``dp`` axis it runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tokens = {"mlp": torch.randn(S, B, H, dtype=F64), "block": torch.randn(S, B, H, dtype=F64)}
    tokens["moe"] = torch.randn(5, H, dtype=F64)
    models = {kind: _models(kind, (mesh, "tp"))[1] for kind in tokens}
    calls = [lambda k=k: DDP(nn.Sequential(models[k]))(tokens[k]) for k in tokens]
    calls += [lambda k=k: DDP(models[k], process_group=mesh.get_group("dp"))(tokens[k]) for k in tokens]
    return refusal_messages(calls)


@pytest.mark.diffcomm_in_process(False)
def test_ddp_over_the_tensor_parallel_ranks_refused(world4) -> None:
    """Before, ``DDP(model)`` (the world) around a ParallelMLP over ``tp`` overwrote tp rank
    1's shards with rank 0's at construction (0.66 off the serial weights; an
    ExpertParallelMoE's experts 0.80 off) and trained on with no error."""
    msg = (
        r"ValueError: diffcomm\.parallel\.{}\(\): `{}` differs between the ranks \[\d, \d\].*DistributedData"
    )
    per_rank = world4.run(_ddp_over_the_shards)
    assert_refused_before_communicating(
        [msgs[:3] for msgs in per_rank],
        [msg.format("ParallelMLP", "fc1.weight"), msg.format("_SequenceParallelBlock", "attn.qkv.weight")]
        + [msg.format("ExpertParallelMoE", r"experts\.0\.fc1\.weight")],
    )
    assert all(msgs[3:] == ["no error"] * 3 for msgs in per_rank), per_rank


def _zero_over_the_shards() -> list[str]:
    """torch's ZeroRedundancyOptimizer over the world and over the ``tp`` axis of a 2 x 2
    mesh (ranks holding different shards or experts), the models in DDP over ``dp``:
    the step refuses on every rank, before it changes or sends anything; over ``dp`` it
    steps, and equals the serial model's step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    out = []
    for kind in ("mlp", "moe"):
        for where in (None, mesh.get_group("tp"), mesh.get_group("dp")):
            ser, mine = _models(kind, (mesh, "tp"))
            model = DDP(mine, process_group=mesh.get_group("dp"))
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=where, lr=0.1)
            sopt = torch.optim.SGD(ser.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(1)
            x, t = (torch.randn(2, S, B, H, dtype=F64, generator=g) for _ in range(2))
            xl, tl = x[dp], t[dp]
            x, t = torch.cat(list(x), 1), torch.cat(list(t), 1)
            if kind == "moe":  # each ep rank half of its dp replica's tokens
                x, t = (a.transpose(0, 1).reshape(-1, H) for a in (x, t))
                xl, tl = (a.transpose(0, 1).reshape(-1, H).chunk(2)[tp] for a in (xl, tl))
            (F.mse_loss(model(xl), tl) / (2 if kind == "moe" else 1)).backward()
            F.mse_loss(ser(x), t).backward()
            if kind == "moe":
                mine.sync_replicated_grads()
            before = [p.detach().clone() for p in mine.parameters()]
            out += refusal_messages([opt.step])
            if out[-1] == "no error":
                sopt.step()
                out.append(f"off {_worst_param(mine, ser):.1e}")
            else:
                same = all(torch.equal(a, p) for a, p in zip(before, mine.parameters(), strict=True))
                out.append(f"unchanged {same}")
    return out


@pytest.mark.diffcomm_in_process(False)
def test_zero_over_the_tensor_parallel_ranks_refused(world4) -> None:
    """Before, ``ZeroRedundancyOptimizer`` over the world or the ``tp`` axis around a
    ParallelMLP over ``tp`` stepped each parameter on one rank and broadcast it over the
    others' different shards: one SGD step left the weights 0.49-0.66 off the serial
    ones (ranks 0/2 and 1/3), with no error. Over ``dp``: 1e-17."""
    msg = (
        r"ValueError: diffcomm\.parallel: torch's ZeroRedundancyOptimizer runs over the ranks "
        r"\[{}\], but its parameter .* `{}` differs between the ranks \[\d, \d\]"
    )
    mlp, moe = "ColumnParallelLinear.weight", r"ExpertParallelMoE\.experts\.0\.fc1\.weight"
    for msgs in world4.run(_zero_over_the_shards):
        assert_refused_before_communicating(
            [[msgs[0], msgs[2], msgs[6], msgs[8]]],
            [msg.format("0, 1, 2, 3", mlp), msg.format(r"\d, \d", mlp)]
            + [msg.format("0, 1, 2, 3", moe), msg.format(r"\d, \d", moe)],
        )
        assert [msgs[i] for i in (1, 3, 7, 9)] == ["unchanged True"] * 4, msgs
        assert msgs[4] == msgs[10] == "no error", msgs
        assert float(msgs[5][4:]) < 1e-10 and float(msgs[11][4:]) < 1e-10, msgs


def _fsdp_over_the_shards() -> list[str]:
    """FSDP2 over the whole world (a 1-D mesh of 4) around a ParallelMLP over the ``tp``
    axis of a 2 x 2 mesh: its output is off the serial one (FSDP assembled each weight
    from different ranks' shards; diffcomm sees only the assembled tensor), and clipping
    refuses, before any of diffcomm's communication; over the ``dp`` axis it clips."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from diffcomm import parallel as par

    mesh, world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), init_device_mesh("cpu", (4,))
    out = []
    for fsdp_mesh in (world, mesh["dp"]):
        ser, mlp = _models("mlp", (mesh, "tp"))
        model = fully_shard(mlp, mesh=fsdp_mesh)
        x = torch.randn(S, B, H, dtype=F64, generator=torch.Generator().manual_seed(0))
        y = model(x)
        out.append(f"off {float((y - ser(x)).abs().max()) > 0.1}")
        y.sum().backward()
        out += refusal_messages([lambda model=model: par.clip_grad_norm_(model, 1.0)])
    return out


@pytest.mark.diffcomm_in_process(False)
def test_fsdp2_over_the_tensor_parallel_ranks_refused_by_clipping(world4) -> None:
    """Before, ``clip_grad_norm_`` of a model sharded by FSDP2 over the ranks holding
    different shards returned a norm and clipped (the model 0.79 off the serial one)."""
    for msgs in world4.run(_fsdp_over_the_shards):
        assert msgs[0] == "off True" and msgs[2:] == ["off False", "no error"], msgs
        assert re.search(
            r"ValueError: .*`module` must be a model sharded by FSDP2 over the data-parallel", msgs[1]
        )
        assert re.search(r"`fc1.weight`, this rank's shard over the ranks \[\d, \d\]", msgs[1])
        assert msgs[1].endswith("[0 comms]"), msgs


def _reducing_optimizers() -> list[str]:
    """torch's optimizers whose step is not elementwise, over a ParallelMLP's shards:
    refused before they change anything; over what is whole on this rank (biases for
    Adafactor, a plain layer) they run."""
    from diffcomm import parallel as par

    mlp, plain = par.ParallelMLP(H, 16, seed=0, dtype=F64), nn.Linear(H, H, dtype=F64)
    x = torch.randn(5, H, dtype=F64)
    (mlp(x).square().sum() + plain(x).sum()).backward()
    matrices = [mlp.fc1.weight, mlp.fc2.weight]
    before = [w.detach().clone() for w in matrices]
    msgs = refusal_messages(
        [
            lambda: torch.optim.Adafactor(mlp.parameters(), lr=0.1).step(),
            lambda: torch.optim.Muon(matrices, lr=0.1).step(),
            lambda: torch.optim.LBFGS(mlp.parameters()).step(lambda: mlp(x).sum()),
            lambda: torch.optim.Adafactor([mlp.fc1.bias, mlp.fc2.bias], lr=0.1).step(),
            lambda: torch.optim.Adafactor(plain.parameters(), lr=0.1).step(),
        ]
    )
    unchanged = all(
        bool((a == b).all()) for a, b in zip(before[:2], [mlp.fc1.weight, mlp.fc2.weight], strict=False)
    )
    return [*msgs, f"unchanged {unchanged}"]


def test_reducing_optimizers_over_shards_refused(world2) -> None:
    """Before, torch.optim.Adafactor and Muon stepped a ParallelMLP's shards with no error
    (after two steps at lr 0.01 the weights were 0.004 and 0.008 off those of the same
    optimizer on the serial MLP, against 6e-17 for Adam)."""
    msg = r"ValueError: diffcomm\.parallel: torch\.optim\.{} .*shard of the serial `ColumnParallel"
    for msgs in world2.run(_reducing_optimizers):
        assert msgs[3:] == ["no error", "no error", "unchanged True"], msgs
        assert_refused_before_communicating(
            [msgs[:3]], [msg.format("Adafactor"), msg.format("Muon"), msg.format("LBFGS")]
        )


def _dense_then_moe(summed: bool) -> tuple[float, float]:
    """A linear layer then an ``ExpertParallelMoE`` over ``ep`` of a (dp, ep) = 2 x 2 mesh,
    in DDP over ``dp``, each rank half of its replica's tokens (loss divided by the EP
    size); ``summed``: the linear layer's gradients summed over ``ep`` as docs/moe.md
    says. The linear weight's and the router's gradient against the serial model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from diffcomm import parallel as par

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dp, ep = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    torch.manual_seed(0)
    dense = nn.Linear(4, 4, dtype=F64)
    moe = par.MoE(4, 6, 4, 2, shared_expert_size=5, activation="tanh", dtype=F64, seed=3)
    ser = nn.Sequential(copy.deepcopy(dense), moe)
    mine = nn.Sequential(dense, par.ExpertParallelMoE.from_serial(moe, (mesh, "ep")))
    model = DDP(mine, process_group=mesh.get_group("dp"))
    g = torch.Generator().manual_seed(1)
    xs, ts = (torch.randn(2, 8, 4, dtype=F64, generator=g) for _ in range(2))  # [dp, tokens, H]
    F.mse_loss(ser(xs.reshape(-1, 4)), ts.reshape(-1, 4)).backward()
    (F.mse_loss(model(xs[dp].chunk(2)[ep]), ts[dp].chunk(2)[ep]) / 2).backward()
    mine[1].sync_replicated_grads()
    if summed:
        for p in mine[0].parameters():
            p.grad = dc.all_reduce(p.grad, group=(mesh, "ep"))
    return (
        float((mine[0].weight.grad - ser[0].weight.grad).abs().max()),
        float((mine[1].router.weight.grad - moe.router.weight.grad).abs().max()),
    )


def test_layers_outside_an_expert_parallel_moe_sum_over_the_ep_axis(world4) -> None:
    """docs/moe.md, data parallelism over another mesh axis: the layers outside the MoE see
    this rank's tokens, so averaged over ``dp`` only their gradients are each EP rank's
    share (0.06 and 0.12 off the serial ones, no error); summed over ``ep`` too, serial.
    The router (``sync_replicated_grads``) is right either way."""
    for dense, router in world4.run(_dense_then_moe, False):
        assert dense > 0.01 and router < 1e-12
    for dense, router in world4.run(_dense_then_moe, True):
        assert dense < 1e-12 and router < 1e-12
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "moe.md").read_text().split())
    assert "sum them over the expert-parallel group too" in text
