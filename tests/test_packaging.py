"""The front door: layout, runtime dependencies, the pytest configuration a user sees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import diffcomm

ROOT = Path(__file__).resolve().parents[1]


def _project_dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the [project] dependencies list, read by hand
        block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
        assert block is not None
        return re.findall(r'"([^"]+)"', block.group(1))
    return tomllib.loads(text)["project"]["dependencies"]


def test_src_layout_a_clone_folder_does_not_shadow_the_package(tmp_path: Path) -> None:
    """``git clone ... diffcomm`` then a script next to the clone: the package still imports.

    With a flat layout the clone folder (no ``__init__.py`` at its top) became a namespace
    package ``diffcomm`` without ``LocalWorld``.
    """
    assert (ROOT / "src" / "diffcomm" / "__init__.py").is_file()
    assert not (ROOT / "diffcomm").exists()  # nothing importable at the repository root
    clone = tmp_path / "diffcomm"  # what a clone looks like from its parent directory
    (clone / "src").mkdir(parents=True)
    (clone / "README.md").write_text("# diffcomm\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import diffcomm\n"
        "assert diffcomm.__file__ is not None, diffcomm.__path__\n"
        "print(diffcomm.__file__, diffcomm.LocalWorld.__name__, diffcomm.all_reduce.__name__)\n"
    )
    for cmd in ([sys.executable, str(script)], [sys.executable, "-c", script.read_text()]):
        p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        path, world, op = p.stdout.split()
        assert Path(path) == Path(diffcomm.__file__) and (world, op) == ("LocalWorld", "all_reduce")


def test_numpy_is_a_runtime_dependency_and_help_prints_nothing_on_stderr() -> None:
    """torch prints ``UserWarning: Failed to initialize NumPy`` in every process without numpy."""
    assert any(re.match(r"numpy\b", d) for d in _project_dependencies())
    p = subprocess.run(
        [sys.executable, "-m", "diffcomm", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
    )
    assert p.returncode == 0 and "check" in p.stdout
    assert p.stderr == ""


def test_pytest_hides_torchs_own_jit_deprecation_but_not_others() -> None:
    """pyproject's filterwarnings: torch's own ``torch.jit`` deprecation is not shown."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    with warnings.catch_warnings(record=True) as seen:  # inherits the filters pytest set up
        torch.jit.script(f)
        warnings.warn("diffcomm.something is deprecated", DeprecationWarning, stacklevel=1)
    messages = [str(w.message) for w in seen]
    assert not any("torch.jit" in m for m in messages), messages
    assert "diffcomm.something is deprecated" in messages


def _type_checking_imports() -> dict[str, str]:
    """name -> submodule of every import under ``if TYPE_CHECKING:`` in ``__init__.py``."""
    import ast

    tree = ast.parse(Path(diffcomm.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    names: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names:
            names[alias.asname or alias.name] = node.module or alias.name
    return names


def test_lazy_exports_all_and_type_checking_imports_agree() -> None:
    """``__all__``, the export table and the ``TYPE_CHECKING`` imports name the same things;
    the ops are read off the registry (every op of a family with a public home) and named
    once more, from their modules, under ``TYPE_CHECKING`` for static analysis."""
    from diffcomm.ops import families
    from diffcomm.ops import registry as R

    exports = {**diffcomm._EXPORTS, **{m: m for m in diffcomm._SUBMODULES}}
    ops = diffcomm._ops()
    assert ops == {
        n: f"ops.{families.HOMES[c.family]}"
        for n, c in R.REGISTRY.items()
        if R.builtin(c) and c.family in families.HOMES
    }
    assert {"all_reduce", "all_to_all", "send", "shift", "reduce_scatter_coalesced"} <= set(ops)
    assert len(diffcomm.__all__) == len(set(diffcomm.__all__))
    assert set(diffcomm.__all__) == set(exports) | set(ops) and not set(exports) & set(ops)
    # static analysis sees each op from its module (the registry runs only at run time)
    typed_ops = {n: getattr(diffcomm, n).__module__.removeprefix("diffcomm.") for n in ops}
    assert _type_checking_imports() == {**exports, **typed_ops}
    assert set(diffcomm.__all__) <= set(dir(diffcomm))
    for name, mod in {**diffcomm._EXPORTS, **ops}.items():
        module = sys.modules.get(f"diffcomm.{mod}") or __import__(f"diffcomm.{mod}", fromlist=["_"])
        assert getattr(diffcomm, name) is getattr(module, name), name
    star: dict[str, object] = {}
    exec("from diffcomm import *", star)
    assert set(diffcomm.__all__) <= set(star)


def test_import_is_eager_and_only_the_command_line_is_lazy() -> None:
    """``import diffcomm`` pays the whole import at once (never inside a first collective,
    where a rank still importing would look like a desync to the others); the command
    line (``sys.argv[0]`` the console script or ``-m``) imports a submodule per first use."""
    eager = (
        "import sys\n"
        "import diffcomm\n"
        "assert 'torch' in sys.modules and 'diffcomm.ops.collectives' in sys.modules\n"
        "missing = [n for n in diffcomm.__all__ if n not in vars(diffcomm)]\n"
        "assert not missing, missing\n"
    )
    lazy = (
        "import sys\n"
        "sys.argv[0] = '/venv/bin/diffcomm'  # as pip's console-script wrapper runs\n"
        "import diffcomm as dc\n"
        "assert 'torch' not in sys.modules, 'the command line imported torch'\n"
        "print(dc.__version__)\n"
        "op = dc.all_reduce\n"
        "assert 'torch' in sys.modules and op.__module__ == 'diffcomm.ops.all_reduce'\n"
        "assert dc.LocalWorld.__module__ == 'diffcomm.runtime.world'\n"
        "assert dc.parallel.__name__ == 'diffcomm.parallel'\n"
        "import diffcomm.testing\n"
        "from diffcomm import testing, world\n"
        "assert testing is diffcomm.testing and world.LocalWorld is dc.LocalWorld\n"
        "try:\n"
        "    dc.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    for code, expected in ((eager, []), (lazy, [diffcomm.__version__, _NO_SUCH_NAME])):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines() == expected


_NO_SUCH_NAME = "module 'diffcomm' has no attribute 'no_such_name'"


def test_every_submodule_imports_first() -> None:
    """Any module may be the first one imported, also where the package is lazy (CLI)."""
    src = Path(diffcomm.__file__).parent
    names = sorted(
        "diffcomm." + ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for p in src.rglob("*.py")
        if p.name not in ("__main__.py", "rank_process.py")  # scripts: they run, not import
    )
    code = (
        "import sys, importlib, torch\n"
        "sys.argv[0] = 'diffcomm'  # the command line's lazy package\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] == 'diffcomm']:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert len(names) > 20


def test_readme_front_door() -> None:
    """The two commands (the second is the one .ci/run runs), the CPU wheel, the docs note."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    first = "pip install torch==2.13.0 && pip install -e . && python -m diffcomm check"
    ci_test_cmd = re.search(r"readonly TEST_CMD='(.*)'", (ROOT / ".ci" / "run").read_text())
    assert ci_test_cmd is not None
    assert first in lines and ci_test_cmd.group(1) in lines
    assert lines.index(ci_test_cmd.group(1)) == lines.index(first) + 1
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in lines
    assert "**How long.**" in readme and "--backend nccl" in readme
    docs = readme.split("## Documentation", 1)[1]
    assert "without outputs" in docs and "tests/test_notebooks.py" in docs


def test_the_readme_test_command_ends_in_one_summary_line_it_explains() -> None:
    """No `-ra` in the project's pytest options: skips and expected failures are counted
    in the last line, not listed one per line (README: "What the test command prints")."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/accelerator/test_cuda.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert "short test summary info" not in proc.stdout and "SKIPPED [" not in proc.stdout, proc.stdout
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", lines[-1]) or "passed" in lines[-1], lines
    readme = (ROOT / "README.md").read_text()
    assert "**What the test command prints.**" in readme and "-rsx" in readme
