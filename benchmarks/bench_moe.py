"""Expert-parallel dispatch + combine, forward + backward: diffcomm against hand-written
``torch.distributed.all_to_all_single`` calls with precomputed splits.

Each rank holds ``--tokens`` float32 tokens of width ``--hidden``, routed top-``k`` to
``--experts`` experts (a fixed random routing per run, the same for both); the experts
are the identity, so a step is the communication and the permutations around it:

* ``diffcomm``: ``dc.parallel.dispatch`` (which exchanges the per-expert counts: the
  step's one host synchronisation) -> ``dc.parallel.combine`` -> ``backward`` of a fixed
  cotangent (autograd: the two adjoint all_to_alls with the split sizes swapped, the
  router gate's gradient included);
* ``torch``: the same permutations and four ``all_to_all_single`` calls (two forward, two
  backward) written by hand, the splits and permutations computed once before timing
  (what a user gets by hand-coding the pair with precomputed splits; no exchange);
* ``exchange``: the counts exchange alone (``exchange_size_lists`` of ``E + 1`` host
  integers), to show its share of the diffcomm step;
* ``diffcomm_planned``: the diffcomm step given the plan (``dispatch(..., plan=plan)``, as
  on a recomputed forward): the same splits as ``torch``, no exchange.

Rounds are paired and interleaved: every round runs each implementation ``--inner`` steps
(round order shuffled per round, the same on every rank); a round's time is the slowest
rank's. Reported: medians and interquartile ranges of the per-step times and of the
paired per-round ratio ``diffcomm / torch``, and ``exchange / diffcomm``.

    python benchmarks/bench_moe.py --world 2 4 --rounds 40 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import int_options

import diffcomm as dc

IMPLS = ("diffcomm", "torch", "exchange", "diffcomm_planned")


def _rank(
    tokens: int, hidden: int, experts: int, k: int, rounds: int, inner: int, warmup: int
) -> dict[str, Any]:
    from diffcomm import backend as B
    from diffcomm.parallel import combine, dispatch

    torch.set_num_threads(1)
    r = dc.get_rank()
    gen = torch.Generator().manual_seed(100 + r)
    x = torch.randn(tokens, hidden, generator=gen)
    gate = torch.rand(tokens, k, generator=gen)
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    cot = torch.randn(tokens, hidden, generator=gen)

    def step_diffcomm() -> None:
        xs = x.detach().requires_grad_(True)
        g = gate.detach().requires_grad_(True)
        h, plan = dispatch(xs, index, experts)
        y = combine(h, g, plan)
        y.backward(cot)

    # the hand-written pair: splits and permutations precomputed (diffcomm's own plan,
    # made once here, outside the timing)
    _, plan = dispatch(x, index, experts)
    tok, slot, order, inv = plan.token_index, plan.slot_index, plan.recv_order, plan.recv_inverse
    send, recv = list(plan.send_splits), list(plan.recv_splits)
    n_send, n_recv = sum(send), sum(recv)

    def step_torch() -> None:
        # forward
        rows = x.index_select(0, tok)
        got = torch.empty(n_recv, hidden)
        dist.all_to_all_single(got, rows, recv, send)
        h = got.index_select(0, order)  # the experts' input (identity experts)
        z = h.index_select(0, inv)
        back = torch.empty(n_send, hidden)
        dist.all_to_all_single(back, z, send, recv)
        wts = gate.reshape(-1).index_select(0, slot)
        y = torch.zeros(tokens, hidden).index_add_(0, tok, back * wts.unsqueeze(1))
        del y
        # backward of y.backward(cot): the gate's gradient and the input's
        g_rows = cot.index_select(0, tok)
        g_w = (g_rows * back).sum(1)
        torch.zeros(tokens * k).index_add_(0, slot, g_w)
        g_back = g_rows * wts.unsqueeze(1)
        g_z = torch.empty(n_recv, hidden)
        dist.all_to_all_single(g_z, g_back, recv, send)
        g_h = g_z.index_select(0, order)
        g_got = g_h.index_select(0, inv)
        g_rows_x = torch.empty(n_send, hidden)
        dist.all_to_all_single(g_rows_x, g_got, send, recv)
        torch.zeros(tokens, hidden).index_add_(0, tok, g_rows_x)

    def step_planned() -> None:
        xs = x.detach().requires_grad_(True)
        g = gate.detach().requires_grad_(True)
        h, _ = dispatch(xs, index, experts, plan=plan)
        combine(h, g, plan).backward(cot)

    counts = [0] * experts + [tokens]

    def step_exchange() -> None:
        B.get_backend().exchange_size_lists(counts, None)

    fns = {"diffcomm": step_diffcomm, "torch": step_torch, "exchange": step_exchange}
    fns["diffcomm_planned"] = step_planned
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for i in range(rounds):
        for name in random.Random(i).sample(list(IMPLS), len(IMPLS)):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / inner)
    return {"times": times, "sent_rows": n_send, "received_rows": n_recv}


def _q(xs: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return statistics.median(xs), qs[0], qs[2]


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    with dc.LocalWorld(world) as lw:
        per_rank = lw.run(
            _rank, args.tokens, args.hidden, args.experts, args.k, args.rounds, args.inner, args.warmup
        )
    rounds = {
        name: [max(pr["times"][name][i] for pr in per_rank) for i in range(args.rounds)] for name in IMPLS
    }
    ratio = [d / t for d, t in zip(rounds["diffcomm"], rounds["torch"])]
    planned = [d / t for d, t in zip(rounds["diffcomm_planned"], rounds["torch"])]
    share = [e / d for e, d in zip(rounds["exchange"], rounds["diffcomm"])]
    out: dict[str, Any] = {"world": world}
    for name in IMPLS:
        out[f"{name}_ms"] = [v * 1e3 for v in _q(rounds[name])]
    out["diffcomm_over_torch"] = list(_q(ratio))
    out["exchange_share"] = list(_q(share))
    out["planned_over_torch"] = list(_q(planned))
    out["rows_sent_per_rank"] = [pr["sent_rows"] for pr in per_rank]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    int_options(p, tokens=1024, hidden=256, experts=8, k=2, rounds=40, inner=3, warmup=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    try:
        load = [round(v, 2) for v in __import__("os").getloadavg()]
    except OSError:
        load = None
    results = [run(w, args) for w in args.world]
    print(
        f"{args.tokens} tokens x {args.hidden} float32 per rank, {args.experts} experts, k={args.k}, "
        f"{args.rounds} paired rounds of {args.inner} steps; load average at start {load}"
    )
    cols = ["world", "diffcomm ms [IQR]", "torch a2a_single ms [IQR]", "diffcomm/torch (paired) [IQR]"]
    cols += ["exchange ms", "exchange share of the diffcomm step", "planned diffcomm/torch (no exchange)"]
    print(" | ".join(cols))
    for res in results:
        d, t, rt = res["diffcomm_ms"], res["torch_ms"], res["diffcomm_over_torch"]
        e, s, pl = res["exchange_ms"], res["exchange_share"], res["planned_over_torch"]
        print(
            f"{res['world']} | {d[0]:.2f} [{d[1]:.2f}-{d[2]:.2f}] | {t[0]:.2f} [{t[1]:.2f}-{t[2]:.2f}] | "
            f"{rt[0]:.3f}x [{rt[1]:.3f}-{rt[2]:.3f}] | {e[0]:.3f} [{e[1]:.3f}-{e[2]:.3f}] | "
            f"{100 * s[0]:.1f}% [{100 * s[1]:.1f}-{100 * s[2]:.1f}] | "
            f"{pl[0]:.3f}x [{pl[1]:.3f}-{pl[2]:.3f}]"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
