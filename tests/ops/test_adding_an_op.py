"""docs/architecture.md's "Adding an op", executed: two new ops defined in this one file.

The block between the ``op-block`` markers below is the code the doc shows (a test checks
the doc's code blocks equal it, character for character): a dual pair of collectives,
``all_stack`` / ``sum_unstack``, and a point-to-point op, ``mirror``. Nothing else in the
repository names them. Defining the classes registers them; then, with no other edit:

* ``python -m diffcomm check --module tests/ops/test_adding_an_op.py`` runs their standard
  cases (reference, gradient, adjoint, double backward) on worlds 2 and 3;
* they are in ``dc.DUALS`` / ``p2p.DUALS`` and the docs' generated tables, and the
  registry's checks (``verify``) pass;
* the testing kit's ``check_adjoint``, ``gradcheck`` and ``assert_matches_serial`` pass;
* they work under backward, double backward, ``torch.func.jvp``, ``vmap`` (one raw
  collective for the whole batch, counted), ``torch.compile`` and ``async_op=True``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import diffcomm as dc
from diffcomm.ops import registry as R

ROOT = Path(__file__).resolve().parents[2]

# --8<-- [start:op-block]
from collections.abc import Iterator  # noqa: E402 - the doc's block starts here
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from diffcomm import backend as B  # noqa: E402
from diffcomm.backend import args as A  # noqa: E402
from diffcomm.ops import wire  # noqa: E402
from diffcomm.ops.base import CommOp, apply, call  # noqa: E402
from diffcomm.ops.registry import SELF  # noqa: E402


class _AllStack(CommOp):
    """Rank r gets every rank's ``x`` stacked along a new dim ``dim``."""

    name = "all_stack"
    family = "collective"  # defining the class registers it: dc.DUALS, check, the docs
    dims = (0,)  # args[0] is a tensor dim: vmap shifts it and makes one call per batch
    forward_text = "every rank's x, stacked along a new dim"
    backward_text = "sum_unstack: slot r of the sum over ranks"

    @staticmethod
    def run(x: Tensor, dim: int, pg: Any, world: int) -> Tensor:  # the one place it communicates
        return B.get_backend().all_gather(x.unsqueeze(0), pg, (1,) * world).movedim(0, dim)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: Any, world: int) -> Tensor:  # its dual's class
        return call(_SumUnstack, g, dim, pg, world)

    @staticmethod
    def out_shape(x: Tensor, dim: int, pg: Any, world: int) -> tuple[int, ...]:  # async_op=True
        return (*x.shape[:dim], world, *x.shape[dim:])

    @staticmethod
    def reference(xs: list[Tensor], kws: list[dict[str, Any]]) -> list[Tensor]:  # serial
        return [torch.stack(xs, kws[0].get("dim", 0)) for _ in xs]

    @staticmethod
    def dual_args(kw: dict[str, Any], world: int) -> tuple[dict[str, Any], float]:
        return {"dim": kw.get("dim", 0)}, 1.0  # the adjoint of all_stack(x, dim) is sum_unstack(y, dim)

    @staticmethod
    def cases(world: int) -> Iterator[dict[str, Any]]:  # what `python -m diffcomm check` runs
        yield {"shape": (2, 3)}
        yield {"shape": (2, 3), "kwargs": {"dim": 2}}
        yield {"shape": (4,), "dtype": "complex128", "kwargs": {"dim": 1}}


class _SumUnstack(CommOp):
    """Rank r gets slot ``r`` (along ``dim``) of the sum over ranks of ``y``."""

    name = "sum_unstack"
    family = "collective"
    dual = _AllStack  # the second of a pair names the first; the registry links both ways
    dims = (0,)
    forward_text = "slot r along dim of the sum over ranks"
    backward_text = "all_stack"

    @staticmethod
    def run(y: Tensor, dim: int, pg: Any, world: int) -> Tensor:
        return B.get_backend().reduce_scatter(y.movedim(dim, 0), "sum", pg, (1,) * world).squeeze(0)

    @staticmethod
    def transpose(g: Tensor, dim: int, pg: Any, world: int) -> Tensor:
        return call(_AllStack, g, dim, pg, world)

    @staticmethod
    def out_shape(y: Tensor, dim: int, pg: Any, world: int) -> tuple[int, ...]:
        return (*y.shape[:dim], *y.shape[dim + 1 :])

    @staticmethod
    def reference(xs: list[Tensor], kws: list[dict[str, Any]]) -> list[Tensor]:
        total = torch.stack(xs).sum(0)
        return [total.select(kws[0].get("dim", 0), r) for r in range(len(xs))]

    @staticmethod
    def dual_args(kw: dict[str, Any], world: int) -> tuple[dict[str, Any], float]:
        return {"dim": kw.get("dim", 0)}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[dict[str, Any]]:
        yield {"shape": (world, 3)}
        yield {"shape": (2, world), "kwargs": {"dim": 1}}


def _world(x: Any, dim: Any, group: Any, op: str, new: bool) -> tuple[Tensor, int, Any, int]:
    """Validation before any communication (errors name the argument), the group resolved once."""
    x = A.check_tensor(x, op, "x")
    A.check_grad_dtype(x, op, "x")
    pg = A.resolve_group(group, op)
    world = B.get_backend().world_size(pg)
    ndim = x.ndim + new  # all_stack's dim is a new dim: one more position
    if type(dim) is not int or not -ndim <= dim < ndim:
        raise A.arg_error(op, "dim", f"an int in [{-ndim}, {ndim})", dim)
    return x, dim % ndim, pg, world


def all_stack(x: Tensor, dim: int = 0, group: A.GroupLike = None, *, async_op: bool = False) -> Tensor:
    """Every rank's ``x`` stacked along a new dim ``dim``: shape ``x.shape`` with ``world``
    inserted at ``dim``. Gradient: ``sum_unstack(grad, dim)``."""
    x, dim, pg, world = _world(x, dim, group, "all_stack", True)
    return apply(_AllStack, x, dim, pg, world, async_op=async_op)


def sum_unstack(y: Tensor, dim: int = 0, group: A.GroupLike = None, *, async_op: bool = False) -> Tensor:
    """Slot ``rank`` along ``dim`` of the sum over ranks of ``y`` (``y.shape[dim] == world``).
    Gradient: ``all_stack(grad, dim)``."""
    y, dim, pg, world = _world(y, dim, group, "sum_unstack", False)
    if y.shape[dim] != world:
        raise A.arg_error(
            "sum_unstack", "y", f"of size {world} (the group size) along dim {dim}", tuple(y.shape)
        )
    return apply(_SumUnstack, y, dim, pg, world, async_op=async_op)


class _Mirror(CommOp):
    """Rank r gets ``x`` of rank ``n - 1 - r``: a permutation that is its own inverse."""

    name = "mirror"
    family = "p2p"
    dual = SELF  # self-dual: its transpose is itself
    elementwise = True  # every rank sends its whole tensor: a vmap batch dim just rides along
    forward_text = "x of rank n - 1 - r"
    backward_text = "mirror(grad)"

    @staticmethod
    def run(x: Tensor, pg: Any) -> Tensor:
        info = B.group_info(pg)
        peer = info.size - 1 - info.rank
        return wire.exchange(x, peer, peer, x.shape, pg, info.rank)  # one batched send/recv

    @staticmethod
    def transpose(g: Tensor, pg: Any) -> Tensor:
        return call(_Mirror, g, pg)

    @staticmethod
    def reference(xs: list[Tensor], kws: list[dict[str, Any]]) -> list[Tensor]:
        return xs[::-1]

    @staticmethod
    def dual_args(kw: dict[str, Any], world: int) -> tuple[dict[str, Any], float]:
        return {}, 1.0

    @staticmethod
    def cases(world: int) -> Iterator[dict[str, Any]]:
        yield {"shape": (2, 3)}
        yield {"shape": (0, 2), "dtype": "float32"}


def mirror(x: Tensor, group: A.GroupLike = None) -> Tensor:
    """Rank ``r`` gets ``x`` of rank ``n - 1 - r`` (same shape on every rank).
    Gradient: ``mirror(grad)``."""
    x = A.check_tensor(x, "mirror", "x")
    A.check_grad_dtype(x, "mirror", "x")
    return apply(_Mirror, x, A.resolve_group(group, "mirror"))


# --8<-- [end:op-block]

NEW = ("all_stack", "sum_unstack", "mirror")
MODULE = __name__  # the registry's kit walks diffcomm's ops and the modules it is told of


def _block(text: str) -> str:
    return text.split("# --8<-- [start:op-block]\n", 1)[1].split("# --8<-- [end:op-block]", 1)[0]


def test_the_docs_code_is_this_files_code() -> None:
    """docs/architecture.md's "Adding an op" shows exactly the block above (less the
    ``noqa`` markers the block needs below this file's imports)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Adding an op", 1)[1].split("\n## ", 1)[0]
    shown = "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))
    mine = re.sub(r"  # noqa: E402.*", "", _block(Path(__file__).read_text()))
    assert shown.strip() == mine.strip()


def test_defining_the_classes_registered_them() -> None:
    from diffcomm.ops import p2p

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))  # the docs' generator (docs/_ext)
    try:
        import diffcomm_docs
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))

    assert dc.DUALS["all_stack"] == "sum_unstack" and dc.DUALS["sum_unstack"] == "all_stack"
    assert dc.dual("mirror") == "mirror" and p2p.DUALS["mirror"] == "mirror"
    assert dc.OPS["all_stack"].fn is all_stack and p2p.OPS["mirror"].fn is mirror
    assert _AllStack.dual is _SumUnstack and _SumUnstack.dual is _AllStack
    assert R.verify() == []  # paired, transposes call the dual's class, out_shape stated
    assert (
        "| `all_stack` | every rank's x, stacked along a new dim | `sum_unstack` |"
        in diffcomm_docs.duals_page()
    )
    assert "| `mirror` | x of rank n - 1 - r | `mirror` | mirror(grad) |" in diffcomm_docs.p2p_page()
    assert set(NEW) <= set(R.with_reference())  # the kit's reference/adjoint checks walk them
    # an op without out_shape refuses async_op=True (before communicating), never runs blocking
    with pytest.raises(TypeError, match="mirror.*async_op=True needs the op's output shape"):
        apply(_Mirror, torch.zeros(2), None, async_op=True)


def _python_m_diffcomm(
    *args: str, cwd: Path, env: dict[str, str], timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diffcomm", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_python_m_diffcomm_check_runs_them() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = _python_m_diffcomm(
        "check", "-n", "2", "3", "--module", __file__, "--ops", *NEW, "--json", cwd=ROOT, env=env
    )
    import json

    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = json.loads(p.stdout)
    assert out["ok"] and {r["op"] for r in out["cases"]} == set(NEW)
    assert len(out["cases"]) == 2 * (3 + 2 + 2)  # every case each class states, on worlds 2 and 3
    assert all(r["adjoint_err"] is not None and r["double_err"] is not None for r in out["cases"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_kits_standard_cases_pass(local_worlds, world_size: int) -> None:
    from diffcomm.testing.cases import run_case, standard_cases, standard_p2p_cases

    def run_all() -> list[str]:
        assert R.REGISTRY["all_stack"] is _AllStack  # (ships this module to the rank: registered)
        n = dc.get_world_size()
        cases = [c for c in [*standard_cases(n, [MODULE]), *standard_p2p_cases(n, [MODULE])] if c.op in NEW]
        assert len(cases) == 7
        return [f"{c.op} {c.label()}: {r.as_dict()}" for c in cases if not (r := run_case(c)).ok]

    assert local_worlds(world_size).run(run_all) == [[]] * world_size


def test_check_adjoint_gradcheck_and_serial_parity(world3: dc.LocalWorld) -> None:
    from diffcomm.testing import assert_matches_serial, check_adjoint, gradcheck

    def rank_body() -> list[float]:
        r = dc.get_rank()
        g = torch.Generator().manual_seed(r)
        x = torch.randn(2, 3, generator=g, dtype=torch.float64)
        errs = [
            check_adjoint(
                lambda t: all_stack(t, 1), x, torch.randn(2, 3, 3, generator=g, dtype=torch.float64)
            ),
            check_adjoint(
                lambda t: all_stack(t, 1),
                x,
                torch.randn(2, 3, 3, generator=g, dtype=torch.float64),
                dual_op=lambda t: sum_unstack(t, 1),
            ),
            check_adjoint(mirror, x, torch.randn(2, 3, generator=g, dtype=torch.float64), dual_op=mirror),
        ]
        xr = x.clone().requires_grad_(True)
        assert gradcheck(lambda t: (all_stack(t, 0).sin(), sum_unstack(all_stack(t, 0) * 2, 0)), (xr,))
        assert gradcheck(lambda t: mirror(t).exp(), (x.clone().requires_grad_(True),))
        return errs

    for errs in world3.run(rank_body):
        assert max(errs) < 1e-12, errs
    # the layer "stack then sum my slot" equals the serial "x summed over the batch dim"
    assert_matches_serial(
        lambda x: sum_unstack(all_stack(x, 0), 0) * 1.0,
        lambda x: x * 3.0,  # slot r of sum over ranks of (every rank's x): world * x on each
        torch.randn(2, 3, dtype=torch.float64),
        world3,
    )


def test_transforms_compile_and_async(world2: dc.LocalWorld) -> None:
    from torch.func import jvp, vmap

    from diffcomm.backend import log_comms

    def rank_body() -> dict[str, Any]:
        r = dc.get_rank()
        x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3) + 10 * r
        res: dict[str, Any] = {}
        # backward and double backward (a gradient penalty)
        xr = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad((all_stack(xr, 0) ** 2).sum(), xr, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), xr)
        res["grad"] = torch.allclose(gx, 2 * 2 * x)  # 2 ranks each hold x in their stack
        res["double"] = torch.allclose(ggx, torch.full_like(x, 4.0))
        # forward mode: the tangent goes through the same linear op
        t = torch.ones_like(x)
        y, ty = jvp(lambda a: all_stack(a, 1), (x,), (t,))
        res["jvp"] = torch.equal(ty, all_stack(t, 1)) and torch.equal(y, all_stack(x, 1))
        # vmap: one raw collective for the whole batch (counted), equal to a loop
        xb = torch.stack([x, x + 1, x + 2])
        stacked = torch.stack([all_stack(a) for a in xb])
        for name, op, batch in (
            ("all_stack", lambda a: all_stack(a, 1), xb),
            ("sum_unstack", sum_unstack, stacked),
            ("mirror", mirror, xb),
        ):
            with dc.debug(False):  # counted without debug mode's own checks
                with log_comms() as log:
                    op(batch[0])
                one = {k: int(row["count"]) for k, row in log.by_op().items()}
                with log_comms() as log:
                    yb = vmap(op)(batch)
                batched = {k: int(row["count"]) for k, row in log.by_op().items()}
            loop = torch.stack([op(a) for a in batch])
            assert torch.equal(vmap(op)(batch), loop)  # in debug mode too (the suite runs both)
            res[f"vmap {name}"] = (batched == one and sum(one.values()) == 1, torch.equal(yb, loop))
        res["mirror"] = torch.equal(mirror(x), x + 10 * (1 - 2 * r))
        # torch.compile: values and gradients equal eager's
        torch._dynamo.reset()
        fn = torch.compile(lambda a: (all_stack(a, 1) * 3).sum(1), fullgraph=True, backend="aot_eager")
        xc = x.clone().requires_grad_(True)
        yc = fn(xc)
        (gc,) = torch.autograd.grad(yc.sum(), xc)
        res["compile"] = torch.equal(yc.detach(), (all_stack(x, 1) * 3).sum(1)) and torch.allclose(
            gc, torch.full_like(x, 6.0)
        )
        # async_op=True: returns at once, the value and gradient equal the blocking op's
        xa = x.clone().requires_grad_(True)
        ya = all_stack(xa, 0, async_op=True)
        res["async_type"] = type(ya).__name__
        (ga,) = torch.autograd.grad((ya * ya).sum(), xa)
        res["async"] = torch.equal(ya.wait().detach(), all_stack(x, 0)) and torch.allclose(ga, 4 * x)
        return res

    for r, res in enumerate(world2.run(rank_body)):
        assert res["grad"] and res["double"] and res["jvp"], (r, res)
        for name in NEW:
            assert res[f"vmap {name}"] == (True, True), (r, name, res)
        assert res["mirror"], (r, res)
        assert res["compile"], (r, res)
        assert res["async_type"] == "AsyncTensor" and res["async"], (r, res)


#: the lines a built-in op adds besides its module and its test, all in its family's home:
#: (file, after this line, the lines to add) - its ``name as name`` import and its entry in
#: the home's first ``__all__`` (the face re-exports it; the command line reads it as data)
_NAMED = [
    (
        "ops/collectives.py",
        "from .all_to_all import raw_all_to_all as raw_all_to_all\n",
        "from .stacking import all_stack as all_stack\nfrom .stacking import sum_unstack as sum_unstack\n",
    ),
    ("ops/collectives.py", '    "all_to_all",\n', '    "all_stack",\n    "sum_unstack",\n'),
    ("ops/p2p.py", "from .send_recv import send as send\n", "from .stacking import mirror as mirror\n"),
    ("ops/p2p.py", '    "ppermute",\n', '    "mirror",\n'),
]


def test_a_built_in_op_is_its_module_and_its_names(tmp_path: Path) -> None:
    """The same block added to diffcomm itself: written as a new module of ``diffcomm.ops``
    in a copy of the package, its names imported (and listed in ``__all__``) by its family's
    home (``ops/collectives.py``, ``ops/p2p.py``), with **no other file edited** (not the
    package face, not the command line, not docs/api.md): its ops are ``dc.all_stack`` /
    ``dc.mirror`` (and in ``__all__``), attributes of their homes, in the registry, the
    docs tables and the API page, named by ``check --help`` and checked by
    ``python -m diffcomm check`` without ``--module``. tests/test_packaging.py names an op
    missing from its home."""
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "diffcomm", src / "diffcomm", ignore=shutil.ignore_patterns("__pycache__"))
    added = src / "diffcomm" / "ops" / "stacking.py"
    added.write_text(
        '"""all_stack / sum_unstack / mirror."""\n\n'
        + re.sub(r"  # noqa: E402.*", "", _block(Path(__file__).read_text()))
    )
    for rel, anchor, lines in _NAMED:
        path = src / "diffcomm" / rel
        text = path.read_text()
        assert text.count(anchor) == 1, (rel, anchor)
        path.write_text(text.replace(anchor, anchor + lines))
    before = sorted(p.relative_to(ROOT / "src") for p in (ROOT / "src" / "diffcomm").rglob("*.py"))
    after = sorted(p.relative_to(src) for p in (src / "diffcomm").rglob("*.py"))
    assert sorted({*before, added.relative_to(src)}) == after  # one file more
    edited = {
        str(p.relative_to(src / "diffcomm"))
        for p in (src / "diffcomm").rglob("*.py")
        if p != added and p.read_text() != (ROOT / "src" / p.relative_to(src)).read_text()
    }
    assert edited == {"ops/collectives.py", "ops/p2p.py"}  # the homes, one per family
    env = {**os.environ, "PYTHONPATH": str(src)}
    probe = (
        "import json, sys, diffcomm as dc\n"
        "from diffcomm.ops import registry as R\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_docs import _documented  # what docs/api.md documents, as its test reads it\n"
        f"api = _documented(open({str(ROOT / 'docs' / 'api.md')!r}).read())\n"
        "from diffcomm.tools.commands import check_ops\n"
        "print(json.dumps({\n"
        "    'file': dc.__file__,\n"
        "    'module': [dc.all_stack.__module__, dc.sum_unstack.__module__, dc.mirror.__module__],\n"
        "    'all': [n for n in ('all_stack', 'sum_unstack', 'mirror') if n in dc.__all__],\n"
        "    'homes': [dc.collectives.all_stack is dc.all_stack, dc.p2p.mirror is dc.mirror],\n"
        "    'duals': [dc.DUALS['all_stack'], dc.p2p.DUALS['mirror']],\n"
        "    'builtin': R.builtin(R.REGISTRY['all_stack']) and R.verify() == [],\n"
        "    'docs': ['| `sum_unstack` |' in dc.collectives.duals_markdown(),\n"
        "             '| `mirror` |' in dc.p2p.p2p_markdown()],\n"
        "    'check_ops': [n for n in check_ops() if n in ('all_stack', 'sum_unstack', 'mirror')],\n"
        "    'api': [n for n in ('all_stack', 'sum_unstack', 'mirror') if any(\n"
        "        getattr(sys.modules.get(m), n, None) is getattr(dc, n) for m, k in api if k == n)],\n"
        "}))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout)
    assert Path(got["file"]).is_relative_to(src)
    assert got["module"] == ["diffcomm.ops.stacking"] * 3
    assert got["all"] == list(NEW) and got["homes"] == [True, True]
    assert got["duals"] == ["sum_unstack", "mirror"] and got["builtin"] and got["docs"] == [True, True]
    assert got["check_ops"] == list(NEW) and got["api"] == list(NEW)
    # the command line knows them before torch is imported (a typo is refused at once) ...
    p = _python_m_diffcomm("check", "--ops", "all_stak", cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 2 and "(did you mean all_stack?)" in p.stderr, p.stderr[-2000:]
    # ... and checks them as diffcomm's own: no --module
    p = _python_m_diffcomm("check", "-n", "2", "--ops", *NEW, "--json", cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = json.loads(p.stdout)
    assert out["ok"] and [r["op"] for r in out["cases"]].count("all_stack") == 3
    assert {r["op"] for r in out["cases"]} == set(NEW) and len(out["cases"]) == 3 + 2 + 2


_MIRROR_DUAL_ARGS = """
    @staticmethod
    def dual_args(kw: dict[str, Any], world: int) -> tuple[dict[str, Any], float]:
        return {}, 1.0
"""
_ALL_STACK_REFERENCE = """
    @staticmethod
    def reference(xs: list[Tensor], kws: list[dict[str, Any]]) -> list[Tensor]:  # serial
        return [torch.stack(xs, kws[0].get("dim", 0)) for _ in xs]
"""


@pytest.mark.waits
def test_a_user_op_without_dual_args_is_checked_and_a_missing_reference_named(tmp_path: Path) -> None:
    """``dual_args`` is optional: ``mirror`` without it passes ``check`` (its backward is
    compared with the serial reference's gradient; no dot-product test). A collective with
    ``cases`` but no ``reference`` is refused before any rank starts, by ``verify``'s words."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    block = re.sub(r"  # noqa: E402.*", "", _block(Path(__file__).read_text()))
    assert block.count(_MIRROR_DUAL_ARGS) == 1 and block.count(_ALL_STACK_REFERENCE) == 1
    no_dual_args = tmp_path / "no_dual_args.py"
    no_dual_args.write_text(block.replace(_MIRROR_DUAL_ARGS, ""))
    p = _python_m_diffcomm(
        "check", "-n", "2", "--module", str(no_dual_args), "--ops", "mirror", "--json", cwd=tmp_path, env=env
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = json.loads(p.stdout)
    assert out["ok"] and {r["op"] for r in out["cases"]} == {"mirror"} and len(out["cases"]) == 2
    assert all(r["adjoint_err"] is None and r["grad_err"] == 0.0 for r in out["cases"]), out["cases"]
    no_reference = tmp_path / "no_reference.py"
    no_reference.write_text(block.replace(_ALL_STACK_REFERENCE, ""))
    p = _python_m_diffcomm("check", "-n", "2", "--module", str(no_reference), cwd=tmp_path, env=env)
    assert p.returncode == 2, p.stdout[-4000:] + p.stderr[-4000:]
    assert "all_stack: cases but no reference" in p.stderr, p.stderr[-4000:]
