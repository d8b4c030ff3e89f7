"""One real ``torchrun --standalone --nproc-per-node=2`` job through ``diffcomm.init()``, and
``init``'s choice of the local device."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import diffcomm as dc
from diffcomm.accelerator import CPUAccelerator, DeviceLike, get_accelerator, set_accelerator
from diffcomm.runtime import joining

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_allreduce.py"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="the `torchrun` launcher is not on PATH")
def test_torchrun_job_through_init() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if get_accelerator().name == "cpu":
        env.pop("DIFFCOMM_ACCELERATOR", None)  # the default detection picks gloo
    else:  # the example's CPU tensors need gloo; 2 nccl ranks would need 2 GPUs
        env["DIFFCOMM_ACCELERATOR"] = "cpu"
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node=2", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=EXAMPLE.parents[1],
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    oks = re.findall(r"OK rank (\d)/2: ([^(\n]*) \(gloo\)", proc.stdout)
    assert sorted(rank for rank, _ in oks) == ["0", "1"], proc.stdout
    assert all(checked.startswith("raw all_reduce, raw all_gather") for _, checked in oks), proc.stdout


MISMATCH = """
import os, sys
import torch
import torch.distributed as dist
import diffcomm as dc

dc.init()
r = dc.get_rank()
out = []
for first in (True, False):  # the size exchange, then the sizes sent with the rows
    if not first:
        dc.all_gather(torch.ones(2, 3))
    try:
        dc.all_gather(torch.ones(2, 3 + r))  # (2, 3) on rank 0, (2, 4) on rank 1
        out.append("no error")
    except dc.CrossRankMismatchError as exc:
        out.append(f"{type(exc).__name__}: {exc}")
y = dc.all_gather(torch.ones(1 + r, 2))  # the ranks are still in step
out.append(f"then {tuple(y.shape)}")
os.write(sys.stdout.fileno(), "".join(f"rank {r}| {line}\\n" for line in out).encode())
dist.destroy_process_group()
"""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="the `torchrun` launcher is not on PATH")
def test_a_gathers_shape_mismatch_under_torchrun_is_an_error_on_every_rank(tmp_path: Path) -> None:
    # no debug mode: before, gloo aborted the job ("Received data size doesn't match")
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFCOMM_ACCELERATOR": "cpu"}
    env.pop("DIFFCOMM_DEBUG", None)
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "EnforceNotMet" not in proc.stderr
    for r in (0, 1):
        lines = [ln.split("| ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith(f"rank {r}| ")]
        assert len(lines) == 3, proc.stdout
        for msg in lines[:2]:
            assert msg.startswith("CrossRankMismatchError: diffcomm.all_gather(): the ranks' `x` must agree")
            assert "x.shape[1] differs: 3 on rank(s) [0]; 4 on rank(s) [1]" in msg, msg
        assert lines[2] == "then (3, 2)"


class _OneGPU(CPUAccelerator):
    """A stand-in for a one-device GPU accelerator whose own backend is nccl."""

    name = "cuda"
    _communication_backend = "nccl"

    def __init__(self) -> None:
        super().__init__()
        self.set_to: list[DeviceLike] = []

    def device_count(self) -> int:
        return 1

    def set_device(self, index: DeviceLike) -> None:
        self.set_to.append(index)


def test_init_sets_the_local_device_or_says_why_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun on a one-GPU machine: local rank 0 gets the GPU; local rank 1 with nccl is
    a ValueError before any rendezvous; with gloo it starts without a device of its own."""
    acc = _OneGPU()
    monkeypatch.setenv("LOCAL_RANK", "0")
    joining._set_local_device(acc, "nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    joining._set_local_device(acc, "gloo")
    assert acc.set_to == [0]
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    with set_accelerator(acc), pytest.raises(ValueError) as err:
        dc.init()  # MASTER_PORT 1: a rendezvous would fail, so this is the check alone
    assert "LOCAL_RANK=1, but this process sees 1 cuda device(s)" in str(err.value)
    assert "--nproc-per-node=1" in str(err.value) and "backend='gloo'" in str(err.value)
    assert "set_device=False" in str(err.value)  # the way out when each process sees one GPU
    assert acc.set_to == [0] and not dc.is_initialized()


_ONE_JOB = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(
    ("changed", "match"),
    [
        # a rank outside the world: before, the rendezvous waited 120 s for peers never coming
        ({"RANK": "3"}, r"RANK='3' must be an integer >= 0 and < 2 \(WORLD_SIZE\)"),
        ({"RANK": "-1"}, r"RANK='-1' must be an integer >= 0 and < 2"),
        # no integer: before, a bare int() error naming no variable
        ({"RANK": "abc"}, r"RANK='abc' must be an integer"),
        ({"WORLD_SIZE": "two"}, r"WORLD_SIZE='two' must be an integer >= 1"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' must be an integer >= 1"),
        ({"MASTER_PORT": "http"}, r"MASTER_PORT='http' must be an integer >= 1 and < 65536"),
        # the local rank: before, read only on a GPU machine (a bare int() error there)
        ({"LOCAL_RANK": "abc"}, r"LOCAL_RANK='abc' must be an integer >= 0 and < 2 \(WORLD_SIZE\)"),
        (
            {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            r"LOCAL_RANK='2' must be an integer >= 0 and < 2 \(LOCAL_WORLD_SIZE\)",
        ),
        (
            {"LOCAL_WORLD_SIZE": "4"},
            r"LOCAL_WORLD_SIZE='4' must be an integer >= 1 and < 3 \(at most WORLD_SIZE\)",
        ),
    ],
)
def test_init_refuses_a_launcher_environment_that_describes_no_job_before_any_rendezvous(
    monkeypatch: pytest.MonkeyPatch, changed: dict[str, str], match: str
) -> None:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_PORT`` set inconsistently (a
    hand-written launcher, a SLURM script): a ValueError naming the variable, at once."""
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**_ONE_JOB, **changed}.items():
        monkeypatch.setenv(key, value)
    with set_accelerator("cpu"), pytest.raises(ValueError, match=r"diffcomm.init\(\): " + match):
        dc.init()
    assert not dc.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": True}, TypeError, r"`timeout` must be a number of seconds or None, got bool"),
        ({"timeout": "5"}, TypeError, r"`timeout` must be a number of seconds or None, got str"),
        ({"timeout": -1}, ValueError, r"`timeout` must be > 0 seconds or None, got -1"),
        (
            {"timeout": datetime.timedelta(0)},
            ValueError,
            r"`timeout` must be > 0 seconds or None, got datetime",
        ),
        ({"set_device": "no"}, TypeError, r"`set_device` must be a bool, got str"),
        ({"backend": 1}, TypeError, r"`backend` must be a str or None, got int"),
    ],
)
def test_init_refuses_wrong_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    """Before, ``timeout=True`` was 1 s, ``timeout=-1`` a collective timeout torch refused
    and ``init`` silently dropped (the 120 s rendezvous timeout held), ``set_device="no"``
    set the device."""
    with pytest.raises(error, match=r"diffcomm.init\(\): " + match):
        dc.init(**kwargs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A launcher environment of a one-rank job; the group and the settings undone after."""
    import torch.distributed as dist

    from diffcomm import _config

    job = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "DIFFCOMM_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    _config.TIMEOUT.reload()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        joining._JOINED[:] = [None, True]
        _config.TIMEOUT.reload()


def test_a_second_init_asking_another_backend_or_timeout_is_an_error(one_rank_job: None) -> None:
    """Before, a second ``init`` returned at once whatever it asked: ``init(backend="nccl")``
    or ``init(timeout=5)`` in a process running a gloo group with a 20 s timeout silently
    kept gloo and 20 s. The same arguments (or none) are still a no-op."""
    import torch

    dc.init(backend="gloo", timeout=20)
    for same in ({}, {"backend": "gloo"}, {"backend": "GLOO"}, {"timeout": 20}, {"timeout": 20.0}):
        dc.init(**same)
    with pytest.raises(ValueError) as err:
        dc.init(backend="nccl")
    assert "backend 'gloo', but `backend='nccl'` was asked" in str(err.value)
    assert "destroy_process_group()" in str(err.value)
    with pytest.raises(ValueError) as err:
        dc.init(timeout=5)
    assert "collectives wait 20 s, but `timeout=5` was asked" in str(err.value)
    assert "dc.timeout(5)" in str(err.value)
    with dc.timeout(5):  # what the collectives wait now is the running value
        dc.init(timeout=5)
        with pytest.raises(ValueError, match="collectives wait 5 s, but `timeout=20` was asked"):
            dc.init(timeout=20)
    assert dc.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # the group is untouched


def test_init_timeout_holds_over_the_environments(
    one_rank_job: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``init(timeout=5)`` under ``DIFFCOMM_TIMEOUT=60``: before, the group got 5 s at
    ``init`` and 60 s at its first op (diffcomm applies the setting before each op)."""
    import torch

    from diffcomm import _config, _torch

    monkeypatch.setenv("DIFFCOMM_TIMEOUT", "60")
    _config.TIMEOUT.reload()
    dc.init(backend="gloo", timeout=5)
    dc.all_reduce(torch.ones(1))
    assert _torch.pg_timeout() == 5.0 and dc.timeout() == 5.0


def test_init_takes_a_timedelta_as_torch_does(one_rank_job: None) -> None:
    """``init_process_group(timeout=datetime.timedelta(...))`` is torch's spelling; before,
    ``dc.init`` refused it with a TypeError."""
    import torch

    from diffcomm import _torch

    dc.init(backend="gloo", timeout=datetime.timedelta(seconds=20))
    dc.all_reduce(torch.ones(1))
    assert _torch.pg_timeout() == 20.0 and dc.timeout() == 20.0
    dc.init(timeout=20)  # the same timeout: a no-op
    dc.init(timeout=datetime.timedelta(seconds=20))
    with pytest.raises(
        ValueError, match=r"collectives wait 20 s, but `timeout=datetime.timedelta\(seconds=5\)`"
    ):
        dc.init(timeout=datetime.timedelta(seconds=5))


def test_a_second_init_asking_another_set_device_is_an_error(one_rank_job: None) -> None:
    """On a GPU machine, ``init(set_device=False)`` then ``init()``: before, the second
    call's ``set_device=True`` was silently ignored (no device set)."""
    acc = _OneGPU()
    with set_accelerator(acc):
        dc.init(backend="gloo", set_device=False)
        dc.init(backend="gloo", set_device=False)
        with pytest.raises(
            ValueError, match=r"joined its group with `set_device=False`, but `set_device=True`"
        ):
            dc.init(backend="gloo")
    assert acc.set_to == []


def _init_again(timeout: float) -> list[str]:
    out = []
    for kwargs in ({}, {"backend": "gloo"}, {"backend": "nccl"}, {"timeout": timeout}, {"timeout": 7}):
        try:
            dc.init(**kwargs)
            out.append("ok")
        except ValueError as exc:
            out.append(str(exc).split(";")[0])
    return out


@pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in_process"])
def test_init_inside_a_local_world_rank(local_worlds: Any, in_process: bool) -> None:
    """A rank of either kind of world already belongs to its group: ``init()`` with its
    backend (the in-process ``inproc`` group stands for gloo) is a no-op, another backend an
    error; a timeout is compared on processes (the world's ``collective_timeout``) and not
    in-process, which has no timeouts (docs/in_process.md)."""
    world = local_worlds(2, in_process=in_process)
    (a, b) = world.run(_init_again, world.collective_timeout)
    assert a == b
    running = "'inproc'" if in_process else "'gloo'"
    assert a[:3] == [
        "ok",
        "ok",
        "diffcomm.init(): this process already belongs to a process group of backend "
        f"{running}, but `backend='nccl'` was asked",
    ]
    assert a[3] == "ok"
    if in_process:
        assert a[4] == "ok"
    else:
        assert a[4].endswith(f"collectives wait {world.collective_timeout:g} s, but `timeout=7` was asked")
