"""``parallel.vocab_parallel_cross_entropy`` with uneven vocabulary shards and with padding
columns (``vocab_size=``), against ``F.cross_entropy`` of the serial float64 model.

Uneven shards are contiguous in rank order (rank ``r`` holds ``[s_r, s_r + v_r)``, the
layout of ``dc.all_gather`` / ``dc.scatter`` with ``split_sizes``). Before: every rank took
its shard to start at ``r * v_r`` and the vocabulary to be ``v_r * world`` (world 3,
vocabulary 10 as ``[4, 3, 3]``: loss 3.3836 for F.cross_entropy's 3.8540, and with label
smoothing a different loss on rank 0 than on ranks 1-2; ``[4, 4, 2]``: a valid target id 7
refused on one rank only, the others waiting in the max all_reduce).

The head is a serial ``nn.Linear`` cut by rows: ``copy_to_region`` (the input's gradient
summed over the group) then this rank's rows, as a ColumnParallelLinear without
``gather_output`` computes them (which itself takes only even shards).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _shared import outcomes
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import diffcomm as dc
from diffcomm import parallel as P
from diffcomm.backend import log_comms

pytestmark = pytest.mark.diffcomm_in_process

F64 = torch.float64
HIDDEN = 3


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, local_worlds: Callable[..., dc.LocalWorld]) -> dc.LocalWorld:
    return local_worlds(request.param)


def _ce_case(case: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: the loss and the gradients of the logits shard, the head's
    rows and the input, from the sharded head and from the serial float64 model."""
    r = dc.get_rank()
    sizes, tokens, vocab = case["sizes"], case["tokens"], case.get("vocab_size")
    total = sum(sizes)
    true_v = total if vocab is None else vocab
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(*tokens, HIDDEN, generator=g, dtype=F64)
    w = torch.randn(total, HIDDEN, generator=g, dtype=F64)
    b = torch.randn(total, generator=g, dtype=F64)
    b[true_v:] += case.get("pad_bias", 0.0)  # padding logits far above the real ones
    target = torch.randint(0, max(true_v, 1), tokens, generator=g)
    ignored = torch.rand(tokens, generator=g) < case["ignore_frac"]
    target[ignored] = case["ignore_index"]
    kw = {
        "label_smoothing": case["smoothing"],
        "reduction": case["reduction"],
        "ignore_index": case["ignore_index"],
    }

    # serial: the full head, the padding columns cut off
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    z_full = F.linear(xs, ws, bs)
    z_full.retain_grad()
    ref = F.cross_entropy(z_full[..., :true_v].reshape(-1, true_v), target.reshape(-1), **kw)
    ref = ref.reshape(tokens) if case["reduction"] == "none" else ref
    cot = torch.randn(ref.shape, generator=g, dtype=F64)  # the same on every rank (replicated)
    ref.backward(cot)

    # parallel: this rank's rows of the head
    s = sum(sizes[:r])
    xp = x.clone().requires_grad_()
    wp, bp = (t[s : s + sizes[r]].clone().requires_grad_() for t in (w, b))
    zp = F.linear(P.copy_to_region(xp), wp, bp)
    zp.retain_grad()
    padding = {} if vocab is None else {"vocab_size": vocab}
    loss = P.vocab_parallel_cross_entropy(zp, target, **padding, **kw)
    loss.backward(cot)
    rows = slice(s, s + sizes[r])
    return {
        "loss": (loss.detach(), ref.detach()),
        "d_logits": (zp.grad, z_full.grad[..., rows]),
        "d_weight": (wp.grad, ws.grad[rows]),
        "d_bias": (bp.grad, bs.grad[rows]),
        "d_input": (xp.grad, xs.grad),
    }


def _run_cases(world: dc.LocalWorld, cases: list[dict[str, Any]]) -> None:
    def all_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [_ce_case(c) for c in cases]

    for rank, per_case in enumerate(world.run(all_cases, cases)):
        for case, got in zip(cases, per_case, strict=True):
            for key, (a, b) in got.items():
                assert_close(
                    a,
                    b,
                    rtol=1e-10,
                    atol=1e-12,
                    equal_nan=True,
                    msg=lambda m, where=f"{key} {case} rank {rank}": f"{where}: {m}",
                )


def _base(**kw: Any) -> dict[str, Any]:
    case = {
        "tokens": (2, 3),
        "seed": 0,
        "smoothing": 0.0,
        "reduction": "mean",
        "ignore_index": -100,
        "ignore_frac": 0.2,
    }
    return {**case, **kw}


#: uneven layouts per world size: torch.tensor_split's, torch.chunk's, one with an empty shard
_UNEVEN = {
    1: [[10]],
    2: [[6, 4], [1, 9]],
    3: [[4, 3, 3], [4, 4, 2], [0, 5, 5], [5, 0, 5]],
    4: [[3, 3, 2, 2], [3, 3, 3, 1], [4, 0, 0, 6]],
}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_uneven_shards_equal_f_cross_entropy(world: dc.LocalWorld, smoothing: float) -> None:
    """World 3, vocabulary 10 as ``[4, 3, 3]`` (and the other layouts): loss and every
    gradient equal the serial model's, in each reduction."""
    cases = [
        _base(sizes=sizes, smoothing=smoothing, reduction=red, seed=i)
        for i, sizes in enumerate(_UNEVEN[world.world_size])
        for red in ("mean", "sum", "none")
    ]
    _run_cases(world, cases)


def _world3_vocab10(smoothing: float) -> tuple[float, float]:
    r = dc.get_rank()
    full = torch.randn(3, 10, generator=torch.Generator().manual_seed(0), dtype=F64)
    target = torch.tensor([0, 5, 8])  # ids every rank took for valid before
    shard = full[:, [0, 4, 7][r] : [4, 7, 10][r]]
    loss = P.vocab_parallel_cross_entropy(shard, target, label_smoothing=smoothing)
    return loss.item(), F.cross_entropy(full, target, label_smoothing=smoothing).item()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_world3_vocabulary10_is_not_silently_wrong(world3, smoothing: float) -> None:
    """The silent case: shards ``[4, 3, 3]`` and ids below 9 passed every rank's old check,
    and the loss was 3.3836 for F.cross_entropy's 3.8540 (smoothing 0.1: 3.3002 on rank 0,
    3.3566 on ranks 1-2, for 3.7574)."""
    for loss, ref in world3.run(_world3_vocab10, smoothing):
        assert loss == pytest.approx(ref, rel=1e-12, abs=1e-12)


@st.composite
def _cases(draw: st.DrawFn, w: int, padded: bool) -> dict[str, Any]:
    sizes = draw(st.lists(st.integers(0, 5), min_size=w, max_size=w).filter(lambda s: sum(s) > 0))
    case = {
        "sizes": sizes,
        "tokens": draw(st.sampled_from([(0,), (1,), (5,), (2, 3)])),
        "seed": draw(st.integers(0, 10_000)),
        "smoothing": draw(st.sampled_from([0.0, 0.1, 1.0])),
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "ignore_index": draw(st.sampled_from([-100, -1, 0, 2])),
        "ignore_frac": draw(st.sampled_from([0.0, 0.3, 1.0])),
    }
    if padded:
        case["vocab_size"] = draw(st.integers(1, sum(sizes)))
        case["pad_bias"] = draw(st.sampled_from([0.0, 1e4]))
    return case


@pytest.mark.parametrize("padded", [False, True], ids=["uneven", "uneven+vocab_size"])
def test_hypothesis_layouts_tokens_smoothing_ignore_reduction(world: dc.LocalWorld, padded: bool) -> None:
    """Any contiguous layout (empty shards included), any token count (none included),
    label smoothing, ignore_index (also a class id), every reduction; with ``vocab_size``
    any amount of padding, its logits at times far above the real ones."""

    @settings(max_examples=10, deadline=None)
    @given(st.lists(_cases(world.world_size, padded), min_size=4, max_size=4))
    def check(cases: list[dict[str, Any]]) -> None:
        _run_cases(world, cases)

    check()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_size_leaves_padding_out_of_the_softmax(world: dc.LocalWorld, smoothing: float) -> None:
    """A vocabulary of 10 padded to a multiple of the group size (even shards, as a
    ColumnParallelLinear head), and uneven shards ending in padding: equal to
    F.cross_entropy of the unpadded logits, the padding's logits and head rows get zero
    gradient — also when the padding's logits are 1e4 above the real ones (the max over
    them would underflow every real class's exp). Before: no ``vocab_size``; the padding
    entered the softmax and the smoothing."""
    n = world.world_size
    even = -(-10 // n) * n
    layouts = [[even // n] * n, [even // n] * (n - 1) + [even // n + 2], *_UNEVEN[n]]
    cases = [
        _base(sizes=sizes, vocab_size=min(9, sum(sizes)), smoothing=smoothing, pad_bias=bias, reduction=red)
        for sizes in layouts
        for bias in (0.0, 1e4)
        for red in ("mean", "none")
    ]
    _run_cases(world, cases)


def _column_parallel_head(vocab: int, padded: int) -> dict[str, Any]:
    r, n = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    serial = torch.nn.Linear(4, padded, dtype=F64)
    head = P.ColumnParallelLinear.from_serial(serial)
    x = torch.randn(5, 4, dtype=F64)
    target = torch.tensor([0, vocab - 1, 3, -100, 1])
    ref = F.cross_entropy(serial(x)[:, :vocab], target, label_smoothing=0.1)
    ref.backward()
    loss = P.vocab_parallel_cross_entropy(head(x), target, label_smoothing=0.1, vocab_size=vocab)
    loss.backward()
    v = padded // n
    return {
        "loss": (loss.detach(), ref.detach()),
        "weight": (head.weight.grad, serial.weight.grad[r * v : (r + 1) * v]),
        "bias": (head.bias.grad, serial.bias.grad[r * v : (r + 1) * v]),
        "padding_rows_zero": bool((serial.weight.grad[vocab:] == 0).all()),
    }


def test_vocab_size_with_a_column_parallel_linear_head(world: dc.LocalWorld) -> None:
    """A ColumnParallelLinear head of a vocabulary of 10 padded to a multiple of the group
    size: the loss and the head's gradients equal the serial head's with the padding cut off."""
    padded = -(-10 // world.world_size) * world.world_size
    for out in world.run(_column_parallel_head, 10, padded):
        assert out.pop("padding_rows_zero")
        for key, (a, b) in out.items():
            assert_close(a, b, rtol=1e-12, atol=1e-14, msg=key)


def _errors(sizes: list[int]) -> dict[str, Any]:
    r = dc.get_rank()
    z = torch.zeros(2, sizes[r])
    out: dict[str, Any] = {}
    before = {
        "vocab_size_target": lambda: P.vocab_parallel_cross_entropy(z, torch.tensor([0, 9]), vocab_size=9),
        "negative_target": lambda: P.vocab_parallel_cross_entropy(z, torch.tensor([-2, 1])),
        "vocab_size_zero": lambda: P.vocab_parallel_cross_entropy(z, torch.tensor([0, 1]), vocab_size=0),
    }
    with log_comms() as log:
        out.update(outcomes(before, ValueError))
        out.update(
            outcomes(
                {
                    "vocab_size_type": lambda: P.vocab_parallel_cross_entropy(
                        z, torch.tensor([0, 1]), vocab_size=9.0
                    )
                },
                TypeError,
            )
        )
    out["comms_before"] = len(log.records)
    after = {  # only the shard sizes tell these: every rank alike, after the max all_reduce
        "target_past_vocabulary": lambda: P.vocab_parallel_cross_entropy(z, torch.tensor([0, 10])),
        "vocab_size_past_shards": lambda: P.vocab_parallel_cross_entropy(
            z, torch.tensor([0, 1]), vocab_size=11
        ),
    }
    out.update(outcomes(after, ValueError))
    # the largest valid id, refused before on the ranks whose shard was smaller than rank 0's
    out["last_class"] = P.vocab_parallel_cross_entropy(z, torch.tensor([0, 9])).item()
    with dc.debug(True):  # uneven shards are no longer a debug-mode mismatch
        out["debug"] = P.vocab_parallel_cross_entropy(z, torch.tensor([0, 9])).item()
    return out


def test_bad_targets_and_vocab_size_are_value_errors_on_every_rank(world3) -> None:
    """What one rank can tell (a negative id; an id at or past ``vocab_size``; a bad
    ``vocab_size``) is refused before any communication; what needs the shard sizes (an id
    past the whole vocabulary, a ``vocab_size`` past it) right after the max all_reduce, on
    every rank with the same message. Before: ``[4, 4, 2]`` with target 7 was refused on
    rank 2 only ("class ids in [0, 6)") while ranks 0-1 waited; ``[4, 3, 3]`` refused the
    valid id 9 on ranks 1-2."""
    for sizes in ([4, 3, 3], [4, 4, 2], [0, 5, 5]):
        outs = world3.run(_errors, sizes)
        for out in outs:
            assert out["comms_before"] == 0, out
            assert "class ids in [0, 9)" in out["vocab_size_target"] and "id 9" in out["vocab_size_target"]
            assert "class ids in [0, V)" in out["negative_target"] and "id -2" in out["negative_target"]
            assert "`vocab_size` must be a positive int" in out["vocab_size_zero"]
            assert "`vocab_size` must be an int" in out["vocab_size_type"]
            assert (
                "class ids in [0, 10)" in out["target_past_vocabulary"]
                and "id 10" in out["target_past_vocabulary"]
            )
            shards = " + ".join(map(str, sizes))
            assert f"at most the classes the shards hold (10 = {shards})" in out["vocab_size_past_shards"], (
                out
            )
            assert out["last_class"] == pytest.approx(torch.log(torch.tensor(10.0)).item(), rel=1e-6)
            assert out["debug"] == out["last_class"]
        assert len({o["target_past_vocabulary"].split(" (rank")[0] for o in outs}) == 1


def _comms(sizes: list[int], vocab_size: int | None) -> list[tuple[str, str]]:
    z = torch.zeros(3, sizes[dc.get_rank()], requires_grad=True)
    with log_comms() as log:
        loss = P.vocab_parallel_cross_entropy(
            z, torch.tensor([0, 1, 2]), vocab_size=vocab_size, label_smoothing=0.1
        )
        loss.backward()
    return [(rec.op, rec.label) for rec in log.records]


@pytest.mark.usefixtures("debug_off")  # counts communications (debug mode adds its checks)
def test_shard_sizes_travel_in_the_max_all_reduce(world3) -> None:
    """Uneven shards cost no extra collective: the same two all_reduces as even ones (the
    sizes ride in the max), none in backward; padding with even shards the same; only
    uneven shards with padding redo the max (the guessed even layout was not theirs)."""
    two = [
        ("all_reduce", "parallel.vocab_parallel_cross_entropy (max, shard sizes)"),
        ("all_reduce", "parallel.vocab_parallel_cross_entropy (sums)"),
    ]
    for sizes, vocab_size in (([3, 3, 3], None), ([4, 3, 2], None), ([3, 3, 3], 8)):
        assert world3.run(_comms, sizes, vocab_size) == [two] * 3, (sizes, vocab_size)
    three = [two[0], ("all_reduce", "parallel.vocab_parallel_cross_entropy (max, uneven padded)"), two[1]]
    assert world3.run(_comms, [4, 3, 2], 8) == [three] * 3


def _under_torch_func(sizes: list[int], vocab_size: int | None) -> dict[str, bool]:
    from torch.func import grad, jvp, vmap

    r, s = dc.get_rank(), sum(sizes[: dc.get_rank()])
    v = vocab_size or sum(sizes)
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, 4, sum(sizes), generator=g, dtype=F64)
    target = torch.randint(0, v, (3, 4), generator=g)
    target[1, 2] = -100
    z = full[..., s : s + sizes[r]].contiguous()

    def ce(zz: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        padding = {} if vocab_size is None else {"vocab_size": vocab_size}
        return P.vocab_parallel_cross_entropy(zz, tt, label_smoothing=0.1, **padding)

    def ref(ff: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(ff[..., :v].reshape(-1, v), tt.reshape(-1), label_smoothing=0.1)

    g_ref = torch.stack([grad(ref)(full[i], target[i])[..., s : s + sizes[r]] for i in range(3)])
    tangent = torch.randn(full.shape, generator=g, dtype=F64)
    _, t_loss = jvp(lambda zz: ce(zz, target), (z,), (tangent[..., s : s + sizes[r]].contiguous(),))
    _, t_ref = jvp(lambda ff: ref(ff, target), (full,), (tangent,))
    close = functools.partial(torch.allclose, rtol=1e-10, atol=1e-12)
    return {
        "vmap": close(vmap(ce)(z, target), torch.stack([ref(full[i], target[i]) for i in range(3)])),
        "vmap_grad": close(vmap(grad(ce))(z, target), g_ref),
        "jvp": close(t_loss, t_ref),
    }


# on processes: forward-mode AD: one stack of dual levels per process (docs/in_process.md, Limits)
@pytest.mark.diffcomm_in_process(False)
def test_uneven_and_padded_under_torch_func(world3) -> None:
    """``vmap``, per-example gradients (``vmap(grad)``) and ``jvp`` with uneven shards (one
    empty) and with ``vocab_size`` padding (even and uneven) equal the serial model's."""
    for sizes, vocab_size in (([4, 3, 3], None), ([4, 0, 6], None), ([4, 3, 2], 8), ([3, 3, 3], 8)):
        for out in world3.run(_under_torch_func, sizes, vocab_size):
            assert out == dict.fromkeys(out, True), (sizes, vocab_size, out)
