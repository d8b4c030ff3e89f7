"""The package's shape, checked: torch internals read in one module, no import cycle
(lazy imports counted), no module over 600 lines without a note, and the layer picture in
docs/architecture.md equal to the import-linter contract.

Pure source analysis (``ast`` over ``src/diffcomm``): no process group, no rank.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

import diffcomm

PKG = Path(diffcomm.__file__).parent
ROOT = PKG.parent.parent


def _modules() -> dict[str, Path]:
    """Every diffcomm module by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


# ------------------------------------------------------------------ torch internals

#: A private name of torch: ``torch._x``, ``torch.a._x``, ``distributed_c10d._x``, a
#: ``from torch._x`` / ``from torch.a._x import``, ``_functional_collectives``.
_TORCH_PRIVATE = re.compile(
    r"\btorch(\.[A-Za-z]\w*)*\._[A-Za-z]|\bdistributed_c10d\._[A-Za-z]|_functional_collectives"
    r"|\bProcessGroup\._[A-Za-z]|\._get_backend\("
)
#: The two hot-path attribute reads ``diffcomm._torch`` documents (each on an object it names).
_HOT_READS = re.compile(r"\._default_pg\b|\._current_level\b")


def test_torch_internals_are_read_in_one_module() -> None:
    offenders = []
    for name, path in _modules().items():
        if name == "diffcomm._torch":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _TORCH_PRIVATE.search(code) and not _HOT_READS.search(code):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == [], "torch internals outside diffcomm/_torch.py:\n" + "\n".join(offenders)
    # and the hot-path reads go through the objects _torch names
    hot = [
        f"{path.relative_to(ROOT)}:{n}"
        for name, path in _modules().items()
        if name != "diffcomm._torch"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b(torch|dist|c10d|distributed_c10d)\.\w*\._(default_pg|current_level)", line)
    ]
    assert hot == []


# ------------------------------------------------------------------ settings


def test_settings_are_read_through_their_public_names() -> None:
    """Outside ``_config`` a setting is read with ``get()`` or the public fast read
    (``value if loaded else get()``), never through its private attributes."""
    private = re.compile(r"\b(?!self\b)\w+\.(_value|_loaded|_parse|_default)\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for name, path in _modules().items()
        if name != "diffcomm._config"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert offenders == []


# ------------------------------------------------------------------ import cycles


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The diffcomm modules ``name`` imports anywhere in its source (module level or
    inside a function: a lazy import closes a cycle as surely as an eager one).
    ``from pkg import sub`` counts as an import of ``pkg.sub`` where that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_lazy_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    modules = _modules()
    # tools/bench.py imports diffcomm._torch only inside a function
    assert "diffcomm._torch" in _imports("diffcomm.tools.bench", PKG / "tools" / "bench.py", modules)


def test_no_import_cycles_among_diffcomm_modules() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(len(v) for v in graph.values()) > 200, "the import graph was not read"
    assert _cycles(graph) == []


# ------------------------------------------------------------------ the layer picture


def _picture_layers() -> list[set[str]]:
    """The layers of docs/architecture.md's picture, top first: the first column of each
    line that starts a layer (a continuation line starts with spaces)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers: begin", 1)[1].split("<!-- layers: end -->", 1)[0]
    lines = block.split("```")[1].strip("\n").splitlines()
    layers = []
    for line in lines:
        if line.strip() and not line.startswith(" "):
            names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            layers.append({n.strip() for n in names.split(",")})
    return layers


def _contract_layers() -> list[set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [
        {name.strip().removeprefix("diffcomm.") for name in re.split(r"[|:]", layer)}
        for layer in contract["layers"]
    ]


def test_architecture_picture_lists_the_contract_layers() -> None:
    picture = _picture_layers()
    assert len(picture) >= 10
    assert picture == _contract_layers()
    # every package and top-level module of diffcomm is in exactly one layer
    top = {
        p.stem if p.suffix else p.name
        for p in PKG.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    placed = set().union(*picture)
    assert top - {"__init__", "__main__"} == placed


# ------------------------------------------------------------------ module size

MAX_LINES = 600
#: A module over MAX_LINES says why in a comment line starting with this marker,
#: followed by the reason (e.g. ``# Size: ~650 lines, over the ~600 guideline: ...``).
SIZE_NOTE = re.compile(r"^# Size: .{40,}", re.M)


def test_no_module_over_600_lines_without_a_note() -> None:
    over = []
    for path in _modules().values():
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES and not SIZE_NOTE.search(text):
            over.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
    assert over == [], f"modules over {MAX_LINES} lines without a `# Size:` note: {over}"


def test_examples_and_benchmarks_call_no_deprecated_keyword() -> None:
    """What users copy and what the performance pages measure calls the current API: no
    ``sizes=`` (renamed ``split_sizes``; the old name warns). The benchmarks called
    ``all_gather`` / ``gather`` with ``sizes=``, so their counts and times took in the
    deprecation path."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for folder in ("examples", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and any(k.arg == "sizes" for k in node.keywords):
                    name = ast.unparse(node.func)
                    if name.split(".")[-1] in ("all_gather", "gather", "scatter"):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {name}(sizes=...)")
    assert not found, found
