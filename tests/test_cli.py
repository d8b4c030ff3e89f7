"""``python -m diffcomm``: the ``info`` subcommand and the subcommand registry."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from diffcomm import __version__, cli


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diffcomm", *args],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def test_info_prints_versions_backends_and_probed_capabilities() -> None:
    proc = _run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert torch.__version__ in out and __version__ in out
    assert "accelerator" in out and "cpu (" in out and "default backend gloo" in out
    assert "c10d backends" in out
    for name in cli.C10D_BACKENDS:
        assert name in out
    assert "gloo capabilities (2 ranks)" in out
    for capability in ("reduce_scatter", "all_gather_into_tensor", "uneven_all_to_all"):
        assert capability in out
    assert "probe took" in out


def test_info_json_without_probe() -> None:
    proc = _run_cli("info", "--no-probe", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["torch"] == torch.__version__ and info["diffcomm"] == __version__
    assert info["c10d_backends"]["gloo"] is True
    assert set(info["c10d_backends"]) == set(cli.C10D_BACKENDS)
    assert info["accelerator"]["name"] == "cpu"
    assert info["settings"] == {
        "debug": False,
        "timeout": None,
        "accelerator": None,
        "flight": True,
        "flight_size": 1024,
        "allow_oversubscribe": False,
    }
    assert "probe" not in info


def test_info_reports_a_bad_setting_instead_of_crashing() -> None:
    proc = _run_cli("info", "--no-probe", env={"DIFFCOMM_ACCELERATOR": "tpu"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # rich wraps long cells
    assert "DIFFCOMM_ACCELERATOR='tpu' is not a known accelerator" in text
    assert "legal values" in text


def test_probe_capabilities_in_process() -> None:
    probe = cli.probe_capabilities(world_size=1)
    assert probe["backend"] == "gloo" and probe["world_size"] == 1
    assert probe["capabilities"]["backend"] == "gloo" and probe["seconds"] > 0


def test_no_subcommand_prints_help_and_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "info" in capsys.readouterr().err


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"diffcomm {__version__}"


def test_registry_adds_subcommands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A later subcommand (``check``, ``bench``) is one registry entry."""

    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--name", required=True)

    def run(args: argparse.Namespace, console: Console) -> int:
        console.print(f"hello {args.name}")
        return 3

    monkeypatch.setitem(cli._SUBCOMMANDS, "hello", cli.Subcommand("say hello", configure, run))
    assert cli.main(["hello", "--name", "ranks"]) == 3
    assert capsys.readouterr().out.strip() == "hello ranks"
    assert cli.main(["hello"]) == 2  # its own arguments are parsed
    assert "--name" in capsys.readouterr().err
