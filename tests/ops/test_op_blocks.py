"""Each fact of an op block stated once, in one member order (docs/architecture.md)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import diffcomm as dc
from diffcomm.ops import registry as R

ROOT = Path(__file__).resolve().parents[2]

BUILTIN = {n: c for n, c in R.REGISTRY.items() if R.builtin(c)}


def _members(cls: type) -> list[tuple[str, bool]]:
    """(name, is a method) of every member ``cls``'s block states, in source order."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)
    out = []
    for s in node.body:
        if isinstance(s, ast.FunctionDef):
            out.append((s.name, True))
        elif isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name):
            out.append((s.targets[0].id, False))
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            out.append((s.target.id, False))
    return out


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_op_block_states_its_members_in_the_one_order(name: str) -> None:
    members = _members(BUILTIN[name])
    ranks = [R.member_rank(m, method) for m, method in members]
    assert ranks == sorted(ranks), f"{name}: {[m for m, _ in members]} (order: {R.MEMBER_ORDER})"


def test_the_member_order_is_the_architecture_pages() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    line = page.split("**One member order in every op block**", 1)[1].split("\n\n", 1)[0]
    named = [n for n in re.findall(r"`(\w+)`", line) if n in R.MEMBER_ORDER]
    assert named == [n for n in R.MEMBER_ORDER if not n.startswith("<")]


def test_member_rank_places_the_unnamed_members() -> None:
    assert R.member_rank("dims", False) == R.MEMBER_ORDER.index("<attributes>")
    assert R.member_rank("jvp", True) == R.MEMBER_ORDER.index("<methods>")
    assert R.member_rank("transpose", True) < R.member_rank("jvp", True) < R.member_rank("cases", True)


@pytest.mark.parametrize("name", sorted(n for n, c in BUILTIN.items() if "spmd" in c.__dict__))
def test_the_typing_rule_reads_the_ops_one_backward_text(name: str) -> None:
    """The op states its backward once (``backward_text``); its typing rule states none
    (the registry copies it), so the typing table shows that one text."""
    cls = BUILTIN[name]
    assert cls.spmd.backward == cls.backward_text
    source = inspect.getsource(cls)
    assert "backward=" not in source, f"{name}: its spmd rule states a backward of its own"
    from diffcomm.spmd.check import typing_table

    rows = [r for r in typing_table().splitlines() if r.startswith(f"| {cls.name} |")]
    assert len(rows) == 1 and f"| {cls.backward_text} |" in rows[0], rows


def test_verify_names_a_gradient_line_that_names_another_op(monkeypatch: pytest.MonkeyPatch) -> None:
    assert R.verify() == [] or all("all_stack" in p or "mirror" in p for p in R.verify())
    doc = dc.broadcast.__doc__
    assert doc is not None and "Gradient:" in doc
    wrong = doc.split("Gradient:", 1)[0] + "Gradient:\n        ``all_gather(grad)``.\n"
    monkeypatch.setattr(dc.broadcast, "__doc__", wrong)
    wanted = "broadcast: its docstring's Gradient: names neither its dual reduce nor its backward 'reduce'"
    assert wanted in R.verify()
