"""One real ``torchrun --standalone --nproc-per-node=2`` job through ``diffcomm.init()``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_allreduce.py"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="the `torchrun` launcher is not on PATH")
def test_torchrun_job_through_init() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DIFFCOMM_ACCELERATOR", None)
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
