"""Per-message cost of diffcomm's send/recv: a ping-pong between 2 local gloo ranks.

Rank 0 sends a ``rows x width`` float32 tensor (default 64 x 1024 = 256 KiB, one
micro-batch's activation in ``bench_pipeline.py`` at m = 8) to rank 1, which receives it
and sends it back; the time of one such round trip (two messages, each a header and the
data) is measured many times and the median reported, for:

* ``dc.send/recv``: the public ops (``send`` sends a private copy of its input);
* ``dc.send_owned/recv`` (when this diffcomm has it): the pipeline runner's send, which
  sends the caller's own tensor without copying it;
* ``dc.send/irecv(like)``: the receive posted ahead with a known shape (the runner's
  steady state before fused messages), header and data receives posted together;
* ``dc.send_owned(fused)/irecv_fused`` (when this diffcomm has them): the runner's steady
  state now, header and data in one message, its one receive posted ahead;
* ``torch isend/recv``: raw ``torch.distributed`` with the shape known on both sides (one
  message each way, what ``torch.distributed.pipelining`` sends after its shape
  inference), for scale.

    python benchmarks/bench_p2p.py [--rows 64] [--width 1024] [--iters 400] [--busy-sender]

``--busy-sender`` measures instead one message's delivery while its sender computes (as a
pipeline stage does right after sending an activation): rank 1 has posted its receive,
rank 0 posts the send and at once runs ~6 ms of matmuls; reported is the time from the
send's posting to the data's arrival on rank 1 (one host clock), for a header-first
message (``dc.send_owned/recv``: the data receive is posted only once the header is in),
a fused one into a receive posted ahead (``irecv_fused``) and raw torch.

Each rank uses one thread; run on a quiet machine (the two ranks want two free cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.ops import p2p


def _pingpong(kind: str, rows: int, width: int, iters: int, warmup: int) -> list[float]:
    torch.set_num_threads(1)
    rank = dc.get_rank()
    other = 1 - rank
    x = torch.randn(rows, width)
    like = x.detach()
    send_owned = getattr(p2p, "send_owned", None)

    def one() -> None:
        if kind == "torch":
            if rank == 0:
                w = dist.isend(x, other)
                dist.recv(like, other)
                w.wait()
            else:
                dist.recv(like, other)
                dist.isend(like, other).wait()
            return
        if kind == "fused":
            if rank == 0:
                p2p.send_owned(x, other, fused=True)
                p2p.irecv_fused(other, like).wait()
            else:
                y = p2p.irecv_fused(other, like).wait()
                p2p.send_owned(y, other, fused=True)
            return
        send = send_owned if kind == "owned" else p2p.send
        if rank == 0:
            send(x, other)
            if kind == "irecv":
                p2p.irecv(other, like=like).wait()
            else:
                p2p.recv(other)
        else:
            y = p2p.irecv(other, like=like).wait() if kind == "irecv" else p2p.recv(other)
            send(y, other)

    times: list[float] = []
    for i in range(warmup + iters):
        if i % 50 == 0:
            B.get_backend().barrier(None)
        t = time.perf_counter()
        one()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    p2p.wait_sends()
    return times


def _busy_sender(kind: str, rows: int, width: int, iters: int) -> list[float]:
    """Rank 1: seconds from rank 0 posting one message to its data being in on rank 1,
    while rank 0 computes (~6 ms of 64-row matmuls) right after posting it."""
    torch.set_num_threads(1)
    rank = dc.get_rank()
    x, like = torch.randn(rows, width), torch.empty(rows, width)
    a, w = torch.randn(64, 1024), torch.randn(1024, 1024)
    stamp = torch.zeros(1, dtype=torch.float64)
    out: list[float] = []
    for i in range(iters + 3):
        B.get_backend().barrier(None)
        if rank == 0:
            time.sleep(0.002)  # rank 1's receive is posted by now
            stamp[0] = time.perf_counter()
            if kind == "torch":
                work = dist.isend(x, 1, tag=7)
            else:
                p2p.send_owned(x, 1, tag=7, fused=kind == "fused")
            for _ in range(4):
                a @ w
            if kind == "torch":
                work.wait()
            else:
                p2p.wait_sends()
            dist.send(stamp, 1, tag=8)
        else:
            if kind == "torch":
                dist.recv(like, 0, tag=7)
            elif kind == "fused":
                p2p.irecv_fused(0, like, tag=7).wait()
            else:
                p2p.recv(0, tag=7)
            arrived = time.perf_counter()
            dist.recv(stamp, 0, tag=8)
            if i >= 3:
                out.append(arrived - float(stamp[0]))
    return out


def _busy_sender_table(rows: int, width: int, iters: int) -> None:
    print(f"one {rows} x {width} float32 message while its sender computes, {iters} messages")
    print(f"cores: {os.cpu_count()}; torch {torch.__version__}; load {os.getloadavg()[0]:.2f}")
    print(f"{'path':<22} {'median ms':>9} {'p10':>7} {'p90':>7} {'max':>7}")
    names = {"plain": "dc header-first", "fused": "dc fused (posted)", "torch": "torch isend/recv"}
    with dc.LocalWorld(2) as world:
        for kind in names:
            t = sorted(world.run(_busy_sender, kind, rows, width, iters)[1])
            q = statistics.quantiles(t, n=10)
            print(
                f"{names[kind]:<22} {statistics.median(t) * 1e3:9.3f} {q[0] * 1e3:7.3f} "
                f"{q[-1] * 1e3:7.3f} {t[-1] * 1e3:7.3f}"
            )
    print(f"load at the end {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--busy-sender", action="store_true", help="one message while its sender computes")
    args = ap.parse_args(argv)
    if args.busy_sender:
        _busy_sender_table(args.rows, args.width, min(args.iters, 60))
        return 0
    kinds = ["public", "irecv", "torch"]
    if hasattr(p2p, "send_owned"):
        kinds.insert(1, "owned")
    if hasattr(p2p, "irecv_fused"):
        kinds.insert(3, "fused")
    nbytes = args.rows * args.width * 4
    print(f"ping-pong of {args.rows} x {args.width} float32 ({nbytes // 1024} KiB) between 2 gloo ranks")
    print(f"cores: {os.cpu_count()}; torch {torch.__version__}; load {os.getloadavg()[0]:.2f}")
    names = {
        "public": "dc.send/recv",
        "owned": "dc.send_owned/recv",
        "irecv": "dc.send/irecv(like)",
        "fused": "dc fused/irecv_fused",
        "torch": "torch isend/recv",
    }
    print(f"{'path':<22} {'median ms':>9} {'p10':>7} {'p90':>7}   (one round trip = 2 messages)")
    with dc.LocalWorld(2) as world:
        for kind in kinds:
            res: list[Any] = world.run(_pingpong, kind, args.rows, args.width, args.iters, args.warmup)
            t = sorted(res[0])
            q = statistics.quantiles(t, n=10)
            print(f"{names[kind]:<22} {statistics.median(t) * 1e3:9.3f} {q[0] * 1e3:7.3f} {q[-1] * 1e3:7.3f}")
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
