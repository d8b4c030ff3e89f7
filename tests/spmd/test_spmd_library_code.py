"""The library's own code under the replication-type check: every example, every notebook's
parallel code and every docs page's runnable parallel code runs inside ``dc.spmd_check``
with no error (issue 45: no false positive on our own programs) — or, where listed with
``refused=``, with the error of a documented rule of the check, and ``why`` it applies
(the report of issue 45 lists them; docs/spmd_types.md, "Limits").

Each is listed explicitly below — what runs, or why it does not (a reason) — and
:func:`test_every_example_notebook_and_docs_block_is_listed` fails when a file, a
notebook's rank function or a docs code block is added without being listed. Sizes are
shrunk by explicit text replacements (each must match the source, so an edit of the
source that drops one fails loudly), and every run uses the shared worlds.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import diffcomm as dc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ROOT / "notebooks"
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class Call:
    """``fn(*args)`` of the loaded code, run inside ``dc.spmd_check()``. ``args`` are
    Python expressions evaluated in that code's namespace on the rank."""

    fn: str
    args: tuple[str, ...] = ()
    #: non-empty: the check refuses this call by one of its documented rules; the
    #: ``SPMDTypeError`` must contain this text (``why`` says which rule, and why it applies)
    refused: str = ""
    why: str = ""


@dataclass(frozen=True)
class Skip:
    """Not run under the check, and why."""

    reason: str


@dataclass(frozen=True)
class Elsewhere:
    """Run under the check by another test (``module::function`` under tests/)."""

    test: str


# the check's documented rules that refuse a docs program (each such block still runs, and
# must raise exactly this; see the report of issue 45 — a convention the check cannot see)
_SUM_CONVENTION = (
    "a sum-convention demo whose loss is replicated: by default the check reads a replicated "
    "loss as a replicated objective (docs/spmd_types.md, 'the loss decides the objective') and "
    "refuses a gradient summed over the ranks; the program is the same as the corpus bug 'all_gather "
    "under a replicated objective', so only the page's intent (the contract's sum convention) "
    "tells them apart: it runs under dc.spmd_check(objective='sum'), and passes"
)
_NOT_SEEN_PER_RANK = (
    "per-rank data the check cannot see as such (a Python dict picked by the rank: "
    "`{0: [...], 1: [...]}[r]` looks the RankInt up by hash and returns a plain list): taken "
    "as replicated, as docs/spmd_types.md says; declare it with dc.spmd.varying"
)
_FLOAT_FROM_RANK = (
    "a value computed from the rank by float arithmetic (`1.0 + r`): Python computes "
    "float + int by float.__add__ without asking the RankInt, so the value is a plain float, "
    "taken as replicated, and its sum refused"
)


# ======================================================================================
# examples/
# ======================================================================================

EXAMPLE_RUNS: dict[str, list[Call] | Skip | Elsewhere] = {
    "context_parallel_llama.py": Elsewhere("spmd/test_spmd.py::test_context_parallel_llama_block_passes"),
    "tensor_parallel_llama.py": Elsewhere("spmd/test_spmd.py::test_llama_style_tensor_parallel_block_passes"),
    "precision_tp_training.py": [Call("train", ("2", "None")), Call("train", ("2", "dc.Precision('bf16')"))],
    "ring_attention.py": [Call("_demo")],
    "with_spmd_types.py": [Call("mixed"), Call("each_checker")],
    "torchrun_allreduce.py": Skip(
        "its main() joins the process group torchrun describes and destroys it at the end: it "
        "cannot run inside a shared world (tests/runtime/test_torchrun.py runs it under torchrun)"
    ),
}


def _fresh_process() -> None:
    """The default generator as a fresh process has it (a non-deterministic seed, different
    on every rank): a program that runs in its own new ``dc.LocalWorld`` starts so, while a
    shared world carries the state an earlier test left (often seeded alike)."""
    import torch

    torch.seed()


def _load_example(name: str) -> dict[str, object]:
    import importlib.util

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"_example_{name[:-3]}", EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


@pytest.mark.parametrize("name", sorted(n for n, v in EXAMPLE_RUNS.items() if isinstance(v, list)))
def test_example_passes_the_check(world2: dc.LocalWorld, name: str) -> None:
    calls = EXAMPLE_RUNS[name]
    assert isinstance(calls, list)
    if name == "with_spmd_types.py":
        pytest.importorskip("spmd_types")

    def body() -> list[str]:
        _fresh_process()
        scope = _load_example(name)
        ran = []
        for c in calls:
            fn, args = scope[c.fn], [eval(a, scope) for a in c.args]
            _refused(c, lambda: fn(*args))  # type: ignore[operator]  # noqa: B023
            ran.append(c.fn)
        return ran

    for ran in world2.run(body):
        assert ran == [c.fn for c in calls]


# ======================================================================================
# notebooks/
# ======================================================================================

#: per notebook: its world size, the rank functions run (with their arguments; a notebook's
#: constants may be shrunk by ``sizes``) and the ones not run, with the reason
NOTEBOOK_RUNS: dict[str, dict[str, object]] = {
    "01_tour": {
        "world": 2,
        "calls": [
            Call("forward_all"),
            Call("matrix_blocks", ("'all_gather'",)),
            # (the vjp at the replicated point zeros: a sum of a replicated value)
            Call("matrix_blocks", ("'all_reduce'",)),  # (its vjp: not typed under torch.func)
            Call("matrix_blocks", ("'reduce_scatter'",)),
            Call("dot_test", ("'all_reduce max'",)),
            Call("dot_test", ("'broadcast'",)),
            Call("check_all_gather"),
            Call("nonlinear_grads", refused="already replicated", why=_NOT_SEEN_PER_RANK),
            Call("broadcast_grads"),
        ],
        "skip": {},
    },
    "02_tensor_parallel_mlp": {
        "world": 2,
        "calls": [
            Call("tp_mlp_grads", ("'mappings'",)),
            Call(
                "wrong_mappings",
                refused="parallel.reduce_from_region",
                why="the notebook's deliberate bugs for debug mode (a rank-dependent loss after "
                "reduce_from_region): the check names the mapping",
            ),
        ],
        "skip": {
            "tp_mlp_grads('plain all_reduce')": "the notebook's deliberate bug: "
            "test_notebook_plain_all_reduce_mlp_is_caught checks the check names it",
            "assert_matches_serial": "the testing kit's comparison (the serial reference runs "
            "on every rank next to the layer); ParallelMLP itself runs under the check in "
            "test_spmd.py::test_parallel_layers_and_blocks_pass",
        },
    },
    "03_pipeline": {
        "world": 2,
        "sizes": {"WIDTH": 16, "BATCH": 16},
        "calls": [Call("pipelined_step", ("'1f1b'",)), Call("pipelined_step", ("'gpipe'",))],
        "skip": {
            "two_stages_by_hand": "every rank holds the whole model and runs a different half "
            "of it, then compares its gradients with the serial ones: under the types those "
            "gradients are partial, and comparing a partial value with a replicated one is an error",
        },
    },
    "04_ring_attention": {
        "world": 4,
        "calls": [
            Call("shift_demo"),
            Call("compare", ("False",)),
            Call("compare", ("True",)),
            Call("library", ("'contiguous'",)),
            Call("library", ("'zigzag'",)),
        ],
        "skip": {},
    },
    "06_expert_parallel_moe": {
        "world": 2,
        "calls": [Call("compare"), Call("train", ("3", "16"))],
        "skip": {},
    },
}


def _notebook_cells(name: str) -> list[str]:
    cells = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _notebook_defs(name: str) -> str:
    """The notebook's definitions (imports, upper-case constants, functions, classes),
    without the statements that start worlds, run them or plot."""
    keep = []
    for cell in _notebook_cells(name):
        for node in ast.parse(cell).body:
            text = ast.unparse(node)
            constant = isinstance(node, ast.Assign) and all(
                isinstance(n, ast.Name) and n.id.isupper()
                for target in node.targets
                for n in (target.elts if isinstance(target, ast.Tuple) else [target])
            )
            simple = constant and "world" not in text
            if simple or isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef):
                keep.append(text)
    return "\n\n".join(keep)


def _notebook_rank_code(name: str) -> set[str]:
    """What the notebook runs on its world: the function of every ``world.run(fn, ...)``
    and every call that takes ``world=world``."""
    found = set()
    for cell in _notebook_cells(name):
        for node in ast.walk(ast.parse(cell)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "run" and ast.unparse(f.value) == "world":
                found.add(ast.unparse(node.args[0]))
            elif any(k.arg == "world" and ast.unparse(k.value) == "world" for k in node.keywords):
                found.add(ast.unparse(f))
    return found


@pytest.mark.parametrize("name", sorted(NOTEBOOK_RUNS))
def test_notebooks_parallel_code_passes(local_worlds: object, name: str) -> None:
    src = _notebook_defs(name)
    spec = NOTEBOOK_RUNS[name]
    calls: list[Call] = spec["calls"]  # type: ignore[assignment]
    sizes: dict[str, int] = spec.get("sizes", {})  # type: ignore[assignment]
    examples = str(EXAMPLES)

    def body() -> list[str]:
        if examples not in sys.path:
            sys.path.insert(0, examples)
        _fresh_process()
        scope: dict[str, object] = {"__name__": "notebook", "n": dc.get_world_size()}
        exec(compile(src, name, "exec"), scope)
        scope.update(sizes)
        ran = []
        for c in calls:
            fn, args = scope[c.fn], [eval(a, scope) for a in c.args]
            _refused(c, lambda: fn(*args))  # type: ignore[operator]  # noqa: B023
            ran.append(c.fn)
        return ran

    for ran in local_worlds(spec["world"]).run(body):  # type: ignore[operator]
        assert ran == [c.fn for c in calls]


def test_notebook_plain_all_reduce_mlp_is_caught(world2: dc.LocalWorld) -> None:
    """Notebook 02's deliberate bug (the sum-convention all_reduce in a TP MLP with a
    replicated loss): the check names the all_reduce and the mapping to use."""
    src = _notebook_defs("02_tensor_parallel_mlp")

    def body() -> str:
        scope: dict[str, object] = {"__name__": "notebook"}
        exec(compile(src, "02", "exec"), scope)
        try:
            with dc.spmd_check():
                scope["tp_mlp_grads"]("plain all_reduce")  # type: ignore[operator]
        except dc.SPMDTypeError as e:
            return str(e)
        return "no error"

    for msg in world2.run(body):
        assert "all_reduce at 02:" in msg and "parallel.reduce_from_region" in msg, msg


# ======================================================================================
# docs/*.md
# ======================================================================================


@dataclass(frozen=True)
class DocRun:
    """How one ```` ```python ```` block of a docs page runs on each rank of a world.

    The block's definitions are executed (its statements that start or run a world are
    dropped), then every ``world.run(fn, *args)`` the block makes, and ``calls``, run
    inside ``dc.spmd_check()``. ``top``: the block's own statements are the rank code (a
    fragment) and run inside the check; ``own_check``: they open ``dc.spmd_check``
    themselves. ``prelude`` defines what a fragment takes from its page's prose; ``sizes``
    are ``(old, new)`` text replacements that shrink it (each must match).
    """

    world: int = 2
    calls: tuple[Call, ...] = ()
    prelude: str = ""
    sizes: tuple[tuple[str, str], ...] = ()
    top: bool = False
    own_check: bool = False
    #: non-empty: the check refuses the block by one of its documented rules (``why``);
    #: the ``SPMDTypeError`` must contain this text
    refused: str = ""
    why: str = ""
    #: the check's ``objective=`` ("sum": the page means the contract's sum convention with a
    #: replicated loss, which the check cannot infer; ``why`` says so)
    objective: str = "loss"


#: imports every docs block may assume (the pages' prose names them)
_DOC_IMPORTS = """\
import torch
import torch.nn.functional as F
from torch import nn
import diffcomm as dc
from diffcomm import parallel
from diffcomm import parallel as par
"""

_SIGNATURE = Skip("a signature, not code")


#: (page, index of its ```python block) -> how it runs, or why not
DOC_RUNS: dict[tuple[str, int], DocRun | Skip | Elsewhere] = {
    ("accelerator.md", 0): Skip("no communication: the accelerator API in one process"),
    ("architecture.md", 0): Skip(
        "defines two new ops (which registers them process-wide, and a user op has no typing "
        "rule until it states one): tests/ops/test_adding_an_op.py runs it"
    ),
    ("async.md", 0): DocRun(
        sizes=(
            ("torch.randn(1024, 256", "torch.randn(8, 16"),
            ("256, 256) @ torch.randn(256, 64)", "16, 16) @ torch.randn(16, 4)"),
        ),
    ),
    ("coalesced.md", 0): DocRun(refused="already replicated", why=_FLOAT_FROM_RANK),
    ("context_parallel.md", 0): DocRun(
        world=4, sizes=(("torch.randn(1, 8, 4096, 64)", "torch.randn(1, 2, 32, 8)"),)
    ),
    ("context_parallel.md", 1): Skip(
        "every line after the first raises (the layout errors the page lists): "
        "tests/parallel/test_context_parallel.py checks them"
    ),
    ("context_parallel.md", 2): Skip(
        "its last line raises (the unnamed-layout error the page shows): "
        "tests/parallel/test_context_ambiguity.py checks it"
    ),
    ("debugging.md", 0): DocRun(
        top=True,
        prelude="x = dc.spmd.varying(torch.ones(3, requires_grad=True))\n",
        objective="sum",
        why=_SUM_CONVENTION,
        sizes=(('rec.dump("flight_{rank}.json")', "rec.dump(_tmp + '/flight_{rank}.json')"),),
    ),
    ("debugging.md", 1): Elsewhere(
        "debug/test_debugging_page.py::test_the_debugging_pages_messages_are_what_its_script_prints"
    ),
    ("in_process.md", 0): DocRun(world=4),  # (a sum of a replicated constant: arithmetic)
    ("index.md", 0): DocRun(objective="sum", why=_SUM_CONVENTION),
    ("install.md", 0): DocRun(),  # (a sum of a replicated constant without a gradient: arithmetic)
    ("moe.md", 0): DocRun(),
    ("moe.md", 1): Skip(
        "a testing-kit call whose `build` and `world` the page's prose defines: "
        "tests/parallel/test_moe.py runs the comparison"
    ),
    ("moe.md", 2): DocRun(),
    ("p2p.md", 0): DocRun(calls=(Call("ring"),)),
    ("p2p.md", 1): DocRun(calls=(Call("step"),)),
    ("parallel.md", 0): DocRun(
        sizes=(("MLP(512, 2048)", "MLP(16, 32)"), ("torch.randn(128, 4, 512", "torch.randn(8, 2, 16")),
    ),
    ("parallel.md", 1): DocRun(),
    ("parallel.md", 2): DocRun(top=True, sizes=(("512, 2048", "16, 32"), ("512, 2048", "16, 32"))),
    ("parallel.md", 3): Skip(
        "a checkpoint written to and read from a directory (no computation to type) with "
        "`build`, `adam` and `path` from the prose: tests/parallel/test_checkpointing.py::"
        "test_dcp_optimizer_state_reshards_adam_moments runs it"
    ),
    ("parallel.md", 4): DocRun(
        top=True,
        prelude=(
            "model = par.ParallelMLP(16, 32, seed=0)\n"
            "model(torch.ones(3, 16)).square().sum().backward()\n"
            "max_norm = 1e-3\n"
        ),
    ),
    ("parallel.md", 5): Skip(
        "a class (weight norm over a RowParallelLinear's split dim), no program: "
        "tests/parallel/test_training_stack.py::test_weight_norm_over_the_split_dim_recipe_matches_serial "
        "trains it against torch's weight_norm of the serial layer"
    ),
    ("parallel.md", 6): DocRun(
        top=True,
        prelude=(
            "V = 4 * dc.get_world_size()\n"
            "logits_shard = dc.spmd.varying(torch.randn(5, 4, requires_grad=True))\n"
            "target = torch.randint(0, V, (5,))\n"
        ),
    ),
    ("pipeline.md", 0): DocRun(sizes=(("range(10)", "range(2)"),)),
    ("pipeline.md", 1): Skip("a schedule table printed at a prompt (no communication)"),
    ("pipeline.md", 2): Skip("schedule tables printed at a prompt (no communication)"),
    ("precision.md", 0): DocRun(
        top=True,
        prelude=(
            "x = dc.spmd.varying(torch.randn(4, 64, requires_grad=True))\n"
            "w_shard = dc.spmd.varying(torch.randn(4, 128, requires_grad=True))\n"
            "partial = dc.spmd.partial(torch.randn(4, 64, requires_grad=True))\n"
        ),
    ),
    ("rng.md", 0): DocRun(
        top=True,
        prelude=(
            "tp_rank, dp_rank, pp_rank = dc.get_rank(), 0, 0\n"
            "x_full = torch.randn(4, 8)\n"
            "x_shard = dc.spmd.varying(torch.randn(4, 8))\n"
        ),
    ),
    ("rng.md", 1): DocRun(
        top=True,
        prelude=(
            "from diffcomm import rng\n"
            "rng.model_parallel_seed(1234, tp_rank=dc.get_rank())\n"
            "tracker = rng.get_tracker()\n"
            "w1 = torch.randn(8, 8, requires_grad=True)\n"
            "w2_shard = dc.spmd.varying(torch.randn(8, 4, requires_grad=True))\n"
            "h = torch.randn(3, 8, requires_grad=True)\n"
        ),
    ),
    ("spmd_types.md", 0): DocRun(
        top=True,
        own_check=True,
        prelude="group = None\nmodel = parallel.ParallelMLP(8, 16, seed=0)\nx = torch.randn(4, 8)\n",
    ),
    ("spmd_types.md", 1): DocRun(
        top=True,
        calls=(Call("_use_copy_reduce"),),
        prelude=(
            "def _use_copy_reduce():\n"
            "    torch.manual_seed(0)  # seeded alike (a shared world's ranks may hold any states)\n"
            "    x = torch.randn(3, 4, requires_grad=True)\n"
            "    w = dc.spmd.varying(torch.randn(4, 2, requires_grad=True))\n"
            "    ReduceFromTP.apply(CopyToTP.apply(x) @ w).pow(2).mean().backward()\n"
        ),
    ),
    ("testing.md", 0): DocRun(
        calls=(
            Call("_my_op_adjoint"),
            Call("_my_tp_function_gradcheck"),
        )
    ),
    ("testing.md", 1): _SIGNATURE,
    ("testing.md", 2): _SIGNATURE,
    ("testing.md", 3): Skip("a recipe whose `layer`, `layer_loss` and `x` the page's prose leaves open"),
    ("testing.md", 4): DocRun(calls=(Call("_my_double_backward_gradcheck"),)),
    ("testing.md", 5): _SIGNATURE,
    ("testing.md", 6): _SIGNATURE,
    ("transforms.md", 0): DocRun(  # (jvp: under torch.func nothing is typed; it passes)
        top=True,
        prelude="x = dc.spmd.varying(torch.randn(4, 3))\nt = dc.spmd.varying(torch.randn(4, 3))\n",
    ),
    ("transforms.md", 1): DocRun(
        top=True,
        prelude=(
            "xs = dc.spmd.varying(torch.randn(5, 3))\n"
            "targets = dc.spmd.varying(torch.randn(5))\n"
            "params = {'w': torch.randn(3)}\n"
            "def loss(p, x, t):\n"
            "    return (x @ p['w'] - t) ** 2\n"
        ),
    ),
    ("with_spmd_types.md", 0): DocRun(
        top=True,
        prelude="g = torch.Generator().manual_seed(0)\n",
    ),
    ("with_spmd_types.md", 1): DocRun(
        top=True,
        own_check=True,
        prelude=(
            "import spmd_types as spmd\n"
            "import torch.distributed as dist\n"
            "from spmd_types.checker import typecheck\n"
            "pg = dist.group.WORLD\n"
        ),
    ),
}

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _doc_blocks(page: str) -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer((DOCS / page).read_text())]


def _doc_rank_code(code: str) -> tuple[str, list[Call]]:
    """The block without its statements that start or run a world, and the calls it makes
    with ``world.run(fn, *args)``."""
    tree = ast.parse(code)
    calls = [
        Call(ast.unparse(node.args[0]), tuple(ast.unparse(a) for a in node.args[1:]))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "run"
        and ast.unparse(node.func.value) == "world"
    ]
    keep = [
        ast.unparse(node)
        for node in tree.body
        if not re.search(r"LocalWorld|world\.run|__main__", ast.unparse(node))
    ]
    return "\n".join(keep), calls


def _doc_case(page: str, index: int, run: DocRun) -> tuple[str, list[Call]]:
    code = _doc_blocks(page)[index]
    for old, new in run.sizes:
        assert old in code, f"docs/{page} block {index}: {old!r} is no longer there"
        code = code.replace(old, new, 1)
    if run.own_check:
        assert "dc.spmd_check(" in code, f"docs/{page} block {index} no longer opens dc.spmd_check"
    kept, calls = _doc_rank_code(code)
    return kept, [*calls, *run.calls]


def _refused(run: Call | DocRun, thunk: Callable[[], object]) -> None:
    """``thunk()`` inside ``dc.spmd_check()``: it passes, or (``run.refused``) the check
    raises the documented error."""
    try:
        with dc.spmd_check(objective=getattr(run, "objective", "loss")):
            thunk()
    except dc.SPMDTypeError as e:
        if not run.refused or run.refused not in str(e):
            raise
        return
    assert not run.refused, f"the check no longer refuses {run!r}: drop `refused` ({run.refused!r})"


DocCase = tuple[int, DocRun, str, list[Call]]


def _run_doc_cases(page: str, cases: list[DocCase], tmp: str) -> list[int]:
    """On each rank: every listed block of ``page``, its rank code inside ``dc.spmd_check``."""
    ran = []
    for i, run, kept, calls in cases:
        if not run.top:  # a whole program (a fragment's prelude stands for its page's prose)
            _fresh_process()
        scope: dict[str, object] = {"__name__": f"docs_{page}_{i}", "_tmp": tmp}
        exec(compile(_DOC_IMPORTS, f"{page}[{i}] imports", "exec"), scope)
        prelude = compile(run.prelude, f"{page}[{i}] prelude", "exec")
        code = compile(kept, f"{page}[{i}]", "exec")
        if run.top and not run.own_check:  # a fragment: its prelude declares types, so inside
            _refused(run, lambda: (exec(prelude, scope), exec(code, scope)))  # noqa: B023
        else:
            exec(prelude, scope)
            exec(code, scope)
        for c in calls:
            fn, args = eval(c.fn, scope), [eval(a, scope) for a in c.args]
            _refused(c if c.refused else run, lambda: fn(*args))  # noqa: B023
        ran.append(i)
    return ran


_DOC_CASES = sorted(k for k, v in DOC_RUNS.items() if isinstance(v, DocRun))


@pytest.mark.parametrize("page", sorted({p for p, _ in _DOC_CASES}))
def test_docs_pages_parallel_code_passes(local_worlds: object, page: str, tmp_path: Path) -> None:
    for n in sorted({DOC_RUNS[k].world for k in _DOC_CASES if k[0] == page}):  # type: ignore[union-attr]
        cases = []
        for p, i in _DOC_CASES:
            run = DOC_RUNS[(p, i)]
            assert isinstance(run, DocRun)
            if p == page and run.world == n:
                if "spmd_types" in _doc_blocks(p)[i] + run.prelude:
                    pytest.importorskip("spmd_types")
                cases.append((i, run, *_doc_case(p, i, run)))
        for ran in local_worlds(n).run(_run_doc_cases, page, cases, str(tmp_path)):  # type: ignore[operator]
            assert ran == [c[0] for c in cases]


# ======================================================================================
# the lists are complete
# ======================================================================================


def _exists(test: str) -> bool:
    path, _, name = test.partition("::")
    return f"def {name}(" in (ROOT / "tests" / path).read_text()


def test_every_example_notebook_and_docs_block_is_listed() -> None:
    """A new example, notebook, notebook rank function or docs code block fails here until
    it is listed above: run under the check, or skipped with a reason."""
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXAMPLE_RUNS)
    notebooks = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert notebooks == sorted(NOTEBOOK_RUNS)
    for name, spec in NOTEBOOK_RUNS.items():
        listed = {c.fn for c in spec["calls"]} | {k.split("(")[0] for k in spec["skip"]}  # type: ignore[attr-defined]
        assert _notebook_rank_code(name) == listed, name
    blocks = {(p.name, i) for p in sorted(DOCS.glob("*.md")) for i in range(len(_doc_blocks(p.name)))}
    assert blocks == set(DOC_RUNS), (sorted(blocks - set(DOC_RUNS)), sorted(set(DOC_RUNS) - blocks))
    calls = [c for v in EXAMPLE_RUNS.values() if isinstance(v, list) for c in v]
    calls += [c for spec in NOTEBOOK_RUNS.values() for c in spec["calls"]]  # type: ignore[attr-defined]
    calls += [c for v in DOC_RUNS.values() if isinstance(v, DocRun) for c in (v, *v.calls)]
    assert all(len(c.why) > 20 for c in calls if c.refused), "a refusal without its reason"
    opted = [v for v in DOC_RUNS.values() if isinstance(v, DocRun) and v.objective != "loss"]
    assert all(len(v.why) > 20 for v in opted), "objective='sum' without its reason"
    for entry in [*EXAMPLE_RUNS.values(), *DOC_RUNS.values()]:
        if isinstance(entry, Skip):
            assert len(entry.reason) > 20, entry
        if isinstance(entry, Elsewhere):
            assert _exists(entry.test), entry.test
    for (page, i), run in DOC_RUNS.items():  # every listed run still matches its block
        if isinstance(run, DocRun):
            kept, calls = _doc_case(page, i, run)
            assert calls or run.top, (page, i)
