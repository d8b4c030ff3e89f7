"""Ring attention: the forward and backward rings (the K/V hops, the online-softmax merge),
the fused-kernel path and the argument checks of :func:`ring_attention`. The block plan
(which queries meet which keys) is :mod:`~diffcomm.parallel.context.plan`, the serial
reference and the dropout mask :mod:`~diffcomm.parallel.context.reference`, the checks
shared with Ulysses :mod:`~diffcomm.parallel.context.args`. Under torch's
``LocalTensorMode`` the same ring runs as one program for every simulated rank
(:class:`_LocalPlan`: the hop a per-rank ``ppermute``, positions and masks per rank, every
block whole with its mask; chosen once per call). See :mod:`diffcomm.parallel.context`."""

# Size: ~700 lines, over the ~600 guideline: the ring's autograd Function (forward and
# backward rings, fused and masked block paths) and its per-simulated-rank plan under
# LocalTensorMode read the same block loop; the block plan itself is in plan.py.

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ... import _config, _torch
from ... import backend as B
from ..._replication import P, R, Rule, V
from ...backend import args as A
from ...backend.in_process import per_rank_attr
from ...backend.local_tensor import LocalTensorBackend
from ...ops import engine as _async
from .._autocast import run_lowered
from .._once import first_order
from .args import check_causal, check_dropout, check_equal_lengths, check_qkv, check_scale, draw_seed
from .layout import (
    LAYOUTS,
    PG,
    Placement,
    doc_ids,
    group_rank_world_or_local,
    group_ranks,
    placed,
    placed_cu_seqlens,
    placed_seq_len,
    placement_of,
    rank_positions,
    require_layout_known,
    require_seq_dim,
    require_seq_len_known,
    resolve_layout,
    resolve_seq,
    tag_grad_of,
)
from .plan import BlockPlan, put_add, take
from .reference import dropout_keep_mask

__all__ = ["ring_attention"]

_RING_TAG = (1 << 16) + 34  # p2p tag of the attention ring (user tags are < 2**16)

# ======================================================================================
# the ring
# ======================================================================================


class _Plan(BlockPlan):
    """Everything about one ring_attention call except the tensors: the block plan, and
    the ring it travels (group, scale, dropout, heads; the same object serves forward
    and backward)."""

    def __init__(
        self,
        pg: PG,
        rank: int,
        world: int,
        table: Tensor,
        docs: Tensor,
        causal: bool,
        scale: float,
        dropout_p: float,
        seed: int,
        heads: int,
        kv_heads: int,
    ) -> None:
        super().__init__(rank, world, table, docs, causal)
        self.pg, self.scale = pg, scale
        self.dropout_p, self.seed = dropout_p, seed
        self.heads, self.kv_heads = heads, kv_heads

    def hop(self, x: Tensor, name: str, j: int | None) -> Tensor:
        """Launch one hop of ``x`` around the ring (``j``: the rank whose K/V block arrives,
        ``None`` for the gradient accumulators)."""
        return _hop(x, self.pg, self.rank, self.world, name)

    def wait(self, x: Tensor) -> Tensor:
        """The finished result of a hop (timed as ``"wait"`` under :func:`_trace`)."""
        if _TRACE is None or not isinstance(x, _async.AsyncTensor):
            return _async.wait(x)
        t0 = time.perf_counter()
        x = _async.wait(x)
        _record("wait", t0)
        return x


class _LocalPlan(_Plan):
    """The plan under torch's ``LocalTensorMode``: one program for every simulated rank,
    so nothing reads the rank as a Python int (``plan.rank`` is 0 and stands for no rank).

    * The hop (send to rank+1, receive from rank-1) is the same pairing on every rank: the
      backend's per-rank ``ppermute``.
    * At step ``i`` the ring loop (:func:`_ring`, run with rank 0) names block ``j =
      -i mod W``; simulated rank ``r`` holds block ``(r + j) mod W``, a per-rank tensor.
    * A block's positions are the layout table's rows selected by those per-rank tensors,
      and its allowed pairs (documents, padding, causal) are computed elementwise from
      them. Which blocks a rank skips and how it trims them differ per rank, so every block
      is one piece with its mask: a fully masked row adds exactly nothing in the online
      softmax (its log-sum-exp is ``-inf``, its weight 0) and gets exactly zero gradient.
    """

    def __init__(self, pg: PG, world: int, table: Tensor, docs: Tensor, causal: bool, *rest: Any) -> None:
        super().__init__(pg, 0, world, table, docs, causal, *rest)
        every = B.get_backend()
        assert isinstance(every, LocalTensorBackend)  # (the adapter while a mode is on)
        self.every = every

    def hop(self, x: Tensor, name: str, j: int | None) -> Tensor:
        W = self.world
        return self.every.ppermute(x.contiguous(), [(r, (r + 1) % W) for r in range(W)], self.pg)

    def block(self, j: int, device: torch.device) -> list[tuple[Any, ...]]:
        n = self.table.shape[1]
        if n == 0:
            return []
        qi, qd = rank_positions(self.table, self.pg), rank_positions(self.docs, self.pg)
        kj = (self.every.rank_tensor(self.pg, self.table.device) + j).view(1) % self.world
        ki, kd = self.table.index_select(0, kj).view(-1), self.docs.index_select(0, kj).view(-1)
        allowed = (qd.view(-1, 1) == kd.view(1, -1)) & (qd.view(-1, 1) >= 0)
        if self.causal:
            allowed &= ki.view(1, -1) <= qi.view(-1, 1)
        # (padding's positions read as 0: masked, never attended; the user mask's and the
        # dropout hash's columns need a real position)
        qpos, kpos = qi.clamp(min=0).to(device), ki.clamp(min=0).to(device)
        return [(slice(0, n), slice(0, n), allowed.to(device), qpos, kpos, False)]


#: A list while :func:`_trace` is active: ``(kind, start, end)`` of every ring step's
#: compute (``"compute"``), wait for a hop (``"wait"``) and hop on the engine (``"comm"``),
#: ``time.perf_counter`` seconds. For the benchmark's timeline; ``None`` costs nothing.
_TRACE: list[tuple[str, float, float]] | None = None
per_rank_attr(sys.modules[__name__], "_TRACE", lambda: None)  # a rank's own in-process


def _record(kind: str, t0: float) -> None:
    if _TRACE is not None:
        _TRACE.append((kind, t0, time.perf_counter()))


@contextlib.contextmanager
def _trace() -> Iterator[list[tuple[str, float, float]]]:
    """Record the ring's compute / wait / communication intervals in the block."""
    global _TRACE
    old, _TRACE = _TRACE, []
    try:
        yield _TRACE
    finally:
        _TRACE = old


def _hop(x: Tensor, pg: PG, rank: int, world: int, name: str) -> Tensor:
    """Launch: send ``x`` to rank+1, receive rank-1's (same shape), on the engine; a
    plain blocking exchange where the engine cannot be used (compile, torch.func)."""
    b = B.get_backend()

    def raw(t: Tensor) -> Tensor:
        t0 = time.perf_counter()
        t = t.contiguous()
        out = torch.empty_like(t)
        if t.numel():
            with B.label(name):
                b.batch_p2p(
                    [
                        ("send", t, (rank + 1) % world, _RING_TAG),
                        ("recv", out, (rank - 1) % world, _RING_TAG),
                    ],
                    pg,
                )
        _record("comm", t0)
        return out

    if not _async.available():
        return raw(x)
    # private: the ring's own packed blocks and sums, waited for before the ring returns
    return _async.launch(x, name, raw, x.shape, private=True)


def _pack(*ts: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    out, o = [], 0
    for t in like:
        out.append(flat[o : o + t.numel()].view(t.shape))
        o += t.numel()
    return out


def _scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``q (B, Hk, G, Sq, D)`` x ``k (B, Hk, Sk, D)`` -> ``(B, Hk, G, Sq, Sk)``."""
    return torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale


class _Mask:
    """The user's ``attn_mask`` as ``(b, Hk|1, G|1, S_local, S)``: bool (True = attend) or
    additive float; columns are global positions."""

    def __init__(self, m: Tensor, heads: int, kv_heads: int) -> None:
        b, h = m.shape[0], m.shape[1]
        g = heads // kv_heads
        self.m = (
            m.view(b, kv_heads, g, m.shape[2], m.shape[3]) if h == heads else m.view(b, 1, 1, *m.shape[2:])
        )
        self.is_bool = m.dtype == torch.bool

    def cols(self, rows: slice | Tensor, kpos: Tensor) -> Tensor:
        return take(self.m, rows, 3).index_select(4, kpos)


def _apply_masks(s: Tensor, allowed: Tensor | None, um: Tensor | None, is_bool: bool) -> Tensor:
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if um is not None:
        s = s.masked_fill(~um, float("-inf")) if is_bool else s + um
    return s


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring accumulates in: float32 for 16-bit inputs, as a flash kernel does.
    The output and log-sum-exp merged over ``W`` blocks (and the dQ/dK/dV summed over them,
    dK/dV carried around the ring) would round at every block in bfloat16: 10-50x SDPA's
    own error on the same inputs at world 3."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _keep(plan: _Plan, qpos: Tensor, kpos: Tensor, B_: int) -> Tensor:
    keep = dropout_keep_mask(plan.seed, B_, plan.heads, qpos, kpos, plan.dropout_p)
    g = plan.heads // plan.kv_heads
    return keep.view(B_, plan.kv_heads, g, qpos.numel(), kpos.numel())


class _RingAttention(torch.autograd.Function):
    """Ring attention, forward and backward rings (first order).

    Not a ``CommOp``: attention fused with its communication (nonlinear in q, k, v); see
    the module docstring."""

    spmd = Rule(
        {V: V},
        tensors=(0, 1, 2),
        group=lambda a: a["plan"].pg,
        backward="reverse ring",
        refuse={R: "q, k, v must be this rank's sequence chunk (declare it varying)", P: "reduce it first"},
    )

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, plan: _Plan) -> Tensor:
        Bq, Hq, Sl, D = q.shape
        Hk, Dv = k.shape[1], v.shape[-1]
        G = Hq // Hk
        q5 = q.detach().reshape(Bq, Hk, G, Sl, D)
        k_, v_ = k.detach(), v.detach()
        um = None if mask is None else _Mask(mask.detach(), Hq, Hk)
        acc = _accumulator(q.dtype)
        out = torch.zeros(Bq, Hk, G, Sl, Dv, dtype=acc, device=q.device)
        lse = torch.full((Bq, Hk, G, Sl), float("-inf"), dtype=acc, device=q.device)
        fast = _fusable(q, v, mask, plan)
        label = f"parallel.ring_attention step {{}}/{plan.world - 1}"
        for _, j, (kj, vj), t0 in _ring(plan, _pack(k_, v_), (k_, v_), label):
            for rows, cols, allowed, qpos, kpos, tril in plan.block(j, q.device):
                qs = take(q5, rows, 3)
                if fast and (allowed is None or tril):
                    o_b, lse_b = _fused_fwd(qs, take(kj, cols, 2), take(vj, cols, 2), tril, plan.scale)
                    _merge(out, lse, rows, o_b, lse_b)
                    continue
                s = _scores(qs.to(acc), take(kj, cols, 2).to(acc), plan.scale)
                s = _apply_masks(
                    s, allowed, None if um is None else um.cols(rows, kpos), bool(um and um.is_bool)
                )
                m = s.amax(-1, keepdim=True)
                m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
                p = torch.exp(s - m)
                l_ = p.sum(-1, keepdim=True)
                lse_b = (m + torch.log(l_)).squeeze(-1)
                if plan.dropout_p > 0:
                    p = p * _keep(plan, qpos, kpos, Bq) / (1 - plan.dropout_p)
                o_b = torch.matmul(p, take(vj, cols, 2).to(acc).unsqueeze(2))
                o_b = o_b / torch.where(l_ > 0, l_, torch.ones_like(l_))
                _merge(out, lse, rows, o_b, lse_b)
            _record("compute", t0)
        ctx.save_for_backward(q, k, v, mask, out, lse)  # (out and lse in the accumulator dtype)
        ctx.plan = plan
        return out.view(Bq, Hq, Sl, Dv).to(q.dtype)

    @staticmethod
    @first_order(
        "parallel.ring_attention",
        "Use ulysses_attention with a twice-differentiable attn_fn for double backward.",
    )
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        q, k, v, mask, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        Bq, Hq, Sl, D = q.shape
        Hk, Dv = k.shape[1], v.shape[-1]
        G = Hq // Hk
        q5 = q.reshape(Bq, Hk, G, Sl, D)
        do = g.reshape(Bq, Hk, G, Sl, Dv)
        wide = out.dtype  # the accumulator dtype (float32 for 16-bit inputs)
        delta = (do.to(wide) * out).sum(-1)  # (B, Hk, G, Sl)
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        um = None if mask is None else _Mask(mask, Hq, Hk)
        dmask = None
        if mask is not None and ctx.needs_input_grad[3]:
            dmask = torch.zeros_like(um.m, dtype=wide)  # type: ignore[union-attr]
        dq = torch.zeros_like(q5, dtype=wide)
        world = plan.world
        fast = _fusable(q, v, mask, plan)
        dkv: Tensor | None = None
        label = f"parallel.ring_attention backward step {{}}/{world}"
        for name, j, (kj, vj), t0 in _ring(plan, _pack(k, v), (k, v), label):
            dk_j, dv_j = torch.zeros_like(k, dtype=wide), torch.zeros_like(v, dtype=wide)
            for rows, cols, allowed, qpos, kpos, tril in plan.block(j, q.device):
                qs = take(q5, rows, 3)
                kc, vc = take(kj, cols, 2), take(vj, cols, 2)
                if fast and (allowed is None or tril):
                    dq_b, dk_b, dv_b = _fused_bwd(
                        take(do, rows, 3),
                        qs,
                        kc,
                        vc,
                        take(out, rows, 3).to(q.dtype),
                        take(lse, rows, 3),
                        tril,
                        plan.scale,
                    )
                    put_add(dq, rows, 3, dq_b)
                    put_add(dk_j, cols, 2, dk_b)
                    put_add(dv_j, cols, 2, dv_b)
                    continue
                qs, kc, vc = qs.to(wide), kc.to(wide), vc.to(wide)
                s = _scores(qs, kc, plan.scale)
                s = _apply_masks(
                    s, allowed, None if um is None else um.cols(rows, kpos), bool(um and um.is_bool)
                )
                p = torch.exp(s - take(lse_safe, rows, 3).unsqueeze(-1))
                dos = take(do, rows, 3).to(wide)
                dp = torch.matmul(dos, vc.unsqueeze(2).transpose(-1, -2))
                if plan.dropout_p > 0:
                    keep = _keep(plan, qpos, kpos, Bq).to(p.dtype) / (1 - plan.dropout_p)
                    pd = p * keep
                    dp = dp * keep
                else:
                    pd = p
                put_add(dv_j, cols, 2, torch.matmul(pd.transpose(-1, -2), dos).sum(2))
                ds = p * (dp - take(delta, rows, 3).unsqueeze(-1))
                put_add(dq, rows, 3, torch.matmul(ds, kc.unsqueeze(2)) * plan.scale)
                put_add(dk_j, cols, 2, torch.matmul(ds.transpose(-1, -2), qs).sum(2) * plan.scale)
                if dmask is not None:
                    _mask_grad(dmask, ds, rows, kpos)
            _record("compute", t0)
            # the K/V gradients travel with their block: add what arrived from rank r-1
            mine = _pack(dk_j, dv_j)
            acc = mine if dkv is None else plan.wait(dkv) + mine
            dkv = plan.hop(acc, name + " (dk, dv)", None) if world > 1 else acc
        assert dkv is not None
        dk, dv = _unpack(plan.wait(dkv), (k, v))
        dm = None
        if dmask is not None:
            dm = dmask.reshape(mask.shape).to(mask.dtype)
        dq_out = dq.view(Bq, Hq, Sl, D).to(q.dtype)
        return dq_out, dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True), dm, None


def _ring(
    plan: _Plan, kv: Tensor, like: tuple[Tensor, Tensor], label: str
) -> Iterator[tuple[str, int, list[Tensor], float]]:
    """The ring's ``world`` steps over the packed K/V block ``kv``: at step ``i`` this rank
    holds rank ``j = rank - i``'s block while the next one travels (hop to rank+1, from
    rank-1, named ``label.format(i + 1)``). Yields ``(name, j, (k_j, v_j) unpacked like
    ``like``, start time)``; the block is swapped for the next when the step's body ends."""
    rank, world = plan.rank, plan.world
    for i in range(world):
        j = (rank - i) % world
        name = label.format(i + 1)
        nxt = plan.hop(kv, name, (j - 1) % world) if i < world - 1 else None
        kv = plan.wait(kv)
        t0 = time.perf_counter()
        yield name, j, _unpack(kv, like), t0
        if nxt is not None:
            kv = nxt


def _merge(out: Tensor, lse: Tensor, rows: slice | Tensor, o_b: Tensor, lse_b: Tensor) -> None:
    """Log-sum-exp merge of a block's ``(o_b, lse_b)`` into ``(out, lse)`` on its rows, in
    place."""
    lse_r = take(lse, rows, 3)
    new = torch.logaddexp(lse_r, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse_r - safe).unsqueeze(-1)
    w_new = torch.exp(lse_b - safe).unsqueeze(-1)
    _put(out, lse, rows, take(out, rows, 3) * w_old + o_b * w_new, new)


def _put(out: Tensor, lse: Tensor, rows: slice | Tensor, o_new: Tensor, lse_new: Tensor) -> None:
    if isinstance(rows, slice):
        out[:, :, :, rows] = o_new
        lse[:, :, :, rows] = lse_new
    else:
        out.index_copy_(3, rows, o_new)
        lse.index_copy_(3, rows, lse_new)


#: torch's fused CPU attention kernel (flash attention for CPU): returns the log-sum-exp,
#: and its backward takes the *global* output and log-sum-exp, which is what a ring needs
_FLASH_CPU, _FLASH_CPU_BWD = _torch.FLASH_ATTENTION_CPU, _torch.FLASH_ATTENTION_CPU_BACKWARD


def _fusable(q: Tensor, v: Tensor, mask: Tensor | None, plan: _Plan) -> bool:
    """Whether full / causal-diagonal pieces can use the fused CPU kernel: CPU tensors of a
    kernel dtype, equal q/v head sizes, no user mask, no dropout (the kernel's dropout is
    not the layout-independent mask of :func:`dropout_keep_mask`)."""
    return (
        _FLASH_CPU is not None
        and _FLASH_CPU_BWD is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
        and v.shape[-1] == q.shape[-1]
        and mask is None
        and plan.dropout_p == 0
        and q.shape[-1] > 0
    )


def _expand_kv(k: Tensor, g: int) -> Tensor:
    """``(B, Hk, S, D)`` -> ``(B, Hk*g, S, D)``: each KV head for its ``g`` query heads."""
    Bn, Hk, S, D = k.shape
    return k.unsqueeze(2).expand(Bn, Hk, g, S, D).reshape(Bn, Hk * g, S, D)


def _fused_fwd(qs: Tensor, kc: Tensor, vc: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One piece on the fused kernel: ``qs (B, Hk, G, n, D)`` -> output ``(B, Hk, G, n, D)``
    and log-sum-exp ``(B, Hk, G, n)``."""
    Bn, Hk, G, n, D = qs.shape
    o, lse = _FLASH_CPU(
        qs.reshape(Bn, Hk * G, n, D), _expand_kv(kc, G), _expand_kv(vc, G), 0.0, causal, scale=scale
    )
    return o.view(Bn, Hk, G, n, D), lse.to(_accumulator(qs.dtype)).view(Bn, Hk, G, n)


def _fused_bwd(
    do: Tensor, qs: Tensor, kc: Tensor, vc: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The fused kernel's backward of one piece, with the **global** output and log-sum-exp
    of these rows (so its probabilities and ``rowsum(dO * O)`` are the whole row's):
    returns this piece's dq ``(B, Hk, G, n, D)`` and dk, dv ``(B, Hk, m, D)``."""
    Bn, Hk, G, n, D = qs.shape
    H = Hk * G
    dq, dk, dv = _FLASH_CPU_BWD(
        do.reshape(Bn, H, n, D).contiguous(),
        qs.reshape(Bn, H, n, D).contiguous(),
        _expand_kv(kc, G).contiguous(),
        _expand_kv(vc, G).contiguous(),
        out.reshape(Bn, H, n, D).contiguous(),
        lse.reshape(Bn, H, n).to(torch.float32 if qs.dtype == torch.bfloat16 else qs.dtype).contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    m = kc.shape[2]
    return (
        dq.view(Bn, Hk, G, n, D),
        dk.view(Bn, Hk, G, m, D).sum(2),
        dv.view(Bn, Hk, G, m, D).sum(2),
    )


def _mask_grad(dmask: Tensor, ds: Tensor, rows: slice | Tensor, kpos: Tensor) -> None:
    """Add ``ds`` (the score gradient of a block) into the additive mask's gradient,
    summed over the dims the mask broadcasts."""
    red = ds
    for d in range(3):
        if dmask.shape[d] == 1 and ds.shape[d] != 1:
            red = red.sum(d, keepdim=True)
    sub = take(dmask, rows, 3)
    sub = sub.index_add(4, kpos, red)
    if isinstance(rows, slice):
        dmask[:, :, :, rows] = sub
    else:
        dmask.index_copy_(3, rows.to(dmask.device), sub)


def _check_mask(mask: Any, q: Tensor, total: int, op: str) -> Tensor | None:
    if mask is None:
        return None
    mask = A.check_tensor(mask, op, "attn_mask")
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise A.arg_error(op, "attn_mask", "a bool or floating-point tensor", mask.dtype, TypeError)
    if mask.dtype.is_floating_point and mask.dtype != q.dtype:
        raise A.arg_error(op, "attn_mask", f"of q's dtype {q.dtype} (or bool)", mask.dtype, TypeError)
    Bq, Hq, Sl = q.shape[:3]
    shape = tuple(mask.shape)
    while len(shape) < 4:
        shape = (1, *shape)
    ok = (
        len(shape) == 4
        and shape[0] in (1, Bq)
        and shape[1] in (1, Hq)
        and shape[2] in (1, Sl)
        and shape[3] == total
    )
    if not ok:
        raise A.arg_error(
            op,
            "attn_mask",
            f"broadcastable as (batch|1, heads|1, seq_local={Sl}|1, seq_len={total}): this rank's "
            "query rows (or one row for all, a key-padding mask), columns in global sequence order",
            f"shape {tuple(mask.shape)}",
        )
    # one row for all (a key-padding mask, the same on every rank in any layout): each
    # query row reads it (an expanded view, no copy; an additive mask's rows' gradients
    # are summed back by the expand's backward)
    return mask.reshape(shape).expand(shape[0], shape[1], Sl, total)


#: why ring attention runs eagerly under ``torch.compile`` (a graph break; what
#: ``fullgraph=True`` reports). Traced, it failed inside diffcomm: with real processes
#: ``AttributeError: 'TraceableBackend' object has no attribute 'batch_p2p'`` (its hops),
#: in the in-process world ``RuntimeError: No backend type associated with device type
#: cpu`` (the length check's size exchange).
_EAGER_UNDER_COMPILE = (
    "diffcomm.parallel.ring_attention: its ring steps are point-to-point exchanges on "
    "diffcomm's communication engine, which dynamo cannot trace, so under torch.compile it "
    "runs eagerly between the compiled graphs (a graph break, same values and gradients). "
    "For one graph (fullgraph=True) use parallel.ulysses_attention (all_to_all, traceable) "
    "or call ring_attention outside the compiled function"
)


def _eager_under_compile(fn: Any) -> Any:
    return _torch.compiler_disable(fn, reason=_EAGER_UNDER_COMPILE)


@_eager_under_compile
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: A.GroupLike = None,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    layout: str | None = None,
    cu_seqlens: Any = None,
    seq_len: int | None = None,
) -> Tensor:
    """Exact attention over a sequence split across the ranks of ``group``: the ring.

    Rank ``r`` holds the positions ``layout_index(S, W, layout=layout)[r]`` of ``q``,
    ``k``, ``v`` (see :func:`shard`). Over ``W`` steps the K/V blocks travel one hop
    around the ring (the next hop runs on the communication engine while the current block
    is computed); each rank merges every block into its output with the online softmax
    (log-sum-exp). Blocks with no allowed pair (causal, other documents) are skipped, and
    the computed part of a block is trimmed to the rows and columns that attend at all —
    which is what makes ``layout="zigzag"`` balanced for causal attention.

    Args:
        q: ``(batch, heads, seq_local, head_dim)``, this rank's queries.
        k: ``(batch, kv_heads, seq_local, head_dim)``; ``kv_heads`` divides ``heads`` (GQA:
            query head ``h`` uses KV head ``h // (heads // kv_heads)``).
        v: ``(batch, kv_heads, seq_local, head_dim_v)``.
        group: ``None`` (world), a ``ProcessGroup`` or ``(DeviceMesh, axis)``.
        causal: a key attends a query only when its global position is not after the
            query's (within the same document with ``cu_seqlens``).
        attn_mask: optional, this rank's rows of the mask: broadcastable to
            ``(batch, heads, seq_local, S)`` with columns in global order (a row dim of 1,
            a key-padding mask ``(batch, 1, 1, S)``, is every row's, the same tensor on
            every rank); bool (``True`` = attend) or additive float (receives its
            gradient). Combined with ``causal``.
            Rows taken with :func:`shard` carry their placement: one other than q's
            layout raises ``ValueError``.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        dropout_p: attention dropout probability (on the softmax weights, as SDPA).
        dropout_seed: the dropout seed (the same on every rank of the group gives the
            serial program's mask; a rank given its own seed drops its own rows with
            it); ``None``: drawn from the current default generator (use a stream of
            :mod:`diffcomm.rng` that is the same across the group: debug mode checks
            that the drawn seeds agree). The mask is
            :func:`dropout_keep_mask` of global coordinates, so it does not depend on
            the layout or world size.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced causal work); ``None``: the
            layout ``q``/``k``/``v`` were placed with by :func:`shard` (their
            :class:`Placement`), else ``"contiguous"`` (:data:`DEFAULT_LAYOUT`, the
            default of every context-parallel entry point). A layout other than the
            tensors' placement, tensors placed differently, or unplaced ones once the
            program used another layout over ``W`` ranks (a guess) raise ``ValueError``.
        cu_seqlens: cumulative lengths of packed documents (``[0, ..., S]``): attention
            stays inside each document (plus ``causal``); the layout balances each document.
        seq_len: the global length ``S`` when the shards are padded (default: the
            length ``q``/``k``/``v``'s placement recorded (:func:`shard` of the whole
            sequence), else ``cu_seqlens[-1]``, else ``W * seq_local``). One that
            contradicts the recorded length raises ``ValueError``; so do unequal lengths
            in the last case (the ranks compare them first: one small exchange).

    Returns:
        ``(batch, heads, seq_local, head_dim_v)``: this rank's rows of attention over the
        whole sequence (zero for padding and for rows that may attend nothing), carrying
        the :class:`Placement` of its rows (so :func:`unshard` needs no ``layout``); of
        ``q``'s dtype, or under ``torch.autocast`` of the autocast dtype (``q``, ``k``,
        ``v`` cast as autocast casts SDPA; the gradients return in their own dtypes).

    Gradient:
        a backward ring: K/V travel again, with their gradient accumulators one hop
        behind; each rank recomputes its blocks from the saved log-sum-exp, keeps the
        ``q`` gradient and adds its ``k``/``v`` contribution to the travelling
        accumulator, which ends on the owner. First order only (``once_differentiable``;
        use :func:`ulysses_attention` for double backward).

    Example::

        def attend():
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))     # the whole sequence
            ql, kl, vl = (parallel.shard(t, layout="zigzag") for t in (q, k, v))
            out = parallel.ring_attention(ql, kl, vl, causal=True)     # zigzag: from the shards
            return parallel.unshard(out)                                # == SDPA(q, k, v)

        with dc.LocalWorld(2) as world:
            world.run(attend)
    """
    op = "parallel.ring_attention"
    q, k, v = check_qkv(q, k, v, op)
    causal = check_causal(causal, op)
    sc = check_scale(scale, q.shape[-1], op)
    p = check_dropout(dropout_p, op)
    pg, rank, world = group_rank_world_or_local(group, op)  # (rank None: see _LocalPlan)
    ranks = group_ranks(pg)
    given = layout
    require_seq_dim(op, {"q": q, "k": k, "v": v})
    layout = resolve_layout(op, layout, {"q": q, "k": k, "v": v}, world, ranks=ranks)
    mp = placement_of(attn_mask)  # the mask's rows, when parallel.shard took them
    if mp is not None and ((mp.layout, mp.world) != (layout, world) or mp.other_ranks(ranks, None)):
        raise A.arg_error(
            op,
            "attn_mask",
            f"this rank's rows under q's layout ({layout!r} over {world} ranks): "
            f"parallel.shard(mask, dim=-2, layout={layout!r})",
            f"rows placed with {mp.describe()}",
        )
    if mp is not None and attn_mask is not None:  # a placed mask leaf's gradient: placed as its rows
        tag_grad_of(attn_mask)
    seq_len = placed_seq_len(op, {"q": q, "k": k, "v": v}, seq_len, cu_seqlens)
    cu_seqlens = placed_cu_seqlens(op, {"q": q, "k": k, "v": v}, cu_seqlens, default=False)
    require_seq_len_known(op, {"q": q, "k": k, "v": v}, seq_len, cu_seqlens, world, None, q.shape[2])
    total, cu, table = resolve_seq(op, q.shape[2], world, layout, cu_seqlens, seq_len, "q")
    mask = _check_mask(attn_mask, q, total, op)
    seed = draw_seed(dropout_seed, p, op)
    if _torch.transforms_active():  # before any communication
        raise RuntimeError(
            f"diffcomm.{op}(): cannot run under a torch.func transform (grad, vjp, vmap, jvp): "
            "its fused ring has a first-order backward of its own, which torch.func cannot "
            "transform. Use torch.autograd (loss.backward(), torch.autograd.grad), or "
            "parallel.ulysses_attention, which runs under torch.func."
        )
    if _torch.forward_ad_level() >= 0 and any(
        t is not None and _torch.FORWARD_AD.unpack_dual(t).tangent is not None for t in (q, k, v, attn_mask)
    ):  # (torch's own error names no op)
        raise RuntimeError(
            f"diffcomm.{op}(): has no forward-mode derivative (torch.autograd.forward_ad dual "
            "tensors): its fused ring has a first-order backward only. Use "
            "parallel.ulysses_attention, which supports forward mode."
        )
    if _config.DEBUG.get():
        B.get_backend().check_consistent(
            op,
            {
                "q": tuple(q.shape),
                "k": tuple(k.shape),
                "v": tuple(v.shape),
                "dtype": q.dtype,
                "causal": causal,
                # each rank's rows took its own scale: another scale on one rank is a wrong
                # attention there (and wrong dK / dV it adds for the others' rows)
                "scale": repr(sc),
                "layout": layout,
                "seq_len": total,
                "cu_seqlens": cu or (),
                "attn_mask": () if mask is None else tuple(mask.shape),
                "dropout_p": repr(p),
                # a drawn seed must agree (the docs: make the stream agree across the
                # group); a given one is each rank's own: its rows take its seed's mask
                "dropout_seed": seed if dropout_seed is None else "given",
            },
            pg,
        )
    require_layout_known(op, given, {"q": q, "k": k, "v": v}, world)  # after the debug check
    if seq_len is None and cu is None and world > 1 and not _config.DEBUG.get():  # S inferred
        # causal, scale and layout, which each rank reads alone, ride in the same exchange
        settings: dict[str, tuple[int, Callable[[int], Any]]] = {
            "causal": (int(causal), bool),
            "scale": (A.float_bits(sc), A.float_of_bits),
            "layout": (LAYOUTS.index(layout), LAYOUTS.__getitem__),
        }
        check_equal_lengths(op, q.shape[2], pg, settings=settings)
    docs = doc_ids(table, total, cu)
    if rank is None:  # torch's LocalTensorMode
        plan: _Plan = _LocalPlan(pg, world, table, docs, causal, sc, p, seed, q.shape[1], k.shape[1])
    else:
        plan = _Plan(pg, rank, world, table, docs, causal, sc, p, seed, q.shape[1], k.shape[1])
    # under torch.autocast: q, k, v (and a float mask) cast as autocast casts SDPA (its
    # lower-precision list), the fused ring run with autocast off
    out = run_lowered(_RingAttention.apply, (q, k, v, mask), plan)
    return placed(out, Placement(layout, world, seq_len=total, ranks=ranks, cu=cu, dim=2))
