"""diffcomm on a CUDA GPU with nccl ranks.

These run only where torch sees a CUDA GPU and has nccl; elsewhere (CI has no GPU) the
whole module is skipped with that reason. One GPU holds one nccl rank (nccl refuses two
ranks on one device), so the worlds here have one rank per visible GPU, at least 1.
What is checked:

* every standard case of ``python -m diffcomm check`` (forward, adjoint, gradient and
  double backward against the float64 single-process reference) with the rank's tensors
  on its GPU, and the same through the command line;
* outputs and gradients stay on the GPU, and the hot path never synchronizes the host
  with the device (``torch.cuda.set_sync_debug_mode("error")`` turns a synchronization
  into an error), sizes given or not;
* ``async_op=True`` launched from a side stream sees the work queued on that stream
  before it (the engine thread runs on the launching thread's device and stream);
* ``torch.func`` and ``torch.compile`` on GPU tensors, and ``python -m diffcomm bench
  --backend nccl``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import diffcomm as dc
from diffcomm import backend as B
from diffcomm.testing.cases import run_case, standard_cases
from diffcomm.testing.coalesced import run_coalesced_case, standard_coalesced_cases
from diffcomm.tools import cli

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU and a torch build with nccl",
)


@pytest.fixture(scope="module")
def gpus(local_worlds):
    return local_worlds(max(1, min(torch.cuda.device_count(), 4)), "nccl")


def test_every_standard_case_on_the_gpu(gpus) -> None:
    def standard(world: int) -> list[dict]:
        assert B.get_backend().comm_device(None).type == "cuda"
        rows = [{"op": c.op, "case": c.label(), **run_case(c).as_dict()} for c in standard_cases(world)]
        rows += [
            {"op": c.op, "case": c.label(), **run_coalesced_case(c).as_dict()}
            for c in standard_coalesced_cases(world)
        ]
        return rows

    per_rank = gpus.run(standard, gpus.world_size)
    bad = [(r["op"], r["case"], r) for rows in per_rank for r in rows if not r["ok"]]
    assert not bad, bad[:5]
    n = gpus.world_size
    assert len(per_rank[0]) == len([*standard_cases(n), *standard_coalesced_cases(n)]) > 40


def test_check_command_on_nccl(capsys: pytest.CaptureFixture[str]) -> None:
    n = max(1, min(torch.cuda.device_count(), 4))
    rc = cli.main(["check", "--backend", "nccl", "-n", str(n), "--ops", "all_gather", "all_to_all", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["cases"], out


def test_outputs_and_gradients_stay_on_the_gpu_without_a_host_sync(gpus) -> None:
    def placement_and_no_sync() -> list[str]:
        w, dev = dc.get_world_size(), torch.device("cuda", torch.cuda.current_device())
        programs = {
            "all_reduce": lambda x: dc.all_reduce(x),
            "all_reduce_max": lambda x: dc.all_reduce(x, "max"),
            "all_gather": lambda x: dc.all_gather(x),
            "all_gather_sized": lambda x: dc.all_gather(x, split_sizes=[4] * w),
            "reduce_scatter": lambda x: dc.reduce_scatter(x),
            "all_to_all": lambda x: dc.all_to_all(x),
            "broadcast": lambda x: dc.broadcast(x, src=0),
            "reduce": lambda x: dc.reduce(x, dst=0),
            "gather": lambda x: dc.gather(x, dst=0, split_sizes=[4] * w),
            "scatter": lambda x: dc.scatter(x, src=0),
        }
        seen = []
        for name, fn in programs.items():
            x = torch.randn(4 * w, 3, device=dev, requires_grad=True)
            fn(x).sum().backward()  # warm: the first call may set things up
            x.grad = None
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = fn(x)
                y.backward(torch.ones_like(y))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert y.device == dev and x.grad is not None and x.grad.device == dev, name
            seen.append(name)
        return seen

    assert all(len(r) == 10 for r in gpus.run(placement_and_no_sync))


def test_async_op_follows_the_launching_stream(gpus) -> None:
    def async_on_a_side_stream() -> float:
        dev = torch.device("cuda", torch.cuda.current_device())
        side = torch.cuda.Stream(dev)
        src = torch.full((1 << 20,), 3.0, device=dev)
        x = torch.zeros_like(src)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on the side stream
            x.copy_(src)  # ... before x gets its values
            y = dc.all_reduce(x, async_op=True)  # must see x as the side stream leaves it
            z = y.wait() * 1.0
        side.synchronize()
        return float((z - 3.0 * dc.get_world_size()).abs().max())

    assert gpus.run(async_on_a_side_stream) == [0.0] * gpus.world_size


def test_torch_func_and_compile_on_the_gpu(gpus) -> None:
    def func_and_compile() -> tuple[float, float]:
        dev = torch.device("cuda", torch.cuda.current_device())
        w = dc.get_world_size()
        xs = torch.randn(5, 2 * w, 3, device=dev, dtype=torch.float64)
        batched = torch.func.vmap(lambda x: dc.all_gather(x))(xs)
        looped = torch.stack([dc.all_gather(x) for x in xs])
        vmap_err = float((batched - looped).abs().max())

        def f(x: torch.Tensor) -> torch.Tensor:
            return dc.reduce_scatter(dc.all_gather(x).sin() * 2).sum()

        torch._dynamo.reset()
        x = xs[0].clone().requires_grad_(True)
        (g_eager,) = torch.autograd.grad(f(x), x)
        (g_comp,) = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(x), x)
        return vmap_err, float((g_eager - g_comp).abs().max())

    for vmap_err, grad_err in gpus.run(func_and_compile):
        assert vmap_err == 0.0 and grad_err < 1e-12


def test_bench_runs_on_nccl(capsys: pytest.CaptureFixture[str]) -> None:
    n = max(1, min(torch.cuda.device_count(), 4))
    argv = [
        "bench",
        "--backend",
        "nccl",
        "-n",
        str(n),
        "--ops",
        "all_gather",
        "--sizes",
        "16KiB",
        "--rounds",
        "3",
    ]
    assert cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    impls = {r["impl"] for r in rows}
    assert {"raw", "floor", "diffcomm"} <= impls, rows
    assert all(r["median_ms"] > 0 for r in rows), rows
