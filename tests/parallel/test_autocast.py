"""The parallel layers under ``torch.autocast("cpu", dtype=torch.bfloat16)`` against the
serial model under the same autocast (float32 parameters): the same output dtype, values
and gradients to bfloat16 precision, float32 parameter gradients; the overlapped linears
run (they raised torch's dtype error) and ``overlap="comm"`` stays bit-identical to the
blocking path (its input gradient communicated in the input's dtype, as the blocking
mapping's); the vocab-parallel loss is float32 as ``F.cross_entropy``'s under autocast
(it was rounded to bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import diffcomm as dc

pytestmark = pytest.mark.diffcomm_in_process

BF16 = torch.bfloat16
TOL = 2e-2  # a few bfloat16 ulps, relative to the largest element


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def _block_vs_serial(kind: str, sp: bool, overlap: object) -> dict[str, object]:
    """One step of a ParallelMLP / ParallelSelfAttention and its serial twin under CPU
    autocast: dtypes, relative differences, and every gradient (to compare paths)."""
    from diffcomm import parallel as par

    r, w = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    if kind == "mlp":
        ser = par.MLP(16, 32)
        mod = par.ParallelMLP.from_serial(ser, sequence_parallel=sp, overlap=overlap)
    else:
        ser = par.SelfAttention(16, 4)
        mod = par.ParallelSelfAttention.from_serial(ser, sequence_parallel=sp)  # (no overlap=)
    x = torch.randn(6, 2, 16)
    x_mine = (x.chunk(w)[r] if sp else x).clone().requires_grad_()
    x_all = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        y, y_ser = mod(x_mine), ser(x_all)
    y.float().pow(2).sum().backward()
    y_ser.float().pow(2).sum().backward()
    mine = (lambda t: t.chunk(w)[r]) if sp else (lambda t: t)
    slices, serial = mod.serial_slices(), dict(ser.named_parameters())
    return {
        "dtypes": (y.dtype, y_ser.dtype, x_mine.grad.dtype, {p.grad.dtype for p in mod.parameters()}),
        "y": _rel(y, mine(y_ser)),
        "x.grad": _rel(x_mine.grad, mine(x_all.grad)),
        "params": max(_rel(p.grad, serial[n].grad[slices[n]]) for n, p in mod.named_parameters()),
        "grads": [x_mine.grad, *(p.grad for p in mod.parameters())],
    }


_CASES = [
    ("mlp", False, False),
    ("mlp", False, "comm"),
    ("mlp", True, False),
    ("mlp", True, "comm"),
    ("mlp", True, "ring"),
    ("attention", False, False),
    ("attention", True, False),
]


@pytest.mark.parametrize(("kind", "sp", "overlap"), _CASES)
def test_blocks_under_autocast_follow_the_serial_model(world2, kind: str, sp: bool, overlap: object) -> None:
    """The output is bfloat16 as the serial block's (the row-parallel bias added after the
    reduction promoted it to float32), values and gradients to bfloat16 precision, the
    parameter gradients float32; the overlapped modes run (they raised torch's 'expected m1
    and m2 to have the same dtype')."""
    for res in world2.run(_block_vs_serial, kind, sp, overlap):
        assert res["dtypes"] == (BF16, BF16, torch.float32, {torch.float32}), res["dtypes"]
        assert res["y"] < TOL and res["x.grad"] < TOL and res["params"] < TOL, res


@pytest.mark.parametrize("sp", [False, True])
def test_overlap_comm_under_autocast_is_the_blocking_path(world2, sp: bool) -> None:
    """``overlap="comm"`` is bit-identical to ``overlap=False`` under autocast too: its
    input gradient is communicated in float32 (the input's dtype), as the blocking
    mapping's, not in bfloat16."""
    blocking = world2.run(_block_vs_serial, "mlp", sp, False)
    comm = world2.run(_block_vs_serial, "mlp", sp, "comm")
    for a, b in zip(blocking, comm):
        assert all(torch.equal(g, h) for g, h in zip(a["grads"], b["grads"]))


def _cross_entropy() -> dict[str, object]:
    from diffcomm import parallel as par

    r, w = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 12)
    head_mine = par.ColumnParallelLinear.from_serial(head)
    h, target = torch.randn(5, 16), torch.randint(0, 12, (5,))
    with torch.autocast("cpu", dtype=BF16):
        loss = par.vocab_parallel_cross_entropy(head_mine(h), target)
        ref = F.cross_entropy(head(h), target)
    loss.backward()
    ref.backward()
    return {
        "dtypes": (loss.dtype, ref.dtype, head_mine.weight.grad.dtype),
        "loss": _rel(loss, ref),
        "weight.grad": _rel(head_mine.weight.grad, head.weight.grad.chunk(w)[r]),
    }


def test_vocab_parallel_cross_entropy_under_autocast_is_float32(world2) -> None:
    """As ``F.cross_entropy`` under autocast (its float32 list): the loss float32 and
    equal to the serial one to float32 precision (it was the bfloat16 logits' dtype: the
    loss rounded to bfloat16, 1.3e-3 off, and the gradients scaled by that rounding)."""
    for res in world2.run(_cross_entropy):
        assert res["dtypes"] == (torch.float32, torch.float32, torch.float32), res
        assert res["loss"] < 1e-6 and res["weight.grad"] < 1e-5, res


def _attention(kind: str) -> dict[str, object]:
    """Context-parallel attention of float32 q, k, v under CPU autocast against SDPA
    under the same autocast (which casts to bfloat16): dtypes and relative errors."""
    from diffcomm import parallel as par

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 8, requires_grad=True) for _ in range(3))
    layout = "zigzag" if kind == "ring" else "contiguous"
    mine = [par.shard(t.detach(), layout=layout).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=BF16):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fn = par.ring_attention if kind == "ring" else par.ulysses_attention
        out = fn(*mine, causal=True)
    out.float().pow(2).sum().backward()
    ref.float().pow(2).sum().backward()
    whole = par.unshard(out).detach()
    grads = [par.unshard(t.grad, layout=layout) for t in mine]
    return {
        "dtypes": (out.dtype, ref.dtype, {t.grad.dtype for t in mine}),
        "out": _rel(whole, ref),
        "grads": max(_rel(g, t.grad) for g, t in zip(grads, (q, k, v))),
    }


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_context_parallel_attention_under_autocast_follows_sdpa(world2, kind: str) -> None:
    """As SDPA under CPU autocast (its lower-precision list): float32 q, k, v give a
    bfloat16 output, values and float32 gradients to bfloat16 precision (the ring returned
    float32: autocast does not see into its fused Function)."""
    for res in world2.run(_attention, kind):
        assert res["dtypes"] == (BF16, BF16, {torch.float32}), res
        assert res["out"] < TOL and res["grads"] < TOL, res


def _float64_under_autocast(kind: str) -> dict[str, object]:
    """float64 inputs and parameters under CPU autocast, which leaves float64 alone (torch's
    autocast casts no float64 tensor): the serial model stays float64; so must ours."""
    from diffcomm import parallel as par

    r, w = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    if kind == "ring":
        q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
        mask = torch.randn(1, 1, 8, 8, dtype=torch.float64)  # a float mask: additive
        with torch.autocast("cpu", dtype=BF16):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out = par.ring_attention(
                *(par.shard(t, dim=2) for t in (q, k, v)), attn_mask=par.shard(mask, dim=2)
            )
        return {"dtypes": (out.dtype, ref.dtype), "err": _rel(par.unshard(out, dim=2), ref)}
    ser = par.MLP(16, 32, dtype=torch.float64)
    overlap = "ring" if kind == "overlap-ring" else kind
    mod = par.ParallelMLP.from_serial(ser, sequence_parallel=True, overlap=overlap)
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=BF16):
        y, y_ser = mod(x.chunk(w)[r]), ser(x)
    return {"dtypes": (y.dtype, y_ser.dtype), "err": _rel(y, y_ser.chunk(w)[r])}


@pytest.mark.parametrize("kind", ["ring", "comm", "overlap-ring"])
def test_float64_under_autocast_stays_float64_as_serial(world2, kind: str) -> None:
    """Before: ring_attention (float mask too) and the overlapped ColumnParallelLinear /
    RowParallelLinear cast float64 to bfloat16 under autocast (ring: relative error 7.7e-3
    and a bfloat16 output for SDPA's float64); serial torch leaves float64 as it is."""
    for res in world2.run(_float64_under_autocast, kind):
        assert res["dtypes"] == (torch.float64, torch.float64), res
        assert res["err"] < 1e-12, res
