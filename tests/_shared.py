"""Helpers shared by several test modules (importable inside rank processes too)."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if TYPE_CHECKING:
    import pytest

T = TypeVar("T")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: the mappings whose forward copies a replicated input: debug mode refuses a per-rank one,
#: which the tests comparing two transports give them (pinned off there)
COPY_FORWARDS = frozenset({"copy_to_region", "scatter_to_region", "scatter_to_sequence"})


def benchmark_json(script: str, *args: str, timeout: float = 600) -> Any:
    """Run ``benchmarks/<script> --json *args`` in a fresh Python (no stdin) and return
    the JSON its last line of output holds; a failing run fails with its stderr."""
    p = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def benchmark_json_here(
    script: str, *args: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Any:
    """:func:`benchmark_json` run in this test's process (``runpy``, as ``__main__``): the
    worlds it starts come from this worker's fork server, with no fresh interpreter that
    imports torch again. Only for a benchmark whose main process changes no global state
    (it starts ``dc.LocalWorld`` objects; its ranks set their own threads)."""
    monkeypatch.setattr(sys, "argv", [script, "--json", *args])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    capsys.readouterr()  # what the test printed before
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except SystemExit as exc:  # a main that ends in sys.exit(main())
        assert exc.code in (0, None), f"{script} exited with {exc.code}"
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def refusals(calls: dict[str, Callable[[], object]], comms: str = "[{} comms]") -> dict[str, str]:
    """Each call's ``ValueError`` message followed by ``comms`` formatted with how many
    communications ran before it (diffcomm's comms log), or ``"no error"``."""
    from diffcomm import backend as B

    out = {}
    for key, call in calls.items():
        with B.log_comms() as log:
            try:
                call()
                out[key] = "no error"
            except ValueError as exc:
                out[key] = f"{exc} {comms.format(log.count())}"
    return out


def refusal_messages(calls: list[Callable[[], object]]) -> list[str]:
    """Each call's ``"Type: message [N comms]"`` (its ``ValueError`` or ``TypeError`` and
    how many communications ran before it, diffcomm's comms log), or ``"no error"``."""
    from diffcomm import backend as B

    out = []
    for call in calls:
        with B.log_comms() as log:
            try:
                call()
                out.append("no error")
            except (ValueError, TypeError) as exc:
                out.append(f"{type(exc).__name__}: {exc} [{log.count()} comms]")
    return out


def assert_refused_before_communicating(per_rank: list[list[str]], patterns: list[str]) -> None:
    """Every rank's messages (``"Type: message [N comms]"``, one a bad call) match
    ``patterns`` one by one, each refused with no communication before it."""
    for msgs in per_rank:
        assert len(msgs) == len(patterns)
        for pat, msg in zip(patterns, msgs):
            assert re.search(pat, msg) and msg.endswith("[0 comms]"), (pat, msg)


def load_serial_refusal(layer: Any, state_dict: dict[str, Any], error: type[BaseException]) -> str:
    """``layer.load_serial_state_dict(state_dict)``'s ``error`` message followed by
    ``untouched=<whether every tensor of the layer kept its value>``; ``"loaded"`` if it
    raised nothing (a test asserting the message then fails on it)."""
    import torch

    before = {k: v.clone() for k, v in layer.state_dict().items()}
    try:
        layer.load_serial_state_dict(state_dict)
    except error as e:
        untouched = all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
        return f"{e} untouched={untouched}"
    return "loaded"


def outcomes(calls: dict[str, Callable[[], object]], error: type[BaseException]) -> dict[str, str]:
    """Each call's outcome by key: ``"no error"``, or the message of the ``error`` it raised
    (any other exception propagates, so a wrong error type fails the test)."""
    out = {}
    for key, call in calls.items():
        try:
            call()
            out[key] = "no error"
        except error as exc:
            out[key] = str(exc)
    return out


def fullgraph_error(fn: Callable[..., object], *args: object) -> str:
    """The message of the ``torch._dynamo.exc.Unsupported`` that compiling ``fn`` with
    ``fullgraph=True`` (backend ``"eager"``, after a dynamo reset) and calling it on
    ``args`` raises, or ``"compiled without error"``."""
    import torch

    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
    except torch._dynamo.exc.Unsupported as err:
        return str(err)
    return "compiled without error"


def check_in_batches(
    world: Any, cases: st.SearchStrategy[T], assert_ok: Callable[[Any, list[T]], None], max_examples: int
) -> None:
    """A property test: ``max_examples`` batches of three cases drawn from ``cases``, each
    batch checked by ``assert_ok(world, batch)`` (one ``world.run`` for three cases)."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.lists(cases, min_size=3, max_size=3))
    def check(batch: list[T]) -> None:
        assert_ok(world, batch)

    check()


def forget_gathered_sizes() -> None:
    """Make every group record of this process forget the row counts its all_gathers
    learned, so the next all_gather without ``split_sizes`` exchanges them first, as on a
    new group (call it on every rank at the same point)."""
    from diffcomm.backend import groups as _groups

    for info in _groups._INFOS.values():
        info.gathered_rows.clear()


def tp_aux_serial(kind: str, hidden: int, inner: int) -> tuple[Any, Any, Any, Any, Any]:
    """The serial reference of the TP-MLP-with-auxiliary-loss programs (float64, seeded):
    ``(x, w1, w2, dw1, dw2)``, the objective ``sum(tanh(x w1^T) w2^T) + 0.5 aux`` with aux the
    output's mean square, or (``kind == "varying"``) the inner activation's."""
    import torch

    def randn(*shape: int, seed: int) -> Any:
        return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))

    x, w1, w2 = randn(5, hidden, seed=0), randn(inner, hidden, seed=1), randn(hidden, inner, seed=2)
    s1, s2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    hs = torch.tanh(x @ s1.T)
    aux_s = hs.pow(2).sum() / hs.numel() if kind == "varying" else (hs @ s2.T).pow(2).mean()
    ((hs @ s2.T).sum() + 0.5 * aux_s).backward()
    return x, w1, w2, s1.grad, s2.grad


def tp_aux_term(kind: str, o: Any, h: Any, b: Any, inner: int) -> Any:
    """The parallel program's auxiliary loss: of the reduced output ``o`` (``ok``), of the
    output summed by ``dc.all_reduce`` (``all_reduce``: a bug), or this rank's share of the
    inner activation ``h``'s square sum (``varying``)."""
    import diffcomm as dc

    if kind == "ok":
        return o.pow(2).mean()
    if kind == "all_reduce":
        return dc.all_reduce(h @ b.T).pow(2).mean()
    return h.pow(2).sum() / (5 * inner)
