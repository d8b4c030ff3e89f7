"""Realistic user programs of context parallelism, expert parallelism, their seams, and
pipeline parallelism, written from the docs (docs/context_parallel.md, docs/moe.md,
docs/pipeline.md, notebooks 03, 04 and 06, examples/), not from the implementation
(issue 45, "Done when").

Each program runs on every rank of a shared ``LocalWorld`` and must end either **right**
(its values and every gradient equal a single-process float64 reference of the whole SPMD
program: under diffcomm's sum convention, the objective is the sum of the per-rank losses)
or in a **clear error** (the documented error type, the message naming the argument). A
program that gives a silently wrong value or an unclear error is a finding: it stays here,
marked ``xfail(strict=True)`` with its symptom.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import diffcomm as dc
from diffcomm import parallel, testing

F64 = torch.float64
TOL = 1e-10


@dataclass
class Program:
    """One user program: its rank body, world size and expected ending."""

    fn: Callable[[], dict[str, float]]
    world: int = 2
    error: tuple[type[BaseException], str] | None = None  # (type, regex on the message)
    finding: str | None = None  # the symptom, when the program is wrong or errors unclearly
    marks: list[Any] = field(default_factory=list)


def _guarded(fn: Callable[[], dict[str, float]]) -> tuple[str, Any, str]:
    """Run ``fn`` on this rank; an exception comes back as data (the world stays up): the
    names of its class and base classes, and its message."""
    try:
        return ("ok", fn(), "")
    except Exception as exc:
        return ("err", [c.__name__ for c in type(exc).__mro__], str(exc))


def _d(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Largest absolute difference (inf when a gradient is missing)."""
    if a is None or b is None:
        return float("inf")
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ context parallelism


def _idx(s: int, w: int, r: int, layout: str) -> list[int]:
    """Rank r's global positions, written from the docs' pictures (not the library)."""
    if layout == "contiguous":
        c = s // w
        return list(range(r * c, (r + 1) * c))
    c = s // (2 * w)  # zigzag: chunks r and 2W-1-r of 2W
    return list(range(r * c, (r + 1) * c)) + list(range((2 * w - 1 - r) * c, (2 * w - r) * c))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, **kw: Any) -> torch.Tensor:
    """Serial reference: torch SDPA, KV heads repeated for GQA (query head h uses h // group)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def _qkv(b: int, h: int, s: int, d: int, kv: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    g = _gen(seed)
    kv = h if kv is None else kv
    return [
        torch.randn(b, h, s, d, dtype=F64, generator=g),
        torch.randn(b, kv, s, d, dtype=F64, generator=g),
        torch.randn(b, kv, s, d, dtype=F64, generator=g),
        torch.randn(b, h, s, d, dtype=F64, generator=g),  # the cotangent of the output
    ]


def _ring_program(
    *,
    s: int,
    layout_shard: str | None,
    layout_op: str | None,
    causal: bool,
    kv: int | None = None,
    h: int = 2,
) -> dict[str, float]:
    """shard -> ring_attention -> (out * cot).sum() per rank -> backward; unshard."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, cot = _qkv(1, h, s, 4, kv)
    kw = {} if layout_shard is None else {"layout": layout_shard}
    ql, kl, vl = (parallel.shard(t, **kw).requires_grad_() for t in (q, k, v))
    cl = parallel.shard(cot, **kw)
    okw = {} if layout_op is None else {"layout": layout_op}
    out = parallel.ring_attention(ql, kl, vl, causal=causal, **okw)
    (out * cl).sum().backward()
    full = parallel.unshard(out, **kw)
    # reference: the sum over ranks of (out_r * cot_r).sum() is (out * cot).sum() serially
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, causal)
    (ref * cot).sum().backward()
    idx = _idx(s, w, r, layout_shard or "contiguous")
    assert qf.grad is not None and kf.grad is not None and vf.grad is not None
    return {
        "out": _d(full, ref),
        "dq": _d(ql.grad, qf.grad[:, :, idx]),
        "dk": _d(kl.grad, kf.grad[:, :, idx]),
        "dv": _d(vl.grad, vf.grad[:, :, idx]),
    }


def cp_ring_defaults_causal() -> dict[str, float]:
    """The issue's first trap: no layout named anywhere, causal."""
    return _ring_program(s=8, layout_shard=None, layout_op=None, causal=True)


def cp_ring_zigzag_in_shard_only() -> dict[str, float]:
    """Zigzag named in shard (and unshard) only: the placement travels to the ring."""
    return _ring_program(s=16, layout_shard="zigzag", layout_op=None, causal=True)


def cp_ring_zigzag_everywhere_noncausal() -> dict[str, float]:
    """Zigzag named everywhere, not causal, world 4."""
    return _ring_program(s=16, layout_shard="zigzag", layout_op="zigzag", causal=False)


def cp_ring_layout_mixed_up() -> dict[str, float]:
    """Sharded zigzag, attended as contiguous: must raise naming `layout`."""
    return _ring_program(s=8, layout_shard="zigzag", layout_op="contiguous", causal=True)


def cp_ring_gqa_world3() -> dict[str, float]:
    """GQA 4 query heads : 1 KV head, causal, zigzag, world 3."""
    return _ring_program(s=12, layout_shard="zigzag", layout_op="zigzag", causal=True, kv=1, h=4)


def cp_ring_chunk_by_hand() -> dict[str, float]:
    """A plain ``x.chunk(W, dim=2)[rank]`` (the docs: the contiguous default) and no layout."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, cot = _qkv(2, 2, 12, 4)
    ql, kl, vl = (t.chunk(w, dim=2)[r].clone().requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    (out * cot.chunk(w, dim=2)[r]).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    idx = _idx(12, w, r, "contiguous")
    assert qf.grad is not None and kf.grad is not None and vf.grad is not None
    return {
        "out": _d(out, ref[:, :, idx]),
        "dq": _d(ql.grad, qf.grad[:, :, idx]),
        "dk": _d(kl.grad, kf.grad[:, :, idx]),
        "dv": _d(vl.grad, vf.grad[:, :, idx]),
    }


def cp_ring_layout_index_by_hand_unnamed() -> dict[str, float]:
    """Shard by hand with ``layout_index(..., layout="zigzag")`` and call the ring without
    ``layout=`` (named in one place only): the shards carry no placement and the program
    used zigzag, so the default would be a guess: refused, naming ``layout`` (on main it
    ran as contiguous: output off by 0.97, dq by 0.81)."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    s = 8
    q, k, v, cot = _qkv(1, 2, s, 4)
    idx = parallel.layout_index(s, w, layout="zigzag")[r]
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    (out * cot[:, :, idx]).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    assert qf.grad is not None
    return {"out": _d(out, ref[:, :, idx]), "dq": _d(ql.grad, qf.grad[:, :, idx])}


def cp_ring_uneven_length_seq_len() -> dict[str, float]:
    """S = 10 over 4 ranks, zigzag: padded shards, ``seq_len=`` to the ring and unshard."""
    from diffcomm import parallel

    s = 10
    q, k, v, cot = _qkv(1, 2, s, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    cl = parallel.shard(cot, layout="zigzag")
    out = parallel.ring_attention(ql, kl, vl, causal=True, layout="zigzag", seq_len=s)
    (out * cl).sum().backward()
    full = parallel.unshard(out, layout="zigzag", seq_len=s)
    dq = parallel.unshard(ql.grad, layout="zigzag", seq_len=s)
    dk = parallel.unshard(kl.grad, layout="zigzag", seq_len=s)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dq": _d(dq, qf.grad), "dk": _d(dk, kf.grad)}


def cp_ring_uneven_chunks_misuse() -> dict[str, float]:
    """S = 10 over 4 ranks cut with ``chunk`` (3, 3, 3, 1 rows): must raise on every rank,
    naming ``q`` and the lengths, not hang, kill a rank or give a wrong value (on main
    gloo aborted a rank: RankDiedError). Debug mode pinned off (the suite also runs under
    DIFFCOMM_DEBUG=1): its check catches it first (the ``_debug`` program below)."""
    with dc.debug(False):
        return _ring_uneven_chunks()


def _ring_uneven_chunks() -> dict[str, float]:
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, _ = _qkv(1, 2, 10, 4)
    ql, kl, vl = (t.chunk(w, dim=2)[r] for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    return {"out": float(out.abs().sum()) * 0.0 + 1.0}  # reaching here is a finding


def cp_ring_uneven_chunks_misuse_debug() -> dict[str, float]:
    """The same misuse in debug mode (``dc.debug(True)``): the cross-rank check of the
    ring's arguments names the ranks whose ``q`` differs, before the ring's first hop."""
    with dc.debug(True):
        return _ring_uneven_chunks()


def cp_ring_seq_len_contradicts_shard() -> dict[str, float]:
    """S = 10 sharded (the placement records 10), ``seq_len=12`` told to the ring: refused
    (a length other than the one the tensors were sharded from is never a value)."""
    from diffcomm import parallel

    q, k, v, _ = _qkv(1, 2, 10, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag") for t in (q, k, v))
    parallel.ring_attention(ql, kl, vl, causal=True, seq_len=12)
    return {"reached": 1.0}


def cp_ring_packed_documents() -> dict[str, float]:
    """Packed documents ``cu_seqlens=[0, 5, 11]`` (the docs' picture), zigzag, causal."""
    from diffcomm import parallel

    s, cu = 11, [0, 5, 11]
    q, k, v, cot = _qkv(1, 2, s, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag", cu_seqlens=cu).requires_grad_() for t in (q, k, v))
    cl = parallel.shard(cot, layout="zigzag", cu_seqlens=cu)
    out = parallel.ring_attention(ql, kl, vl, causal=True, layout="zigzag", cu_seqlens=cu)
    (out * cl).sum().backward()
    full = parallel.unshard(out, layout="zigzag", cu_seqlens=cu, seq_len=s)
    dv = parallel.unshard(vl.grad, layout="zigzag", cu_seqlens=cu, seq_len=s)
    doc = torch.tensor([0] * 5 + [1] * 6)
    pos = torch.arange(s)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, attn_mask=mask)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dv": _d(dv, vf.grad)}


def cp_ring_bool_mask_rows() -> dict[str, float]:
    """A user bool mask (rows taken with ``shard(mask, dim=2)``, columns global), not causal."""
    from diffcomm import parallel

    s = 8
    q, k, v, cot = _qkv(1, 2, s, 4)
    mask = torch.rand(1, 1, s, s, generator=_gen(5)) > 0.4
    mask |= torch.eye(s, dtype=torch.bool)
    ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, attn_mask=parallel.shard(mask, dim=2))
    (out * parallel.shard(cot)).sum().backward()
    full = parallel.unshard(out)
    dk = parallel.unshard(kl.grad)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, attn_mask=mask)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dk": _d(dk, kf.grad)}


def cp_ring_scale_and_loss_through_unshard() -> dict[str, float]:
    """Every rank takes its loss over the unsharded output (the sum convention: the SPMD
    objective is W times the serial loss), with a custom ``scale``."""
    from diffcomm import parallel

    w = dc.get_world_size()
    q, k, v, cot = _qkv(1, 2, 8, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True, scale=0.3)
    full = parallel.unshard(out)
    (full * cot).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True, scale=0.3)
    (w * (ref * cot).sum()).backward()
    dq = parallel.unshard(ql.grad, layout="zigzag")
    return {"out": _d(full, ref), "dq": _d(dq, qf.grad)}


def cp_ring_gradient_penalty() -> dict[str, float]:
    """A gradient penalty through the ring (first-order backward only): the documented
    RuntimeError, not a dropped term."""
    from diffcomm import parallel

    q, k, v, cot = _qkv(1, 2, 8, 4)
    ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    task = (out * parallel.shard(cot)).sum()
    (gq,) = torch.autograd.grad(task, ql, create_graph=True)
    (task + gq.square().sum()).backward()
    return {"reached": 1.0}


def cp_ulysses_gradient_penalty_reference_as_attn_fn() -> dict[str, float]:
    """The docs' alternative taken literally: ``attn_fn=parallel.attention_reference``."""
    return _ulysses_penalty(wrap=False)


def cp_ulysses_gradient_penalty() -> dict[str, float]:
    """The documented alternative, ``attention_reference`` wrapped to take ``is_causal``."""
    return _ulysses_penalty(wrap=True)


def _ulysses_penalty(wrap: bool) -> dict[str, float]:
    """A gradient penalty through Ulysses with a twice-differentiable local attention."""
    from diffcomm import parallel

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: Any) -> torch.Tensor:
        return parallel.attention_reference(q, k, v, causal=is_causal, scale=scale)

    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, cot = _qkv(1, 2, 8, 4)
    ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))
    out = parallel.ulysses_attention(
        ql, kl, vl, causal=True, attn_fn=attn if wrap else parallel.attention_reference
    )
    task = (out * parallel.shard(cot)).sum()
    (gq,) = torch.autograd.grad(task, ql, create_graph=True)
    (task + gq.square().sum()).backward()
    # reference: sum over ranks of (task_r + |d task_r / d q_r|^2); d task/d q_r = d task_r/d q_r
    # only for the rank's own q rows, and task = sum of task_r, so the penalty is |d task/d q|^2
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    scores = (qf @ kf.transpose(-1, -2)) / qf.shape[-1] ** 0.5  # math attention: twice differentiable
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    ref = scores.softmax(-1) @ vf
    t_all = (ref * cot).sum()
    (gf,) = torch.autograd.grad(t_all, qf, create_graph=True)
    (t_all + gf.square().sum()).backward()
    idx = _idx(8, w, r, "contiguous")
    assert qf.grad is not None and kf.grad is not None
    return {"dq": _d(ql.grad, qf.grad[:, :, idx]), "dk": _d(kl.grad, kf.grad[:, :, idx])}


def cp_ulysses_contiguous_causal() -> dict[str, float]:
    """Ulysses on the default shards, causal, world 2."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, cot = _qkv(2, 4, 8, 4)
    ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))
    out = parallel.ulysses_attention(ql, kl, vl, causal=True)
    (out * parallel.shard(cot)).sum().backward()
    full = parallel.unshard(out)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    idx = _idx(8, w, r, "contiguous")
    assert qf.grad is not None and vf.grad is not None
    return {
        "out": _d(full, ref),
        "dq": _d(ql.grad, qf.grad[:, :, idx]),
        "dv": _d(vl.grad, vf.grad[:, :, idx]),
    }


def cp_ulysses_zigzag_shard() -> dict[str, float]:
    """Ulysses given zigzag shards: refused, naming `q`."""
    from diffcomm import parallel

    q, k, v, _ = _qkv(1, 2, 8, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag") for t in (q, k, v))
    parallel.ulysses_attention(ql, kl, vl, causal=True)
    return {"reached": 1.0}


def cp_ulysses_gqa_uneven_heads_lengths() -> dict[str, float]:
    """The docs' picture: 3 query heads, 1 KV head, lengths 3 and 2 (sliced by hand)."""
    from diffcomm import parallel

    r = dc.get_rank()
    q, k, v, cot = _qkv(1, 3, 5, 4, kv=1)
    rows = [0, 1, 2] if r == 0 else [3, 4]
    ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
    out = parallel.ulysses_attention(ql, kl, vl, causal=True)
    (out * cot[:, :, rows]).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    assert qf.grad is not None and kf.grad is not None and vf.grad is not None
    return {
        "out": _d(out, ref[:, :, rows]),
        "dq": _d(ql.grad, qf.grad[:, :, rows]),
        "dk": _d(kl.grad, kf.grad[:, :, rows]),
        "dv": _d(vl.grad, vf.grad[:, :, rows]),
    }


def _mesh_2x2() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))


def cp_usp_2x2_zigzag() -> dict[str, float]:
    """USP on a 2x2 mesh (ring x ulysses), zigzag over the ring, causal, world 4."""
    from diffcomm import parallel

    mesh = _mesh_2x2()
    ug, rg = (mesh, "ulysses"), (mesh, "ring")
    q, k, v, cot = _qkv(1, 4, 16, 4)
    ql, kl, vl = (
        parallel.shard(t, 2, rg, layout="zigzag", ulysses_group=ug).requires_grad_() for t in (q, k, v)
    )
    cl = parallel.shard(cot, 2, rg, layout="zigzag", ulysses_group=ug)
    out = parallel.usp_attention(ql, kl, vl, ug, rg, causal=True)
    (out * cl).sum().backward()
    full = parallel.unshard(out, 2, rg, layout="zigzag", ulysses_group=ug)
    dq = parallel.unshard(ql.grad, 2, rg, layout="zigzag", ulysses_group=ug)
    dk = parallel.unshard(kl.grad, 2, rg, layout="zigzag", ulysses_group=ug)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dq": _d(dq, qf.grad), "dk": _d(dk, kf.grad)}


def cp_usp_shard_to_ring() -> dict[str, float]:
    """A USP shard given to plain ring_attention over the world: refused."""
    from diffcomm import parallel

    mesh = _mesh_2x2()
    ug, rg = (mesh, "ulysses"), (mesh, "ring")
    q, k, v, _ = _qkv(1, 4, 16, 4)
    ql, kl, vl = (parallel.shard(t, 2, rg, layout="zigzag", ulysses_group=ug) for t in (q, k, v))
    parallel.ring_attention(ql, kl, vl, causal=True)
    return {"reached": 1.0}


def cp_q_and_k_placed_differently() -> dict[str, float]:
    """q zigzag, k and v contiguous (a copy-paste slip): refused."""
    from diffcomm import parallel

    q, k, v, _ = _qkv(1, 2, 8, 4)
    ql = parallel.shard(q, layout="zigzag")
    kl, vl = parallel.shard(k), parallel.shard(v)
    parallel.ring_attention(ql, kl, vl, causal=True)
    return {"reached": 1.0}


def _block_program(named_at_op: bool) -> dict[str, float]:
    """A model-like block: x (B, S, D) sharded on dim 1 zigzag, replicated q/k/v/o
    projections around the ring, per-rank loss, weight gradients all_reduced (the
    example's recipe). ``named_at_op``: the layout also named at the ring."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    b, s, d, h = 1, 8, 8, 2
    g = _gen(3)
    x = torch.randn(b, s, d, dtype=F64, generator=g)
    cot = torch.randn(b, s, d, dtype=F64, generator=g)
    weights = [torch.randn(d, d, dtype=F64, generator=g) / d**0.5 for _ in range(4)]

    def block(xx: torch.Tensor, ws: list[torch.Tensor], attn: Callable[..., torch.Tensor]) -> torch.Tensor:
        bb, ss, _ = xx.shape
        q, k, v = ((xx @ wi).view(bb, ss, h, d // h).transpose(1, 2) for wi in ws[:3])
        a = attn(q, k, v)
        return a.transpose(1, 2).reshape(bb, ss, d) @ ws[3]

    ws = [wi.clone().requires_grad_() for wi in weights]
    xl = parallel.shard(x, dim=1, layout="zigzag").requires_grad_()
    kw = {"layout": "zigzag"} if named_at_op else {}
    y = block(xl, ws, lambda q, k, v: parallel.ring_attention(q, k, v, causal=True, **kw))
    (y * parallel.shard(cot, dim=1, layout="zigzag")).sum().backward()
    grads = [dc.all_reduce(wi.grad) for wi in ws]
    full = parallel.unshard(y, dim=1, layout="zigzag")
    wf = [wi.clone().requires_grad_() for wi in weights]
    xf = x.clone().requires_grad_()
    ref = block(xf, wf, lambda q, k, v: _sdpa(q, k, v, True))
    (ref * cot).sum().backward()
    idx = _idx(s, w, r, "zigzag")
    assert xf.grad is not None
    out = {"out": _d(full, ref), "dx": _d(xl.grad, xf.grad[:, idx])}
    out.update({f"dW{i}": _d(gi, wi.grad) for i, (gi, wi) in enumerate(zip(grads, wf))})
    return out


def cp_block_projections_named_everywhere() -> dict[str, float]:
    """The block with the layout named at shard, ring and unshard (the example's way)."""
    return _block_program(named_at_op=True)


def cp_block_projections_named_at_shard_only() -> dict[str, float]:
    """The block with zigzag named at shard/unshard only: the projections make new tensors,
    the placement is lost; the program used zigzag, so the ring refuses to guess, naming
    ``layout`` (on main it fell back to contiguous: output off by 0.92, weight grads 2.5)."""
    return _block_program(named_at_op=False)


def cp_unshard_with_other_layout() -> dict[str, float]:
    """Output of a zigzag ring unsharded as contiguous: refused."""
    from diffcomm import parallel

    q, k, v, _ = _qkv(1, 2, 8, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag") for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    parallel.unshard(out, layout="contiguous")
    return {"reached": 1.0}


def cp_ring_forgot_seq_len() -> dict[str, float]:
    """S = 10 over 4 ranks, zigzag: padded shards, ``seq_len=`` given to unshard but
    forgotten at the ring (the docs: pass it to ring_attention / unshard)."""
    from diffcomm import parallel

    s = 10
    q, k, v, cot = _qkv(1, 2, s, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    full = parallel.unshard(out, layout="zigzag", seq_len=s)
    dk = parallel.unshard(kl.grad, layout="zigzag", seq_len=s)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dk": _d(dk, kf.grad)}


def cp_ulysses_whole_sequence_under_check() -> dict[str, float]:
    """Forgot to shard: the whole sequence on every rank into Ulysses, under
    ``dc.spmd_check`` (documented to refuse it)."""
    from diffcomm import parallel

    q, k, v, _ = _qkv(1, 2, 8, 4)
    with dc.spmd_check():
        parallel.ulysses_attention(q, k, v, causal=True)
    return {"reached": 1.0}


def cp_ring_additive_mask_gradient() -> dict[str, float]:
    """An additive float mask (a learned bias): its rows taken with ``shard(mask, dim=2)``,
    its gradient summed over ranks equals the serial one."""
    from diffcomm import parallel

    s = 8
    q, k, v, cot = _qkv(1, 2, s, 4)
    bias = torch.randn(1, 2, s, s, dtype=F64, generator=_gen(6))
    ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))
    bl = bias.clone().requires_grad_()
    out = parallel.ring_attention(ql, kl, vl, causal=True, attn_mask=parallel.shard(bl, dim=2))
    (out * parallel.shard(cot)).sum().backward()
    assert bl.grad is not None
    dbias = dc.all_reduce(bl.grad)
    full, dq = parallel.unshard(out), parallel.unshard(ql.grad)
    qf, kf, vf, bf = (t.clone().requires_grad_() for t in (q, k, v, bias))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    ref = _sdpa(qf, kf, vf, attn_mask=bf.masked_fill(~causal, float("-inf")))
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dq": _d(dq, qf.grad), "dbias": _d(dbias, bf.grad)}


def cp_ring_dropout_vs_reference() -> dict[str, float]:
    """Dropout with a shared seed against ``attention_reference`` with the same seed."""
    from diffcomm import parallel

    q, k, v, cot = _qkv(1, 2, 16, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True, dropout_p=0.3, dropout_seed=11)
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    full, dv = parallel.unshard(out), parallel.unshard(vl.grad, layout="zigzag")
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = parallel.attention_reference(qf, kf, vf, causal=True, dropout_p=0.3, dropout_seed=11)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dv": _d(dv, vf.grad)}


def cp_ulysses_fewer_heads_than_ranks() -> dict[str, float]:
    """Ulysses with 2 query heads and 1 KV head over 3 ranks (a rank only relays)."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, cot = _qkv(1, 2, 9, 4, kv=1)
    ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))
    out = parallel.ulysses_attention(ql, kl, vl, causal=True)
    (out * parallel.shard(cot)).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    idx = _idx(9, w, r, "contiguous")
    assert kf.grad is not None and vf.grad is not None
    return {
        "out": _d(out, ref[:, :, idx]),
        "dk": _d(kl.grad, kf.grad[:, :, idx]),
        "dv": _d(vl.grad, vf.grad[:, :, idx]),
    }


def cp_ring_v_head_dim_and_frozen_kv() -> dict[str, float]:
    """v with a larger head size than q/k, and k/v frozen (only q learns)."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    g = _gen(8)
    q, k = (torch.randn(1, 2, 8, 4, dtype=F64, generator=g) for _ in range(2))
    v, cot = (torch.randn(1, 2, 8, 6, dtype=F64, generator=g) for _ in range(2))
    ql = parallel.shard(q, layout="zigzag").requires_grad_()
    kl, vl = parallel.shard(k, layout="zigzag"), parallel.shard(v, layout="zigzag")
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    qf = q.clone().requires_grad_()
    ref = _sdpa(qf, k, v, True)
    (ref * cot).sum().backward()
    idx = _idx(8, w, r, "zigzag")
    assert qf.grad is not None
    return {"out": _d(out, ref[:, :, idx]), "dq": _d(ql.grad, qf.grad[:, :, idx])}


def cp_unshard_grad_without_layout() -> dict[str, float]:
    """Zigzag named at shard; the output unsharded without ``layout=`` (it carries it), and
    so are the gradients ``ql.grad`` (a new tensor that autograd made)."""
    from diffcomm import parallel

    q, k, v, cot = _qkv(1, 2, 8, 4)
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True)
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    full, dq = parallel.unshard(out), parallel.unshard(ql.grad)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dq": _d(dq, qf.grad)}


def cp_ring_on_mesh_axis_with_dp_w4() -> dict[str, float]:
    """A 2x2 mesh (dp x cp): each cp group rings over its own sequence (different data per
    dp replica), zigzag, ``group=(mesh, "cp")``."""
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm import parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = (mesh, "cp")
    q, k, v, cot = _qkv(1, 2, 8, 4, seed=40 + mesh.get_local_rank("dp"))
    ql, kl, vl = (parallel.shard(t, 2, cp, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, cp, causal=True)
    (out * parallel.shard(cot, 2, cp, layout="zigzag")).sum().backward()
    full = parallel.unshard(out, 2, cp)
    dk = parallel.unshard(kl.grad, 2, cp, layout="zigzag")
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dk": _d(dk, kf.grad)}


def cp_ring_mixed_dtypes() -> dict[str, float]:
    """q in float32, k and v in float64 (a half-converted model): refused."""
    from diffcomm import parallel

    q, k, v, _ = _qkv(1, 2, 8, 4)
    parallel.ring_attention(parallel.shard(q.float()), parallel.shard(k), parallel.shard(v), causal=True)
    return {"reached": 1.0}


def cp_usp_packed_documents_w4() -> dict[str, float]:
    """USP on a 2x2 mesh with packed documents ``cu_seqlens=[0, 7, 16]``, zigzag, causal."""
    from diffcomm import parallel

    mesh = _mesh_2x2()
    ug, rg = (mesh, "ulysses"), (mesh, "ring")
    s, cu = 16, [0, 7, 16]
    q, k, v, cot = _qkv(1, 4, s, 4)
    kw: dict[str, Any] = {"layout": "zigzag", "cu_seqlens": cu, "ulysses_group": ug}
    ql, kl, vl = (parallel.shard(t, 2, rg, **kw).requires_grad_() for t in (q, k, v))
    out = parallel.usp_attention(ql, kl, vl, ug, rg, causal=True, layout="zigzag", cu_seqlens=cu)
    (out * parallel.shard(cot, 2, rg, **kw)).sum().backward()
    full = parallel.unshard(out, 2, rg, seq_len=s, **kw)
    dq = parallel.unshard(ql.grad, 2, rg, seq_len=s, **kw)
    doc = torch.tensor([0] * 7 + [1] * 9)
    pos = torch.arange(s)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, attn_mask=mask)
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dq": _d(dq, qf.grad)}


def cp_ring_zigzag_causal_and_mask_w3() -> dict[str, float]:
    """Causal and a bool padding-style mask together, zigzag, the mask's rows sharded
    with the same layout (``shard(mask, dim=2, layout="zigzag")``), world 3."""
    from diffcomm import parallel

    s = 12
    q, k, v, cot = _qkv(2, 2, s, 4)
    mask = torch.ones(2, 1, s, s, dtype=torch.bool)
    mask[1, :, :, 9:] = False  # the second sequence's last 3 keys are padding
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    ml = parallel.shard(mask, dim=2, layout="zigzag")
    out = parallel.ring_attention(ql, kl, vl, causal=True, attn_mask=ml)
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    full, dk = parallel.unshard(out), parallel.unshard(kl.grad, layout="zigzag")
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, attn_mask=mask & torch.ones(s, s, dtype=torch.bool).tril())
    (ref * cot).sum().backward()
    return {"out": _d(full, ref), "dk": _d(dk, kf.grad)}


def cp_ulysses_explicit_seq_lens_w3() -> dict[str, float]:
    """Ulysses with pieces of 4, 1 and 2 tokens sliced by hand and ``seq_lens=`` given."""
    from diffcomm import parallel

    r = dc.get_rank()
    lens = [4, 1, 2]
    q, k, v, cot = _qkv(1, 3, 7, 4)
    rows = list(range(sum(lens[:r]), sum(lens[: r + 1])))
    ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
    out = parallel.ulysses_attention(ql, kl, vl, causal=True, seq_lens=lens)
    (out * cot[:, :, rows]).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _sdpa(qf, kf, vf, True)
    (ref * cot).sum().backward()
    assert qf.grad is not None and vf.grad is not None
    return {
        "out": _d(out, ref[:, :, rows]),
        "dq": _d(ql.grad, qf.grad[:, :, rows]),
        "dv": _d(vl.grad, vf.grad[:, :, rows]),
    }


def cp_ring_mask_rows_other_layout() -> dict[str, float]:
    """q/k/v zigzag, the mask's rows taken with the default (contiguous) shard: refused."""
    from diffcomm import parallel

    s = 8
    q, k, v, _ = _qkv(1, 2, s, 4)
    mask = torch.rand(1, 1, s, s, generator=_gen(5)) > 0.3
    mask |= torch.eye(s, dtype=torch.bool)
    ql, kl, vl = (parallel.shard(t, layout="zigzag") for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, attn_mask=parallel.shard(mask, dim=2))
    return {"out": _d(parallel.unshard(out), _sdpa(q, k, v, attn_mask=mask))}


CP_PROGRAMS: dict[str, Program] = {
    "ring_defaults_causal": Program(cp_ring_defaults_causal),
    "ring_zigzag_in_shard_only": Program(cp_ring_zigzag_in_shard_only),
    "ring_zigzag_everywhere_noncausal_w4": Program(cp_ring_zigzag_everywhere_noncausal, world=4),
    "ring_layout_mixed_up": Program(cp_ring_layout_mixed_up, error=(ValueError, r"`layout`")),
    "ring_gqa_w3": Program(cp_ring_gqa_world3, world=3),
    "ring_chunk_by_hand": Program(cp_ring_chunk_by_hand),
    "ring_layout_index_by_hand_unnamed": Program(
        cp_ring_layout_index_by_hand_unnamed, error=(ValueError, r"`layout` must be named.*'zigzag'")
    ),
    "ring_uneven_length_seq_len_w4": Program(cp_ring_uneven_length_seq_len, world=4),
    "ring_uneven_chunks_misuse_w4": Program(
        cp_ring_uneven_chunks_misuse,
        world=4,
        error=(ValueError, r"ring_attention\(\): `q` must be of the same length.*rank 2: 3, rank 3: 1"),
    ),
    "ring_uneven_chunks_misuse_debug_w4": Program(
        cp_ring_uneven_chunks_misuse_debug, world=4, error=(ValueError, r"ring_attention.*\bq\b")
    ),
    "ring_seq_len_contradicts_shard": Program(
        cp_ring_seq_len_contradicts_shard, error=(ValueError, r"`seq_len` must be 10 \(or None\)")
    ),
    "ring_packed_documents": Program(cp_ring_packed_documents),
    "ring_bool_mask_rows": Program(cp_ring_bool_mask_rows),
    "ring_scale_loss_through_unshard": Program(cp_ring_scale_and_loss_through_unshard),
    "ring_gradient_penalty": Program(
        cp_ring_gradient_penalty, error=(RuntimeError, r"first-order backward only")
    ),
    "ulysses_gradient_penalty": Program(cp_ulysses_gradient_penalty),
    "ulysses_gradient_penalty_reference_as_attn_fn": Program(
        cp_ulysses_gradient_penalty_reference_as_attn_fn
    ),
    "ulysses_contiguous_causal": Program(cp_ulysses_contiguous_causal),
    "ulysses_zigzag_shard": Program(cp_ulysses_zigzag_shard, error=(ValueError, r"`q`")),
    "ulysses_gqa_uneven_heads_lengths": Program(cp_ulysses_gqa_uneven_heads_lengths),
    "usp_2x2_zigzag_w4": Program(cp_usp_2x2_zigzag, world=4),
    "usp_shard_to_ring_w4": Program(cp_usp_shard_to_ring, world=4, error=(ValueError, r"`q`.*Ulysses")),
    "q_and_k_placed_differently": Program(cp_q_and_k_placed_differently, error=(ValueError, r"`k`|`q`")),
    "block_projections_named_everywhere": Program(cp_block_projections_named_everywhere),
    "block_projections_named_at_shard_only": Program(
        cp_block_projections_named_at_shard_only, error=(ValueError, r"`layout` must be named.*'zigzag'")
    ),
    "unshard_with_other_layout": Program(cp_unshard_with_other_layout, error=(ValueError, r"`layout`")),
    "ring_forgot_seq_len_w4": Program(cp_ring_forgot_seq_len, world=4),
    "ulysses_whole_sequence_under_check": Program(
        cp_ulysses_whole_sequence_under_check, error=(TypeError, r"q, k, v must be this rank's piece")
    ),
    "ring_additive_mask_gradient": Program(cp_ring_additive_mask_gradient),
    "ring_dropout_vs_reference_w4": Program(cp_ring_dropout_vs_reference, world=4),
    "ulysses_fewer_heads_than_ranks_w3": Program(cp_ulysses_fewer_heads_than_ranks, world=3),
    "ring_v_head_dim_and_frozen_kv": Program(cp_ring_v_head_dim_and_frozen_kv),
    "unshard_grad_without_layout": Program(cp_unshard_grad_without_layout),
    "ring_on_mesh_axis_with_dp_w4": Program(cp_ring_on_mesh_axis_with_dp_w4, world=4),
    "ring_mixed_dtypes": Program(cp_ring_mixed_dtypes, error=(TypeError, r"`k/v` must be of q.s dtype")),
    "usp_packed_documents_w4": Program(cp_usp_packed_documents_w4, world=4),
    "ring_zigzag_causal_and_mask_w3": Program(cp_ring_zigzag_causal_and_mask_w3, world=3),
    "ulysses_explicit_seq_lens_w3": Program(cp_ulysses_explicit_seq_lens_w3, world=3),
    "ring_mask_rows_other_layout": Program(
        cp_ring_mask_rows_other_layout,
        error=(ValueError, r"`attn_mask` must be this rank's rows under q's layout"),
    ),
}


# ------------------------------------------------------------------ expert parallelism


def _tokens(counts: list[int], h: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """All ranks' tokens (rank 0's first), their cotangents, and this rank's rows."""
    r = dc.get_rank()
    g = _gen(seed)
    n = sum(counts)
    xs, cot = torch.randn(n, h, dtype=F64, generator=g), torch.randn(n, h, dtype=F64, generator=g)
    lo = sum(counts[:r])
    return xs, cot, slice(lo, lo + counts[r])


def _ep_vs_serial(
    counts: list[int],
    *,
    e: int = 4,
    k: int = 2,
    coef: float = 0.5,
    build: str = "from_serial",
    checked: bool = False,
    **layer_kw: Any,
) -> dict[str, float]:
    """The notebook's comparison: the serial MoE on all tokens, the parallel layer on this
    rank's, loss ``(y * cot).sum() + coef * aux_loss``; every parameter through the
    documented serial mapping (``serial_names``), shares summed by
    ``sync_replicated_grads``."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    h = 6
    serial = MoE(h, 5, e, k, activation="tanh", dtype=F64, seed=0, **layer_kw)
    if build == "from_serial":
        ep = ExpertParallelMoE.from_serial(serial)
    else:  # built on its own, then loaded from the serial state dict
        ep = ExpertParallelMoE(h, 5, e, k, activation="tanh", dtype=F64, seed=123, **layer_kw)
        ep.load_serial_state_dict(serial.state_dict())
    xs, cot, mine = _tokens(counts, h)
    x_all = xs.clone().requires_grad_()
    y_all = serial(x_all)
    ((y_all * cot).sum() + coef * serial.aux_loss).backward()
    x = xs[mine].clone().requires_grad_()
    with dc.spmd_check(varying=[x]) if checked else contextlib.nullcontext():
        y = ep(x)
        loss = (y * cot[mine]).sum() + coef * ep.aux_loss
        loss.backward()
        ep.sync_replicated_grads()
    assert x_all.grad is not None
    out = {
        "y": _d(y, y_all[mine]),
        "dx": _d(x.grad, x_all.grad[mine]),
        "loss": abs(
            float(dc.all_reduce(loss.detach())) - float((y_all * cot).sum() + coef * serial.aux_loss)
        ),
    }
    sp = dict(serial.named_parameters())
    for name, p in ep.named_parameters():
        q = sp[ep.serial_names()[name]]
        out[f"{name}"] = max(_d(p, q), _d(p.grad, q.grad))
    return out


def moe_ep_from_serial_k2() -> dict[str, float]:
    """The notebook's check: from_serial, k = 2, a shared expert, 7 and 5 tokens."""
    return _ep_vs_serial([7, 5], shared_expert_size=4)


def moe_ep_capacity_drops_w3() -> dict[str, float]:
    """A capacity factor that drops assignments, world 3, 6 experts."""
    return _ep_vs_serial([5, 4, 6], e=6, capacity_factor=0.75)


def moe_ep_k1_renormalize_empty_rank_w4() -> dict[str, float]:
    """k = 1, renormalised gates, a rank with no tokens, world 4."""
    return _ep_vs_serial([3, 0, 4, 2], k=1, renormalize=True)


def moe_ep_built_then_loaded() -> dict[str, float]:
    """Built on its own (another seed), then ``load_serial_state_dict(serial.state_dict())``."""
    return _ep_vs_serial([4, 6], build="load", shared_expert_size=3)


def moe_ep_k_equals_e() -> dict[str, float]:
    """k = E = 4: every token to every expert, with a capacity factor of 1."""
    return _ep_vs_serial([3, 5], k=4, capacity_factor=1.0)


def moe_ep_assert_matches_serial() -> dict[str, float]:
    """The docs' one-liner: ``assert_matches_serial`` with no param_map (called on every rank)."""
    from diffcomm.parallel import ExpertParallelMoE, MoE
    from diffcomm.testing import Shard, assert_matches_serial, build

    def make_serial() -> Any:
        return MoE(4, 6, 4, 2, shared_expert_size=5, activation="tanh", dtype=F64, seed=0)

    assert_matches_serial(
        build(ExpertParallelMoE.from_serial),
        build(make_serial),
        lambda: torch.randn(6, 4, dtype=F64),
        input_specs=[Shard(0)],
        output_specs=[Shard(0)],
        rtol=0.0,
        atol=TOL,
    )
    return {"assert_matches_serial": 0.0}


def moe_ep_two_sgd_steps_mean_loss() -> dict[str, float]:
    """Two SGD steps on a mean loss over all tokens (``plan.total_tokens``), the serial MoE
    beside it; the parameters after the steps through ``to_serial_state_dict``."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    counts = [6, 4]
    serial = MoE(6, 5, 4, 2, shared_expert_size=3, activation="tanh", dtype=F64, seed=0)
    ep = ExpertParallelMoE.from_serial(serial)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(ep.parameters(), lr=0.1, momentum=0.9)
    out = {}
    for step in range(2):
        xs, cot, mine = _tokens(counts, 6, seed=10 + step)
        opt_s.zero_grad()
        ((serial(xs) - cot).pow(2).sum() / len(xs) + 0.1 * serial.aux_loss).backward()
        opt_s.step()
        opt_p.zero_grad()
        y = ep(xs[mine])
        ((y - cot[mine]).pow(2).sum() / ep.plan.total_tokens + 0.1 * ep.aux_loss).backward()
        ep.sync_replicated_grads()
        opt_p.step()
    sd = ep.to_serial_state_dict()
    for name, p in serial.named_parameters():
        out[name] = _d(sd[name], p.detach())
    return out


def _manual(
    counts: list[int], *, e: int, k: int, async_op: bool = False, identity: bool = False
) -> dict[str, float]:
    """route -> dispatch -> local experts (tanh(x @ W_e)) -> combine, by hand, against the
    same computation on all tokens in one process."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    h = 5
    g = _gen(7)
    router = torch.randn(h, e, dtype=F64, generator=g)
    experts = torch.randn(e, h, h, dtype=F64, generator=g) / h**0.5
    xs, cot, mine = _tokens(counts, h)
    per = e // w
    # parallel
    wr = router.clone().requires_grad_()
    we = experts[r * per : (r + 1) * per].clone().requires_grad_()
    x = xs[mine].clone().requires_grad_()
    gates, index, _ = parallel.route(x @ wr, k)
    h_in, plan = parallel.dispatch(x, index, e, async_op=async_op)
    if identity:
        h_out = h_in * 1.0
    else:
        h_out = torch.cat(
            [torch.tanh(rows @ we[i]) for i, rows in enumerate(h_in.split(list(plan.expert_splits)))]
        )
    y = parallel.combine(h_out, gates, plan)
    (y * cot[mine]).sum().backward()
    assert wr.grad is not None
    d_router = dc.all_reduce(wr.grad)
    # serial
    wr_s, we_s, x_s = (t.clone().requires_grad_() for t in (router, experts, xs))
    probs = (x_s @ wr_s).softmax(-1)
    top, idx = probs.topk(k, -1)
    y_s = torch.zeros_like(x_s)
    for j in range(k):
        f = x_s if identity else torch.tanh(torch.einsum("th,thg->tg", x_s, we_s[idx[:, j]]))
        y_s = y_s + top[:, j : j + 1] * f
    (y_s * cot).sum().backward()
    assert x_s.grad is not None and wr_s.grad is not None
    out = {"y": _d(y, y_s[mine]), "dx": _d(x.grad, x_s.grad[mine]), "drouter": _d(d_router, wr_s.grad)}
    if not identity:
        assert we_s.grad is not None
        out["dexperts"] = _d(we.grad, we_s.grad[r * per : (r + 1) * per])
    return out


def moe_manual_route_dispatch_combine() -> dict[str, float]:
    """The pair by hand: 4 experts as weight tensors, 2 per rank, k = 2."""
    return _manual([5, 7], e=4, k=2)


def moe_manual_identity_experts_w3() -> dict[str, float]:
    """Identity experts: y = sum of the gates times x (world 3, 6 experts, k = 3)."""
    return _manual([4, 2, 5], e=6, k=3, identity=True)


def moe_manual_async_dispatch() -> dict[str, float]:
    """``dispatch(..., async_op=True)``: the AsyncTensor goes straight into torch ops."""
    return _manual([6, 3], e=4, k=2, async_op=True)


def moe_manual_async_dispatch_one_expert_per_rank_w4() -> dict[str, float]:
    """Async dispatch, one expert per rank, world 4, k = 1."""
    return _manual([2, 3, 4, 1], e=4, k=1, async_op=True)


def moe_load_balancing_loss() -> dict[str, float]:
    """``load_balancing_loss`` summed over ranks is the serial Switch loss E * sum_e f_e P_e,
    its gradient through the router probabilities."""
    from diffcomm import parallel

    e, k, h, counts = 4, 2, 5, [5, 8]
    router = torch.randn(h, e, dtype=F64, generator=_gen(4))
    xs, _, mine = _tokens(counts, h)
    wr = router.clone().requires_grad_()
    x = xs[mine]
    _, index, probs = parallel.route(x @ wr, k)
    _, plan = parallel.dispatch(x, index, e)
    lb = parallel.load_balancing_loss(probs, plan)
    lb.backward()
    assert wr.grad is not None
    total, d_router = dc.all_reduce(lb.detach()), dc.all_reduce(wr.grad)
    wr_s = router.clone().requires_grad_()
    p_all = (xs @ wr_s).softmax(-1)
    idx = p_all.topk(k, -1).indices
    f = torch.bincount(idx.flatten(), minlength=e).to(F64) / (len(xs) * k)
    lb_s = e * (f * p_all.mean(0)).sum()
    lb_s.backward()
    return {"loss": _d(total, lb_s.detach()), "drouter": _d(d_router, wr_s.grad)}


def moe_plan_reuse_recompute() -> dict[str, float]:
    """A recomputed forward (checkpointing) reuses the plan: same values and gradients."""
    from diffcomm import parallel

    e, k, h, counts = 4, 2, 5, [6, 4]
    xs, cot, mine = _tokens(counts, h)
    router = torch.randn(h, e, dtype=F64, generator=_gen(9))
    x1, x2 = xs[mine].clone().requires_grad_(), xs[mine].clone().requires_grad_()
    gates, index, _ = parallel.route(xs[mine] @ router, k)
    h1, plan = parallel.dispatch(x1, index, e)
    h2, _ = parallel.dispatch(x2, index, e, plan=plan)
    y1 = parallel.combine(torch.sin(h1), gates, plan)
    y2 = parallel.combine(torch.sin(h2), gates, plan)
    (y1 * cot[mine]).sum().backward()
    (y2 * cot[mine]).sum().backward()
    return {"y": _d(y1, y2), "dx": _d(x1.grad, x2.grad)}


def _routed(k: int = 2, e: int = 4, t: int = 5, h: int = 3) -> tuple[Any, ...]:
    from diffcomm import parallel

    x = torch.randn(t, h, dtype=F64, generator=_gen(dc.get_rank()))
    gates, index, probs = parallel.route(torch.randn(t, e, dtype=F64, generator=_gen(1)), k)
    return x, gates, index, probs


def moe_combine_gates_k_plus_1() -> dict[str, float]:
    """combine given gates of shape (T, k+1) after a k = 2 dispatch: refused."""
    from diffcomm import parallel

    x, gates, index, _ = _routed()
    h_in, plan = parallel.dispatch(x, index, 4)
    parallel.combine(h_in, torch.cat([gates, gates[:, :1]], 1), plan)
    return {"reached": 1.0}


def moe_combine_wrong_rows() -> dict[str, float]:
    """combine given one row fewer than the dispatch delivered: refused."""
    from diffcomm import parallel

    x, gates, index, _ = _routed()
    h_in, plan = parallel.dispatch(x, index, 4)
    parallel.combine(torch.zeros(h_in.shape[0] + 1, 3, dtype=F64), gates, plan)
    return {"reached": 1.0}


def moe_dispatch_index_out_of_range() -> dict[str, float]:
    """Expert ids from a router over 8 experts, dispatched over 4: refused."""
    from diffcomm import parallel

    x, _, index, _ = _routed(e=8)
    parallel.dispatch(x, index, 4)
    return {"reached": 1.0}


def moe_dispatch_index_1d() -> dict[str, float]:
    """k = 1 with the index squeezed to (T,): refused (the docs say (T, k))."""
    from diffcomm import parallel

    x, _, index, _ = _routed(k=1)
    parallel.dispatch(x, index[:, 0], 4)
    return {"reached": 1.0}


def moe_dispatch_float_index() -> dict[str, float]:
    """Expert ids as floats: a TypeError naming expert_index."""
    from diffcomm import parallel

    x, _, index, _ = _routed()
    parallel.dispatch(x, index.to(F64), 4)
    return {"reached": 1.0}


def moe_num_experts_not_divisible() -> dict[str, float]:
    """3 experts over 2 ranks: refused, naming num_experts."""
    from diffcomm import parallel

    x, _, index, _ = _routed(e=3)
    parallel.dispatch(x, index, 3)
    return {"reached": 1.0}


def moe_plan_reused_with_other_k() -> dict[str, float]:
    """A plan made with k = 2 reused for a k = 1 dispatch: refused."""
    from diffcomm import parallel

    x, _, index, _ = _routed()
    _, plan = parallel.dispatch(x, index, 4)
    parallel.dispatch(x, index[:, :1], 4, plan=plan)
    return {"reached": 1.0}


def moe_route_k_too_large() -> dict[str, float]:
    """route(logits over 4 experts, k=5): refused, naming k."""
    _routed(k=5)
    return {"reached": 1.0}


def moe_layer_wrong_hidden() -> dict[str, float]:
    """The issue's ExpertParallelMoE(6, 5, 4)(zeros(3, 7)): an error naming x and hidden_size."""
    from diffcomm.parallel import ExpertParallelMoE

    ExpertParallelMoE(6, 5, num_experts=4, seed=0)(torch.zeros(3, 7))
    return {"reached": 1.0}


def moe_layer_k_too_large() -> dict[str, float]:
    """ExpertParallelMoE(k=9) over 4 experts: the error names k and the class called."""
    from diffcomm.parallel import ExpertParallelMoE

    ExpertParallelMoE(6, 5, num_experts=4, k=9, seed=0)
    return {"reached": 1.0}


def moe_layer_3d_input() -> dict[str, float]:
    """A (batch, seq, hidden) input (the layer takes (..., hidden)) against the serial
    MoE on the flattened tokens of all ranks."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    r = dc.get_rank()
    serial = MoE(6, 5, 4, 2, shared_expert_size=3, activation="tanh", dtype=F64, seed=0)
    ep = ExpertParallelMoE.from_serial(serial)
    xs, cot, _ = _tokens([12, 12], 6)
    x3, c3 = xs.view(4, 6, 6), cot.view(4, 6, 6)  # 2 sequences of 6 tokens per rank
    x_all = x3.clone().requires_grad_()
    ((serial(x_all) * c3).sum() + serial.aux_loss).backward()
    x = x3[2 * r : 2 * r + 2].clone().requires_grad_()
    y = ep(x)
    ((y * c3[2 * r : 2 * r + 2]).sum() + ep.aux_loss).backward()
    ep.sync_replicated_grads()
    assert x_all.grad is not None and serial.router.weight.grad is not None
    return {
        "y": _d(y, serial(x3)[2 * r : 2 * r + 2]),
        "dx": _d(x.grad, x_all.grad[2 * r : 2 * r + 2]),
        "drouter": _d(ep.router.weight.grad, serial.router.weight.grad),
    }


def moe_manual_capacity_drops() -> dict[str, float]:
    """dispatch with ``capacity_factor=0.5``: C = ceil(0.5 * N * k / E) per expert, first
    come first served in the serial order (rank 0's tokens first, token by token), the
    drop rule written from the docs."""
    import math

    from diffcomm import parallel

    e, k, h, counts = 4, 2, 3, [6, 5]
    xs, cot, mine = _tokens(counts, h)
    router = torch.randn(h, e, dtype=F64, generator=_gen(12))
    x = xs[mine].clone().requires_grad_()
    gates, index, _ = parallel.route(x @ router, k)
    h_in, plan = parallel.dispatch(x, index, e, capacity_factor=0.5)
    y = parallel.combine(torch.sin(h_in), gates, plan)
    (y * cot[mine]).sum().backward()
    x_s = xs.clone().requires_grad_()
    top, idx = (x_s @ router).softmax(-1).topk(k, -1)
    cap = math.ceil(0.5 * len(xs) * k / e)
    taken = [0] * e
    keep = torch.zeros(len(xs), k, dtype=torch.bool)
    for t in range(len(xs)):
        for j in range(k):
            ex = int(idx[t, j])
            if taken[ex] < cap:
                taken[ex] += 1
                keep[t, j] = True
    y_s = (top * keep * 1.0).unsqueeze(-1).mul(torch.sin(x_s).unsqueeze(1)).sum(1)
    (y_s * cot).sum().backward()
    assert x_s.grad is not None
    return {"y": _d(y, y_s[mine]), "dx": _d(x.grad, x_s.grad[mine])}


def moe_manual_gradient_penalty() -> dict[str, float]:
    """A gradient penalty through dispatch/combine (the docs: double backward works),
    against the same program on all tokens in one process."""
    from diffcomm import parallel

    r, w = dc.get_rank(), dc.get_world_size()
    e, k, h, counts = 4, 2, 3, [4, 5]
    g = _gen(13)
    router = torch.randn(h, e, dtype=F64, generator=g)
    experts = torch.randn(e, h, h, dtype=F64, generator=g)
    xs, cot, mine = _tokens(counts, h)
    per = e // w
    we = experts[r * per : (r + 1) * per].clone().requires_grad_()
    x = xs[mine].clone().requires_grad_()
    gates, index, _ = parallel.route(x @ router, k)
    h_in, plan = parallel.dispatch(x, index, e)
    h_out = torch.cat(
        [torch.tanh(rows @ we[i]) for i, rows in enumerate(h_in.split(list(plan.expert_splits)))]
    )
    task = (parallel.combine(h_out, gates, plan) * cot[mine]).sum()
    (gx,) = torch.autograd.grad(task, x, create_graph=True)
    (task + gx.square().sum()).backward()
    we_s, x_s = experts.clone().requires_grad_(), xs.clone().requires_grad_()
    top, idx = (x_s @ router).softmax(-1).topk(k, -1)
    y_s = sum(
        top[:, j : j + 1] * torch.tanh(torch.einsum("th,thg->tg", x_s, we_s[idx[:, j]])) for j in range(k)
    )
    t_s = (y_s * cot).sum()
    (gx_s,) = torch.autograd.grad(t_s, x_s, create_graph=True)
    (t_s + gx_s.square().sum()).backward()
    assert x_s.grad is not None and we_s.grad is not None
    return {"dx": _d(x.grad, x_s.grad[mine]), "dexperts": _d(we.grad, we_s.grad[r * per : (r + 1) * per])}


def moe_ep_custom_experts() -> dict[str, float]:
    """``experts=`` this rank's own modules (nn.Linear + tanh), the serial computation by
    hand from the layer's router (``moe.router``)."""
    import copy

    from torch import nn

    from diffcomm.parallel import ExpertParallelMoE

    r, w = dc.get_rank(), dc.get_world_size()
    e, k, h, counts = 4, 2, 5, [5, 7]
    torch.manual_seed(0)
    all_experts = [nn.Sequential(nn.Linear(h, h), nn.Tanh()).to(F64) for _ in range(e)]
    per = e // w
    serial_experts = copy.deepcopy(all_experts)
    moe = ExpertParallelMoE(h, 8, e, k, experts=all_experts[r * per : (r + 1) * per], dtype=F64, seed=0)
    xs, cot, mine = _tokens(counts, h)
    x = xs[mine].clone().requires_grad_()
    y = moe(x)
    (y * cot[mine]).sum().backward()
    moe.sync_replicated_grads()
    router = moe.router.weight.detach().clone().requires_grad_()
    x_s = xs.clone().requires_grad_()
    top, idx = (x_s @ router.T).softmax(-1).topk(k, -1)
    outs = torch.stack([ex(x_s) for ex in serial_experts], 1)  # (N, E, h)
    y_s = sum(top[:, j : j + 1] * outs[torch.arange(len(xs)), idx[:, j]] for j in range(k))
    (y_s * cot).sum().backward()
    assert x_s.grad is not None
    out = {
        "y": _d(y, y_s[mine]),
        "dx": _d(x.grad, x_s.grad[mine]),
        "drouter": _d(moe.router.weight.grad, router.grad),
    }
    for i in range(r * per, (r + 1) * per):
        for (n, p), q in zip(all_experts[i].named_parameters(), serial_experts[i].parameters()):
            out[f"expert{i}.{n}"] = _d(p.grad, q.grad)
    return out


def moe_ep_grad_accumulation() -> dict[str, float]:
    """Two micro-batches, backward each, ``sync_replicated_grads()`` once: the serial MoE
    over both micro-batches' tokens."""
    from diffcomm.parallel import ExpertParallelMoE, MoE

    serial = MoE(6, 5, 4, 2, shared_expert_size=3, activation="tanh", dtype=F64, seed=0)
    ep = ExpertParallelMoE.from_serial(serial)
    for mb in range(2):
        xs, cot, mine = _tokens([4, 3] if mb == 0 else [2, 6], 6, seed=20 + mb)
        ((serial(xs) * cot).sum() + 0.3 * serial.aux_loss).backward()
        ((ep(xs[mine]) * cot[mine]).sum() + 0.3 * ep.aux_loss).backward()
    ep.sync_replicated_grads()
    sp = dict(serial.named_parameters())
    return {name: _d(p.grad, sp[ep.serial_names()[name]].grad) for name, p in ep.named_parameters()}


def moe_ep_on_mesh_with_dp_w4() -> dict[str, float]:
    """A 2x2 mesh (dp x ep): ``group=(mesh, "ep")``; each EP group is a serial MoE over its
    own tokens (different data per dp replica)."""
    from torch.distributed.device_mesh import init_device_mesh

    from diffcomm.parallel import ExpertParallelMoE, MoE

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dp, ep_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    serial = MoE(6, 5, 4, 2, shared_expert_size=3, activation="tanh", dtype=F64, seed=0)
    ep = ExpertParallelMoE.from_serial(serial, group=(mesh, "ep"))
    counts = [3, 5]
    g = _gen(30 + dp)
    xs, cot = torch.randn(8, 6, dtype=F64, generator=g), torch.randn(8, 6, dtype=F64, generator=g)
    mine = slice(sum(counts[:ep_rank]), sum(counts[: ep_rank + 1]))
    x_all = xs.clone().requires_grad_()
    ((serial(x_all) * cot).sum() + serial.aux_loss).backward()
    x = xs[mine].clone().requires_grad_()
    y = ep(x)
    ((y * cot[mine]).sum() + ep.aux_loss).backward()
    ep.sync_replicated_grads()
    sp = dict(serial.named_parameters())
    assert x_all.grad is not None
    out = {"y": _d(y, serial(xs)[mine]), "dx": _d(x.grad, x_all.grad[mine])}
    out.update({name: _d(p.grad, sp[ep.serial_names()[name]].grad) for name, p in ep.named_parameters()})
    return out


def moe_lb_loss_wrong_probs() -> dict[str, float]:
    """load_balancing_loss given the probabilities of one token fewer: refused."""
    from diffcomm import parallel

    x, _, index, probs = _routed()
    _, plan = parallel.dispatch(x, index, 4)
    parallel.load_balancing_loss(probs[:-1], plan)
    return {"reached": 1.0}


def moe_dispatch_tokens_mismatch() -> dict[str, float]:
    """dispatch given x of one token fewer than expert_index: refused."""
    from diffcomm import parallel

    x, _, index, _ = _routed()
    parallel.dispatch(x[:-1], index, 4)
    return {"reached": 1.0}


def moe_layer_float32_input() -> dict[str, float]:
    """A float32 batch into a float64 layer."""
    from diffcomm.parallel import ExpertParallelMoE

    ExpertParallelMoE(6, 5, 4, dtype=F64, seed=0)(torch.zeros(3, 6))
    return {"reached": 1.0}


def moe_ep_under_spmd_check() -> dict[str, float]:
    """The docs' step under ``dc.spmd_check`` (tokens declared varying): no false positive,
    and the values still equal the serial MoE's."""
    return _ep_vs_serial([5, 4], checked=True, shared_expert_size=3)


def moe_ep_forgot_sync_under_check() -> dict[str, float]:
    """The same step without ``sync_replicated_grads()`` under ``dc.spmd_check``: the
    router's gradient is a per-rank share; leaving the block must name it."""
    from diffcomm.parallel import ExpertParallelMoE

    moe = ExpertParallelMoE(6, 5, 4, 2, dtype=F64, seed=0)
    x = torch.randn(5, 6, dtype=F64, generator=_gen(dc.get_rank()))
    with dc.spmd_check(varying=[x]):
        (moe(x).pow(2).sum() + 0.1 * moe.aux_loss).backward()
    return {"reached": 1.0}


def moe_histogram_and_dropped() -> dict[str, float]:
    """``tokens_per_expert`` (over the whole group, before dropping) and ``dropped`` against
    counts by hand from the serial routing and the docs' drop rule."""
    import math

    from diffcomm.parallel import ExpertParallelMoE, MoE

    e, k, counts, cf = 4, 2, [7, 5], 0.6
    serial = MoE(6, 5, e, k, capacity_factor=cf, activation="tanh", dtype=F64, seed=0)
    ep = ExpertParallelMoE.from_serial(serial)
    xs, _, mine = _tokens(counts, 6)
    ep(xs[mine])
    idx = (xs @ serial.router.weight.detach().T).softmax(-1).topk(k, -1).indices
    hist = torch.bincount(idx.flatten(), minlength=e)
    cap = math.ceil(cf * len(xs) * k / e)
    dropped = int((hist - cap).clamp(min=0).sum())
    serial(xs)  # the serial layer on all ranks' tokens: the same count (docs/moe.md)
    assert dropped > 0
    return {
        "tokens_per_expert": _d(torch.as_tensor(ep.tokens_per_expert).to(F64), hist.to(F64)),
        "dropped": abs(float(ep.dropped) - dropped),
        "serial_dropped": abs(float(serial.dropped) - dropped),
    }


def moe_async_straight_to_combine_and_linear() -> dict[str, float]:
    """Async dispatch: the AsyncTensor into an ``nn.Linear`` expert (one expert per rank)
    and, in a second step, straight into ``combine`` (a skip expert)."""
    from torch import nn

    from diffcomm import parallel

    r = dc.get_rank()
    e, k, h, counts = 2, 1, 4, [5, 3]
    torch.manual_seed(0)
    experts = [nn.Linear(h, h).to(F64) for _ in range(e)]
    xs, cot, mine = _tokens(counts, h)
    router = torch.randn(h, e, dtype=F64, generator=_gen(2))
    x = xs[mine].clone().requires_grad_()
    gates, index, _ = parallel.route(x @ router, k)
    h_in, plan = parallel.dispatch(x, index, e, async_op=True)
    y = parallel.combine(experts[r](h_in), gates, plan)
    h_in2, plan2 = parallel.dispatch(x, index, e, async_op=True)
    y2 = parallel.combine(h_in2, gates, plan2)
    ((y + y2) * cot[mine]).sum().backward()
    x_s = xs.clone().requires_grad_()
    top, idx = (x_s @ router).softmax(-1).topk(k, -1)
    ys = torch.stack([ex(x_s) for ex in experts], 1)[torch.arange(len(xs)), idx[:, 0]]
    ((top[:, :1] * (ys + x_s)) * cot).sum().backward()
    assert x_s.grad is not None
    return {"y": _d(y + y2, (top[:, :1] * (ys + x_s))[mine]), "dx": _d(x.grad, x_s.grad[mine])}


def moe_manual_empty_rank() -> dict[str, float]:
    """A rank with no tokens (a (0, H) batch) in the hand-written pair."""
    return _manual([0, 6], e=4, k=2)


def moe_plan_reused_after_routing_changed() -> dict[str, float]:
    """The plan of the previous step reused (to skip the counts exchange) after the router
    changed the routing, same shapes: must raise naming `plan` or give the fresh
    dispatch's values and gradients, never send tokens to the old experts."""
    from diffcomm import parallel

    e, k, h = 4, 2, 3
    x = torch.randn(6, h, dtype=F64, generator=_gen(dc.get_rank())).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    cot = torch.randn(6, h, dtype=F64, generator=_gen(52))
    _, index, _ = parallel.route(torch.randn(6, e, dtype=F64, generator=_gen(50)), k)
    gates2, index2, _ = parallel.route(torch.randn(6, e, dtype=F64, generator=_gen(51)), k)
    assert not torch.equal(index, index2)
    _, plan = parallel.dispatch(x, index, e)
    h_in, plan2 = parallel.dispatch(x, index2, e, plan=plan)
    first = dc.get_rank() * (e // dc.get_world_size())

    def experts(rows: torch.Tensor, p: Any) -> torch.Tensor:  # expert j: sin((j + 1) * x)
        parts = rows.split(list(p.expert_splits))
        return torch.cat([torch.sin((first + i + 1) * part) for i, part in enumerate(parts)])

    y = parallel.combine(experts(h_in, plan2), gates2, plan2)
    (y * cot).sum().backward()
    h_ok, plan_ok = parallel.dispatch(x2, index2, e)
    y_ok = parallel.combine(experts(h_ok, plan_ok), gates2, plan_ok)
    (y_ok * cot).sum().backward()
    return {"y": _d(y, y_ok), "dx": _d(x.grad, x2.grad)}


def moe_plan_reused_with_other_capacity() -> dict[str, float]:
    """The plan of a dropless dispatch reused with ``capacity_factor=`` (same routing): the
    plan would not drop; must raise naming ``plan``."""
    from diffcomm import parallel

    x = torch.randn(6, 3, dtype=F64, generator=_gen(dc.get_rank()))
    _, index, _ = parallel.route(torch.randn(6, 4, dtype=F64, generator=_gen(50)), 2)
    _, plan = parallel.dispatch(x, index, 4)
    parallel.dispatch(x, index, 4, capacity_factor=0.5, plan=plan)
    return {"reached": 1.0}


def moe_serial_layer_float32_input() -> dict[str, float]:
    """A float32 batch into the float64 serial MoE: named as the parallel layer names it."""
    from diffcomm.parallel import MoE

    MoE(6, 5, 4, dtype=F64, seed=0)(torch.zeros(3, 6))
    return {"reached": 1.0}


def moe_int32_index_duplicate_expert() -> dict[str, float]:
    """A hand-made int32 index that picks the same expert twice for some tokens: the token
    gets the sum of both gates times that expert (identity experts)."""
    from diffcomm import parallel

    r = dc.get_rank()
    e, k, h = 4, 2, 3
    x = torch.randn(5, h, dtype=F64, generator=_gen(r)).requires_grad_()
    index = torch.tensor([[0, 0], [1, 3], [2, 2], [3, 1], [1, 1]], dtype=torch.int32)
    gates = torch.rand(5, k, dtype=F64, generator=_gen(60)).requires_grad_()
    h_in, plan = parallel.dispatch(x, index, e)
    y = parallel.combine(h_in * 2.0, gates, plan)
    cot = torch.randn(5, h, dtype=F64, generator=_gen(61))
    (y * cot).sum().backward()
    x_s, g_s = x.detach().clone().requires_grad_(), gates.detach().clone().requires_grad_()
    y_s = 2.0 * g_s.sum(1, keepdim=True) * x_s
    (y_s * cot).sum().backward()
    return {"y": _d(y, y_s), "dx": _d(x.grad, x_s.grad), "dgates": _d(gates.grad, g_s.grad)}


MOE_PROGRAMS: dict[str, Program] = {
    "ep_from_serial_k2": Program(moe_ep_from_serial_k2),
    "ep_capacity_drops_w3": Program(moe_ep_capacity_drops_w3, world=3),
    "ep_k1_renormalize_empty_rank_w4": Program(moe_ep_k1_renormalize_empty_rank_w4, world=4),
    "ep_built_then_loaded": Program(moe_ep_built_then_loaded),
    "ep_k_equals_e_capacity": Program(moe_ep_k_equals_e),
    "ep_assert_matches_serial": Program(moe_ep_assert_matches_serial),
    "ep_two_sgd_steps_mean_loss": Program(moe_ep_two_sgd_steps_mean_loss),
    "ep_3d_input": Program(moe_layer_3d_input),
    "manual_route_dispatch_combine": Program(moe_manual_route_dispatch_combine),
    "manual_identity_experts_w3": Program(moe_manual_identity_experts_w3, world=3),
    "manual_async_dispatch": Program(moe_manual_async_dispatch),
    "manual_async_one_expert_per_rank_w4": Program(moe_manual_async_dispatch_one_expert_per_rank_w4, world=4),
    "load_balancing_loss": Program(moe_load_balancing_loss),
    "plan_reuse_recompute": Program(moe_plan_reuse_recompute),
    "combine_gates_k_plus_1": Program(moe_combine_gates_k_plus_1, error=(ValueError, r"`gate_weights`")),
    "combine_wrong_rows": Program(moe_combine_wrong_rows, error=(ValueError, r"`expert_outputs`")),
    "dispatch_index_out_of_range": Program(
        moe_dispatch_index_out_of_range, error=(ValueError, r"`expert_index`")
    ),
    "dispatch_index_1d": Program(moe_dispatch_index_1d, error=(ValueError, r"`expert_index`")),
    "dispatch_float_index": Program(moe_dispatch_float_index, error=(TypeError, r"`expert_index`")),
    "num_experts_not_divisible": Program(moe_num_experts_not_divisible, error=(ValueError, r"`num_experts`")),
    "plan_reused_with_other_k": Program(moe_plan_reused_with_other_k, error=(ValueError, r"`plan`")),
    "route_k_too_large": Program(moe_route_k_too_large, error=(ValueError, r"`k`")),
    "layer_wrong_hidden": Program(moe_layer_wrong_hidden, error=(ValueError, r"`x`.*hidden_size")),
    "layer_k_too_large": Program(moe_layer_k_too_large, error=(ValueError, r"ExpertParallelMoE.*`k`")),
    "manual_capacity_drops": Program(moe_manual_capacity_drops),
    "manual_gradient_penalty": Program(moe_manual_gradient_penalty),
    "ep_custom_experts": Program(moe_ep_custom_experts),
    "ep_grad_accumulation": Program(moe_ep_grad_accumulation),
    "ep_on_mesh_with_dp_w4": Program(moe_ep_on_mesh_with_dp_w4, world=4),
    "lb_loss_wrong_probs": Program(moe_lb_loss_wrong_probs, error=(ValueError, r"`probs`")),
    "dispatch_tokens_mismatch": Program(
        moe_dispatch_tokens_mismatch, error=(ValueError, r"`x`|`expert_index`")
    ),
    "ep_under_spmd_check": Program(moe_ep_under_spmd_check),
    "ep_forgot_sync_under_check": Program(
        moe_ep_forgot_sync_under_check,
        error=(TypeError, r"ExpertParallelMoE\.router\.weight.*ExpertParallelMoE\.sync_replicated_grads\(\)"),
    ),
    "histogram_and_dropped": Program(moe_histogram_and_dropped),
    "async_straight_to_combine_and_linear": Program(moe_async_straight_to_combine_and_linear),
    "manual_empty_rank": Program(moe_manual_empty_rank),
    "plan_reused_after_routing_changed": Program(
        moe_plan_reused_after_routing_changed, error=(ValueError, r"`plan`.*routing changed")
    ),
    "plan_reused_with_other_capacity": Program(
        moe_plan_reused_with_other_capacity, error=(ValueError, r"`plan`.*capacity_factor")
    ),
    "serial_layer_float32_input": Program(
        moe_serial_layer_float32_input,
        error=(TypeError, r"parallel\.MoE\(\): `x` must be of the layer's dtype"),
    ),
    "int32_index_duplicate_expert": Program(moe_int32_index_duplicate_expert),
    "layer_float32_input": Program(
        moe_layer_float32_input, error=(TypeError, r"ExpertParallelMoE\(\): `x` must be of the layer's dtype")
    ),
}


# ------------------------------------------------------------------ where two APIs meet
#
# Written from docs/precision.md, docs/async.md, docs/in_process.md, docs/rng.md,
# docs/context_parallel.md and docs/spmd_types.md: precision= with the mappings and MoE,
# asynchronous results fed to other ops (the check, the ring, an optimizer), the RNG
# streams with context parallelism, the replication-type check with asynchronous and
# quantized ops. Each also runs in the in-process world (test_seam_program_in_process):
# the same ending there as on processes.


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    """Small integers as float64: exact on a bf16 / fp16 wire and in every sum here, so a
    quantized program's values and gradients equal the float64 reference exactly."""
    return torch.randint(-4, 5, shape, generator=_gen(seed)).to(F64)


def seam_precision_all_gather_bf16_fp16_backward() -> dict[str, float]:
    """all_gather on a bf16 wire with an fp16 backward; each rank's own loss."""
    r, w = dc.get_rank(), dc.get_world_size()
    xs = _ints(w, 3, 4, seed=1)
    x = xs[r].clone().requires_grad_()
    y = dc.all_gather(x, precision=dc.Precision("bf16", backward=dc.Precision("fp16")))
    (y * _ints(3 * w, 4, seed=10 + r)).sum().backward()
    xf = xs.clone().requires_grad_()
    yf = torch.cat(list(xf))
    sum((yf * _ints(3 * w, 4, seed=10 + j)).sum() for j in range(w)).backward()
    assert xf.grad is not None
    return {"y": _d(y, yf), "dx": _d(x.grad, xf.grad[r])}


def seam_precision_wire_none_uneven_avg_reduce_scatter() -> dict[str, float]:
    """Precision(None) (the payload's own dtype, exactly) on an uneven avg reduce_scatter
    of random float64 data."""
    r, w = dc.get_rank(), dc.get_world_size()
    sizes = [5 - (w - 1)] + [1] * (w - 1)
    xs = torch.randn(w, 5, 3, dtype=F64, generator=_gen(2))
    cots = torch.randn(w, 5, 3, dtype=F64, generator=_gen(3))
    x = xs[r].clone().requires_grad_()
    y = dc.reduce_scatter(x, op="avg", split_sizes=sizes, precision=dc.Precision(None))
    own = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    (y * cots[r][own]).sum().backward()
    xf = xs.clone().requires_grad_()
    mean = xf.mean(0)
    loss = sum(
        (mean[sum(sizes[:j]) : sum(sizes[: j + 1])] * cots[j][sum(sizes[:j]) : sum(sizes[: j + 1])]).sum()
        for j in range(w)
    )
    loss.backward()
    assert xf.grad is not None
    return {"y": _d(y, mean[own]), "dx": _d(x.grad, xf.grad[r])}


def seam_precision_row_parallel_reduce_bf16_backward() -> dict[str, float]:
    """A row-parallel linear leaving the region with reduce_from_region, forward exact
    (wire None) and backward on a bf16 wire; replicated loss (the mapping's convention)."""
    r, w = dc.get_rank(), dc.get_world_size()
    wt, x, c = _ints(4, 2 * w, seed=3), _ints(3, 2 * w, seed=4), _ints(3, 4, seed=5)
    cols = slice(2 * r, 2 * r + 2)
    wl = wt[:, cols].clone().requires_grad_()
    p = dc.Precision(None, backward=dc.Precision("bf16"))
    y = parallel.reduce_from_region(x[:, cols] @ wl.T, precision=p)
    (y * c).sum().backward()
    wf = wt.clone().requires_grad_()
    (x @ wf.T * c).sum().backward()
    assert wf.grad is not None
    return {"y": _d(y, x @ wt.T), "dw": _d(wl.grad, wf.grad[:, cols])}


def seam_precision_as_a_string() -> dict[str, float]:
    """precision="bf16" (a string, not a dc.Precision)."""
    dc.all_reduce(torch.ones(3, dtype=F64), precision="bf16")  # type: ignore[arg-type]
    return {}


def seam_precision_with_async_op() -> dict[str, float]:
    """precision= and async_op=True together (documented as not supported)."""
    dc.all_reduce(torch.ones(3, dtype=F64), precision=dc.Precision("bf16"), async_op=True)
    return {}


def seam_precision_moe_empty_rank() -> dict[str, float]:
    """dispatch / combine with precision=Precision(None), k=2, rank 1 holding no tokens,
    experts that scale their rows; against the serial mixture."""
    r, w = dc.get_rank(), dc.get_world_size()
    e, h, k = 2 * w, 3, 2
    counts = [5, 0] + [2] * (w - 2)
    g = _gen(7)
    xs = torch.randn(sum(counts), h, dtype=F64, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(sum(counts))])
    gates = torch.rand(sum(counts), k, dtype=F64, generator=g)
    cots = torch.randn(sum(counts), h, dtype=F64, generator=g)
    mine = slice(sum(counts[:r]), sum(counts[: r + 1]))
    x, gate = xs[mine].clone().requires_grad_(), gates[mine].clone().requires_grad_()
    p = dc.Precision(None)
    rows, plan = parallel.dispatch(x, idx[mine], e, precision=p)
    scale = torch.arange(1.0, e + 1, dtype=F64)
    parts = rows.split(plan.expert_splits)
    outs = torch.cat([part * scale[r * (e // w) + i] for i, part in enumerate(parts)])
    y = parallel.combine(outs, gate, plan, precision=p)
    (y * cots[mine]).sum().backward()
    xf, gf = xs.clone().requires_grad_(), gates.clone().requires_grad_()
    yf = sum(gf[:, j : j + 1] * xf * scale[idx[:, j]][:, None] for j in range(k))
    (yf * cots).sum().backward()
    assert xf.grad is not None and gf.grad is not None
    return {"y": _d(y, yf[mine]), "dx": _d(x.grad, xf.grad[mine]), "dgate": _d(gate.grad, gf.grad[mine])}


def seam_async_gather_into_reduce_scatter() -> dict[str, float]:
    """An AsyncTensor from all_gather, scaled, into a blocking reduce_scatter."""
    r, w = dc.get_rank(), dc.get_world_size()
    xs = torch.randn(w, 2, 3, dtype=F64, generator=_gen(1))
    cots = torch.randn(w, 2, 3, dtype=F64, generator=_gen(2))
    x = xs[r].clone().requires_grad_()
    z = dc.reduce_scatter(dc.all_gather(x, async_op=True) * 2)
    (z * cots[r]).sum().backward()
    xf = xs.clone().requires_grad_()
    (2 * w * xf * cots).sum().backward()  # z_j = sum over ranks of 2 x_j
    assert xf.grad is not None
    return {"z": _d(z, 2 * w * xs[r]), "dx": _d(x.grad, xf.grad[r])}


def seam_async_averaged_grads_into_sgd() -> dict[str, float]:
    """Data parallel: p.grad = dc.all_reduce(p.grad, op="avg", async_op=True) for each
    parameter, then torch's clip_grad_norm_ and SGD, two steps; against the serial model
    trained on the whole batch."""
    r, w = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2, dtype=F64)
    ser = torch.nn.Linear(3, 2, dtype=F64)
    ser.load_state_dict(lin.state_dict())
    xs = 3 * torch.randn(2 * w, 3, dtype=F64, generator=_gen(2))
    opt, opt_s = torch.optim.SGD(lin.parameters(), lr=0.5), torch.optim.SGD(ser.parameters(), lr=0.5)
    out = {}
    for step in range(2):
        opt.zero_grad()
        lin(xs[2 * r : 2 * r + 2]).pow(2).mean().backward()
        for p in lin.parameters():
            p.grad = dc.all_reduce(p.grad, op="avg", async_op=True)  # type: ignore[arg-type]
        norm = torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.5)
        opt.step()
        opt_s.zero_grad()
        ser(xs).pow(2).mean().backward()
        out[f"norm{step}"] = _d(norm, torch.nn.utils.clip_grad_norm_(ser.parameters(), 0.5))
        opt_s.step()
    return out | {n: _d(p, q) for (n, p), q in zip(lin.named_parameters(), ser.parameters())}


def seam_async_result_changed_in_place() -> dict[str, float]:
    """h = all_reduce(..., async_op=True); h.mul_(2) before any other use."""
    r, w = dc.get_rank(), dc.get_world_size()
    x = torch.full((3,), float(r + 1), dtype=F64, requires_grad=True)
    h = dc.all_reduce(x * 1, async_op=True)
    h.mul_(2)
    (h * torch.arange(3.0, dtype=F64)).sum().backward()
    total = w * (w + 1) / 2
    return {
        "h": _d(h.detach(), torch.full((3,), 2 * total, dtype=F64)),
        "dx": _d(x.grad, 2 * w * torch.arange(3.0, dtype=F64)),
    }


def seam_async_coalesced_into_async_all_gather() -> dict[str, float]:
    """all_reduce_coalesced(async_op=True) results concatenated into an asynchronous
    all_gather; each rank's own loss."""
    r, w = dc.get_rank(), dc.get_world_size()
    a = torch.full((2,), float(r + 1), dtype=F64, requires_grad=True)
    b = torch.full((3,), float(2 * r), dtype=F64, requires_grad=True)
    ha, hb = dc.all_reduce_coalesced([a, b], async_op=True)
    z = dc.all_gather(torch.cat([ha, hb]), async_op=True)
    (z * (torch.arange(5.0 * w, dtype=F64) + r)).sum().backward()
    sa, sb = w * (w + 1) / 2, float(w * (w - 1))
    want = torch.tensor([sa, sa, sb, sb, sb], dtype=F64).repeat(w)
    # d(sum of the ranks' losses)/dy_j = the sum over ranks of their cotangents' chunk j,
    # and every y_j holds the sums of a and b: each a gets the sum over the chunks
    g = sum(torch.arange(5.0 * w, dtype=F64) + j for j in range(w)).reshape(w, 5).sum(0)
    return {"z": _d(z, want), "da": _d(a.grad, g[:2]), "db": _d(b.grad, g[2:])}


def seam_async_broadcast_then_shard_ring() -> dict[str, float]:
    """Rank 0 holds the batch and broadcasts it asynchronously; every rank shards the
    AsyncTensor (zigzag) and runs causal ring attention."""
    r, w = dc.get_rank(), dc.get_world_size()
    q, k, v, _ = _qkv(1, 2, 4 * w, 4)
    qkv = torch.stack([q, k, v])
    full = dc.broadcast(qkv if r == 0 else torch.zeros_like(qkv), src=0, async_op=True)
    ql, kl, vl = (parallel.shard(full[i], layout="zigzag") for i in range(3))
    out = parallel.unshard(parallel.ring_attention(ql, kl, vl, causal=True))
    return {"out": _d(out, _sdpa(q, k, v, causal=True))}


def seam_async_counts_then_spmd_check() -> dict[str, float]:
    """A pending asynchronous all_gather of token counts (one int64 per rank) when a
    dc.spmd_check block is entered, rank 0 a little late (docs/async.md: launch order is
    issue order; a blocking op queues behind pending ones)."""
    import time

    r, w = dc.get_rank(), dc.get_world_size()
    if r == 0:
        time.sleep(0.5)
    big = dc.all_reduce(torch.full((200, 50), float(r + 1), dtype=F64), async_op=True)
    counts = dc.all_gather(torch.tensor([10 * (r + 1)]), async_op=True)
    if r == 0:
        time.sleep(0.5)
    with dc.spmd_check():
        y = dc.all_gather(dc.spmd.varying(torch.full((2,), float(r), dtype=F64)))
    want = torch.tensor([10 * (j + 1) for j in range(w)])
    return {
        "counts": _d(counts, want),
        "big": _d(big, torch.full((200, 50), w * (w + 1) / 2, dtype=F64)),
        "y": _d(y, torch.arange(float(w), dtype=F64).repeat_interleave(2)),
    }


def seam_cp_rope_positions_sharded() -> dict[str, float]:
    """Rotary embeddings from position ids sharded with the sequence (zigzag), causal ring
    attention; against SDPA over the whole sequence."""
    r, w = dc.get_rank(), dc.get_world_size()
    s, d = 8 * w, 4
    q, k, v, cot = _qkv(1, 2, s, d, seed=3)
    pos = torch.arange(s)

    def rope(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        ang = p.to(F64)[:, None] / (10000 ** (torch.arange(0, d, 2, dtype=F64) / d))[None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1).flatten(-2)

    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    pl = parallel.shard(pos, dim=0, layout="zigzag")
    out = parallel.ring_attention(rope(ql, pl), rope(kl, pl), vl, causal=True, layout="zigzag")
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(rope(qf, pos), rope(kf, pos), vf, is_causal=True)
    (ref * cot).sum().backward()
    idx = _idx(s, w, r, "zigzag")
    assert qf.grad is not None and kf.grad is not None and vf.grad is not None
    return {
        "out": _d(parallel.unshard(out, layout="zigzag"), ref),
        "dq": _d(ql.grad, qf.grad[:, :, idx]),
        "dk": _d(kl.grad, kf.grad[:, :, idx]),
        "dv": _d(vl.grad, vf.grad[:, :, idx]),
    }


def seam_cp_dropout_seed_per_rank() -> dict[str, float]:
    """Ring attention with dropout and a different dropout_seed on every rank: each rank's
    rows take its own seed's mask (the mask is a hash of global coordinates), forward and
    backward; against attention_reference with each rank's seed for its rows."""
    r, w = dc.get_rank(), dc.get_world_size()
    s = 4 * w
    q, k, v, cot = _qkv(1, 2, s, 4, seed=3)
    seeds = [11 + 7 * j for j in range(w)]
    ql, kl, vl = (parallel.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = parallel.ring_attention(ql, kl, vl, causal=True, dropout_p=0.4, dropout_seed=seeds[r])
    (out * parallel.shard(cot, layout="zigzag")).sum().backward()
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    refs = [
        parallel.attention_reference(qf, kf, vf, causal=True, dropout_p=0.4, dropout_seed=seeds[j])[
            :, :, _idx(s, w, j, "zigzag")
        ]
        for j in range(w)
    ]
    sum((ref * cot[:, :, _idx(s, w, j, "zigzag")]).sum() for j, ref in enumerate(refs)).backward()
    idx = _idx(s, w, r, "zigzag")
    assert qf.grad is not None and kf.grad is not None and vf.grad is not None
    return {
        "out": _d(out, refs[r]),
        "dq": _d(ql.grad, qf.grad[:, :, idx]),
        "dk": _d(kl.grad, kf.grad[:, :, idx]),
        "dv": _d(vl.grad, vf.grad[:, :, idx]),
    }


def seam_cp_dropout_seed_per_rank_debug() -> dict[str, float]:
    """The same in debug mode: a seed given per rank is that rank's own (only a drawn seed
    must agree). Before, the debug check refused it ("dropout_seed differs")."""
    with dc.debug(True):
        return seam_cp_dropout_seed_per_rank()


def seam_cp_dropout_seed_from_forked_stream() -> dict[str, float]:
    """dropout_seed=None inside rng's model-parallel stream (a different seed on every
    rank), debug mode on."""
    from diffcomm import rng

    r, w = dc.get_rank(), dc.get_world_size()
    rng.model_parallel_seed(1234, tp_rank=r)
    q, k, v, _ = _qkv(1, 2, 4 * w, 4)
    ql, kl, vl = (parallel.shard(t) for t in (q, k, v))
    with dc.debug(True), rng.get_tracker().fork():
        parallel.ring_attention(ql, kl, vl, dropout_p=0.5)
    return {}


def seam_cp_checkpointed_ring_dropout() -> dict[str, float]:
    """rng.checkpoint around ring attention with dropout, the seed drawn from the default
    generator inside the checkpointed function: the recomputation gives the forward's
    gradients."""
    from diffcomm import rng

    q, k, v, cot = _qkv(1, 2, 4 * dc.get_world_size(), 4, seed=3)

    def run(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(5)
        ql, kl, vl = (parallel.shard(t).requires_grad_() for t in (q, k, v))

        def attend(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return parallel.ring_attention(a * 1, b * 1, c * 1, dropout_p=0.3)

        out = rng.checkpoint(attend, ql, kl, vl) if checkpointed else attend(ql, kl, vl)
        (out * parallel.shard(cot)).sum().backward()
        assert ql.grad is not None and kl.grad is not None and vl.grad is not None
        return [out, ql.grad, kl.grad, vl.grad]

    return {n: _d(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), run(True), run(False))}


def _tp_under_check(reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """A column -> row TP MLP by hand, its leaving reduction given, in dc.spmd_check."""
    r, w = dc.get_rank(), dc.get_world_size()
    x = torch.randn(3, 4, dtype=F64, generator=_gen(1))
    w1 = torch.randn(2 * w, 4, dtype=F64, generator=_gen(2))[2 * r : 2 * r + 2].requires_grad_()
    w2 = torch.randn(4, 2 * w, dtype=F64, generator=_gen(3))[:, 2 * r : 2 * r + 2].clone().requires_grad_()
    with dc.spmd_check(varying=[w1, w2]):
        h = torch.tanh(parallel.copy_to_region(x) @ w1.T)
        reduce(h @ w2.T).pow(2).mean().backward()
    return {"unreachable": float("inf")}  # the check raises at the backward


def seam_check_quantized_all_reduce_under_replicated_objective() -> dict[str, float]:
    """dc.all_reduce(precision=...) where reduce_from_region belongs (Megatron's 2x),
    inside the check."""
    return _tp_under_check(lambda p: dc.all_reduce(p, precision=dc.Precision(None)))


def seam_check_async_all_reduce_under_replicated_objective() -> dict[str, float]:
    """dc.all_reduce(async_op=True) where reduce_from_region belongs, inside the check."""
    return _tp_under_check(lambda p: dc.all_reduce(p, async_op=True))


def _dp_async_under_check(forget_biases: bool) -> dict[str, float]:
    w = dc.get_world_size()
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2, dtype=F64)
    ser = torch.nn.Linear(3, 2, dtype=F64)
    ser.load_state_dict(lin.state_dict())
    xs = torch.randn(2 * w, 3, dtype=F64, generator=_gen(2))
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    with dc.spmd_check():
        rr = dc.get_rank()
        lin(xs[2 * rr : 2 * rr + 2]).pow(2).mean().backward()
        for p in lin.parameters():
            if not (forget_biases and p.dim() == 1):
                p.grad = dc.all_reduce(p.grad, op="avg", async_op=True)  # type: ignore[arg-type]
        opt.step()
    ser(xs).pow(2).mean().backward()
    torch.optim.SGD(ser.parameters(), lr=0.5).step()
    return {n: _d(p, q) for (n, p), q in zip(lin.named_parameters(), ser.parameters())}


def seam_check_dp_async_averaged_grads() -> dict[str, float]:
    """Data parallel in the check, gradients averaged asynchronously before the step."""
    return _dp_async_under_check(forget_biases=False)


def seam_check_dp_async_biases_forgotten() -> dict[str, float]:
    """The same with the biases' gradients left per rank: caught before the step."""
    return _dp_async_under_check(forget_biases=True)


def seam_check_moe_async_dispatch_router_not_summed() -> dict[str, float]:
    """Manual MoE (route, dispatch(async_op=True), combine) in the check, the router's
    gradient not summed over the ranks."""
    w = dc.get_world_size()
    e, h, k = 4, 3, 2
    router = torch.nn.Linear(h, e, bias=False, dtype=F64)
    xs = torch.randn(3 * w, h, dtype=F64, generator=_gen(5))
    with dc.spmd_check():
        rr = dc.get_rank()
        x = xs[3 * rr : 3 * rr + 3]
        gate, idx, _ = parallel.route(router(x), k)
        rows, plan = parallel.dispatch(x, idx, e, async_op=True)
        outs = torch.cat(
            [torch.tanh(part) * (i + 1) for i, part in enumerate(rows.split(plan.expert_splits))]
        )
        parallel.combine(outs, gate, plan).pow(2).sum().backward()
    return {"unreachable": float("inf")}


def _cp_tokens_into_ep_moe(
    capacity_factor: float | None, layout: str = "zigzag", positions: bool = True
) -> dict[str, float]:
    """Context parallel meets expert parallel: a (batch 2, sequence, hidden) activation
    sharded along the sequence goes through ExpertParallelMoE.from_serial over the same
    group, with each token's serial position (``b * S + s``, sharded alike: docs/moe.md,
    "Capacity and dropping"); against the serial MoE on the whole sequence, rows and
    gradients. Without ``positions`` the documented rule instead: the serial MoE on the
    tokens in rank order (rank 0's local tokens, then rank 1's, ...)."""
    r, w = dc.get_rank(), dc.get_world_size()
    s, h = 8 * w, 4
    x = torch.randn(2, s, h, dtype=F64, generator=_gen(0))
    cot = torch.randn(2, s, h, dtype=F64, generator=_gen(1))
    serial = parallel.MoE(h, 6, num_experts=2 * w, k=1, capacity_factor=capacity_factor, seed=0, dtype=F64)
    moe = parallel.ExpertParallelMoE.from_serial(serial)
    xl = parallel.shard(x, dim=1, layout=layout).requires_grad_()
    pos = parallel.shard(torch.arange(2 * s).reshape(2, s), dim=1, layout=layout) if positions else None
    y_l = moe(xl, positions=pos)
    (y_l * parallel.shard(cot, dim=1, layout=layout)).sum().backward()
    idx = [_idx(s, w, q, layout) for q in range(w)]
    if positions:  # the serial model's token order
        order = torch.arange(2 * s).reshape(2, s)
    else:  # rank order: every rank's (2, S / w) tokens flattened, rank after rank
        order = torch.cat([torch.arange(2 * s).reshape(2, s)[:, i].reshape(-1) for i in idx])
    xf = x.reshape(-1, h)[order.reshape(-1)].clone().requires_grad_()
    y = serial(xf)
    (y * cot.reshape(-1, h)[order.reshape(-1)]).sum().backward()
    assert xf.grad is not None
    if positions:
        y_ref, g_ref = y.reshape(2, s, h)[:, idx[r]], xf.grad.reshape(2, s, h)[:, idx[r]]
    else:
        lo, n = r * 2 * len(idx[r]), 2 * len(idx[r])
        y_ref, g_ref = (t[lo : lo + n].reshape(2, -1, h) for t in (y, xf.grad))
    got = {"y": _d(y_l.detach(), y_ref), "dx": _d(xl.grad, g_ref)}
    if capacity_factor is not None:  # the capacity really dropped some (else nothing is shown)
        got["nothing_dropped"] = float(moe.dropped == 0)
    return got


def seam_cp_tokens_into_ep_moe_dropless() -> dict[str, float]:
    return _cp_tokens_into_ep_moe(None)


def seam_cp_tokens_into_ep_moe_capacity() -> dict[str, float]:
    return _cp_tokens_into_ep_moe(1.0)


def seam_cp_tokens_into_ep_moe_capacity_contiguous() -> dict[str, float]:
    return _cp_tokens_into_ep_moe(0.75, layout="contiguous")


def seam_cp_tokens_into_ep_moe_capacity_rank_order() -> dict[str, float]:
    return _cp_tokens_into_ep_moe(1.0, positions=False)


# One group named two ways (the default group as ``None`` and as ``dist.group.WORLD``),
# and two groups over the same ranks (a new group of every rank, a mesh dim spanning
# them): what diffcomm keeps per group (row sizes learnt by all_gather, p2p message
# numbers, the flight recorder's counters) is one group's, never mixed across names.


def _gathers(group_of_step: Callable[[int], Any], steps: int = 3) -> dict[str, float]:
    """Uneven all_gathers without split sizes (and a coalesced one) on each step's group;
    values and gradients against the serial concatenation."""
    r, w = dc.get_rank(), dc.get_world_size()
    out: dict[str, float] = {}
    for step in range(steps):
        grp = group_of_step(step)
        xs = [_ints(1 + (j + step) % 3, 3, seed=20 * step + j) for j in range(w)]
        x = xs[r].clone().requires_grad_()
        y = dc.all_gather(x, group=grp)
        cs = [_ints(*y.shape, seed=90 + 10 * step + j) for j in range(w)]
        (y * cs[r]).sum().backward()
        off = sum(t.shape[0] for t in xs[:r])
        out[f"y{step}"] = _d(y, torch.cat(xs))
        out[f"dx{step}"] = _d(x.grad, sum(cs)[off : off + xs[r].shape[0]])
        a, b = _ints(1 + (r + step) % 2, 2, seed=60 + r), _ints(2, 1 + r % 2, seed=70 + r)
        ya, yb = dc.all_gather_coalesced([a, b.T], group=grp)
        out[f"coalesced{step}"] = max(
            _d(ya, torch.cat([_ints(1 + (j + step) % 2, 2, seed=60 + j) for j in range(w)])),
            _d(yb, torch.cat([_ints(2, 1 + j % 2, seed=70 + j).T for j in range(w)])),
        )
    return out


def seam_default_group_named_two_ways() -> dict[str, float]:
    """Rank 0 names the default group ``None``, the other ranks ``dist.group.WORLD`` (the
    same group), after the group learnt its row sizes under the name ``None`` only."""
    import torch.distributed as dist
    from _shared import forget_gathered_sizes

    forget_gathered_sizes()
    dc.all_gather(torch.zeros(2, 3, dtype=F64))
    dc.all_gather_coalesced([torch.zeros(2, 2, dtype=F64), torch.zeros(1, 2, dtype=F64)])
    world = None if dc.get_rank() == 0 else dist.group.WORLD
    return _gathers(lambda step: world)


def seam_groups_over_the_same_ranks() -> dict[str, float]:
    """The default group, a new group of every rank and a mesh dim spanning them, in
    turns; p2p messages on two of them received in the other order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    r, w = dc.get_rank(), dc.get_world_size()
    every = dist.new_group(list(range(w)))
    mesh = init_device_mesh("cpu", (1, w), mesh_dim_names=("dp", "tp"))
    groups = [None, every, (mesh, "tp"), dist.group.WORLD]
    out = _gathers(lambda step: groups[step % 4], steps=8)
    m = [_ints(4, seed=40 + k) for k in range(2)]
    if r == 0:
        a, b = m[0].clone().requires_grad_(), m[1].clone().requires_grad_()
        (dc.send(a, 1, group=every) + dc.send(b, 1)).backward()
        out["da"], out["db"] = _d(a.grad, 2 * m[0]), _d(b.grad, 3 * m[1])
    elif r == 1:
        v = dc.recv(0, group=dist.group.WORLD)  # sent second, on the default group
        u = dc.recv(0, group=every)
        (2 * u * m[0] + 3 * v * m[1]).sum().backward()
        out["u"], out["v"] = _d(u, m[0]), _d(v, m[1])
    return out


SEAM_PROGRAMS: dict[str, Program] = {
    "precision_all_gather_bf16_fp16_backward": Program(seam_precision_all_gather_bf16_fp16_backward),
    "precision_all_gather_bf16_fp16_backward_w3": Program(
        seam_precision_all_gather_bf16_fp16_backward, world=3
    ),
    "precision_wire_none_uneven_avg_reduce_scatter_w3": Program(
        seam_precision_wire_none_uneven_avg_reduce_scatter, world=3
    ),
    "precision_row_parallel_reduce_bf16_backward": Program(seam_precision_row_parallel_reduce_bf16_backward),
    "precision_as_a_string": Program(
        seam_precision_as_a_string, error=(TypeError, r"precision must be a diffcomm\.Precision")
    ),
    "precision_with_async_op": Program(
        seam_precision_with_async_op, error=(ValueError, r"async_op=True with precision=")
    ),
    "precision_moe_empty_rank_w3": Program(seam_precision_moe_empty_rank, world=3),
    "async_gather_into_reduce_scatter": Program(seam_async_gather_into_reduce_scatter),
    "async_averaged_grads_into_sgd_w3": Program(seam_async_averaged_grads_into_sgd, world=3),
    "async_result_changed_in_place": Program(seam_async_result_changed_in_place),
    "async_coalesced_into_async_all_gather": Program(seam_async_coalesced_into_async_all_gather),
    "async_broadcast_then_shard_ring": Program(seam_async_broadcast_then_shard_ring),
    "async_counts_then_spmd_check": Program(seam_async_counts_then_spmd_check),
    "cp_rope_positions_sharded": Program(seam_cp_rope_positions_sharded),
    "cp_dropout_seed_per_rank_w3": Program(seam_cp_dropout_seed_per_rank, world=3),
    "cp_dropout_seed_per_rank_debug_w3": Program(seam_cp_dropout_seed_per_rank_debug, world=3),
    "cp_dropout_seed_from_forked_stream": Program(
        seam_cp_dropout_seed_from_forked_stream, error=(ValueError, r"dropout_seed differs")
    ),
    "cp_checkpointed_ring_dropout": Program(seam_cp_checkpointed_ring_dropout),
    "cp_tokens_into_ep_moe_dropless": Program(seam_cp_tokens_into_ep_moe_dropless),
    "cp_tokens_into_ep_moe_capacity": Program(seam_cp_tokens_into_ep_moe_capacity),
    "cp_tokens_into_ep_moe_capacity_w3": Program(seam_cp_tokens_into_ep_moe_capacity, world=3),
    "cp_tokens_into_ep_moe_capacity_contiguous": Program(seam_cp_tokens_into_ep_moe_capacity_contiguous),
    "cp_tokens_into_ep_moe_capacity_rank_order": Program(seam_cp_tokens_into_ep_moe_capacity_rank_order),
    "check_quantized_all_reduce_under_replicated_objective": Program(
        seam_check_quantized_all_reduce_under_replicated_objective,
        error=(TypeError, r"the loss is replicated.*all_reduce"),
    ),
    "check_async_all_reduce_under_replicated_objective": Program(
        seam_check_async_all_reduce_under_replicated_objective,
        error=(TypeError, r"the loss is replicated.*all_reduce"),
    ),
    "check_dp_async_averaged_grads": Program(seam_check_dp_async_averaged_grads),
    "check_dp_async_biases_forgotten": Program(
        seam_check_dp_async_biases_forgotten,
        error=(TypeError, r"Linear\.bias is replicated, but its gradient is partial"),
    ),
    "check_moe_async_dispatch_router_not_summed": Program(
        seam_check_moe_async_dispatch_router_not_summed,
        error=(TypeError, r"Linear\.weight is replicated, but its gradient is partial"),
    ),
    "default_group_named_two_ways_w3": Program(seam_default_group_named_two_ways, world=3),
    "groups_over_the_same_ranks": Program(seam_groups_over_the_same_ranks),
}


# ------------------------------------------------------------------ pipeline parallelism
# Pipeline programs (docs/pipeline.md): slightly unusual user models through the runner,
# each compared with the serial float64 model on the whole batch (the loss the runner
# returns is the mean over micro-batches of ``loss_fn``; .grad holds its gradient).


def _mlp(
    widths: list[int], seed: int = 0, act: Callable[[], torch.nn.Module] = torch.nn.Tanh
) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b, dtype=F64), act()]
    return torch.nn.Sequential(*layers[:-1])


def _serial_loss(
    model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor | None, n_micro: int, loss_fn: Callable[..., Any]
) -> torch.Tensor:
    """The serial program the runner promises: mean over micro-batches of loss_fn."""
    xs = x.chunk(n_micro)
    ts = [None] * n_micro if t is None else list(t.chunk(n_micro))
    outs = [model(xm) for xm in xs]
    return sum(loss_fn(o) if tm is None else loss_fn(o, tm) for o, tm in zip(outs, ts)) / n_micro


def _grads_vs(
    model: torch.nn.Module, ref: torch.nn.Module, stages: list[torch.nn.Module]
) -> dict[str, float]:
    """Each parameter of this rank's stages against the same parameter of ``ref`` (a
    second copy of ``model``); a parameter that requires no grad must have none."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ref_ps = list(ref.parameters())
    out: dict[str, float] = {}
    seen: set[int] = set()
    for i, s in enumerate(stages):
        for local, p in s.named_parameters():
            name = f"chunk{i}.{local}"
            if id(p) in seen:
                continue
            seen.add(id(p))
            rp = ref_ps[index[id(p)]]
            if not p.requires_grad:
                out[f"{name} (frozen)"] = 0.0 if p.grad is None else float("inf")
            elif rp.grad is None:  # serially no gradient reaches it: none, or zeros
                out[name] = 0.0 if p.grad is None else float(p.grad.abs().max())
            else:
                out[name] = _d(p.grad, rp.grad)
    return out


def _pp_run(
    build: Callable[[], torch.nn.Module],
    *,
    schedule: str = "1f1b",
    n_micro: int = 4,
    batch: int = 8,
    d_in: int = 4,
    d_out: int = 2,
    chunks: int = 1,
    balance: list[int] | None = None,
    loss_fn: Callable[..., Any] = F.mse_loss,
    with_targets: bool = True,
    steps: int = 1,
) -> dict[str, float]:
    """The docs' recipe: partition, runner.step; ``steps`` steps accumulate into .grad."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    model, ref = build(), build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-module warning
        parts = partition(model, p * chunks, balance=balance)
    if schedule in ("zbv", "dualpipev"):
        stages: list[torch.nn.Module] = [parts[r], parts[2 * p - 1 - r]]
    else:
        stages = list(parts[r::p])
    runner = PipelineRunner(stages if chunks > 1 else stages[0], schedule=schedule, loss_fn=loss_fn)
    g = _gen(5)
    out: dict[str, float] = {}
    for i in range(steps):
        x = torch.randn(batch, d_in, dtype=F64, generator=g)
        t = torch.randn(batch, d_out, dtype=F64, generator=g) if with_targets else None
        loss = runner.step(x, t, n_micro=n_micro)
        ref_loss = _serial_loss(ref, x, t, n_micro, loss_fn)
        ref_loss.backward()
        out[f"loss{i}"] = _d(loss, ref_loss.detach())
    out.update(_grads_vs(model, ref, stages))
    return out


def pp_stage_without_parameters_w3() -> dict[str, float]:
    """The middle rank's stage is a lone activation (no parameters), 1F1B."""
    return _pp_run(lambda: _mlp([4, 6, 2]), balance=[1, 1, 1])


def pp_frozen_first_stage() -> dict[str, float]:
    """Stage 0 frozen (fine-tuning the head): its output needs no grad, the next stage's
    recv returns a tensor that needs none; the head's gradients are right, stage 0 has none."""

    def build() -> torch.nn.Module:
        m = _mlp([4, 8, 8, 2])
        for q in m[0].parameters():
            q.requires_grad_(False)
        return m

    return _pp_run(build, balance=[2, 3])


def pp_frozen_middle_stage_w3() -> dict[str, float]:
    """Stage 1 of 3 frozen; gradients still flow through it to stage 0."""

    def build() -> torch.nn.Module:
        m = _mlp([4, 6, 6, 2])
        for q in m[2].parameters():
            q.requires_grad_(False)
        return m

    return _pp_run(build, balance=[2, 2, 1])


def pp_gpipe_three_micro_batches() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 8, 8, 2]), schedule="gpipe", n_micro=3, batch=9)


def pp_interleaved_odd_micro_batches_w3() -> dict[str, float]:
    """Interleaved, 2 chunks per rank, 5 micro-batches over 3 ranks (p does not divide m)."""
    return _pp_run(lambda: _mlp([4, 5, 5, 5, 5, 5, 2]), schedule="interleaved", chunks=2, n_micro=5, batch=10)


def pp_zbh1_seven_micro_batches() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 8, 8, 2]), schedule="zb-h1", n_micro=7, batch=7)


def pp_zbv_odd_micro_batches() -> dict[str, float]:
    """ZB-V at p = 2 with m = 5 (2p + 1)."""
    return _pp_run(lambda: _mlp([4, 5, 5, 5, 2]), schedule="zbv", chunks=2, n_micro=5, batch=10)


def pp_dualpipev_too_few_micro_batches() -> dict[str, float]:
    """DualPipeV needs m >= 2p: m = 3 at p = 2 is refused before any message."""
    return _pp_run(lambda: _mlp([4, 5, 5, 5, 2]), schedule="dualpipev", chunks=2, n_micro=3, batch=6)


def pp_batch_not_divisible() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 8, 2]), n_micro=3, batch=8)


class _DictHead(torch.nn.Module):
    """A last stage returning a dict (its output goes to loss_fn as it is, docs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 2, dtype=F64)
        self.b = torch.nn.Linear(8, 3, dtype=F64)

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.a(h), "aux": self.b(h)}


def pp_last_stage_returns_dict_loss_ignores_aux() -> dict[str, float]:
    """The head returns {logits, aux}; the loss reads only logits (aux's weights get none:
    a zero or missing gradient, like the serial model's None)."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=F64), torch.nn.Tanh(), _DictHead())

    def loss_fn(out: dict[str, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out["logits"], t)

    return _pp_run(build, balance=[2, 1], loss_fn=loss_fn)


def pp_loss_ignores_some_columns_zbh1() -> dict[str, float]:
    """The model outputs 3 columns, the loss uses the first only (no targets: loss_fn(out))."""
    return _pp_run(
        lambda: _mlp([4, 8, 8, 3]),
        schedule="zb-h1",
        d_out=3,
        loss_fn=lambda o: o[:, 0].square().mean(),
        with_targets=False,
    )


def _tied(p: int) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        emb = torch.nn.Linear(4, 4, dtype=F64)  # used first and last (tied)
        mids = [torch.nn.Linear(4, 4, dtype=F64) for _ in range(2 * p - 2)]
        return torch.nn.Sequential(
            emb, torch.nn.Tanh(), *[m for lin in mids for m in (lin, torch.nn.Tanh())], emb
        )

    return build


def pp_tied_first_last_zbv() -> dict[str, float]:
    """A weight tied between the first and the last layer under ZB-V: the V placement puts
    both stages on rank 0, which so holds the tied weight's whole gradient."""
    p = dc.get_world_size()
    n = 2 * (2 * p - 1) + 1
    balance = [2] * (2 * p - 1) + [n - 2 * (2 * p - 1)]
    return _pp_run(_tied(p), schedule="zbv", chunks=2, d_out=4, balance=balance)


def pp_tied_first_last_1f1b_summed() -> dict[str, float]:
    """The same tied weight under 1F1B: the first and last stage are on ranks 0 and p-1,
    each backward fills its part of the gradient, and the runner sums them over the two
    ranks (partition recorded the tie). The user sums nothing: the docs' recipe before
    (``dc.all_reduce(q.grad)`` after the step) would now count the weight twice."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    build = _tied(2)  # emb, tanh, (lin, tanh) x 2, emb: 7 layers
    model, ref = build(), build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stage = partition(model, p, balance=[3, 4])[r]
    runner = PipelineRunner(stage, schedule="1f1b", loss_fn=F.mse_loss)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 4, dtype=F64, generator=g)
    loss = runner.step(x, t, n_micro=4)  # both ranks hold emb: its gradient is summed
    ref_loss = _serial_loss(ref, x, t, 4, F.mse_loss)
    ref_loss.backward()
    return {"loss": _d(loss, ref_loss.detach()), **_grads_vs(model, ref, [stage])}


def pp_two_steps_accumulate_1f1b() -> dict[str, float]:
    """Gradient accumulation over two runner steps (no zero_grad between them)."""
    return _pp_run(lambda: _mlp([4, 8, 8, 2]), steps=2)


def pp_two_steps_accumulate_zbv() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 5, 5, 5, 2]), schedule="zbv", chunks=2, steps=2)


def pp_two_steps_accumulate_interleaved_other_n_micro() -> dict[str, float]:
    """Two steps with different n_micro (4, then 2) on one runner, interleaved."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    build = lambda: _mlp([4, 5, 5, 5, 2])
    model, ref = build(), build()
    stages = list(partition(model, 2 * p)[r::p])
    runner = PipelineRunner(stages, schedule="interleaved", loss_fn=F.mse_loss)
    g = _gen(5)
    out: dict[str, float] = {}
    for i, m in enumerate((4, 2)):
        x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
        loss = runner.step(x, t, n_micro=m)
        ref_loss = _serial_loss(ref, x, t, m, F.mse_loss)
        ref_loss.backward()
        out[f"loss{i}"] = _d(loss, ref_loss.detach())
    return {**out, **_grads_vs(model, ref, stages)}


class _DropStage(torch.nn.Module):
    """Linear then dropout drawn on the tracker's model-parallel stream (recomputed in
    backward under ``rng.checkpoint`` when ``ckpt``)."""

    ckpt = False

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(a, b, dtype=F64)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        from diffcomm import rng

        with rng.get_tracker().fork():
            return F.dropout(torch.tanh(self.lin(x)), 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from diffcomm import rng

        return rng.checkpoint(self.block, x) if self.ckpt else self.block(x)


class _DropStageCkpt(_DropStage):
    ckpt = True


def _dropout_program(schedule: str, stage: type[_DropStage] = _DropStage) -> dict[str, float]:
    """Dropout under the RNG tracker, seeded per stage (pp_rank). The reference replays
    each stage's stream in the order its rank runs the forwards (micro-batch order)."""
    from diffcomm import rng
    from diffcomm.pipeline import PipelineRunner

    r, p = dc.get_rank(), dc.get_world_size()
    torch.manual_seed(0)
    stages = [stage(4, 6)] + [stage(6, 6) for _ in range(p - 2)] + [torch.nn.Linear(6, 2, dtype=F64)]
    torch.manual_seed(0)
    refs = [_DropStage(4, 6)] + [_DropStage(6, 6) for _ in range(p - 2)] + [torch.nn.Linear(6, 2, dtype=F64)]
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    rng.model_parallel_seed(7, tp_rank=0, pp_rank=r)
    runner = PipelineRunner(stages[r], schedule=schedule, loss_fn=F.mse_loss)
    loss = runner.step(x, t, n_micro=4)
    hs = list(x.chunk(4))
    for s, st in enumerate(refs):  # stage by stage, each with its rank's seeds
        rng.model_parallel_seed(7, tp_rank=0, pp_rank=s)
        hs = [st(h) for h in hs]
    ref_loss = sum(F.mse_loss(h, tm) for h, tm in zip(hs, t.chunk(4))) / 4
    ref_loss.backward()
    out = {"loss": _d(loss, ref_loss.detach())}
    for (n, q), rq in zip(stages[r].named_parameters(), refs[r].parameters()):
        out[n] = _d(q.grad, rq.grad)
    return out


def pp_dropout_tracker_1f1b_w3() -> dict[str, float]:
    return _dropout_program("1f1b")


def pp_dropout_tracker_zbh1() -> dict[str, float]:
    return _dropout_program("zb-h1")


def pp_dropout_tracker_checkpointed_zbh1_w3() -> dict[str, float]:
    """The dropout stages under rng.checkpoint, their backward split into I and W: the
    recomputation draws the forward's masks."""
    return _dropout_program("zb-h1", _DropStageCkpt)


def pp_input_grad_frozen_model() -> dict[str, float]:
    """input_grad=True on a fully frozen model (an adversarial-input program): stage 0's
    runner.input_grad is the gradient of the loss w.r.t. inputs."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    model = _mlp([4, 8, 8, 2])
    for q in model.parameters():
        q.requires_grad_(False)
    runner = PipelineRunner(partition(model, p)[r], schedule="1f1b", loss_fn=F.mse_loss)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    loss = runner.step(x, t, n_micro=4, input_grad=True)
    xf = x.clone().requires_grad_()
    ref_loss = _serial_loss(model, xf, t, 4, F.mse_loss)
    ref_loss.backward()
    out = {"loss": _d(loss, ref_loss.detach())}
    if r == 0:
        out["dx"] = _d(runner.input_grad, xf.grad)
    return out


class _NoGradMiddle(torch.nn.Module):
    """A stage computed without autograd (a frozen feature block under ``torch.no_grad``)
    or on a detached input (``x.detach()``, a stop-gradient): its output does not carry a
    gradient back to its input."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.lin, self.detach = torch.nn.Linear(4, 4, dtype=F64), detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.detach:
            return torch.tanh(self.lin(x.detach()))
        with torch.no_grad():
            return torch.tanh(self.lin(x))


def _stop_gradient_program(detach: bool, schedule: str) -> dict[str, float]:
    """Stage 1 of 3 passes no gradient back to stage 0: serially stage 0's parameters get
    none. On main the runner's stage 1 never ran its receive's backward, and stage 0 waited
    for that gradient until the timeout (a DesyncError about a peer that "never ran the
    matching call")."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        lin = lambda a, b: torch.nn.Linear(a, b, dtype=F64)
        return torch.nn.Sequential(lin(4, 4), _NoGradMiddle(detach), lin(4, 2))

    with dc.timeout(10):
        return _pp_run(build, schedule=schedule, balance=[1, 1, 1])


def _stop_gradient_v(detach: bool, schedule: str, pos: int) -> dict[str, float]:
    """The stop-gradient layer as virtual stage ``pos`` of 4 under a two-chunk schedule."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = [torch.nn.Linear(4, 4, dtype=F64) for _ in range(3)]
        mods[pos] = _NoGradMiddle(detach)
        return torch.nn.Sequential(*mods, torch.nn.Linear(4, 2, dtype=F64))

    with dc.timeout(10):
        return _pp_run(build, schedule=schedule, chunks=2, balance=[1, 1, 1, 1])


def pp_no_grad_stage_at_the_v_turn_zbv() -> dict[str, float]:
    """Virtual stage 1 (rank 1's first chunk) under no_grad: its input came from rank 0."""
    return _stop_gradient_v(False, "zbv", 1)


def pp_detached_stage_after_the_v_turn_dualpipev() -> dict[str, float]:
    """Virtual stage 2 (rank 1's second chunk, fed locally at the turn) detaches its input."""
    return _stop_gradient_v(True, "dualpipev", 2)


def pp_no_grad_middle_stage_1f1b_w3() -> dict[str, float]:
    return _stop_gradient_program(False, "1f1b")


def pp_detached_input_middle_stage_zbh1_w3() -> dict[str, float]:
    return _stop_gradient_program(True, "zb-h1")


def pp_detached_input_middle_stage_gpipe_w3() -> dict[str, float]:
    return _stop_gradient_program(True, "gpipe")


def _inplace_relu_stages(schedule: str) -> dict[str, float]:
    """``nn.Sequential(Linear, ReLU(inplace=True), Linear)`` cut after the first Linear: the
    second stage starts with an in-place ReLU on the received activation. On main torch
    refused it ("Output 0 of _Recv is a view and is being modified inplace") on rank 1,
    and rank 0 waited for its gradient until the timeout."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        lin = lambda a, b: torch.nn.Linear(a, b, dtype=F64)
        return torch.nn.Sequential(lin(4, 8), torch.nn.ReLU(inplace=True), lin(8, 2))

    with dc.timeout(10):
        return _pp_run(build, schedule=schedule, balance=[1, 2])


def pp_inplace_relu_on_received_activation_1f1b() -> dict[str, float]:
    return _inplace_relu_stages("1f1b")


def pp_inplace_relu_on_received_activation_zbh1() -> dict[str, float]:
    return _inplace_relu_stages("zb-h1")


def _runner_for(schedule: str, model: torch.nn.Module) -> tuple[Any, list[torch.nn.Module]]:
    """The docs' placement for ``schedule`` (V for zbv/dualpipev, loop for interleaved)."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    v = schedule in ("zbv", "dualpipev", "interleaved")
    parts = partition(model, 2 * p if v else p)
    if schedule in ("zbv", "dualpipev"):
        stages = [parts[r], parts[2 * p - 1 - r]]
    else:
        stages = list(parts[r::p])
    runner = PipelineRunner(stages if v else stages[0], schedule=schedule, loss_fn=F.mse_loss)
    return runner, stages


def _eval_step(schedule: str) -> dict[str, float]:
    """A validation loss: ``runner.step`` under ``torch.no_grad()`` returns the serial loss
    and leaves every ``.grad`` as it was (None)."""
    model = _mlp([4, 5, 5, 5, 2])
    runner, _ = _runner_for(schedule, model)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    with torch.no_grad():
        loss = runner.step(x, t, n_micro=4)
        ref = _serial_loss(model, x, t, 4, F.mse_loss)
    touched = [q for q in model.parameters() if q.grad is not None]
    return {"loss": _d(loss, ref), "grads left alone": 0.0 if not touched else float("inf")}


def pp_eval_step_under_no_grad_1f1b() -> dict[str, float]:
    return _eval_step("1f1b")


def pp_eval_step_under_no_grad_zbv() -> dict[str, float]:
    return _eval_step("zbv")


def pp_inputs_require_grad_without_input_grad_zbh1() -> dict[str, float]:
    """The user's batch requires grad (input_grad=False): stage 0 accumulates the loss's
    gradient into ``x.grad`` as the serial ``loss.backward()`` does."""
    model, ref = _mlp([4, 5, 5, 5, 2]), _mlp([4, 5, 5, 5, 2])
    runner, stages = _runner_for("zb-h1", model)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    xg, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = runner.step(xg, t, n_micro=4)
    ref_loss = _serial_loss(ref, xf, t, 4, F.mse_loss)
    ref_loss.backward()
    out = {"loss": _d(loss, ref_loss.detach()), **_grads_vs(model, ref, stages)}
    if dc.get_rank() == 0:
        out["x.grad"] = _d(xg.grad, xf.grad)
    return out


class _DataDependentRows(torch.nn.Module):
    """A stage whose activation's shape differs between micro-batches: it keeps the rows
    whose first feature is positive (``reshape``: the same numel, laid out (-1, 8) or
    (-1, 4) by the micro-batch's first value)."""

    def __init__(self, reshape: bool) -> None:
        super().__init__()
        self.lin, self.reshape = torch.nn.Linear(4, 4, dtype=F64), reshape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.reshape:
            return h.reshape(-1, 8) if x[0, 0] > 0 else h
        return h[h[:, 0] > 0]


class _ScaleTanh(torch.nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1,), w, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


def _variable_shapes(reshape: bool, schedule: str) -> dict[str, float]:
    """Activations of other shapes in every micro-batch, over two steps (the runner's
    agreed shape per channel, fused messages and pre-posted receives all see them)."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(_DataDependentRows(reshape), _ScaleTanh(1.3), _ScaleTanh(0.7))

    return _pp_run(
        build,
        schedule=schedule,
        balance=[1, 1, 1],
        loss_fn=lambda o: o.square().sum(),
        with_targets=False,
        batch=16,
        n_micro=8,
        steps=2,
    )


def pp_variable_rows_per_micro_batch_1f1b_w3() -> dict[str, float]:
    return _variable_shapes(False, "1f1b")


def pp_variable_layout_per_micro_batch_zbh1_w3() -> dict[str, float]:
    return _variable_shapes(True, "zb-h1")


def _misplaced(kind: str) -> dict[str, float]:
    """Chunks from partition() given to the runner in another placement than the schedule's
    (docs: interleaved takes parts[r::p], the V schedules [parts[r], parts[2p-1-r]])."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    model, ref = _mlp([4] * 8 + [2]), _mlp([4] * 8 + [2])
    if kind == "interleaved_contiguous":  # the natural guess: rank r takes parts 2r, 2r+1
        stages, schedule = list(partition(model, 2 * p)[2 * r : 2 * r + 2]), "interleaved"
    elif kind == "zbv_loop":
        stages, schedule = list(partition(model, 2 * p)[r::p]), "zbv"
    else:  # 1F1B with the ranks reversed
        stages, schedule = [partition(model, p)[p - 1 - r]], "1f1b"
    runner = PipelineRunner(stages if len(stages) > 1 else stages[0], schedule=schedule, loss_fn=F.mse_loss)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    loss = runner.step(x, t, n_micro=4)
    ref_loss = _serial_loss(ref, x, t, 4, F.mse_loss)
    ref_loss.backward()
    return {"loss": _d(loss, ref_loss.detach()), **_grads_vs(model, ref, stages)}


def pp_interleaved_chunks_taken_contiguously() -> dict[str, float]:
    """On main: it ran the model in the order 0, 2, 1, 3, silently (loss off by 0.049,
    gradients by up to 0.04)."""
    return _misplaced("interleaved_contiguous")


def pp_zbv_chunks_in_loop_placement() -> dict[str, float]:
    """On main: a shape error from inside the wrong stage on one rank, a timeout on the other."""
    return _misplaced("zbv_loop")


def pp_1f1b_stages_reversed() -> dict[str, float]:
    """On main: both ranks waited until the timeout (a DesyncError)."""
    return _misplaced("1f1b_reversed")


def _measured(schedule: str) -> dict[str, float]:
    """costs="measure": the W steps placed from measured times (they change between steps,
    and again after remeasure()), four steps accumulating into .grad."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    model, ref = _mlp([4, 5, 5, 5, 2]), _mlp([4, 5, 5, 5, 2])
    v = schedule == "zbv"
    parts = partition(model, 2 * p if v else p)
    stages = [parts[r], parts[2 * p - 1 - r]] if v else [parts[r]]
    runner = PipelineRunner(
        stages if v else stages[0], schedule=schedule, loss_fn=F.mse_loss, costs="measure"
    )
    g = _gen(5)
    out: dict[str, float] = {}
    for i in range(4):
        x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
        loss = runner.step(x, t, n_micro=4)
        ref_loss = _serial_loss(ref, x, t, 4, F.mse_loss)
        ref_loss.backward()
        out[f"loss{i}"] = _d(loss, ref_loss.detach())
        if i == 1:
            runner.remeasure()
    return {**out, **_grads_vs(model, ref, stages)}


def pp_measured_w_placement_zbh1() -> dict[str, float]:
    return _measured("zb-h1")


def pp_measured_w_placement_zbv() -> dict[str, float]:
    return _measured("zbv")


def _reverse_b(p: int, m: int) -> list[list[Any]]:
    """A user's schedule: every forward, then the backwards newest first (GPipe reversed)."""
    from diffcomm.pipeline import Step

    return [[Step("F", i) for i in range(m)] + [Step("B", i) for i in reversed(range(m))] for _ in range(p)]


def _reverse_i_then_w(p: int, m: int) -> list[list[Any]]:
    from diffcomm.pipeline import Step

    steps = [Step("F", i) for i in range(m)] + [Step("I", i) for i in reversed(range(m))]
    return [steps + [Step("W", i) for i in range(m)] for _ in range(p)]


def _w_before_i(p: int, m: int) -> list[list[Any]]:
    from diffcomm.pipeline import Step

    steps = [Step("F", i) for i in range(m)]
    return [steps + [s for i in range(m) for s in (Step("W", i), Step("I", i))] for _ in range(p)]


def pp_custom_schedule_backwards_reversed() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 8, 8, 2]), schedule=_reverse_b)  # type: ignore[arg-type]


def pp_custom_schedule_split_reversed_w3() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 8, 8, 2]), schedule=_reverse_i_then_w, balance=[2, 2, 1])  # type: ignore[arg-type]


def pp_custom_schedule_w_before_i() -> dict[str, float]:
    return _pp_run(lambda: _mlp([4, 8, 8, 2]), schedule=_w_before_i)  # type: ignore[arg-type]


def pp_zbv_input_grad_and_loss_on_rank0_only() -> dict[str, float]:
    """ZB-V with input_grad=True and broadcast_loss=False: rank 0 holds the first and the
    last stage, so it returns the loss and the input gradient; the other ranks None."""
    from diffcomm.pipeline import PipelineRunner, partition

    r, p = dc.get_rank(), dc.get_world_size()
    model, ref = _mlp([4, 5, 5, 5, 2]), _mlp([4, 5, 5, 5, 2])
    parts = partition(model, 2 * p)
    stages = [parts[r], parts[2 * p - 1 - r]]
    runner = PipelineRunner(stages, schedule="zbv", loss_fn=F.mse_loss, broadcast_loss=False)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    loss = runner.step(x, t, n_micro=4, input_grad=True)
    xf = x.clone().requires_grad_()
    ref_loss = _serial_loss(ref, xf, t, 4, F.mse_loss)
    ref_loss.backward()
    out = _grads_vs(model, ref, stages)
    if r == 0:
        out.update(loss=_d(loss, ref_loss.detach()), dx=_d(runner.input_grad, xf.grad))
    else:
        out["loss is None"] = 0.0 if loss is None else float("inf")
    return out


PP_PROGRAMS: dict[str, Program] = {
    "measured_w_placement_zbh1": Program(pp_measured_w_placement_zbh1),
    "measured_w_placement_zbv": Program(pp_measured_w_placement_zbv),
    "interleaved_chunks_taken_contiguously": Program(
        pp_interleaved_chunks_taken_contiguously, error=(ValueError, r"`stage`.*parts\[\d::2\]")
    ),
    "zbv_chunks_in_loop_placement": Program(
        pp_zbv_chunks_in_loop_placement, error=(ValueError, r"`stage`.*\[parts\[\d\], parts\[\d\]\]")
    ),
    "1f1b_stages_reversed": Program(pp_1f1b_stages_reversed, error=(ValueError, r"`stage`.*parts\[\d\]")),
    "variable_rows_per_micro_batch_1f1b_w3": Program(pp_variable_rows_per_micro_batch_1f1b_w3, world=3),
    "variable_layout_per_micro_batch_zbh1_w3": Program(pp_variable_layout_per_micro_batch_zbh1_w3, world=3),
    "eval_step_under_no_grad_1f1b": Program(pp_eval_step_under_no_grad_1f1b),
    "eval_step_under_no_grad_zbv": Program(pp_eval_step_under_no_grad_zbv),
    "inputs_require_grad_without_input_grad_zbh1": Program(pp_inputs_require_grad_without_input_grad_zbh1),
    "inplace_relu_on_received_activation_1f1b": Program(pp_inplace_relu_on_received_activation_1f1b),
    "inplace_relu_on_received_activation_zbh1": Program(pp_inplace_relu_on_received_activation_zbh1),
    "custom_schedule_backwards_reversed": Program(pp_custom_schedule_backwards_reversed),
    "custom_schedule_split_reversed_w3": Program(pp_custom_schedule_split_reversed_w3, world=3),
    "custom_schedule_w_before_i": Program(
        pp_custom_schedule_w_before_i, error=(ValueError, r"`schedule` must be each I before its W")
    ),
    "zbv_input_grad_and_loss_on_rank0_only": Program(pp_zbv_input_grad_and_loss_on_rank0_only),
    "no_grad_middle_stage_1f1b_w3": Program(pp_no_grad_middle_stage_1f1b_w3, world=3),
    "no_grad_stage_at_the_v_turn_zbv": Program(pp_no_grad_stage_at_the_v_turn_zbv),
    "detached_stage_after_the_v_turn_dualpipev": Program(pp_detached_stage_after_the_v_turn_dualpipev),
    "detached_input_middle_stage_zbh1_w3": Program(pp_detached_input_middle_stage_zbh1_w3, world=3),
    "detached_input_middle_stage_gpipe_w3": Program(pp_detached_input_middle_stage_gpipe_w3, world=3),
    "stage_without_parameters_w3": Program(pp_stage_without_parameters_w3, world=3),
    "frozen_first_stage": Program(pp_frozen_first_stage),
    "frozen_middle_stage_w3": Program(pp_frozen_middle_stage_w3, world=3),
    "gpipe_three_micro_batches": Program(pp_gpipe_three_micro_batches),
    "interleaved_odd_micro_batches_w3": Program(pp_interleaved_odd_micro_batches_w3, world=3),
    "zbh1_seven_micro_batches": Program(pp_zbh1_seven_micro_batches),
    "zbv_odd_micro_batches": Program(pp_zbv_odd_micro_batches),
    "dualpipev_too_few_micro_batches": Program(
        pp_dualpipev_too_few_micro_batches, error=(ValueError, r"n_micro")
    ),
    "batch_not_divisible": Program(pp_batch_not_divisible, error=(ValueError, r"n_micro")),
    "last_stage_returns_dict_loss_ignores_aux": Program(pp_last_stage_returns_dict_loss_ignores_aux),
    "loss_ignores_some_columns_zbh1": Program(pp_loss_ignores_some_columns_zbh1),
    "tied_first_last_zbv": Program(pp_tied_first_last_zbv),
    "tied_first_last_1f1b_summed": Program(pp_tied_first_last_1f1b_summed),
    "two_steps_accumulate_1f1b": Program(pp_two_steps_accumulate_1f1b),
    "two_steps_accumulate_zbv": Program(pp_two_steps_accumulate_zbv),
    "two_steps_accumulate_interleaved_other_n_micro": Program(
        pp_two_steps_accumulate_interleaved_other_n_micro
    ),
    "dropout_tracker_1f1b_w3": Program(pp_dropout_tracker_1f1b_w3, world=3),
    "dropout_tracker_zbh1": Program(pp_dropout_tracker_zbh1),
    "dropout_tracker_checkpointed_zbh1_w3": Program(pp_dropout_tracker_checkpointed_zbh1_w3, world=3),
    "input_grad_frozen_model": Program(pp_input_grad_frozen_model),
}


# ------------------------------------------------------------------ the testing kit
# diffcomm.testing (docs/testing.md) on user-written ops and on sequence-parallel layers:
# a correct program passes the kit's check; a wrong one fails it with the documented
# AssertionError (a check that passes a wrong program is the silent wrong answer here).


def _ok(check: Callable[[], Any]) -> dict[str, float]:
    """The check passes: 0; its AssertionError: inf (a false alarm)."""
    try:
        check()
    except AssertionError as exc:
        return {f"false alarm: {str(exc)[:200]}": float("inf")}
    return {"passed": 0.0}


def _caught(check: Callable[[], Any], pattern: str) -> dict[str, float]:
    """The check must fail with an AssertionError matching ``pattern``: 0; a pass: inf."""
    try:
        check()
    except AssertionError as exc:
        return {"caught": 0.0 if re.search(pattern, str(exc)) else float("inf")}
    return {"missed (the check passed a wrong program)": float("inf")}


class _MyGather(torch.autograd.Function):
    """A user's all_gather along dim 0, backward written by hand (``wrong``: the classic
    slip of keeping this rank's slice of its own gradient, with no sum over ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wrong: bool) -> torch.Tensor:
        ctx.wrong, ctx.n = wrong, x.shape[0]
        return dc.all_gather(x.detach())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        r, n = dc.get_rank(), ctx.n
        if ctx.wrong:
            return g[r * n : (r + 1) * n].clone(), None
        return dc.reduce_scatter(g.contiguous()), None


def kit_check_adjoint_user_gather_right() -> dict[str, float]:
    x = torch.randn(3, 2, dtype=F64, generator=_gen(dc.get_rank()))
    y = torch.randn(3 * dc.get_world_size(), 2, dtype=F64, generator=_gen(9 + dc.get_rank()))
    return _ok(lambda: testing.check_adjoint(lambda t: _MyGather.apply(t, False), x, y))


def kit_check_adjoint_user_gather_wrong_backward() -> dict[str, float]:
    x = torch.randn(3, 2, dtype=F64, generator=_gen(dc.get_rank()))
    y = torch.randn(3 * dc.get_world_size(), 2, dtype=F64, generator=_gen(9 + dc.get_rank()))
    return _caught(lambda: testing.check_adjoint(lambda t: _MyGather.apply(t, True), x, y), r".")


def kit_gradcheck_user_gather_wrong_backward() -> dict[str, float]:
    x = torch.randn(2, 2, dtype=F64, generator=_gen(dc.get_rank()), requires_grad=True)
    return _caught(lambda: testing.gradcheck(lambda t: torch.tanh(_MyGather.apply(t, True)), (x,)), r"differ")


def kit_gradcheck_user_gather_right_replicated_input() -> dict[str, float]:
    """A replicated input (the same on every rank) listed in ``replicated``."""
    x = torch.randn(2, 2, dtype=F64, generator=_gen(0), requires_grad=True)  # same everywhere
    w = torch.randn(2, 2, dtype=F64, generator=_gen(1 + dc.get_rank()), requires_grad=True)
    fn = lambda x, w: torch.tanh(_MyGather.apply(x @ w, False))
    return _ok(lambda: testing.gradcheck(fn, (x, w), replicated=[0]))


def kit_check_adjoint_dual_op_wrong_scale() -> dict[str, float]:
    """A user states the dual of all_reduce(avg) as all_reduce(sum) (the 1/W forgotten)."""
    x = torch.randn(4, dtype=F64, generator=_gen(dc.get_rank()))
    y = torch.randn(4, dtype=F64, generator=_gen(5 + dc.get_rank()))
    return _caught(
        lambda: testing.check_adjoint(
            lambda t: dc.all_reduce(t, op="avg"), x, y, dual_op=lambda g: dc.all_reduce(g)
        ),
        r".",
    )


def kit_gradcheck_float32_input() -> dict[str, float]:
    """The docs: the inputs that require grad must be float64."""
    x = torch.randn(3, generator=_gen(0)).requires_grad_()
    testing.gradcheck(lambda t: dc.all_reduce(t), (x,))
    return {"ran": 0.0}


def _sp_mlp_matches(specs: bool, seq: int = 6) -> dict[str, float]:
    """docs/testing.md's sequence-parallel example, called inside the rank (no ``world=``)."""
    from diffcomm.testing import Shard, assert_matches_serial

    torch.manual_seed(0)
    serial = parallel.MLP(8, 12, dtype=F64)
    x = torch.randn(seq, 2, 8, dtype=F64)
    sp = parallel.ParallelMLP.from_serial(serial, sequence_parallel=True)
    kw: dict[str, Any] = {"input_specs": [Shard(0)], "output_specs": [Shard(0)]} if specs else {}
    return {"check": lambda: assert_matches_serial(sp, serial, x, **kw)}  # type: ignore[dict-item]


def kit_assert_matches_serial_sp_mlp_w3() -> dict[str, float]:
    return _ok(_sp_mlp_matches(True)["check"])  # type: ignore[arg-type]


def kit_assert_matches_serial_sp_mlp_forgot_specs() -> dict[str, float]:
    """The Shard(0) specs left out: the layer gets the whole sequence as its shard; the
    check must not pass."""
    return _caught(_sp_mlp_matches(False)["check"], r".")  # type: ignore[arg-type]


class _NoCopyTP(torch.nn.Module):
    """A user's column -> row MLP with ``copy_to_region`` left out: the input gradient is
    one rank's part, not the sum (the parameters' gradients are right)."""

    def __init__(self, serial: Any) -> None:
        super().__init__()
        r, w = dc.get_rank(), dc.get_world_size()
        h = serial.fc1.weight.shape[0] // w
        self.w1 = torch.nn.Parameter(serial.fc1.weight.detach()[r * h : (r + 1) * h].clone())
        self.w2 = torch.nn.Parameter(serial.fc2.weight.detach()[:, r * h : (r + 1) * h].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel.reduce_from_region(torch.tanh(x @ self.w1.T) @ self.w2.T)


def kit_assert_matches_serial_missing_copy_input_grad() -> dict[str, float]:
    from diffcomm.testing import assert_matches_serial

    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(6, 8, bias=False, dtype=F64), torch.nn.Linear(8, 6, bias=False, dtype=F64)
    serial = torch.nn.Module()
    serial.fc1, serial.fc2 = fc1, fc2
    serial.forward = lambda x: fc2(torch.tanh(fc1(x)))  # type: ignore[method-assign]
    x = torch.randn(3, 6, dtype=F64).requires_grad_()
    names = {"w1": ("fc1.weight", None), "w2": ("fc2.weight", None)}
    tp = _NoCopyTP(serial)
    r, w = dc.get_rank(), dc.get_world_size()
    h = 8 // w
    names = {
        "w1": ("fc1.weight", slice(r * h, (r + 1) * h)),
        "w2": ("fc2.weight", (slice(None), slice(r * h, (r + 1) * h))),
    }
    return _caught(lambda: assert_matches_serial(tp, serial, x, param_map=names), r"gradient of inputs\[0\]")


class _SerialTwice(torch.nn.Module):
    """A serial pre-norm residual block applied twice with the same weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln = torch.nn.LayerNorm(8, dtype=F64)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)
        self.mlp = parallel.MLP(8, 12, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = x + self.mlp(self.ln(x))
        return x


def _sp_twice(container: type[torch.nn.Module]) -> dict[str, float]:
    """The block's sequence-parallel twin (SequenceParallelLayerNorm + ParallelMLP with
    sequence_parallel=True) in the user's container, checked by assert_matches_serial."""
    from diffcomm.testing import Shard, assert_matches_serial

    serial = _SerialTwice()

    class Twice(container):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            self.ln = parallel.SequenceParallelLayerNorm.from_serial(serial.ln)
            self.mlp = parallel.ParallelMLP.from_serial(serial.mlp, sequence_parallel=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                x = x + self.mlp(self.ln(x))
            return x

    sp = Twice()
    param_map = {
        f"{m}.{k}": (f"{m}.{k}", v) for m in ("ln", "mlp") for k, v in getattr(sp, m).serial_slices().items()
    }
    x = torch.randn(6, 2, 8, dtype=F64, generator=_gen(3))
    return _ok(
        lambda: assert_matches_serial(
            sp, serial, x, input_specs=[Shard(0)], output_specs=[Shard(0)], param_map=param_map
        )
    )


def kit_sp_block_applied_twice_parallel_module_w3() -> dict[str, float]:
    """The container a ParallelModule: the replicated LN/bias gradients coalesced once for
    the whole forward, whose layers run twice."""
    return _sp_twice(parallel.ParallelModule)


def kit_sp_block_applied_twice_plain_module() -> dict[str, float]:
    """The container a plain nn.Module: each layer reduces its own replicated gradients."""
    return _sp_twice(torch.nn.Module)


def kit_on_a_subgroup_w3() -> dict[str, float]:
    """The kit on new_group([0, 1]) while rank 2 does something else: assert_matches_serial
    of a tensor-parallel MLP, gradcheck and check_adjoint, each given ``group=``."""
    import torch.distributed as dist

    from diffcomm.testing import assert_matches_serial

    r = dc.get_rank()
    g = dist.new_group([0, 1])
    if r == 2:
        return {"outside": 0.0}
    torch.manual_seed(0)
    serial = parallel.MLP(8, 12, dtype=F64)
    x = torch.randn(3, 8, dtype=F64)
    tp = parallel.ParallelMLP.from_serial(serial, group=g)
    xs = torch.randn(2, 2, dtype=F64, generator=_gen(r), requires_grad=True)
    y = torch.randn(4, 2, dtype=F64, generator=_gen(7 + r))
    out = _ok(lambda: assert_matches_serial(tp, serial, x, group=g))
    out.update(
        _ok(lambda: testing.gradcheck(lambda t: torch.tanh(dc.all_gather(t, group=g)), (xs,), group=g))
    )
    out["adjoint"] = testing.check_adjoint(lambda t: dc.all_gather(t, group=g), xs.detach(), y, group=g)
    return out


def kit_gradcheck_sequence_parallel_layernorm_w3() -> dict[str, float]:
    """gradcheck of SequenceParallelLayerNorm with its parameters as inputs
    (functional_call, docs/testing.md), output gathered along the sequence so the objective
    is replicated; the sequence shard is each rank's own input, the parameters replicated."""
    r, w = dc.get_rank(), dc.get_world_size()
    ln = parallel.SequenceParallelLayerNorm(3, dtype=F64)
    torch.manual_seed(0)
    ps = [torch.randn(3, dtype=F64).requires_grad_() for _ in range(2)]  # weight, bias: the same everywhere
    x = torch.randn(2 * w, 2, 3, dtype=F64).chunk(w)[r].clone().requires_grad_()
    names = [n for n, _ in ln.named_parameters()]

    def fn(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        y = torch.func.functional_call(ln, dict(zip(names, params)), (x,))
        return parallel.gather_from_sequence(torch.tanh(y), dim=0)

    return _ok(lambda: testing.gradcheck(fn, (x, *ps), objective="replicated", replicated=[1, 2]))


KIT_PROGRAMS: dict[str, Program] = {
    "gradcheck_sequence_parallel_layernorm_w3": Program(
        kit_gradcheck_sequence_parallel_layernorm_w3, world=3
    ),
    "on_a_subgroup_w3": Program(kit_on_a_subgroup_w3, world=3),
    "sp_block_applied_twice_parallel_module_w3": Program(
        kit_sp_block_applied_twice_parallel_module_w3, world=3
    ),
    "sp_block_applied_twice_plain_module": Program(kit_sp_block_applied_twice_plain_module),
    "check_adjoint_user_gather_right": Program(kit_check_adjoint_user_gather_right),
    "check_adjoint_user_gather_wrong_backward_w3": Program(
        kit_check_adjoint_user_gather_wrong_backward, world=3
    ),
    "gradcheck_user_gather_wrong_backward": Program(kit_gradcheck_user_gather_wrong_backward),
    "gradcheck_user_gather_right_replicated_input": Program(kit_gradcheck_user_gather_right_replicated_input),
    "check_adjoint_dual_op_wrong_scale": Program(kit_check_adjoint_dual_op_wrong_scale),
    "gradcheck_float32_input": Program(
        kit_gradcheck_float32_input, error=(ValueError, r"`inputs\[0\]` must be float64")
    ),
    "assert_matches_serial_sp_mlp_w3": Program(kit_assert_matches_serial_sp_mlp_w3, world=3),
    "assert_matches_serial_sp_mlp_forgot_specs": Program(kit_assert_matches_serial_sp_mlp_forgot_specs),
    "assert_matches_serial_missing_copy_input_grad": Program(
        kit_assert_matches_serial_missing_copy_input_grad
    ),
}


# ------------------------------------------------------------------ interop and subgroups
# diffcomm ops on torch.distributed subgroups (group-local src/dst, ranks outside the
# group), DeviceMesh axes, DTensor inputs and torch.distributed.nn / dc.compat mixed with
# diffcomm ops. The reference simulates every rank in one process in float64.


def _xs(w: int, shape: tuple[int, ...] = (2, 3), seed: int = 0) -> list[torch.Tensor]:
    """Every rank's tensor (rank r's from seed + r): each rank can build all of them."""
    return [torch.randn(*shape, dtype=F64, generator=_gen(seed + r)) for r in range(w)]


def io_subgroup_members_only_w3() -> dict[str, float]:
    """all_reduce on new_group([0, 2]); rank 1 runs no collective on it."""
    import torch.distributed as dist

    r = dc.get_rank()
    g = dist.new_group([0, 2])
    xs, cs = _xs(3), _xs(3, seed=100)
    if r == 1:
        return {"outside": 0.0}
    x = xs[r].clone().requires_grad_()
    y = dc.all_reduce(x * (r + 1), group=g)
    (y * cs[r]).sum().backward()
    return {"y": _d(y, xs[0] + 3 * xs[2]), "dx": _d(x.grad, (r + 1) * (cs[0] + cs[2]))}


def io_subgroup_non_member_calls_w3() -> dict[str, float]:
    """Rank 1, outside new_group([0, 2]), calls the op on it by mistake: a clear error
    naming `group` on rank 1; ranks 0 and 2 get their right answer."""
    import torch.distributed as dist

    r = dc.get_rank()
    g = dist.new_group([0, 2])
    xs = _xs(3)
    if r == 1:
        try:
            dc.all_reduce(xs[1], group=g)
        except (ValueError, TypeError) as exc:
            return {"clear error": 0.0 if "`group`" in str(exc) else float("inf")}
        except Exception as exc:
            return {f"{type(exc).__name__}: {str(exc)[:150]}": float("inf")}
        return {"no error": float("inf")}
    return {"y": _d(dc.all_reduce(xs[r], group=g), xs[0] + xs[2])}


def io_subgroup_broadcast_group_local_src_w3() -> dict[str, float]:
    """broadcast(src=0) on new_group([1, 2]): src is group-local, global rank 1."""
    import torch.distributed as dist

    r = dc.get_rank()
    g = dist.new_group([1, 2])
    xs, cs = _xs(3), _xs(3, seed=100)
    if r == 0:
        return {"outside": 0.0}
    x = xs[r].clone().requires_grad_()
    y = dc.broadcast(x, src=0, group=g)
    (y * cs[r]).sum().backward()
    return {"y": _d(y, xs[1]), "dx": _d(x.grad, cs[1] + cs[2] if r == 1 else torch.zeros_like(x))}


def io_subgroup_send_recv_group_local_w3() -> dict[str, float]:
    """send(dst=1) / recv(src=0) on new_group([1, 2]): group-local peers."""
    import torch.distributed as dist

    r = dc.get_rank()
    g = dist.new_group([1, 2])
    xs, cs = _xs(3), _xs(3, seed=100)
    if r == 0:
        return {"outside": 0.0}
    if r == 1:
        x = xs[1].clone().requires_grad_()
        dc.send(x, dst=1, group=g).backward()
        return {"dx": _d(x.grad, cs[2])}
    z = dc.recv(src=0, group=g)
    (z * cs[2]).sum().backward()
    return {"z": _d(z, xs[1])}


def io_group_as_rank_list() -> dict[str, float]:
    """A list of ranks is not a group (the contract: None, a ProcessGroup, (mesh, axis))."""
    dc.all_reduce(torch.ones(2, dtype=F64), group=[0, 1])  # type: ignore[arg-type]
    return {"ran": 0.0}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def io_mesh_axes_gather_then_reduce_scatter_w4() -> dict[str, float]:
    """2 x 2 mesh (dp, tp): all_gather on ("tp" by name), reduce_scatter on dim index 0
    (dp), vs a simulation of the four ranks (row-major mesh: rank = 2 dp + tp)."""
    r = dc.get_rank()
    mesh = _mesh((2, 2), ("dp", "tp"))
    xs, cs = _xs(4, (2, 3)), _xs(4, (2, 3), seed=100)
    x = xs[r].clone().requires_grad_()
    z = dc.reduce_scatter(dc.all_gather(x, group=(mesh, "tp")), group=(mesh, 0))
    (z * cs[r]).sum().backward()
    sx = [t.clone().requires_grad_() for t in xs]
    ys = [torch.cat([sx[2 * (s // 2)], sx[2 * (s // 2) + 1]]) for s in range(4)]
    zs = [(ys[s % 2] + ys[s % 2 + 2]).chunk(2)[s // 2] for s in range(4)]
    sum((zz * c).sum() for zz, c in zip(zs, cs)).backward()
    return {"z": _d(z, zs[r]), "dx": _d(x.grad, sx[r].grad)}


def io_mesh_unknown_axis_name_w4() -> dict[str, float]:
    mesh = _mesh((2, 2), ("dp", "tp"))
    dc.all_reduce(torch.ones(2, dtype=F64), group=(mesh, "pp"))
    return {"ran": 0.0}


def io_dtensor_into_all_reduce() -> dict[str, float]:
    """A DTensor (sharded on a 1-D mesh) given to dc.all_reduce: the per-rank meaning is
    its local shard's, the global one a different tensor: the right answer or an error
    naming `x`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    w = dc.get_world_size()
    mesh = _mesh((w,), ("dp",))
    full = torch.arange(4.0 * w, dtype=F64).reshape(2 * w, 2)
    xd = distribute_tensor(full, mesh, [Shard(0)])
    y = dc.all_reduce(xd)
    local = y.to_local() if hasattr(y, "to_local") else y
    return {"y vs sum of shards": _d(local, sum(full.chunk(w)))}


def io_dtensor_to_local_into_all_gather() -> dict[str, float]:
    """What the error says to do: to_local() into dc, the gradient back on the shard."""
    from torch.distributed.tensor import Shard, distribute_tensor

    w = dc.get_world_size()
    mesh = _mesh((w,), ("dp",))
    full = torch.arange(4.0 * w, dtype=F64).reshape(2 * w, 2).requires_grad_()
    xd = distribute_tensor(full.detach(), mesh, [Shard(0)]).requires_grad_()
    y = dc.all_gather(xd.to_local())
    (y * full.detach()).sum().backward()  # sum over ranks: w * <full, full>
    assert xd.grad is not None
    return {
        "y": _d(y, full.detach()),
        "dx": _d(xd.grad.to_local(), w * full.detach().chunk(w)[dc.get_rank()]),
    }


def io_compat_and_torch_nn_mixed_with_dc() -> dict[str, float]:
    """dc.compat.all_gather (torch.distributed.nn's signature: a tuple) -> cat ->
    torch.distributed.nn's all_reduce -> dc.reduce_scatter, vs the simulation."""
    from torch.distributed.nn import functional as tdnn

    from diffcomm import compat

    r, w = dc.get_rank(), dc.get_world_size()
    xs, cs = _xs(w), _xs(w, (2 * w // w, 3), seed=100)
    x = xs[r].clone().requires_grad_()
    y = torch.cat(compat.all_gather(x))
    z = dc.reduce_scatter(tdnn.all_reduce(torch.tanh(y)))
    (z * cs[r]).sum().backward()
    sx = [t.clone().requires_grad_() for t in xs]
    full = torch.tanh(torch.cat(sx))
    zs = (w * full).chunk(w)  # all_reduce of w equal copies, then reduce_scatter sums w of them
    zs = [(w * zz) for zz in zs]
    sum((zz * c).sum() for zz, c in zip(zs, cs)).backward()
    return {"z": _d(z, zs[r]), "dx": _d(x.grad, sx[r].grad)}


def io_pipeline_on_mesh_with_dp_w4() -> dict[str, float]:
    """A 2 x 2 mesh (dp, pp): the runner on the pp axis, each dp replica on its half of the
    batch, gradients averaged over dp: the serial model on the whole batch."""
    from diffcomm.pipeline import PipelineRunner, partition

    mesh = _mesh((2, 2), ("dp", "pp"))
    dp, pp = mesh.get_coordinate()
    model, ref = _mlp([4, 8, 8, 2]), _mlp([4, 8, 8, 2])
    stage = partition(model, 2)[pp]
    runner = PipelineRunner(stage, schedule="1f1b", group=(mesh, "pp"), loss_fn=F.mse_loss)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    loss = runner.step(x.chunk(2)[dp], t.chunk(2)[dp], n_micro=2)
    loss = dc.all_reduce(loss, op="avg", group=(mesh, "dp"))
    for q in stage.parameters():
        q.grad = dc.all_reduce(q.grad, op="avg", group=(mesh, "dp"))
    ref_loss = F.mse_loss(ref(x), t)
    ref_loss.backward()
    return {"loss": _d(loss, ref_loss.detach()), **_grads_vs(model, ref, [stage])}


def io_subgroup_unsorted_ranks_reduce_w3() -> dict[str, float]:
    """new_group([2, 0]) (ranks listed out of order): reduce(dst=1) and scatter(src=0) use
    the group-local ranks torch gives the group (dist.get_global_rank)."""
    import torch.distributed as dist

    r = dc.get_rank()
    g = dist.new_group([2, 0])
    xs, cs = _xs(3, (4, 3)), _xs(3, (4, 3), seed=100)
    if r == 1:
        return {"outside": 0.0}
    dst, src = dist.get_global_rank(g, 1), dist.get_global_rank(g, 0)
    me = dist.get_group_rank(g, r)
    x = xs[r].clone().requires_grad_()
    y = dc.reduce(x, dst=1, group=g)
    z = dc.scatter(x, src=0, group=g)
    ((y * cs[r]).sum() + (z * cs[r][:2]).sum()).backward()
    y_ref = xs[0] + xs[2] if r == dst else torch.zeros(4, 3, dtype=F64)
    z_ref = xs[src].chunk(2)[me]
    dx_ref = cs[dst] + (
        torch.cat([cs[q][:2] for q in sorted((0, 2), key=lambda q: dist.get_group_rank(g, q))])
        if r == src
        else 0
    )
    return {"y": _d(y, y_ref), "z": _d(z, z_ref), "dx": _d(x.grad, dx_ref)}


def io_mesh_column_major_broadcast_and_shift_w4() -> dict[str, float]:
    """A DeviceMesh over [[0, 2], [1, 3]]: on axis "b", rank 0's peer is 2. broadcast(src=1)
    on that axis is the axis' second member; shift(1) on axis "a" rotates 0 <-> 1, 2 <-> 3."""
    from torch.distributed.device_mesh import DeviceMesh

    r = dc.get_rank()
    mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("a", "b"))
    row = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}[r]
    col = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}[r]
    xs, cs = _xs(4), _xs(4, seed=100)
    x = xs[r].clone().requires_grad_()
    y = dc.broadcast(x, src=1, group=(mesh, "b"))
    z = dc.shift(x, 1, group=(mesh, "a"))
    ((y * cs[r]).sum() + (z * cs[r]).sum()).backward()
    other = col[1 - col.index(r)]
    dx = (cs[row[0]] + cs[row[1]] if r == row[1] else 0) + cs[other]
    return {"y": _d(y, xs[row[1]]), "z": _d(z, xs[other]), "dx": _d(x.grad, dx)}


def io_results_changed_in_place_w3() -> dict[str, float]:
    """Results changed in place, as any torch result may be: all_gather along dim 1 then
    ``mul_``, a received tensor then ``relu_`` (ring: each rank receives from r - 1)."""
    r, w = dc.get_rank(), dc.get_world_size()
    xs, cs = _xs(w, (2, 3)), _xs(w, (2, 3 * w), seed=100)
    x = xs[r].clone().requires_grad_()
    y = dc.all_gather(torch.tanh(x), dim=1).mul_(2.0)
    tok = dc.send(x * 1.0, dst=(r + 1) % w)  # sends do not block (docs/p2p.md)
    z = dc.recv(src=(r - 1) % w)
    z = z.relu_()
    ((y * cs[r]).sum() + (z * cs[r][:, :3]).sum() + tok).backward()
    sx = [t.clone().requires_grad_() for t in xs]
    ys = [2.0 * torch.cat([torch.tanh(t) for t in sx], dim=1) for _ in range(w)]
    zs = [torch.relu(sx[(q - 1) % w]) for q in range(w)]
    sum((ys[q] * cs[q]).sum() + (zs[q] * cs[q][:, :3]).sum() for q in range(w)).backward()
    return {"y": _d(y, ys[r]), "z": _d(z, zs[r]), "dx": _d(x.grad, sx[r].grad)}


def io_checkpointed_collectives_and_sendrecv() -> dict[str, float]:
    """torch.utils.checkpoint (non-reentrant) around all_reduce(max), sendrecv and
    all_gather: every rank recomputes them in backward, in the same order."""
    import torch.utils.checkpoint as ckpt

    r, w = dc.get_rank(), dc.get_world_size()
    xs, cs = _xs(w), _xs(w, (2 * w, 3), seed=100)
    x = xs[r].clone().requires_grad_()

    def block(t: torch.Tensor) -> torch.Tensor:
        m = dc.all_reduce(t, op="max")
        nb = dc.sendrecv(torch.tanh(t), dst=(r + 1) % w, src=(r - 1) % w)
        return torch.tanh(dc.all_gather(m * nb))

    y = ckpt.checkpoint(block, x, use_reentrant=False)
    (y * cs[r]).sum().backward()
    sx = [t.clone().requires_grad_() for t in xs]
    m = torch.stack(sx).amax(0)
    full = torch.tanh(torch.cat([m * torch.tanh(sx[(q - 1) % w]) for q in range(w)]))
    sum((full * cs[q]).sum() for q in range(w)).backward()
    return {"y": _d(y, full), "dx": _d(x.grad, sx[r].grad)}


def _pipeline_under_check(schedule: str) -> dict[str, float]:
    """A training step of a pipeline under dc.spmd_check (docs/spmd_types.md: a stage's
    parameters are its own): no false positive, and the step is still right."""
    model, ref = _mlp([4, 5, 5, 5, 2]), _mlp([4, 5, 5, 5, 2])
    runner, stages = _runner_for(schedule, model)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    with dc.spmd_check():
        loss = runner.step(x, t, n_micro=4)
        torch.optim.SGD([q for st in stages for q in st.parameters()], lr=0.0).step()
    ref_loss = _serial_loss(ref, x, t, 4, F.mse_loss)
    ref_loss.backward()
    return {"loss": _d(loss, ref_loss.detach()), **_grads_vs(model, ref, stages)}


def io_pipeline_interleaved_under_spmd_check() -> dict[str, float]:
    return _pipeline_under_check("interleaved")


def io_pipeline_dualpipev_under_spmd_check() -> dict[str, float]:
    return _pipeline_under_check("dualpipev")


def io_pipeline_on_mesh_forgot_dp_sync_under_check_w4() -> dict[str, float]:
    """The (dp, pp) mesh program checked over the dp axis, with the dp gradient average
    left out: the replicas would drift apart; the check names the parameter."""
    from diffcomm.pipeline import PipelineRunner, partition

    mesh = _mesh((2, 2), ("dp", "pp"))
    dp, pp = mesh.get_coordinate()
    stage = partition(_mlp([4, 8, 8, 2]), 2)[pp]
    runner = PipelineRunner(stage, schedule="1f1b", group=(mesh, "pp"), loss_fn=F.mse_loss)
    g = _gen(5)
    x, t = torch.randn(8, 4, dtype=F64, generator=g), torch.randn(8, 2, dtype=F64, generator=g)
    with dc.spmd_check(group=(mesh, "dp")):
        runner.step(dc.spmd.varying(x.chunk(2)[dp]), dc.spmd.varying(t.chunk(2)[dp]), n_micro=2)
        torch.optim.SGD(stage.parameters(), lr=0.1).step()
    return {"ran": 0.0}


def io_submesh_alone_as_group_w4() -> dict[str, float]:
    """``mesh["tp"]`` (a 1-D DeviceMesh, DTensor's habit) passed as the group by itself."""
    mesh = _mesh((2, 2), ("dp", "tp"))
    dc.all_reduce(torch.ones(1, dtype=F64), group=mesh["tp"])
    return {"ran": 0.0}


def io_submesh_pair_and_get_group_w4() -> dict[str, float]:
    """(mesh["tp"], 0), (mesh["tp"], "tp") and mesh.get_group("tp"): the same tp group."""
    r = dc.get_rank()
    mesh = _mesh((2, 2), ("dp", "tp"))
    x = torch.full((1,), float(r), dtype=F64)
    want = float(2 * (r // 2) + 2 * (r // 2) + 1)  # the two ranks of this rank's tp row
    return {
        str(k): abs(float(dc.all_reduce(x, group=g)) - want)
        for k, g in enumerate([(mesh["tp"], 0), (mesh["tp"], "tp"), mesh.get_group("tp"), (mesh, "tp")])
    }


IO_PROGRAMS: dict[str, Program] = {
    "submesh_alone_as_group_w4": Program(
        io_submesh_alone_as_group_w4,
        world=4,
        error=(TypeError, r"`group` must be .*\(DeviceMesh, axis\) pair"),
    ),
    "submesh_pair_and_get_group_w4": Program(io_submesh_pair_and_get_group_w4, world=4),
    "pipeline_interleaved_under_spmd_check": Program(io_pipeline_interleaved_under_spmd_check),
    "pipeline_dualpipev_under_spmd_check": Program(io_pipeline_dualpipev_under_spmd_check),
    "pipeline_on_mesh_forgot_dp_sync_under_check_w4": Program(
        io_pipeline_on_mesh_forgot_dp_sync_under_check_w4,
        world=4,
        error=(TypeError, r"Linear\.weight is replicated, but its gradient is partial"),
    ),
    "checkpointed_collectives_and_sendrecv_w3": Program(io_checkpointed_collectives_and_sendrecv, world=3),
    "results_changed_in_place_w3": Program(io_results_changed_in_place_w3, world=3),
    "subgroup_unsorted_ranks_reduce_w3": Program(io_subgroup_unsorted_ranks_reduce_w3, world=3),
    "mesh_column_major_broadcast_and_shift_w4": Program(io_mesh_column_major_broadcast_and_shift_w4, world=4),
    "subgroup_members_only_w3": Program(io_subgroup_members_only_w3, world=3),
    "subgroup_non_member_calls_w3": Program(io_subgroup_non_member_calls_w3, world=3),
    "subgroup_broadcast_group_local_src_w3": Program(io_subgroup_broadcast_group_local_src_w3, world=3),
    "subgroup_send_recv_group_local_w3": Program(io_subgroup_send_recv_group_local_w3, world=3),
    "group_as_rank_list": Program(io_group_as_rank_list, error=(TypeError, r"`group`")),
    "mesh_axes_gather_then_reduce_scatter_w4": Program(io_mesh_axes_gather_then_reduce_scatter_w4, world=4),
    "mesh_unknown_axis_name_w4": Program(io_mesh_unknown_axis_name_w4, world=4, error=(ValueError, r"pp")),
    "dtensor_into_all_reduce": Program(
        io_dtensor_into_all_reduce,
        error=(TypeError, r"`x` must be a plain torch.Tensor.*to_local.*got a DTensor"),
    ),
    "dtensor_to_local_into_all_gather": Program(io_dtensor_to_local_into_all_gather),
    "compat_and_torch_nn_mixed_with_dc": Program(io_compat_and_torch_nn_mixed_with_dc),
    "pipeline_on_mesh_with_dp_w4": Program(io_pipeline_on_mesh_with_dp_w4, world=4),
}


# ------------------------------------------------------------------ the test


def _cases() -> list[Any]:
    cases = []
    for area, table in (
        ("cp", CP_PROGRAMS),
        ("moe", MOE_PROGRAMS),
        ("seam", SEAM_PROGRAMS),
        ("pp", PP_PROGRAMS),
        ("kit", KIT_PROGRAMS),
        ("io", IO_PROGRAMS),
    ):
        for name, prog in table.items():
            marks = list(prog.marks)
            if prog.finding is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=prog.finding))
            cases.append(pytest.param(prog, id=f"{area}-{name}", marks=marks))
    return cases


#: the programs that stay on gloo processes: the seam programs (each also runs in-process
#: in test_seam_program_in_process: the pair checks that both worlds end alike) and the one
#: that calls torch.distributed.nn (its ops look the group up in torch's world group map,
#: which the in-process world does not fill). The others need no real transport
#: (docs/in_process.md: the same values, errors and gradients), so they run in-process.
_ON_PROCESSES = ("seam-", "io-compat_and_torch_nn_mixed_with_dc")


def _in_process_unless_kept(cases: list[Any]) -> list[Any]:
    inproc = pytest.mark.diffcomm_in_process
    return [
        c if c.id.startswith(_ON_PROCESSES) else pytest.param(*c.values, id=c.id, marks=[*c.marks, inproc])
        for c in cases
    ]


@pytest.mark.parametrize("prog", _in_process_unless_kept(_cases()))
def test_user_program(prog: Program, local_worlds: Callable[..., Any]) -> None:
    """The program ends right (every value and gradient equals the float64 serial
    reference of the whole SPMD program) or in the documented error naming the argument."""
    _assert_ends_as_expected(prog, local_worlds(prog.world).run(_guarded, prog.fn))


@pytest.mark.parametrize("prog", [c for c in _cases() if c.id.startswith("seam-")])
def test_seam_program_in_process(prog: Program, local_worlds: Callable[..., Any]) -> None:
    """All ranks in one process (docs/in_process.md): the same ending as on processes."""
    _assert_ends_as_expected(prog, local_worlds(prog.world, in_process=True).run(_guarded, prog.fn))


def _uneven_round_trip(sizes: list[int], dim: int) -> float:
    """A user's linear op on uneven shards: all_gather of this rank's ``sizes[r]`` rows,
    a fixed scaling, reduce_scatter back with the same split, checked by check_adjoint."""
    r = dc.get_rank()
    shape = [2, 3]
    shape[dim] = sizes[r]
    x = torch.randn(*shape, dtype=F64, generator=_gen(r))
    y = torch.randn(*shape, dtype=F64, generator=_gen(50 + r))
    scale = torch.arange(1.0, sum(sizes) + 1, dtype=F64).reshape([-1, 1] if dim == 0 else [1, -1])

    def op(t: torch.Tensor) -> torch.Tensor:
        return dc.reduce_scatter(dc.all_gather(t, dim=dim) * scale, dim=dim, split_sizes=sizes)

    return testing.check_adjoint(op, x, y)


def test_kit_strategies_uneven_sizes_into_check_adjoint(local_worlds: Callable[..., Any]) -> None:
    """docs/testing.md's strategies: uneven split sizes (zeros allowed) drawn by hypothesis
    for a user's op on a world of 3, each checked by the dot-product test."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from diffcomm.testing import strategies as dst

    world = local_worlds(3)

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    @given(sizes=dst.uneven_split_sizes(total=5, world=3), dim=st.sampled_from([0, 1]))
    def check(sizes: list[int], dim: int) -> None:
        assert max(world.run(_uneven_round_trip, list(sizes), dim)) < 1e-10

    check()


def _assert_ends_as_expected(prog: Program, results: list[tuple[str, Any, str]]) -> None:
    for rank, (kind, value, msg) in enumerate(results):
        if prog.error is None:
            assert kind == "ok", f"rank {rank} raised {value[0]}: {msg}"
            assert value, f"rank {rank} compared nothing"
            worst = max(value.values())
            assert worst <= TOL, f"rank {rank}: silently wrong, differences {value}"
        else:
            exc_type, pattern = prog.error
            assert kind == "err", f"rank {rank}: no error, returned {value}"
            assert exc_type.__name__ in value, (
                f"rank {rank}: {value[0]} instead of {exc_type.__name__}: {msg}"
            )
            assert re.search(pattern, msg), f"rank {rank}: message does not name {pattern!r}: {msg}"
