"""A weight shared by pipeline stages (the tied LM: the input embedding's weight reused as
the output projection) against the serial float64 model.

``partition`` records the parameters several stages use; the runner sums their gradients
over the ranks holding those stages after every step (a use inside one rank is already
summed by autograd, and must not be summed twice), and ``grad_norm`` / ``clip_grad_norm_``
with ``pipeline_group=`` count them once. Before, each rank kept its own part of the
gradient (the embedding's or the head's), the norm counted the weight on both ranks, and
the copies drifted apart after the first optimizer step.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm import parallel as par
from diffcomm.ops import wire
from diffcomm.pipeline import PipelineRunner, partition

pytestmark = pytest.mark.diffcomm_in_process

VOCAB, DIM = 11, 6


class _Head(nn.Module):
    """The output projection: the embedding's weight, transposed (a tied LM head)."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.emb.weight)


def _tied_lm(n_stages: int) -> nn.Sequential:
    """``2 * n_stages`` layers, two per stage: the embedding in stage 0, its head in the
    last; with 4 stages or more also a ``Linear`` (``shared``) used in stage 0 and in stage
    ``n_stages - 2`` (a module used twice)."""
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
    shared = nn.Linear(DIM, DIM, dtype=torch.float64)
    layers: list[nn.Module] = [emb, shared]
    for s in range(1, n_stages - 1):
        inner = shared if s == n_stages - 2 else nn.Linear(DIM, DIM, dtype=torch.float64)
        layers += [nn.Tanh(), inner]
    layers += [nn.Tanh(), _Head(emb)]
    return nn.Sequential(*layers)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _parts(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the tie's warning (its own test below)
        return partition(model, n_stages, balance=[2] * n_stages)


def _mine(parts: list[nn.Sequential], schedule: str, rank: int, n: int) -> list[nn.Sequential]:
    if schedule == "zbv":
        return [parts[rank], parts[2 * n - 1 - rank]]
    return parts[rank::n]


class _Wrapper(nn.Module):
    """A stage inside a module of the user's (as a wrapper holds it): the tie is still found."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _tied_training(schedule: str, v: int, wrap: bool = False) -> dict[int, torch.Tensor]:
    """Two optimizer steps, each of two accumulated runner steps, against the serial model:
    every gradient, the clipped norm, and the parameters after each optimizer step. Returns
    the tied parameters this rank holds (by tie), for the copies to be compared."""
    rank, n = dist.get_rank(), dist.get_world_size()
    n_stages = n * v
    model = _tied_lm(n_stages)
    serial = copy.deepcopy(model)  # (keeps the ties)
    mine = _mine(_parts(model, n_stages), schedule, rank, n)
    ref = _mine(_parts(serial, n_stages), schedule, rank, n)
    run: list[nn.Module] = [_Wrapper(c) for c in mine] if wrap else list(mine)
    runner = PipelineRunner(run if len(run) > 1 else run[0], schedule, loss_fn=_lm_loss)
    stage, serial_stage = nn.ModuleList(run), nn.ModuleList(ref)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.9)
    opt_ref = torch.optim.SGD(serial.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        ids = torch.randint(VOCAB, (8, 5), generator=g)
        tgt = torch.randint(VOCAB, (8, 5), generator=g)
        for half in (slice(0, 4), slice(4, 8)):  # gradients accumulate over two steps
            loss = runner.step(ids[half], tgt[half], n_micro=2)
            ref_loss = _lm_loss(serial(ids[half]), tgt[half])
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-13, atol=1e-15)
        for (name, p), q in zip(stage.named_parameters(), serial_stage.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=f"{name}'s gradient")
        norm = par.grad_norm(stage, pipeline_group=dist.group.WORLD)
        total = par.clip_grad_norm_(stage, 0.05, pipeline_group=dist.group.WORLD)
        ref_total = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_total, rtol=1e-12, atol=0)
        torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=0)
        for p, q in zip(stage.parameters(), serial_stage.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        for p, q in zip(stage.parameters(), serial_stage.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert wire.SENDS.pending() == 0
    held: dict[int, torch.Tensor] = {}
    for chunk in mine:
        for tie, _, name in chunk.partition_ties:
            held[tie] = chunk.get_parameter(name).detach().clone()
    return held


@pytest.mark.parametrize(
    ("schedule", "v", "n"),
    [
        ("1f1b", 1, 2),  # the embedding on rank 0, the head on rank 1
        ("1f1b", 1, 4),  # embedding: ranks 0 and 3; the shared Linear: ranks 0 and 2
        ("zb-h1", 1, 2),  # the backward split into I and W
        ("interleaved", 2, 2),  # embedding: ranks 0 and 1; the Linear: stages 0 and 2, both rank 0
        ("interleaved", 2, 4),  # embedding: stages 0 and 7 (ranks 0, 3); Linear: 0 and 6 (ranks 0, 2)
        ("zbv", 2, 2),  # embedding: stages 0 and 3, both rank 0; the Linear: ranks 0 and 1
    ],
)
def test_a_weight_tied_across_stages_gets_the_serial_gradient(
    local_worlds: Callable[[int], dc.LocalWorld], schedule: str, v: int, n: int
) -> None:
    """Each copy of a tied weight holds the serial gradient after every step (the sum of
    its stages' parts, accumulated over steps with each part counted once), a use within
    one rank is not summed twice, the norm counts it once (torch's clip_grad_norm_ of the
    serial model to 1e-12), and the copies stay bitwise equal after optimizer steps.
    Before: 1f1b at 2 ranks left the embedding's gradient on rank 0 and the head's on rank
    1 (neither the serial sum), and the norm counted the weight twice."""
    held = local_worlds(n).run(_tied_training, schedule, v)
    by_tie: dict[int, list[torch.Tensor]] = {}
    for per_rank in held:
        for tie, value in per_rank.items():
            by_tie.setdefault(tie, []).append(value)
    assert by_tie, "the model has tied weights"
    for tie, copies in by_tie.items():
        assert all(torch.equal(c, copies[0]) for c in copies), f"tie {tie}: copies differ"


def test_partition_records_ties_and_its_warning_says_what_the_runner_does() -> None:
    """The tie is recorded on every stage using it (the runner and grad_norm read it), and
    the warning no longer tells the runner's users to all-reduce the gradient by hand —
    which, now that the runner sums it, would count it twice."""
    model = _tied_lm(4)
    with pytest.warns(UserWarning) as record:
        parts = partition(model, 4, balance=[2] * 4)
    text = str(record[0].message)
    assert "PipelineRunner.step sums it over those ranks" in text
    assert "do not all-reduce it again" in text
    assert "dc.all_reduce(p.grad" not in text
    emb, shared = model[0].weight, model[1].weight
    assert [(t, s) for t, s, _ in parts[0].partition_ties] == [(0, (0, 3)), (1, (0, 2)), (2, (0, 2))]
    assert parts[0].get_parameter(parts[0].partition_ties[0][2]) is emb
    assert parts[0].get_parameter(parts[0].partition_ties[1][2]) is shared
    assert [(t, s) for t, s, _ in parts[1].partition_ties] == []
    assert [(t, s) for t, s, _ in parts[2].partition_ties] == [(1, (0, 2)), (2, (0, 2))]
    assert [(t, s) for t, s, _ in parts[3].partition_ties] == [(0, (0, 3))]
    assert parts[3].get_parameter(parts[3].partition_ties[0][2]) is emb


@pytest.mark.diffcomm_in_process(False)
def test_a_tied_weight_is_exchanged_between_processes(world2: dc.LocalWorld) -> None:
    """The exchange over real transport (gloo processes): the same numbers as in-process,
    and no send left pending."""
    held = world2.run(_tied_training, "1f1b", 1)
    assert torch.equal(held[0][0], held[1][0])


def test_a_stage_inside_a_wrapper_still_sums_its_tie(world2: dc.LocalWorld) -> None:
    """The runner finds partition's record inside a module wrapping the stage, as
    grad_norm does (otherwise grad_norm counted the weight once while the runner left each
    rank its part: a silently wrong norm and gradient)."""
    held = world2.run(_tied_training, "1f1b", 1, True)
    assert torch.equal(held[0][0], held[1][0])


def _stages_at_other_positions() -> str:
    model = _tied_lm(4)
    parts = _parts(model, 4)
    r = dist.get_rank()
    try:  # two partition stages in one chunk: their stages are no placement's
        PipelineRunner(nn.Sequential(parts[2 * r], parts[2 * r + 1]), "1f1b", loss_fn=_lm_loss)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_tie_in_stages_the_placement_does_not_run_is_refused(world2: dc.LocalWorld) -> None:
    """A tie recorded by partition(model, 4) in a chunk that joins two of its stages, on 2
    ranks: its stages cannot be mapped to ranks; a ValueError before any communication
    (instead of a guess at which ranks hold it)."""
    for msg in world2.run(_stages_at_other_positions):
        assert "`stage` must be chunks that are partition(model, 2) stages" in msg, msg
        assert "partition's stage 0 of 4 in chunk 0" in msg or "partition's stage 2 of 4" in msg, msg


def _top_tag() -> str:
    r, n = dist.get_rank(), dist.get_world_size()
    mine = _parts(_tied_lm(n), n)[r]  # 4 ranks: the embedding's tie on ranks 0 and 3 only
    try:
        PipelineRunner(mine, "1f1b", loss_fn=_lm_loss, tag=wire.MAX_TAG - 1)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_the_tied_weights_tag_is_refused_on_every_rank(world4: dc.LocalWorld) -> None:
    """The tag after the chunks' carries the tied weights' gradients; the largest ``tag``
    is refused on every rank, also on those holding no tie (a bound only the ranks
    holding one knew would leave the others running into the step, waiting)."""
    for msg in world4.run(_top_tag):
        assert f"`tag` must be an int <= {wire.MAX_TAG - 2}" in msg, msg


def _three_uses(schedule: str) -> float:
    """One Linear at stages 0, 2 and 3 of 4 on 2 ranks: two of its uses on one rank (summed
    there by autograd, once), the third on the other."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    a = nn.Linear(4, 4, dtype=torch.float64)
    model = nn.Sequential(
        a, nn.Tanh(), nn.Linear(4, 4, dtype=torch.float64), nn.Tanh(), a, nn.Tanh(), a, nn.Tanh()
    )
    serial = copy.deepcopy(model)
    mine = _mine(_parts(model, 4), schedule, r, n)
    ref = _mine(_parts(serial, 4), schedule, r, n)
    runner = PipelineRunner(mine, schedule, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(8, 4, dtype=torch.float64, generator=g),
        torch.randn(8, 4, dtype=torch.float64, generator=g),
    )
    runner.step(x, y, n_micro=2)
    nn.functional.mse_loss(serial(x), y).backward()
    pairs = zip(nn.ModuleList(mine).parameters(), nn.ModuleList(ref).parameters(), strict=True)
    return max(float((p.grad - q.grad).abs().max()) for p, q in pairs)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_weight_used_twice_on_one_rank_and_once_on_another(world2: dc.LocalWorld, schedule: str) -> None:
    """Exchanged once per rank, not per use: rank 0 (interleaved: stages 0, 2; ZB-V: 0, 3)
    sends the sum of its two uses, rank 1 its one; both get the serial gradient."""
    for err in world2.run(_three_uses, schedule):
        assert err < 1e-12, err


class _SerialVocabLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, dtype=torch.float64)
        self.mid = nn.Linear(4, 4, dtype=torch.float64)
        self.head = nn.Linear(4, 8, bias=False, dtype=torch.float64)
        self.head.weight = self.emb.weight


def _tensor_parallel_tie() -> dict[str, float]:
    """World 4 as pp x tp = 2 x 2: a vocab-parallel embedding (stage 0) tied to a
    column-parallel head (stage 1), each a shard over tp; the pipelines run over pp."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp, pp = (mesh, "tp"), (mesh, "pp")
    torch.manual_seed(0)
    serial = _SerialVocabLM()
    emb = par.VocabParallelEmbedding.from_serial(serial.emb, group=tp)
    head = par.ColumnParallelLinear.from_serial(serial.head, group=tp)
    head.weight = emb.weight
    stage = _parts(nn.Sequential(emb, nn.Tanh(), copy.deepcopy(serial.mid), head), 2)[
        mesh.get_local_rank("pp")
    ]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return par.vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group=tp
        )

    runner = PipelineRunner(stage, "1f1b", group=pp, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(8, (4, 3), generator=g), torch.randint(8, (4, 3), generator=g)
    loss = runner.step(ids, tgt, n_micro=2)
    logits = nn.functional.linear(serial.mid(torch.tanh(serial.emb(ids))), serial.emb.weight)
    ref = nn.functional.cross_entropy(logits.reshape(-1, 8), tgt.reshape(-1))
    ref.backward()
    t = mesh.get_local_rank("tp")
    tied = emb.weight if mesh.get_local_rank("pp") == 0 else head.weight
    norm = par.grad_norm(stage, group=tp, pipeline_group=pp)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in serial.parameters() if p.grad is not None])
    return {
        "loss": float((loss - ref.detach()).abs()),
        "tied": float((tied.grad - serial.emb.weight.grad[4 * t : 4 * (t + 1)]).abs().max()),  # type: ignore[index, operator]
        "norm": float((norm - ref_norm).abs()),
    }


def test_a_tensor_parallel_weight_tied_across_stages(local_worlds: Callable[[int], dc.LocalWorld]) -> None:
    """The tied LM with tensor parallelism inside the stages: each tp rank's shard of the
    tied weight is summed over its pipeline (pp) ranks, and the norm (sharded over tp,
    staged over pp) counts it once: the serial model's, to 1e-12."""
    for res in local_worlds(4).run(_tensor_parallel_tie):
        assert max(res.values()) < 1e-12, res


def _chunks_copied_apart(schedule: str) -> list[float]:
    """One Linear used at all 4 stages of 2 ranks, each rank's two chunks deep-copied one by
    one (as to move each to its device): on a rank, the tie is two parameter objects that
    autograd does not add up. Returns the largest gradient error and the norm's error."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    a = nn.Linear(4, 4, dtype=torch.float64)
    model = nn.Sequential(*[m for _ in range(4) for m in (a, nn.Tanh())])
    serial = copy.deepcopy(model)
    mine = [copy.deepcopy(c) for c in _mine(_parts(model, 4), schedule, r, n)]
    ref = _mine(_parts(serial, 4), schedule, r, n)
    runner = PipelineRunner(mine, schedule, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(8, 4, dtype=torch.float64, generator=g) for _ in range(2))
    for half in (slice(0, 4), slice(4, 8)):  # accumulated over two steps
        runner.step(x[half], y[half], n_micro=2)
        nn.functional.mse_loss(serial(x[half]), y[half]).backward()
    pairs = [(p, q) for c, s in zip(mine, ref) for p, q in zip(c.parameters(), s.parameters(), strict=True)]
    norm = par.grad_norm(nn.ModuleList(mine), pipeline_group=dist.group.WORLD)
    ref_norm = torch.nn.utils.get_total_norm([q.grad for q in serial.parameters()])
    return [max(float((p.grad - q.grad).abs().max()) for p, q in pairs), float((norm - ref_norm).abs())]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_chunks_copied_apart_on_one_rank_still_sum_their_tie(world2: dc.LocalWorld, schedule: str) -> None:
    """Each copy of the tie on a rank gets the serial gradient and the norm counts it once.
    Before: the runner summed only the first chunk's copy, the second kept its own part
    (gradient error 0.83 after two accumulated steps, interleaved and ZB-V alike; 1.2 in
    the parameters after two SGD steps), and grad_norm counted the second copy again."""
    for grad_err, norm_err in world2.run(_chunks_copied_apart, schedule):
        assert grad_err < 1e-12, grad_err
        assert norm_err < 1e-12, norm_err


class _SideBranch(nn.Module):
    """``x + a(x)``, the branch without gradient when ``off`` (its module's forward under
    ``torch.no_grad``, as a weight frozen for some steps): the tied ``a`` gets none."""

    def __init__(self, a: nn.Module) -> None:
        super().__init__()
        self.a, self.off = a, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.off):
            y = self.a(x)
        return x + y


def _tie_without_gradient_for_a_step() -> dict[str, object]:
    """A Linear tied between stages 0 and 1 of 2 ranks, without gradient anywhere at the
    second of two AdamW steps: its gradient stays None (AdamW skips it, as serially)."""
    r = dist.get_rank()
    torch.manual_seed(0)
    a = nn.Linear(4, 4, dtype=torch.float64)
    model = nn.Sequential(
        _SideBranch(a),
        nn.Linear(4, 4, dtype=torch.float64),
        _SideBranch(a),
        nn.Linear(4, 4, dtype=torch.float64),
    )
    serial = copy.deepcopy(model)
    mine, ref = _parts(model, 2)[r], _parts(serial, 2)[r]
    runner = PipelineRunner(mine, "1f1b", loss_fn=nn.functional.mse_loss)
    opt, opt_ref = (
        torch.optim.AdamW(mine.parameters(), lr=0.1),
        torch.optim.AdamW(serial.parameters(), lr=0.1),
    )
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        for m in [*model.modules(), *serial.modules()]:
            if isinstance(m, _SideBranch):
                m.off = step == 1
        x, y = (torch.randn(4, 4, dtype=torch.float64, generator=g) for _ in range(2))
        runner.step(x, y, n_micro=2)
        nn.functional.mse_loss(serial(x), y).backward()
        grads = {n: p.grad is None for n, p in mine.named_parameters() if ".a." in f".{n}"}
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    err = max(float((p - q).abs().max()) for p, q in zip(mine.parameters(), ref.parameters(), strict=True))
    return {"tied grad is None at step 2": grads, "weights": err}


def test_a_tie_without_gradient_anywhere_keeps_none(world2: dc.LocalWorld) -> None:
    """Before: the runner gave the tie a zero gradient on every rank holding it (each sent
    zeros for its missing part), so AdamW decayed and moved the tied weight (0.067 from the
    serial model after the step) where the serial model's gradient is None and AdamW skips
    it. Now the ranks tell each other first which ties got a part."""
    for res in world2.run(_tie_without_gradient_for_a_step):
        assert all(res["tied grad is None at step 2"].values()), res  # type: ignore[attr-defined]
        assert res["weights"] < 1e-12, res


def _tie_frozen_on_one_rank(n: int) -> dict[str, object]:
    """The embedding tied between the first and the last stage, frozen (``requires_grad=
    False``) on the last rank only: the step is refused on both holders, after its loss
    broadcast (no rank waits); frozen on both, the next step trains the rest as serially."""
    rank = dist.get_rank()
    model = _tied_lm(n)
    serial = copy.deepcopy(model)
    mine, ref = _parts(model, n)[rank], _parts(serial, n)[rank]
    runner = PipelineRunner(mine, "1f1b", loss_fn=_lm_loss)
    tied = {name for _, _, name in mine.partition_ties if mine.get_parameter(name) is model[0].weight}
    g = torch.Generator().manual_seed(3)
    ids, tgt = torch.randint(VOCAB, (4, 5), generator=g), torch.randint(VOCAB, (4, 5), generator=g)
    if rank == n - 1:
        for name in tied:
            mine.get_parameter(name).requires_grad_(False)
    error = None
    try:
        runner.step(ids, tgt, n_micro=2)
    except ValueError as e:
        error = str(e)
    for p in [*model.parameters(), *serial.parameters()]:
        p.grad = None
    model[0].weight.requires_grad_(False)  # the embedding, now frozen on every rank
    serial[0].weight.requires_grad_(False)
    loss = runner.step(ids, tgt, n_micro=2)
    _lm_loss(serial(ids), tgt).backward()
    err = (
        max(
            float((p.grad - q.grad).abs().max())
            for p, q in zip(mine.parameters(), ref.parameters(), strict=True)
            if q.grad is not None
        )
        if any(q.grad is not None for q in ref.parameters())
        else 0.0
    )
    frozen = [mine.get_parameter(name).grad is None for name in tied]
    return {"error": error, "loss": float(loss), "grads": err, "frozen tie without grad": frozen}


@pytest.mark.parametrize("n", [2, 4])
def test_a_tie_frozen_on_one_rank_only_is_refused_on_every_holder(n: int) -> None:
    """Before: the frozen copy (the head's, rank ``n-1``) kept its weight while rank 0's
    copy got the summed gradient and moved: the copies drifted apart silently. Now every
    rank holding the tie raises a ValueError naming it, and the ranks stay in step."""
    with dc.LocalWorld(n, in_process=True) as world:
        results = world.run(_tie_frozen_on_one_rank, n)
    for rank, res in enumerate(results):
        if rank in (0, n - 1):
            error = str(res["error"])
            assert "`requires_grad` must be the same on every copy of a weight tied across stages" in error
            assert f"tie 0 (held by ranks [0, {n - 1}]" in error, error
            assert f"requires grad on rank(s) [0] and is frozen on rank(s) [{n - 1}]" in error, error
        else:  # (holds no tie: it finished its step)
            assert res["error"] is None, res
        assert res["grads"] < 1e-12, res
        assert all(res["frozen tie without grad"]), res  # type: ignore[attr-defined]
    assert len({r["loss"] for r in results}) == 1


# --------------------------------------------------------------------------------------
# stages cut by hand: one Parameter in two chunks of a rank; running statistics shared
# --------------------------------------------------------------------------------------


def _hand_cut_sharing(schedule: str, grad_first: object) -> float:
    """Chunks built by hand (no ``partition``), the same ``Linear`` (one Parameter object)
    in two chunks of one rank: virtual stages 0 and 2 of the interleaved placement (rank
    0), 0 and 3 and 1 and 2 of the V placement. The worst gradient difference from the
    serial float64 model."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    lins = [nn.Linear(DIM, DIM, dtype=torch.float64) for _ in range(2 * n)]
    for a, b in [(0, 2)] if schedule == "interleaved" else [(0, 3), (1, 2)]:
        lins[b] = lins[a]
    stages = [nn.Sequential(lin, nn.Tanh()) for lin in lins]
    serial = copy.deepcopy(nn.Sequential(*stages))  # (keeps the sharing)
    pick = (lambda s: s[rank::n]) if schedule == "interleaved" else (lambda s: [s[rank], s[2 * n - 1 - rank]])
    mine, ref = pick(stages), pick(list(serial))
    runner = PipelineRunner(mine, schedule, loss_fn=nn.functional.mse_loss, grad_first=grad_first)
    g = torch.Generator().manual_seed(1)
    x, t = (torch.randn(8, DIM, dtype=torch.float64, generator=g) for _ in range(2))
    runner.step(x, t, n_micro=4)
    nn.functional.mse_loss(serial(x), t).backward()
    return max(
        float((p.grad - q.grad).abs().max())
        for c, sc in zip(mine, ref, strict=True)
        for p, q in zip(c.parameters(), sc.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("schedule", "grad_first"),
    [("interleaved", None), ("interleaved", True), ("zbv", None), ("dualpipev", True)],
)
def test_hand_cut_chunks_sharing_a_parameter_on_one_rank(
    world2: dc.LocalWorld, schedule: str, grad_first: object
) -> None:
    """A Parameter object in two chunks of one rank (stages cut by hand: nothing recorded)
    gets the serial gradient, its two uses summed once by autograd in the one ``.grad``,
    also with the backward split into I and W (5.6e-17). A tie across ranks of stages cut
    by hand is two parameters to the runner (docs/pipeline.md)."""
    assert max(world2.run(_hand_cut_sharing, schedule, grad_first)) < 1e-14


def _shared_batch_norm(shares: list[tuple[int, int]], n_micro: int, hand: bool, train: bool = True) -> str:
    """Four stages of ``Linear, BatchNorm1d``, interleaved on 2 ranks, each pair of
    ``shares`` one BatchNorm1d (stages 0 and 1: on two ranks; 0 and 2: on rank 0), cut by
    ``partition`` or by hand: the step's outcome, and whether the first shared running mean
    equals the serial model's, run micro-batch after micro-batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    norms = [nn.BatchNorm1d(DIM, dtype=torch.float64) for _ in range(4)]
    for a, b in shares:
        norms[b] = norms[a]
    layers: list[nn.Module] = []
    for s in range(4):
        layers += [nn.Linear(DIM, DIM, dtype=torch.float64), norms[s]]
    model = nn.Sequential(*layers).train(train)
    serial = copy.deepcopy(model)
    parts = [nn.Sequential(*layers[2 * s : 2 * s + 2]) for s in range(4)] if hand else _parts(model, 4)
    runner = PipelineRunner(parts[rank::n], "interleaved", loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, t = (torch.randn(8, DIM, dtype=torch.float64, generator=g) for _ in range(2))
    bn = norms[shares[0][0]]
    before = bn.running_mean.clone()
    try:
        runner.step(x, t, n_micro=n_micro)
    except ValueError as e:
        return f"refused {torch.equal(before, bn.running_mean)}: {e}"
    for xm in x.chunk(n_micro):
        serial(xm)
    if not any(bn is m for c in parts[rank::n] for m in c.modules()):
        return "ran (not held)"
    return f"ran {float((bn.running_mean - serial[2 * shares[0][0] + 1].running_mean).abs().max()):.1e}"


def test_running_statistics_shared_by_stages_refused(world2: dc.LocalWorld) -> None:
    """Before, a BatchNorm1d used in stages 0 and 1 (on two ranks) left each rank's copy of
    its running mean with its own stage's update only: 0.028 and 0.032 off the serial one
    after one step, no error; in stages 0 and 2 of rank 0 with n_micro=2 / 4, updated in
    the schedule's order: 0.005 / 0.009 off a serial run of the micro-batches. Now refused
    by ``step`` before any communication, on both ranks (recorded by ``partition``; cut by
    hand, seen by the rank holding both uses); with one micro-batch on one rank, or in
    eval mode, it runs and equals serial."""
    refused = (
        r"refused True: diffcomm\.PipelineRunner\.step\(\): .* running statistics in training "
        r"mode in the virtual stages \[{}\], {}"
    )
    for res in world2.run(_shared_batch_norm, [(0, 1)], 1, False):
        assert re.match(refused.format("0, 1", r"on the ranks \[0, 1\]"), res), res
    for res in world2.run(_shared_batch_norm, [(0, 2)], 2, False):
        assert re.match(refused.format("0, 2", r"on rank 0 with n_micro=2"), res), res
    rank0, rank1 = world2.run(_shared_batch_norm, [(0, 2), (1, 3)], 4, True)  # by hand: each its own
    assert re.match(refused.format("0, 2", r"on rank 0 with n_micro=4"), rank0), rank0
    assert re.match(refused.format("1, 3", r"on rank 1 with n_micro=4"), rank1), rank1
    for shares, n_micro, hand, train in [([(0, 2)], 1, False, True), ([(0, 2)], 1, True, True)] + [
        ([(0, 1)], 2, False, False)
    ]:
        res = world2.run(_shared_batch_norm, shares, n_micro, hand, train)
        assert res[0] == "ran 0.0e+00" and res[1] in ("ran 0.0e+00", "ran (not held)"), res
