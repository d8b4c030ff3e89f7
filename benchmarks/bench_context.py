"""Context parallelism on local gloo ranks: ring attention's speed, balance, overlap and memory.

Four measurements (``diffcomm.parallel.context``), float32, ``(batch, heads, S, head_dim)``
= ``(1, H, S, 64)``, one thread per rank:

* **speed** — forward + backward of causal ring attention (zigzag layout) over ``S`` tokens
  at world 2 and 4, against the same total work on one rank (a one-rank LocalWorld running
  the same blockwise code on the whole sequence, and torch's fused CPU
  ``scaled_dot_product_attention``). Paired rounds: each round runs the world-W ring and
  the one-rank references back to back, in alternating order; a ring round's time is the
  slowest rank's. Medians and [min, max] over rounds.
* **timeline** — one forward + backward at world 4 with the ring's trace on: per rank, the
  intervals of block compute, of each K/V hop on the communication engine, and of waiting
  for a hop; printed as an ASCII timeline, with the fraction of communication time that
  ran while the rank computed (the overlap).
* **balance** — per-rank compute time of causal ring attention at world 4, zigzag against
  the plain (contiguous) ring: each rank's forward + backward is replayed in this one
  process with its K/V blocks handed over locally (no communication, no other rank
  competing for the cores), ranks interleaved in paired rounds; plus the per-rank
  score-entry counts (``ring_attention_work``, proportional to FLOPs).
* **memory** — peak RSS growth of one rank during forward + backward at world 4 for
  growing ``S`` (per-rank O(S/W): K/V blocks, saved tensors and one query tile of scores).
* **lengths** — the price of the equal-length check: shards cut by hand (no placement)
  and no ``seq_len=`` cost one small exchange of every rank's length before the ring;
  forward + backward with it against the same call given ``seq_len=`` (no exchange),
  interleaved in paired rounds, slowest rank per pass, at world 2 and 4; and the
  exchange alone (median of 200 calls).

It also tries ``torch.distributed.tensor.experimental.context_parallel`` (PyTorch's own
ring attention for SDPA) on the same gloo ranks and reports whether it runs.

    python benchmarks/bench_context.py [--seq 2048] [--heads 8] [--rounds 5] [--quick] [--json]

The ranks share this machine's cores: world 4 on fewer than 4 free cores cannot reach a
4x speedup; the results report ``os.cpu_count()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from typing import Any

import torch

import diffcomm as dc
from diffcomm.accelerator import get_accelerator
from diffcomm.parallel import context as cp
from diffcomm.parallel.context import layout as cpl
from diffcomm.parallel.context import ring as cpr

D = 64
SECTIONS = ("torch", "speed", "timeline", "balance", "memory", "lengths")


def _inputs(S: int, H: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, S, D, generator=g) for _ in range(3))


# ----------------------------------------------------------------------------- speed


def _ring_round(S: int, H: int, reps: int) -> list[float]:
    """On every rank: ``reps`` timed forward+backward passes of the ring (one barrier before
    each); returns this rank's times."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    q, k, v = (cp.shard(t, layout="zigzag").requires_grad_() for t in _inputs(S, H))
    out = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        cp.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()
        out.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    return out[1:]  # the first is a warm-up


def _serial_round(S: int, H: int, reps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    q, k, v = (t.requires_grad_() for t in _inputs(S, H))
    res: dict[str, list[float]] = {"blockwise": [], "sdpa": []}
    for name in res:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            if name == "sdpa":
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = cp.ring_attention(q, k, v, causal=True)  # a world of one: the whole sequence
            o.sum().backward()
            if i:
                res[name].append(time.perf_counter() - t0)
            q.grad = k.grad = v.grad = None
    return res


def speed(S: int, H: int, rounds: int, reps: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with dc.LocalWorld(1) as one:
        for W in worlds:
            ring: list[float] = []
            serial: dict[str, list[float]] = {"blockwise": [], "sdpa": []}
            with dc.LocalWorld(W) as world:
                for r in range(rounds):
                    order = ("ring", "serial") if r % 2 == 0 else ("serial", "ring")
                    for what in order:
                        if what == "ring":
                            per_rank = world.run(_ring_round, S, H, reps)
                            ring += [max(ts) for ts in zip(*per_rank, strict=True)]
                        else:
                            got = one.run(_serial_round, S, H, reps)[0]
                            for key in serial:
                                serial[key] += got[key]
            cell = {"ring": _stats(ring), **{f"one rank, {k}": _stats(v) for k, v in serial.items()}}
            cell["speedup vs one rank (blockwise)"] = round(
                cell["one rank, blockwise"]["median"] / cell["ring"]["median"], 3
            )
            cell["speedup vs one rank (sdpa)"] = round(
                cell["one rank, sdpa"]["median"] / cell["ring"]["median"], 3
            )
            out[f"world {W}"] = cell
    return out


def _stats(ts: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(ts), 4), "min": round(min(ts), 4), "max": round(max(ts), 4)}


# -------------------------------------------------------------------------- timeline


def _timeline_rank(S: int, H: int) -> list[tuple[str, float, float]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    q, k, v = (cp.shard(t, layout="zigzag").requires_grad_() for t in _inputs(S, H))
    cp.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()  # warm-up
    dist.barrier()
    with cpr._trace() as trace:
        t0 = time.perf_counter()
        cp.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()
        end = time.perf_counter()
    return [(kind, a - t0, b - t0) for kind, a, b in trace] + [("end", end - t0, end - t0)]


def _overlap(trace: list[tuple[str, float, float]]) -> dict[str, float]:
    comp = [(a, b) for k, a, b in trace if k == "compute"]
    comm = [(a, b) for k, a, b in trace if k == "comm"]
    wait = sum(b - a for k, a, b in trace if k == "wait")
    total_comm = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in comp)
    return {
        "comm_s": round(total_comm, 4),
        "comm_under_compute_s": round(hidden, 4),
        "overlap_fraction": round(hidden / total_comm, 3) if total_comm else 0.0,
        "compute_s": round(sum(b - a for a, b in comp), 4),
        "wait_s": round(wait, 4),
    }


def _ascii(traces: list[list[tuple[str, float, float]]], width: int = 100) -> str:
    end = max(t[-1][2] for t in traces)
    lines = [f"timeline, {end * 1e3:.1f} ms across; C compute, = hop on the engine, w waiting, # compute+hop"]
    for r, trace in enumerate(traces):
        row = []
        for i in range(width):
            a, b = end * i / width, end * (i + 1) / width

            def busy(kind: str, a: float = a, b: float = b, trace: Any = trace) -> bool:
                return any(k == kind and s < b and e > a for k, s, e in trace)

            c, m, w = busy("compute"), busy("comm"), busy("wait")
            row.append("#" if c and m else "C" if c else "w" if w else "=" if m else ".")
        lines.append(f"rank {r} |{''.join(row)}|")
    return "\n".join(lines)


def timeline(S: int, H: int, W: int) -> dict[str, Any]:
    with dc.LocalWorld(W) as world:
        traces = world.run(_timeline_rank, S, H)
    return {"per_rank": [_overlap(t) for t in traces], "ascii": _ascii(traces)}


# --------------------------------------------------------------------------- balance


class _Replay(cpr._Plan):
    """A rank's plan whose hops hand over the other ranks' K/V locally (no communication)."""

    def __init__(self, blocks: dict[int, torch.Tensor], *args: Any) -> None:
        super().__init__(*args)
        self.blocks = blocks

    def hop(self, x: torch.Tensor, name: str, j: int | None) -> torch.Tensor:
        return self.blocks[j] if j is not None else x

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        return x


def balance(S: int, H: int, W: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    q, k, v = _inputs(S, H)
    out: dict[str, Any] = {}
    for layout in ("zigzag", "contiguous"):
        table = cp.layout_index(S, W, layout=layout)
        docs = cpl.doc_ids(table, S, None)
        shards = [tuple(t.index_select(2, table[r]) for t in (q, k, v)) for r in range(W)]
        blocks = {r: cpr._pack(kk, vv) for r, (_, kk, vv) in enumerate(shards)}
        times: list[list[float]] = [[] for _ in range(W)]
        for rnd in range(rounds + 1):
            order = range(W) if rnd % 2 == 0 else reversed(range(W))
            for r in order:
                plan = _Replay(blocks, None, r, W, table, docs, True, D**-0.5, 0.0, 0, H, H)
                ql, kl, vl = (t.clone().requires_grad_() for t in shards[r])
                t0 = time.perf_counter()
                cpr._RingAttention.apply(ql, kl, vl, None, plan).sum().backward()
                if rnd:
                    times[r].append(time.perf_counter() - t0)
        med = [statistics.median(t) for t in times]
        mean = sum(med) / W
        work = cp.ring_attention_work(S, W, layout=layout, causal=True)
        wmean = sum(work["computed"]) / W
        out[layout] = {
            "per_rank_compute_s": [round(m, 4) for m in med],
            "max_dev_from_mean": round(max(abs(m - mean) for m in med) / mean, 3),
            "max_over_min": round(max(med) / min(med), 3),
            "per_rank_score_entries": work["computed"],
            "score_entries_max_dev_from_mean": round(
                max(abs(c - wmean) for c in work["computed"]) / wmean, 4
            ),
            "per_rank_attended_pairs": work["attended"],
        }
    return out


# ---------------------------------------------------------------------------- memory


def _memory_rank(seqs: list[int], H: int) -> dict[int, int]:
    torch.set_num_threads(1)
    acc = get_accelerator()
    out = {}
    for S in seqs:
        q, k, v = (cp.shard(t, layout="zigzag").requires_grad_() for t in _inputs(S, H))
        acc.reset_peak_memory_stats()
        before = acc.memory_allocated()
        cp.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()
        out[S] = acc.max_memory_allocated() - before
        del q, k, v
    return out


def memory(seqs: list[int], H: int, W: int) -> dict[str, Any]:
    with dc.LocalWorld(W) as world:
        per_rank = world.run(_memory_rank, seqs, H)
    rows = {}
    for S in seqs:
        peak = max(r[S] for r in per_rank)
        kv = 4 * 4 * H * (S // W) * D  # q, k, v, out of one rank, float32
        rows[str(S)] = {
            "peak_rss_growth_MiB": round(peak / 2**20, 1),
            "one_rank_q_k_v_out_MiB": round(kv / 2**20, 1),
            "dense_scores_of_whole_sequence_MiB": round(4 * H * S * S / 2**20, 1),
        }
    return rows


# --------------------------------------------------------------- torch context_parallel


def _torch_cp() -> str:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dc.get_world_size(),))
    q, k, v = _inputs(64, 2)
    msgs = []
    for backend in ("default", "math"):
        qc, kc, vc = (t.clone() for t in (q, k, v))
        try:
            with context_parallel(mesh, buffers=[qc, kc, vc], buffer_seq_dims=[2, 2, 2]):
                if backend == "math":
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    with sdpa_kernel(SDPBackend.MATH):
                        F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
                else:
                    F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
            msgs.append(f"{backend} SDPA backend: ran")
        except Exception as exc:  # reported, not handled
            last = traceback.format_exception_only(exc)[-1].strip()
            msgs.append(f"{backend} SDPA backend: {last}")
    return "; ".join(msgs)


def torch_context_parallel() -> str:
    with dc.LocalWorld(2) as world:
        return world.run(_torch_cp)[0]


# --------------------------------------------------------------------------- lengths


def _lengths_round(S: int, H: int, reps: int) -> dict[str, list[float]]:
    """On every rank: ``reps`` paired passes (order alternating) of forward + backward on
    contiguous shards cut by hand, without ``seq_len=`` (the length exchange runs) and with
    it (no exchange); and 200 timed length exchanges alone."""
    import torch.distributed as dist

    from diffcomm import backend as B

    torch.set_num_threads(1)
    r, w = dist.get_rank(), dist.get_world_size()
    q, k, v = (t.chunk(w, 2)[r].clone().requires_grad_() for t in _inputs(S, H))
    res: dict[str, list[float]] = {"checked (no seq_len)": [], "seq_len given": [], "exchange alone": []}
    for i in range(reps + 1):
        order = (
            ("checked (no seq_len)", "seq_len given")
            if i % 2 == 0
            else ("seq_len given", "checked (no seq_len)")
        )
        for what in order:
            kw = {"seq_len": S} if what == "seq_len given" else {}
            dist.barrier()
            t0 = time.perf_counter()
            cp.ring_attention(q, k, v, causal=True, layout="contiguous", **kw).sum().backward()
            if i:
                res[what].append(time.perf_counter() - t0)
            q.grad = k.grad = v.grad = None
    b = B.get_backend()
    dist.barrier()
    for _ in range(200):
        t0 = time.perf_counter()
        b.exchange_sizes(q.shape[2], None)
        res["exchange alone"].append(time.perf_counter() - t0)
    return res


def lengths(seqs: list[int], H: int, rounds: int, reps: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for W in worlds:
        with dc.LocalWorld(W) as world:
            for S in seqs:
                got: dict[str, list[float]] = {}
                for _ in range(rounds):
                    per_rank = world.run(_lengths_round, S, H, reps)
                    for key in per_rank[0]:
                        # slowest rank per pass (per exchange for the exchange alone)
                        got.setdefault(key, []).extend(max(ts) for ts in zip(*(p[key] for p in per_rank)))
                cell: dict[str, Any] = {k: _stats(v) for k, v in got.items()}
                diffs = [a - b for a, b in zip(got["checked (no seq_len)"], got["seq_len given"])]
                cell["paired difference (s)"] = _stats(diffs)
                cell["exchange alone (us)"] = round(1e6 * statistics.median(got["exchange alone"]), 1)
                del cell["exchange alone"]
                out[f"world {W}, S={S}"] = cell
    return out


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048, help="global sequence length S")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="timed passes per round")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--json", action="store_true", help="print one JSON line at the end")
    ap.add_argument(
        "--only", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="run only these measurements"
    )
    a = ap.parse_args(argv)
    S, H, rounds = a.seq, a.heads, a.rounds
    seqs = [1024, 2048, 4096, 8192]
    if a.quick:
        S, H, rounds, seqs = 256, 2, 2, [256, 512]
    res: dict[str, Any] = {
        "config": {"S": S, "heads": H, "head_dim": D, "dtype": "float32", "cpu_count": os.cpu_count()}
    }
    print(json.dumps(res["config"]))
    if "torch" in a.only:
        res["torch_context_parallel"] = torch_context_parallel()
        print("torch context_parallel on CPU/gloo:", res["torch_context_parallel"])
    if "speed" in a.only:
        res["speed"] = speed(S, H, rounds, a.reps, (2, 4))
        for W, cell in res["speed"].items():
            print(f"speed {W}: {json.dumps(cell)}")
    if "timeline" in a.only:
        res["timeline"] = timeline(S, H, 4)
        print(res["timeline"].pop("ascii"))
        for r, o in enumerate(res["timeline"]["per_rank"]):
            print(f"overlap rank {r}: {json.dumps(o)}")
    if "balance" in a.only:
        res["balance"] = balance(S, H, 4, rounds)
        for layout, cell in res["balance"].items():
            print(f"balance {layout}: {json.dumps(cell)}")
    if "memory" in a.only:
        res["memory"] = memory(seqs, H, 4)
        for S_, cell in res["memory"].items():
            print(f"memory S={S_}: {json.dumps(cell)}")
    if "lengths" in a.only:
        res["lengths"] = lengths(sorted({256, S}), H, rounds, a.reps, (2, 4))
        for key, cell in res["lengths"].items():
            print(f"lengths {key}: {json.dumps(cell)}")
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
