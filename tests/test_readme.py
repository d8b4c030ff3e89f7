"""The README's claims about the code, checked against the code: how many cases
``python -m diffcomm check`` runs, the notebooks its table lists, and what the test
command installs (the ``test`` extra) and what it leaves to CI's lint step (``lint``)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _extra(name: str) -> list[str]:
    """The distribution names of a pyproject extra (lower case, no version)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in extras[name]]


def test_the_readme_states_how_many_cases_check_runs() -> None:
    """The number in "`python -m diffcomm check` runs N cases ... on worlds 2 and 3" is the
    number of cases the command's default worlds hold (it said 110 while the code ran 124)."""
    from diffcomm.tools.cli import build_parser
    from diffcomm.tools.commands import standard_suite

    worlds = build_parser("python -m diffcomm").parse_args(["check"]).world
    cases = sum(len(standard_suite(w)) for w in worlds)
    claim = re.search(r"`python -m diffcomm check` runs (\d+) cases(.*?)\.\n", README, re.S)
    assert claim is not None, "the README no longer says how many cases `check` runs"
    assert int(claim.group(1)) == cases, f"README: {claim.group(1)} cases; the code: {cases}"
    said = " ".join(claim.group(2).split())
    assert said.endswith("on worlds " + " and ".join(map(str, worlds))), said


def test_the_readme_notebooks_table_lists_every_notebook() -> None:
    """Every notebook in notebooks/ has a row (06_expert_parallel_moe had none), and every
    row links a notebook that exists, under its own name."""
    section = README.split("## Notebooks", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[`([^`]+)`\]\(notebooks/([^)]+)\.ipynb\) \|", section, re.M)
    assert rows, "no notebook rows found in the README's Notebooks section"
    assert all(name == stem for name, stem in rows), rows
    on_disk = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(stem for _, stem in rows) == on_disk


def test_the_readme_names_every_pipeline_schedule() -> None:
    """The "What's inside" row of ``diffcomm.pipeline`` names every schedule the runner
    takes by name (it listed four of the six: ZB-V and DualPipeV were missing)."""
    from diffcomm.pipeline import SCHEDULES

    shown = {
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved": "interleaved 1F1B",
        "zb-h1": "ZB-H1",
        "zbv": "ZB-V",
        "dualpipev": "DualPipeV",
    }
    assert set(SCHEDULES) == set(shown), sorted(SCHEDULES)
    row = next(line for line in README.splitlines() if line.startswith("| `diffcomm.pipeline` |"))
    assert all(name in row for name in shown.values()), row


def test_the_readme_names_what_the_test_extra_installs_and_the_lint_extra() -> None:
    """Each package of the ``test`` extra is named in the README's table of what the test
    command installs (numpy is a run-time dependency already); the linters CI runs after
    the tests are the ``lint`` extra, which .ci/run installs and no test imports."""
    table = README.split("**What the test command installs, and why.**", 1)[1].split("\n\n", 2)[1]
    named = {n.strip().lower() for row in table.splitlines()[2:] for n in row.split("|")[1].split(",")}
    runtime = {"numpy"}
    assert set(_extra("test")) - runtime == named, (set(_extra("test")), named)
    lint = _extra("lint")
    assert set(lint) == {"ruff", "import-linter", "mypy"} and not set(lint) & set(_extra("test"))
    assert 'pip install -e ".[lint]"' in README
    ci = (ROOT / ".ci" / "run").read_text()
    install = ci.index('\npip install -e ".[lint]"')
    assert all(ci.index(f"\n{tool}") > install for tool in ("ruff check .", "lint-imports", "mypy"))
    imports = re.compile(r"^\s*(?:import|from)\s+(ruff|mypy|importlinter)\b", re.M)
    users = [p for p in (ROOT / "tests").rglob("*.py") if imports.search(p.read_text())]
    assert users == [], f"tests import a lint tool, so it belongs in the test extra: {users}"
