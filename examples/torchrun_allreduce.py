"""A real multi-process job through ``diffcomm.init()`` under torchrun (CPU / gloo).

Run::

    torchrun --standalone --nproc-per-node=2 examples/torchrun_allreduce.py

Each rank joins the process group that torchrun describes in its environment, runs a raw
all_reduce through the backend adapter and checks the result. Where the autograd
collectives exist (``diffcomm.all_reduce``), it also checks the gradient: under the
sum-of-per-rank-objectives convention, ``d/dx_r sum_s sum(all_reduce(x)_s) = world``.
Prints ``OK rank r/n`` on success; any mismatch raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm.backend import get_backend


def main() -> None:
    dc.init()  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by torchrun
    rank, world = dc.get_rank(), dc.get_world_size()
    backend = get_backend()
    try:
        x = torch.arange(4, dtype=torch.float32) + rank
        y = backend.all_reduce(x, "sum", None)
        expected = torch.arange(4, dtype=torch.float32) * world + world * (world - 1) / 2
        torch.testing.assert_close(y, expected)
        assert torch.equal(x, torch.arange(4, dtype=torch.float32) + rank), "input modified"

        gathered = backend.all_gather(torch.full((1, 2), float(rank)), None)
        torch.testing.assert_close(
            gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(2).view(world, 2)
        )

        checked = ["raw all_reduce", "raw all_gather"]
        if hasattr(dc, "all_reduce"):  # the autograd collectives, once they exist
            xg = x.clone().requires_grad_(True)
            out = dc.all_reduce(xg)
            torch.testing.assert_close(out.detach(), expected)
            out.sum().backward()
            torch.testing.assert_close(xg.grad, torch.full_like(x, float(world)))
            checked.append("dc.all_reduce gradient")
        backend.barrier(None)
        line = f"OK rank {rank}/{world}: {', '.join(checked)} ({dist.get_backend()})\n"
        os.write(sys.stdout.fileno(), line.encode())  # one write: ranks share the terminal
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
