"""``python -m diffcomm``: the ``info`` subcommand and the subcommand registry."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

import diffcomm as dc
from diffcomm import __version__
from diffcomm.accelerator import get_accelerator
from diffcomm.tools import cli


def _run_python(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _run_python("-m", "diffcomm", *args, env=env)


def _imports_torch(p: subprocess.CompletedProcess[str]) -> bool:
    """Whether a ``python -X importtime`` run imported torch (it must import diffcomm.tools.cli)."""
    imported = [line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if "|" in line]
    assert "diffcomm.tools.cli" in imported
    return any(m.split(".")[0] == "torch" for m in imported)


def test_info_prints_versions_backends_and_probed_capabilities() -> None:
    proc = _run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert torch.__version__ in out and __version__ in out
    acc = get_accelerator()  # the subprocess detects the same one (cpu here, cuda on a GPU machine)
    assert "accelerator" in out and f"{acc.name} (" in out
    assert f"default backend {acc.communication_backend_name()}" in out
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
    assert info["accelerator"]["name"] == get_accelerator().name
    assert info["settings"] == dc.settings()  # what this process reads from the same environment
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


def _one_error_line(err: str, command: str = "") -> str:
    """The one error message in ``err`` (a usage error's whole stderr), its lines joined:
    it starts with ``<prog> <command>: error:``, fits 100 columns, and any line after the
    first is its continuation (indented)."""
    lines = err.splitlines()
    prefix = f"python -m diffcomm {command}".rstrip() + ": error: "
    assert lines and lines[0].startswith(prefix), err
    assert all(line.startswith("  ") for line in lines[1:]), err
    assert max(len(line) for line in lines) <= 100, err
    return " ".join(err.split())


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["--wat"],
        ["check", "-n", "0"],
        ["check", "--world", "two"],
        ["check", "--backend", "nosuch"],
        ["check", "--module", "no/such/ops.py"],
        ["check", "--module", "no_such_module_of_ops"],
        ["bench", "--sizes", "lots"],
        ["bench", "--rounds", "1"],
        ["bench", "--ops", "allreduce"],
        ["bench", "--coalesced", "gather"],
        ["info", "--probe"],
    ],
)
def test_every_usage_error_is_one_message_within_100_columns_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    command = argv[0] if argv and argv[0] in cli._SUBCOMMANDS else ""
    _one_error_line(err, command)


def test_unknown_op_lists_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    from diffcomm.testing.cases import standard_cases, standard_p2p_cases
    from diffcomm.testing.coalesced import standard_coalesced_cases
    from diffcomm.testing.mappings import standard_mapping_cases
    from diffcomm.tools.commands import check_ops

    CHECK_OPS = check_ops()  # read from the op classes' source, torch-free
    assert cli.main(["check", "--ops", "all_gather", "allreduce"]) == 2
    line = _one_error_line(capsys.readouterr().err, "check")
    assert "unknown op 'allreduce' (did you mean all_reduce?)" in line
    cases = [*standard_cases(2), *standard_p2p_cases(2), *standard_coalesced_cases(2)]
    cases += standard_mapping_cases(2)
    # the torch-free list is the cases' ops, in their order: nothing listed twice drifts
    assert list(dict.fromkeys(c.op for c in cases)) == list(CHECK_OPS)
    # and, family by family, the registry's own ops in its order
    from diffcomm.ops import registry as R
    from diffcomm.tools.op_names import builtin_ops

    assert builtin_ops() == {
        f: [n for n, c in R.family(f).items() if R.builtin(c)]
        for f in ("collective", "p2p", "coalesced", "mapping")
    }
    assert set(CHECK_OPS) >= {"all_reduce", "all_reduce_coalesced", "shift", "ppermute", "sendrecv"}
    assert set(CHECK_OPS) >= {"send/recv", "copy_to_region", "all_to_all_region"}
    assert set(line.split("valid: ")[1].split(", ")) == {*CHECK_OPS, "send", "recv"}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["check", "-n", "0"], "world size must be >= 1, got 0"),
        (["check", "--ops", "sendd"], "unknown op 'sendd' (did you mean send?)"),
        (["check", "--backend", "glo"], "unknown backend 'glo' (did you mean gloo?)"),
    ],
)
def test_check_refuses_bad_arguments_before_importing_torch(argv: list[str], words: str) -> None:
    """Refused at once (no torch import: it takes seconds), with the command's own words."""
    p = _run_python("-X", "importtime", "-m", "diffcomm", *argv, timeout=120)
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if "|" not in ln]
    assert errors[0].startswith("python -m diffcomm check: error: "), p.stderr
    assert all(ln.startswith("  ") for ln in errors[1:]), p.stderr  # one message, wrapped
    assert max(map(len, errors)) <= 100 and words in " ".join(" ".join(errors).split()), p.stderr
    assert not _imports_torch(p)


@pytest.mark.parametrize("command", ["check", "bench"])
def test_refusing_a_world_too_large_names_the_commands_own_flag(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command, "-n", "99999"]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert "this machine cannot hold the world" in line
    assert line.endswith("override with --allow-oversubscribe.")
    assert "allow_oversubscribe=True" not in line and "DIFFCOMM_ALLOW_OVERSUBSCRIBE" not in line


def test_nccl_without_gpus_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend nccl`` on a machine without a GPU per rank: no traceback, no rank started."""
    world = str(torch.cuda.device_count() + 1)  # always one rank more than there are GPUs
    for command in ("check", "bench"):
        assert cli.main([command, "--backend", "nccl", "-n", world]) == 2
        line = _one_error_line(capsys.readouterr().err, command)
        assert "--backend nccl" in line and ("not available in this torch build" in line or "GPU" in line)


def test_prog_name_follows_argv0() -> None:
    assert cli.prog_name("/home/u/.venv/bin/diffcomm") == "diffcomm"
    assert cli.prog_name("/venv/Scripts/diffcomm.exe") == "diffcomm"
    assert cli.prog_name("/src/diffcomm/__main__.py") == "python -m diffcomm"


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["bench", "--help"], ["info", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    """``python -m diffcomm ... --help`` answers at once: nothing imports torch."""
    p = _run_python("-X", "importtime", "-m", "diffcomm", *argv, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: python -m diffcomm")
    assert not _imports_torch(p)


def test_console_script_usage_says_diffcomm(tmp_path: Path) -> None:
    """The ``diffcomm`` console script, as pip writes it: usage names it, no torch import."""
    script = tmp_path / "diffcomm"
    script.write_text(
        "import re\n"
        "import sys\n"
        "from diffcomm.tools.cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(main())\n"
    )
    p = _run_python("-X", "importtime", str(script), "check", "--help", timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: diffcomm check")
    assert not _imports_torch(p)
    bad = _run_python(str(script), "check", "--ops", "allreduce", timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("diffcomm check: error: --ops: unknown op")
    assert max(len(line) for line in bad.stderr.splitlines()) <= 100, bad.stderr
