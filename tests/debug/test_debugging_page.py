"""docs/debugging.md says "every message below is real": this runs the page's own script
(its ``train.py``, defined in ``__main__`` and shipped to the ranks by value) and checks
that each block marked ``<!-- output of: python train.py N SCENARIO -->`` is what the run
printed - the user's file and line (``train.py:14``) included - after normalising the
times (``after 0.2 s``, ``for 2.0 s``) and gloo's source path.

``DIFFCOMM_REGENERATE_DOCS=1 python -m pytest tests/debug/test_debugging_page.py`` rewrites the
blocks from the run instead (times included) and then passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "debugging.md"
SRC = Path(__file__).resolve().parents[2] / "src"
MARK = re.compile(r"<!-- output of: python train\.py (\d+) (\w+) -->\n```text\n(.*?)```", re.S)


def page_script(text: str) -> str:
    head = text.index("### The file")
    start = text.index("```python\n", head) + len("```python\n")
    return text[start : text.index("```", start)]


def normalise(block: str) -> str:
    block = re.sub(r"\b(after|for) \d+\.\d+ s\b", r"\1 <t> s", block)
    block = re.sub(r"\[/\S+/gloo/\S+\]", "[gloo source]", block)
    # Two ranks that time out together race (the page says so): the later one may read
    # its peer's closed connection instead of its own timeout. Both outcomes carry the
    # same diagnosis; only these two phrases differ.
    block = block.replace("failed (a peer closed its connection mid-op)", "timed out")
    block = re.sub(r"Timed out waiting \d+ms", "Timed out waiting <t>ms", block)
    return re.sub(
        r"Backend error: \[gloo source\] Connection closed by peer .*",
        "Backend error: [gloo source] Timed out waiting <t>ms for recv operation to complete",
        block,
    )


def start_blocks(tmp: Path, n: int, names: list[str]) -> subprocess.Popen[str]:
    """Start ``python train.py N NAMES...`` in ``tmp`` (read its blocks with :func:`blocks_of`)."""
    # the page shows the messages without debug mode (its blocks that use it say so)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), *sys.path]), DIFFCOMM_DEBUG="0")
    return subprocess.Popen(
        [sys.executable, "train.py", str(n), *names],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def blocks_of(p: subprocess.Popen[str], names: list[str]) -> list[str]:
    """The output blocks of a run started by :func:`start_blocks`, one per name."""
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    blocks = re.split(r"^(?=# \w+Error after )", stdout, flags=re.M)
    blocks = [b for b in blocks if b.strip()]
    assert len(blocks) == len(names), stdout
    return blocks


@pytest.mark.waits
@pytest.mark.slow
def test_the_debugging_pages_messages_are_what_its_script_prints(tmp_path: Path) -> None:
    text = PAGE.read_text()
    (tmp_path / "train.py").write_text(page_script(text))
    marks = list(MARK.finditer(text))
    assert len(marks) == 7, "the page's marked output blocks were not found"
    by_size: dict[int, list[str]] = {}
    for m in marks:
        by_size.setdefault(int(m.group(1)), []).append(m.group(2))
    real: dict[tuple[int, str], str] = {}
    # one world per size, the sizes run side by side: most of each run is waiting for
    # the script's 2 s timeouts
    runs = {n: start_blocks(tmp_path, n, names) for n, names in by_size.items()}
    try:
        for n, names in by_size.items():
            for name, block in zip(names, blocks_of(runs[n], names), strict=True):
                real[(n, name)] = block
    finally:
        for p in runs.values():
            if p.poll() is None:  # a failed or timed-out run: no script left behind
                p.kill()
                p.communicate()
    if os.environ.get("DIFFCOMM_REGENERATE_DOCS") == "1":
        out = MARK.sub(
            lambda m: m.group(0).replace(m.group(3), real[(int(m.group(1)), m.group(2))]),
            text,
        )
        PAGE.write_text(out)
        text = out
    for m in MARK.finditer(text):
        key = (int(m.group(1)), m.group(2))
        assert normalise(m.group(3)) == normalise(real[key]), f"page and run differ for {key}"
        assert "<dynamic-code>" not in real[key] and "train.py:" in real[key]
