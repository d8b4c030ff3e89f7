"""Tests for diffcomm.rng: named RNG streams, model-parallel seeding, checkpoint replay.

Ranks are simulated in one process: seeding "as tp_rank r" and drawing a dropout mask
is a pure function of (seed, ranks), which is all the cross-rank properties depend on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from diffcomm import rng
from diffcomm.accelerator import Accelerator, get_accelerator
from diffcomm.rng import MODEL_PARALLEL_RNG, RNGStatesTracker


@pytest.fixture(autouse=True)
def _keep_rng_state():
    """Leave the default generators and the default tracker as they were."""
    acc = get_accelerator()
    saved_tracker = rng.get_tracker().get_states()
    with torch.random.fork_rng(devices=[]), acc.fork_rng():
        yield
    rng.get_tracker().set_states(saved_tracker)


@pytest.fixture
def acc() -> Accelerator:
    return get_accelerator()


@pytest.fixture
def tracker(acc: Accelerator) -> RNGStatesTracker:
    return RNGStatesTracker(acc)


def _rand(acc: Accelerator, n: int = 16) -> torch.Tensor:
    return torch.rand(n, device=acc.device())


# ------------------------------------------------------------------------------ tracker


def test_add_rejects_a_used_name_or_seed(tracker: RNGStatesTracker) -> None:
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="name='a' is already added"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed=1 is already used by RNG stream 'a'"):
        tracker.add("b", 1)
    assert tracker.names == ["a"]


@pytest.mark.parametrize(
    ("name", "seed", "match"),
    [(3, 1, "name must be a str"), ("a", 1.0, "seed must be an int"), ("a", True, "seed")],
)
def test_add_checks_types(tracker: RNGStatesTracker, name: object, seed: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        tracker.add(name, seed)  # type: ignore[arg-type]


def test_add_leaves_default_generator_alone(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    state = acc.get_rng_state()
    tracker.add("a", 5)
    assert torch.equal(acc.get_rng_state(), state)


def test_fork_of_unknown_stream_names_the_known_ones(tracker: RNGStatesTracker) -> None:
    tracker.add("a", 1)
    with pytest.raises(KeyError, match=r"no RNG stream named 'b'; known streams: \['a'\]"):
        with tracker.fork("b"):
            pass


def test_fork_draws_from_the_stream_and_advances_it(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    tracker.add("s", 11)
    with tracker.fork("s"):
        first = _rand(acc)
    with tracker.fork("s"):
        second = _rand(acc)
    g = acc.generator(11)
    assert torch.equal(first, torch.rand(16, generator=g, device=acc.device()))
    assert torch.equal(second, torch.rand(16, generator=g, device=acc.device()))


def test_fork_restores_the_default_stream(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    tracker.add("s", 11)
    acc.manual_seed(0)
    expected = [_rand(acc), _rand(acc)]
    acc.manual_seed(0)
    got = [_rand(acc)]
    with tracker.fork("s"):
        _rand(acc, 1000)
    got.append(_rand(acc))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_fork_restores_when_the_block_raises(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    tracker.add("s", 11)
    default_state, stream_state = acc.get_rng_state(), tracker.get_states()["s"]
    with pytest.raises(ZeroDivisionError), tracker.fork("s"):
        _rand(acc)
        raise ZeroDivisionError
    assert torch.equal(acc.get_rng_state(), default_state)
    assert not torch.equal(tracker.get_states()["s"], stream_state)  # the draw counted
    with tracker.fork("s"):  # and the stream is usable again
        pass


def test_forks_nest_across_streams_but_not_within_one(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        with tracker.fork("b"):
            inner = _rand(acc)
        with pytest.raises(RuntimeError, match="already forked"), tracker.fork("a"):
            pass
    assert torch.equal(inner, torch.rand(16, generator=acc.generator(2), device=acc.device()))


def test_get_and_set_states_replay_a_stream(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    tracker.add("s", 3)
    states = tracker.get_states()
    with tracker.fork("s"):
        first = _rand(acc)
    tracker.get_states()["s"].zero_()  # get_states returns copies...
    assert tracker.get_states()["s"].any()
    tracker.set_states(states)
    states["s"].zero_()  # ...and set_states takes copies
    with tracker.fork("s"):
        assert torch.equal(_rand(acc), first)


def _seeded(acc: Accelerator, seed: int) -> torch.Tensor:
    return acc.generator(seed).get_state()


def test_set_states_checks_types(tracker: RNGStatesTracker) -> None:
    with pytest.raises(TypeError, match="states must map"):
        tracker.set_states({"a": [1, 2]})  # type: ignore[dict-item]


def test_reset_forgets_names_and_seeds(tracker: RNGStatesTracker) -> None:
    tracker.add("a", 1)
    tracker.reset()
    assert tracker.names == [] and "a" not in tracker
    tracker.add("a", 1)
    assert "a" in tracker


def test_get_tracker_is_one_shared_tracker() -> None:
    assert rng.get_tracker() is rng.get_tracker()
    assert isinstance(rng.get_tracker(), RNGStatesTracker)


# ------------------------------------------------------------------- model parallel seed


def _masks(tp_rank: int, dp_rank: int = 0, pp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(replicated mask, model-parallel mask) that rank (tp, dp, pp) would draw."""
    acc = get_accelerator()
    tracker = rng.model_parallel_seed(
        1234, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, tracker=RNGStatesTracker(acc)
    )
    ones = torch.ones(4096, device=acc.device())
    replicated = F.dropout(ones, 0.5) != 0
    with tracker.fork():
        sharded = F.dropout(ones, 0.5) != 0
    return replicated, sharded


def test_model_parallel_masks_differ_across_tp_ranks() -> None:
    (rep0, tp0), (rep1, tp1) = _masks(tp_rank=0), _masks(tp_rank=1)
    assert not torch.equal(tp0, tp1)
    assert torch.equal(rep0, rep1)  # the default generator agrees across TP ranks


def test_model_parallel_masks_agree_across_dp_ranks() -> None:
    for tp_rank in (0, 1):
        rep_a, tp_a = _masks(tp_rank, dp_rank=0)
        rep_b, tp_b = _masks(tp_rank, dp_rank=3)
        assert torch.equal(tp_a, tp_b)
        assert torch.equal(rep_a, rep_b)


def test_model_parallel_masks_differ_across_pipeline_stages() -> None:
    (rep0, tp0), (rep1, tp1) = _masks(0, pp_rank=0), _masks(0, pp_rank=1)
    assert not torch.equal(rep0, rep1)
    assert not torch.equal(tp0, tp1)


@pytest.mark.parametrize(("tp_rank", "pp_rank"), [(0, 0), (3, 0), (1, 2)])
def test_model_parallel_seed_formula(acc: Accelerator, tp_rank: int, pp_rank: int) -> None:
    tracker = rng.model_parallel_seed(42, tp_rank, pp_rank=pp_rank, tracker=RNGStatesTracker(acc))
    base = 42 + 100 * pp_rank
    assert acc.initial_seed() == base
    assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], _seeded(acc, base + 2718 + tp_rank))


def test_model_parallel_seed_can_be_called_again(tracker: RNGStatesTracker) -> None:
    rng.model_parallel_seed(1, tp_rank=0, tracker=tracker)
    rng.model_parallel_seed(2, tp_rank=1, tracker=tracker)  # resets, no duplicate error
    assert tracker.names == [MODEL_PARALLEL_RNG]


def test_model_parallel_seed_uses_the_default_tracker() -> None:
    returned = rng.model_parallel_seed(5, tp_rank=0)
    assert returned is rng.get_tracker()
    assert MODEL_PARALLEL_RNG in rng.get_tracker()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": -1, "tp_rank": 0}, ValueError, "seed must be >= 0"),
        ({"seed": 1, "tp_rank": -1}, ValueError, "tp_rank must be >= 0"),
        ({"seed": 1, "tp_rank": 0, "dp_rank": -2}, ValueError, "dp_rank"),
        ({"seed": 1, "tp_rank": 0, "pp_rank": 0.5}, TypeError, "pp_rank must be an int"),
        ({"seed": 1.5, "tp_rank": 0}, TypeError, "seed must be an int"),
    ],
)
def test_model_parallel_seed_validates(
    tracker: RNGStatesTracker, kwargs: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        rng.model_parallel_seed(**kwargs, tracker=tracker)


# ---------------------------------------------------------------------------- checkpoint


def _train_step(mode: str, tracker: RNGStatesTracker) -> tuple[torch.Tensor, torch.Tensor]:
    """Three layers, each with a replicated and a model-parallel dropout.

    Returns the weight gradient and the model-parallel stream state after backward.
    """
    acc = tracker.accelerator
    dev = acc.device()
    rng.model_parallel_seed(7, tp_rank=1, tracker=tracker)
    w = torch.randn(32, 32, device=dev, requires_grad=True)
    x = torch.randn(4, 32, device=dev)

    def layer(h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = F.dropout(h @ w, 0.5)
        with tracker.fork():
            h = F.dropout(torch.tanh(h), 0.5)
        return h * scale

    h = x
    for _ in range(3):
        if mode == "plain":
            h = layer(h, scale=0.5)
        elif mode == "diffcomm":
            h = rng.checkpoint(layer, h, scale=0.5, tracker=tracker)
        else:
            h = torch.utils.checkpoint.checkpoint(layer, h, scale=0.5, use_reentrant=False)
    h.sum().backward()
    return w.grad, tracker.get_states()[MODEL_PARALLEL_RNG]


def test_checkpoint_replays_named_streams(tracker: RNGStatesTracker) -> None:
    grad_plain, state_plain = _train_step("plain", tracker)
    grad_ckpt, state_ckpt = _train_step("diffcomm", tracker)
    assert torch.equal(grad_ckpt, grad_plain)
    assert torch.equal(state_ckpt, state_plain)  # recomputation did not disturb the stream


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_alone_would_not_and_is_refused(tracker: RNGStatesTracker, reentrant: bool) -> None:
    """Why rng.checkpoint exists: torch's recomputation would draw another stream mask (the
    stream has moved on since the forward). That gave a wrong gradient with no error; a
    stream drawn from during backward, outside rng.checkpoint's replay, is now refused."""
    match = r"drawn from during backward.*diffcomm\.rng\.checkpoint"
    if not reentrant:
        with pytest.raises(RuntimeError, match=match):
            _train_step("torch", tracker)
    else:  # (the reentrant variant needs an input that requires grad, and passes no keywords)
        tracker.add("s", 5)
        x = torch.randn(4, 8, requires_grad=True)

        def layer(h: torch.Tensor) -> torch.Tensor:
            with tracker.fork("s"):
                return F.dropout(torch.tanh(h), 0.5)

        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        with pytest.raises(RuntimeError, match=match):
            out.sum().backward()
    assert not tracker._active  # the refused fork left no stream marked active


def test_a_stream_drawn_from_in_a_backward_hook_is_refused(tracker: RNGStatesTracker) -> None:
    tracker.add("s", 3)
    x = torch.ones(4, requires_grad=True)

    def hook(g: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            return F.dropout(g, 0.5)

    x.register_hook(hook)
    with pytest.raises(RuntimeError, match="drawn from during backward"):
        (2 * x).sum().backward()
    with tracker.fork("s"):  # outside backward: as before
        F.dropout(x, 0.5)


def test_checkpoint_replays_on_every_recomputation(acc: Accelerator, tracker: RNGStatesTracker) -> None:
    tracker.add("s", 9)
    w = torch.randn(8, device=acc.device(), requires_grad=True)

    def fn(v: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            return F.dropout(v * w, 0.5)

    x = torch.ones(8, device=acc.device())
    out = rng.checkpoint(fn, x, tracker=tracker)
    mask = out.detach() != 0
    out.sum().backward(retain_graph=True)
    out.sum().backward()  # recomputes again; the mask must be the same both times
    assert torch.equal(w.grad, 2 * 2.0 * x * mask)


def test_checkpoint_with_reentrant_variant(tracker: RNGStatesTracker) -> None:
    acc = tracker.accelerator
    tracker.add("s", 9)
    x = torch.randn(6, 6, device=acc.device(), requires_grad=True)

    def fn(v: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            return F.dropout(v.exp(), 0.5)

    with acc.fork_rng():
        saved = tracker.get_states()
        fn(x).sum().backward()
        expected = x.grad.clone()
        tracker.set_states(saved)
    x.grad = None
    rng.checkpoint(fn, x, tracker=tracker, use_reentrant=True).sum().backward()
    assert torch.equal(x.grad, expected)


def _save_clones(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    """A selective-checkpointing policy that keeps every aten.clone's output."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.aten.clone.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_checkpoint_under_selective_checkpointing_gives_fns_gradient(tracker: RNGStatesTracker) -> None:
    """Selective checkpointing (``context_fn``) matches each recomputed op to the forward's
    by op and count. The replay copied the streams' states with ``aten.clone`` inside the
    recomputation, an op the forward had not run: every clone of ``fn`` after it got the
    saved output of the clone before, so ``a = x.clone()`` came back as
    ``sin(x).clone()`` and the gradient was that of another function, with no error
    (x = 1.0: 1.333 instead of 2 cos(1) = 1.081)."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    tracker.add("s", 3)
    sac = functools.partial(create_selective_checkpoint_contexts, _save_clones)

    def fn(v: torch.Tensor) -> torch.Tensor:
        a = v.clone()
        return a.sin().clone() * 2

    x = torch.linspace(0.1, 1.0, 5, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    (got,) = torch.autograd.grad(rng.checkpoint(fn, x, tracker=tracker, context_fn=sac).sum(), x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(expected, 2 * x.detach().cos())


def test_checkpoint_under_selective_checkpointing_replays_the_streams(tracker: RNGStatesTracker) -> None:
    """The same with dropout from a named stream and from the default generator inside
    ``fn``: the masks of the recomputation are the forward's."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    tracker.add("s", 3)
    sac = functools.partial(create_selective_checkpoint_contexts, _save_clones)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def fn(v: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(v @ w), 0.5)
        with tracker.fork("s"):
            return F.dropout(h.clone().sin(), 0.5)

    x = torch.randn(4, 8, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        saved = tracker.get_states()
        (expected,) = torch.autograd.grad(fn(x).sum(), w)
        tracker.set_states(saved)
    (got,) = torch.autograd.grad(rng.checkpoint(fn, x, tracker=tracker, context_fn=sac).sum(), w)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("preserve", [False, 0, None])
def test_checkpoint_refuses_preserve_rng_state_off(tracker: RNGStatesTracker, preserve: object) -> None:
    """``rng.checkpoint(fn, x, preserve_rng_state=False)`` went to torch, which then did not
    restore the default generator before recomputing ``fn``: its dropout drew another
    mask there than in the forward call, and the weight gradient was off by 3.9 (its
    largest entry 3.3), with no error. Refused before ``fn`` runs."""
    tracker.add("s", 3)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    calls = []

    def fn(v: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return F.dropout(torch.tanh(v @ w), 0.5)

    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rng\.checkpoint\(\): `preserve_rng_state` must be True"):
        rng.checkpoint(fn, x, tracker=tracker, preserve_rng_state=preserve)
    assert not calls
    rng.checkpoint(fn, x, tracker=tracker, preserve_rng_state=True).sum().backward()  # as before


# ------------------------------------------------------------- in-process world's ranks

_MODULE_TRACKER = RNGStatesTracker()  # one per process: shared by an in-process world's ranks


def _seed_then_draw(tracker: RNGStatesTracker | None) -> torch.Tensor:
    """Seed ``tracker`` (default: the module's) as this TP rank, hand over, draw."""
    import diffcomm as dc

    tracker = _MODULE_TRACKER if tracker is None else tracker
    rng.model_parallel_seed(7, tp_rank=dc.get_rank(), tracker=tracker)
    dc.all_reduce(torch.ones(1))  # the other rank runs here (and seeds it too)
    with tracker.fork():
        return torch.rand(4)


def _made_inside() -> torch.Tensor:
    return _seed_then_draw(RNGStatesTracker())


def test_a_tracker_shared_by_in_process_ranks_is_refused(inproc_world2) -> None:
    """A tracker made at module level is one object for every rank of an in-process world
    (each process has its own copy): rank 1's model_parallel_seed reset it under rank 0,
    so rank 0 drew 0.4121 from the stream where a process draws 0.0930, silently. Now an
    error naming the fix; a tracker passed to run() or made inside the function is the
    rank's own and draws what a process draws."""
    from diffcomm._errors import RankError

    with pytest.raises(RankError, match=r"made outside the ranks \(module level\?\)"):
        inproc_world2.run(_seed_then_draw, None)
    expected = [_seeded(get_accelerator(), 7 + 2718 + r) for r in range(2)]
    for got in (inproc_world2.run(_seed_then_draw, RNGStatesTracker()), inproc_world2.run(_made_inside)):
        for r in range(2):
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(expected[r])
                assert torch.equal(got[r], torch.rand(4))


# ------------------------------------------------------------------ save / resume (state_dict)


def _draws(tracker: RNGStatesTracker, acc: Accelerator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stream draw, accelerator default draw, CPU default draw)."""
    with tracker.fork():
        stream = _rand(acc)
    return stream, _rand(acc), torch.rand(4)


def test_state_dict_resumes_the_draws_of_the_uninterrupted_run(
    acc: Accelerator, tracker: RNGStatesTracker
) -> None:
    """A resumed job re-runs model_parallel_seed, which draws the masks of step 0 again;
    loading state_dict() continues where the saving job stood (stream and default
    generators), and a copy: later draws do not change the saved state."""
    rng.model_parallel_seed(3, tp_rank=1, pp_rank=2, tracker=tracker)
    first = _draws(tracker, acc)
    saved = tracker.state_dict()
    want = _draws(tracker, acc)
    _draws(tracker, acc)
    assert list(saved) == ["tp1_pp2"]
    assert {k: v for k, v in saved["tp1_pp2"].items() if isinstance(v, int)} == {
        "seed": 3,
        "tp_rank": 1,
        "pp_rank": 2,
    }
    rng.model_parallel_seed(3, tp_rank=1, pp_rank=2, tracker=tracker)  # the resumed job
    assert all(torch.equal(a, b) for a, b in zip(_draws(tracker, acc), first))  # step 0's again
    rng.model_parallel_seed(3, tp_rank=1, pp_rank=2, tracker=tracker)
    tracker.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(_draws(tracker, acc), want))


def test_load_state_dict_refuses_another_ranks_state(tracker: RNGStatesTracker) -> None:
    """One rank's file loaded on every rank (or DCP of get_states(), which keeps one rank's
    copy) gave every TP rank rank 0's stream: the same dropout masks on every shard."""
    saved = rng.model_parallel_seed(3, tp_rank=0, tracker=tracker).state_dict()
    rng.model_parallel_seed(3, tp_rank=1, tracker=tracker)
    before = tracker.get_states()
    with pytest.raises(ValueError, match=r"this rank is tp1_pp0 .* holds \['tp0_pp0'\].*same dropout masks"):
        tracker.load_state_dict(saved)
    assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], before[MODEL_PARALLEL_RNG])
    rng.model_parallel_seed(3, tp_rank=0, pp_rank=1, tracker=tracker)
    with pytest.raises(ValueError, match="this rank is tp0_pp1"):
        tracker.load_state_dict(saved)


def test_load_state_dict_refuses_other_streams(tracker: RNGStatesTracker) -> None:
    saved = rng.model_parallel_seed(3, tp_rank=0, tracker=tracker).state_dict()
    rng.model_parallel_seed(3, tp_rank=0, tracker=tracker)
    tracker.add("experts", 99)
    with pytest.raises(ValueError, match=r"saved streams \['model-parallel'\] are not the tracker's"):
        tracker.load_state_dict(saved)


def test_state_dict_needs_model_parallel_seed(tracker: RNGStatesTracker) -> None:
    tracker.add("a", 1)
    for call in (tracker.state_dict, lambda: tracker.load_state_dict({})):
        with pytest.raises(RuntimeError, match="not seeded by diffcomm.rng.model_parallel_seed"):
            call()
    rng.model_parallel_seed(3, tp_rank=0, tracker=tracker)
    tracker.reset()
    with pytest.raises(RuntimeError, match="not seeded"):
        tracker.state_dict()


def _dcp_round_trip(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Save the rank's RNG state with torch.distributed.checkpoint, resume, draw."""
    import torch.distributed.checkpoint as dcp

    import diffcomm as dc

    tracker = rng.model_parallel_seed(1, tp_rank=dc.get_rank())
    dcp.save({"rng": tracker.state_dict()}, checkpoint_id=path)
    with tracker.fork():
        want = torch.rand(8)
    rng.model_parallel_seed(1, tp_rank=dc.get_rank())
    with tracker.fork():
        torch.rand(8)  # the resumed job moved on before loading
    state = {"rng": tracker.state_dict()}
    dcp.load(state, checkpoint_id=path)
    tracker.load_state_dict(state["rng"])
    with tracker.fork():
        return want, torch.rand(8)


def test_dcp_of_the_rng_state_keeps_each_tp_ranks_stream(inproc_world2, tmp_path) -> None:
    """DCP keeps one copy of a key every rank saves: get_states() under one key came back
    as rank 0's on every rank (the same masks on both TP ranks, silently). state_dict()
    is keyed by the rank, so each gets its own stream back."""
    got = inproc_world2.run(_dcp_round_trip, str(tmp_path / "ck"))
    for want, drawn in got:
        assert torch.equal(want, drawn)
    assert not torch.equal(got[0][1], got[1][1])


def _seed_in_one_run() -> None:
    import diffcomm as dc

    rng.model_parallel_seed(5, tp_rank=dc.get_rank())


def _draw_in_the_next_run() -> tuple[list[str], torch.Tensor]:
    with rng.get_tracker().fork():
        return rng.get_tracker().names, torch.rand(4)


def test_in_process_tracker_is_per_rank_across_runs(inproc_world2) -> None:
    """The default tracker of an in-process rank keeps its own streams between run()
    calls, as a process's does."""
    inproc_world2.run(_seed_in_one_run)
    got = inproc_world2.run(_draw_in_the_next_run)
    for r in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(_seeded(get_accelerator(), 5 + 2718 + r))
            assert got[r][0] == [MODEL_PARALLEL_RNG]
            assert torch.equal(got[r][1], torch.rand(4))


def _dcp_round_trip_tp2_dp2(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TP=2 x DP=2: draw, save with DCP, resume, draw (stream, default generator)."""
    import torch.distributed.checkpoint as dcp

    import diffcomm as dc

    tp, dp = dc.get_rank() % 2, dc.get_rank() // 2
    tracker = rng.model_parallel_seed(1, tp_rank=tp, dp_rank=dp)
    with tracker.fork():
        torch.rand(5)
    torch.rand(7)
    dcp.save({"rng": tracker.state_dict()}, checkpoint_id=path)
    rng.model_parallel_seed(1, tp_rank=tp, dp_rank=dp)
    state = {"rng": tracker.state_dict()}
    dcp.load(state, checkpoint_id=path)
    tracker.load_state_dict(state["rng"])
    with tracker.fork():
        stream = torch.rand(3)
    return stream, torch.rand(3)


def test_resumed_streams_agree_across_dp_and_differ_across_tp(world4, tmp_path) -> None:
    """gloo processes, TP=2 x DP=2, through torch.distributed.checkpoint: after the resume
    the model-parallel stream agrees across DP replicas and differs across TP ranks, and
    the default generator agrees everywhere."""
    out = world4.run(_dcp_round_trip_tp2_dp2, str(tmp_path / "ck"))
    assert torch.equal(out[0][0], out[2][0]) and torch.equal(out[1][0], out[3][0])
    assert not torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(out[0][1], o[1]) for o in out)
