"""Low-precision collectives: bytes on the wire vs fp32, and what quantizing costs here.

For each wire format (fp32 = no ``precision=``; bf16; fp16; fp8 e4m3 / e5m2 with block
sizes) and each op (all_reduce, reduce_scatter, all_gather, all_to_all) of an fp32
``(rows, cols)`` tensor per rank on a gloo ``LocalWorld``:

* bytes each rank sends per forward call, from the comms logger (payload bytes of every
  dtype, fp8 scales included, times each raw op's bus factor: an fp32 all_reduce sends
  ``2 (n-1)/n`` of its payload; the quantized one an all_to_all and an all_gather of
  ``(n-1)/n`` each), and the ratio fp32 bytes / these bytes;
* median seconds of the forward call (gloo on shared CPUs: indicative only);
* median seconds of quantize + dequantize (``encode`` + ``decode``) of the tensor, the
  local cost the fewer bytes must pay for.

Run: ``python benchmarks/bench_precision.py [--world 2] [--rows 256] [--cols 1024]
[--calls 20] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from _common import int_options

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.ops.precision import Precision, decode, encode

FORMATS: list[tuple[str, Any]] = [
    ("fp32", None),
    ("bf16", ("bf16", None)),
    ("fp16", ("fp16", None)),
    ("e4m3 row", ("fp8_e4m3", None)),
    ("e4m3/128", ("fp8_e4m3", 128)),
    ("e4m3/32", ("fp8_e4m3", 32)),
    ("e5m2/128", ("fp8_e5m2", 128)),
]
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def _call(op: str, x: torch.Tensor, p: Precision | None) -> torch.Tensor:
    kw: dict[str, Any] = {} if p is None else {"precision": p}
    if op == "all_gather":
        kw["split_sizes"] = [x.shape[0]] * dc.get_world_size()
    return getattr(dc, op)(x, **kw)


def _rank(rows: int, cols: int, calls: int) -> list[dict[str, Any]]:
    x = torch.randn(rows, cols)
    out = []
    for name, spec in FORMATS:
        p = None if spec is None else Precision(spec[0], block_size=spec[1])
        row: dict[str, Any] = {"format": name}
        if p is not None:
            for _ in range(3):
                decode(*encode(x, p), x.dtype)
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                decode(*encode(x, p), x.dtype)
                ts.append(time.perf_counter() - t0)
            row["quant_dequant_s"] = statistics.median(ts)
        for op in OPS:
            with B.log_comms() as log:
                _call(op, x, p)
            row[f"{op}_bytes"] = log.total_bytes()
            row[f"{op}_by_dtype"] = log.by_dtype()
            row[f"{op}_sent"] = sum(log.sent_by_dtype().values())
            for _ in range(2):
                _call(op, x, p)
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                _call(op, x, p)
                ts.append(time.perf_counter() - t0)
            row[f"{op}_s"] = statistics.median(ts)
        out.append(row)
    return out


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__), world=2, rows=256, cols=1024, calls=20)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    with dc.LocalWorld(a.world) as world:
        rows = world.run(_rank, a.rows, a.cols, a.calls)[0]
    base = rows[0]
    for row in rows:
        for op in OPS:
            row[f"{op}_ratio"] = base[f"{op}_sent"] / row[f"{op}_sent"]
    if a.json:
        print(json.dumps({"world": a.world, "rows": a.rows, "cols": a.cols, "results": rows}))
        return
    print(
        f"world {a.world}, fp32 tensor ({a.rows}, {a.cols}) per rank; bytes each rank sends per forward "
        "call (comms logger: payload x bus factor; fp8: payload + float32 scales), x fewer than fp32"
    )
    head = f"{'format':<10}" + "".join(f"{op:>22}" for op in OPS) + f"{'quant+dequant':>15}"
    print(head)
    for row in rows:
        cells = "".join(f"{row[f'{op}_sent']:>11.0f} ({row[f'{op}_ratio']:4.2f}x)" + " " * 3 for op in OPS)
        q = row.get("quant_dequant_s")
        print(f"{row['format']:<10}{cells}{(f'{q * 1e6:.0f} us' if q else '-'):>15}")
    print("median seconds per forward call:")
    for row in rows:
        print(f"{row['format']:<10}" + "".join(f"{row[f'{op}_s'] * 1e3:>19.2f} ms" for op in OPS))


if __name__ == "__main__":
    main()
