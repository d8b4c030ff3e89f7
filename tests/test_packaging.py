"""The front door: layout, runtime dependencies, the pytest configuration a user sees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

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


def test_every_builtin_op_is_exported_by_its_home() -> None:
    """Every registered built-in op is bound, by name, in its family's home (``dc.p2p.send``)
    and listed in the home's first literal ``__all__`` in the registry's order (what the
    command line reads, ``tools/op_names.py``); the package face re-exports every name of
    the homes' ``__all__`` (``dc.send``, ``__all__``); the face's ``__all__`` is what it binds."""
    from diffcomm import parallel
    from diffcomm.ops import coalesced, collectives, p2p
    from diffcomm.ops import registry as R
    from diffcomm.tools.op_names import builtin_ops

    homes = {"collective": collectives, "p2p": p2p, "coalesced": coalesced, "mapping": parallel}
    ops = {f: [n for n, c in R.family(f).items() if R.builtin(c)] for f in homes}
    for f, names in ops.items():
        for name in names:
            fn = R.public_fn(R.REGISTRY[name])
            assert getattr(homes[f], name, None) is fn and name in homes[f].__all__, (f, name)
            if f != "mapping":  # the mappings are dc.parallel.<name>
                assert getattr(diffcomm, name, None) is fn and name in diffcomm.__all__, name
    assert builtin_ops() == ops
    for home in (collectives, p2p, coalesced):  # the face re-exports each home's __all__
        for name in home.__all__:
            assert getattr(diffcomm, name) is getattr(home, name) and name in diffcomm.__all__, name
    # diffcomm.parallel's face imports every public name of its modules by name
    faces = ("mappings", "layers", "blocks", "loss", "context", "routing", "moe", "grads")
    for module in (getattr(parallel, m) for m in faces):
        for n in module.__all__:
            assert n in parallel.__all__ and vars(parallel).get(n) is getattr(module, n), (module.__name__, n)
    assert len(diffcomm.__all__) == len(set(diffcomm.__all__))
    # __all__ is what the face binds: every function, class and table of the package it binds
    ours = {
        n
        for n, v in vars(diffcomm).items()
        if not n.startswith("_") and not isinstance(v, ModuleType) and _defined_in_diffcomm(v)
    }
    assert ours <= set(diffcomm.__all__) <= set(vars(diffcomm))
    star: dict[str, object] = {}
    exec("from diffcomm import *", star)
    assert set(diffcomm.__all__) <= set(star)


def _defined_in_diffcomm(value: object) -> bool:
    module = getattr(value, "__module__", None) or type(value).__module__
    return module.split(".")[0] == "diffcomm"


def test_dc_debug_is_the_setting_and_no_package_shadows_it() -> None:
    """One name, one thing: ``dc.debug`` is the setting (the contract's ``dc.debug(True)``);
    what diffcomm records of its communication is ``diffcomm.diagnostics``."""
    import importlib.util

    import diffcomm.diagnostics.recorder

    assert importlib.util.find_spec("diffcomm.debug") is None
    assert diffcomm.debug is diffcomm._config.debug
    assert diffcomm.diagnostics.recorder.FlightRecorder is diffcomm.FlightRecorder
    before = diffcomm.debug()
    with diffcomm.debug(True):
        assert diffcomm.debug() is True
    assert diffcomm.debug() is before


def test_p2p_exports_what_its_docstring_says() -> None:
    """The names ``diffcomm.ops.p2p``'s docstring calls private are attributes, not exported."""
    from diffcomm.ops import p2p

    said = re.search(r"private entries, (.*?): attributes here, not exported", p2p.__doc__ or "", re.S)
    assert said is not None
    private = re.findall(r"``(\w+)``", said.group(1))
    assert len(private) == 6 and all(callable(getattr(p2p, n)) for n in private)
    assert not set(private) & set(p2p.__all__)
    assert {"send", "recv", "irecv", "post_grad_recv", "wait_sends"} <= set(p2p.__all__)


#: The probe's mypy follows every import of diffcomm, and of torch the modules that name
#: the types in diffcomm's signatures (``Tensor``, ``ProcessGroup``); the rest of torch is
#: skipped (``Any``): analysing all of it was 80% of the test's time (10 s -> 2 s of CPU),
#: and the revealed signatures are the same.
_PROBE_MYPY_INI = """[mypy]
follow_imports = silent
[mypy-torch.*]
follow_imports = skip
[mypy-torch]
follow_imports = silent
[mypy-torch._tensor]
follow_imports = silent
[mypy-torch.distributed]
follow_imports = silent
[mypy-torch._C._distributed_c10d]
follow_imports = silent
"""


def test_go_to_definition_reaches_the_function(tmp_path: Path) -> None:
    """Static analysis sees ``dc.all_gather`` as the function (its signature), not ``Any``:
    one op of each family home the face re-exports (``from .ops.<home> import *``)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import diffcomm as dc\n"
        "reveal_type(dc.all_gather)\nreveal_type(dc.send)\nreveal_type(dc.all_reduce_coalesced)\n"
    )
    (tmp_path / "mypy.ini").write_text(_PROBE_MYPY_INI)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file=mypy.ini",
            "--no-incremental",
            "--cache-dir=/dev/null",
            "probe.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    revealed = re.findall(r'Revealed type is "(.*)"', p.stdout)
    assert len(revealed) == 3, p.stdout + p.stderr
    assert revealed[0].startswith("def (x: torch._tensor.Tensor, dim: int =, group: "), revealed
    assert revealed[1].startswith("def (x: torch._tensor.Tensor, dst: int, group: "), revealed
    assert revealed[2].startswith("def (tensors: typing.Sequence[torch._tensor.Tensor], op: "), revealed


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
    # a star import is a first use too: the lazy package's ``__all__`` is the whole face
    lazy_star = (
        "import sys\n"
        "sys.argv[0] = 'diffcomm'\n"
        "import diffcomm as dc\n"
        "assert 'torch' not in sys.modules, 'the command line imported torch'\n"
        "star = {}\n"
        "exec('from diffcomm import *', star)\n"
        "del star['__builtins__']\n"
        "assert {'all_gather', 'send', 'DUALS', 'LocalWorld'} <= set(star) == set(dc.__all__)\n"
    )
    for code, expected in ((eager, []), (lazy, [diffcomm.__version__, _NO_SUCH_NAME]), (lazy_star, [])):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines() == expected


_NO_SUCH_NAME = "module 'diffcomm' has no attribute 'no_such_name'"


#: Each source file is compiled once, not once per fresh import: where no bytecode is
#: written (``PYTHONDONTWRITEBYTECODE=1``) the ~110 rounds of imports below recompiled
#: every module each time (about 2/3 of the test's 10 s). Compiling is a pure function of
#: the source, so every module still runs its body afresh as the first one imported.
_COMPILE_ONCE = (
    "import importlib.machinery as _m\n"
    "_compile, _compiled = _m.SourceFileLoader.source_to_code, {}\n"
    "def _source_to_code(self, data, path, *, _optimize=-1):\n"
    "    if (path, data) not in _compiled:\n"
    "        _compiled[path, data] = _compile(self, data, path, _optimize=_optimize)\n"
    "    return _compiled[path, data]\n"
    "_m.SourceFileLoader.source_to_code = _source_to_code\n"
)


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
        f"{_COMPILE_ONCE}"
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
    in the last line, not listed one per line (README: "What the test command prints").
    (``-n 0``: the project's other options as they are, without two worker interpreters
    for six skipped tests.)"""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "tests/accelerator/test_cuda.py",
        ],
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
