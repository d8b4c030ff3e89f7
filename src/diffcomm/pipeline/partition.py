"""Cut a sequential model into contiguous pipeline stages."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from ..backend import args as A

__all__ = ["partition"]


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def partition(
    model: nn.Sequential | Sequence[nn.Module], n_stages: int, balance: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """Cut a sequential model into ``n_stages`` contiguous stages.

    Args:
        model: an ``nn.Sequential`` or a list of modules applied in order.
        n_stages: number of stages (>= 1, at most the number of layers).
        balance: layers per stage (``n_stages`` positive ints summing to the number of
            layers); default: minimise the largest stage's parameter count.

    Returns:
        ``n_stages`` ``nn.Sequential`` s sharing the model's modules (no copies), so the
        parameters of stage ``s`` are the model's own. Each layer keeps its name in the
        model (``stage.state_dict()`` is the serial state dict's slice of the stage's
        layers, as ``torch.distributed.pipelining`` keeps names: a
        ``torch.distributed.checkpoint`` of the stages holds the whole model, and loads at
        any number of stages or into the serial model); ``stage[i]`` is its ``i``-th layer. Each records
        ``partition_position = (s, n_stages)``, which :class:`PipelineRunner` checks
        against the virtual stage it runs the chunk as. A module used at several positions
        keeps every use. A parameter used in several stages (a module with parameters
        used twice, or a weight tied between two modules: an input embedding reused as the
        output projection) is recorded on each of them (``partition_ties``): a
        :class:`PipelineRunner` sums its gradient over the ranks holding those stages after
        every step (each copy then holds the serial gradient), and
        :func:`diffcomm.parallel.grad_norm` with ``pipeline_group=`` counts it once. A
        ``UserWarning`` says so (a loop of one's own must sum it; the runner's users must
        not sum it again).

    Example::

        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        stages = partition(model, 2)       # [Linear, ReLU, Linear] | [ReLU, Linear] (by params)
        stage = stages[dc.get_rank()]
    """
    # every position, as nn.Sequential runs them: children() lists a module used twice
    # (a shared activation, a weight-shared block) once, and the stages lost its second use
    if isinstance(model, nn.Sequential):
        names, layers = list(model._modules), list(model._modules.values())
    else:
        layers = list(model)
        names = [str(i) for i in range(len(layers))]
    if not all(isinstance(m, nn.Module) for m in layers):
        raise A.arg_error("partition", "model", "an nn.Sequential or a list of nn.Modules", model, TypeError)
    n_stages = A.check_int(n_stages, "partition", "n_stages")
    n = len(layers)
    if not 1 <= n_stages <= n:
        raise A.arg_error("partition", "n_stages", f"an int in [1, {n}] (the number of layers)", n_stages)
    if balance is not None:
        sizes = [A.check_int(b, "partition", "balance") for b in balance]
        if len(sizes) != n_stages or any(b < 1 for b in sizes) or sum(sizes) != n:
            raise A.arg_error(
                "partition", "balance", f"{n_stages} positive ints summing to {n} (the layers)", list(balance)
            )
    else:
        sizes = _balanced_sizes([_n_params(m) for m in layers], n_stages)
    out, start = [], 0
    for i, size in enumerate(sizes):
        # each layer under its name in the model: the stages' state dicts are disjoint slices
        # of the serial one (named from 0, every stage's first layer was `0.weight`, and a
        # torch.distributed.checkpoint of the stages kept one stage's tensor per key: a
        # resumed run loaded another stage's weights, silently where the shapes allowed)
        stage = nn.Sequential(OrderedDict(zip(names[start : start + size], layers[start : start + size])))
        # where the stage sits in the model: the runner checks it against the virtual stage
        # its placement gives the chunk (a chunk given to the wrong rank or slot ran another
        # model, silently, when the widths allowed it)
        stage.__dict__["partition_position"] = (i, n_stages)
        out.append(stage)
        start += size
    _record_ties(out)
    _record_shared_statistics(out)
    _warn_shared_across_stages(out)
    return out


def _record_ties(stages: list[nn.Sequential]) -> None:
    """Record on each stage the parameters it shares with other stages:
    ``stage.partition_ties``, a tuple of ``(tie, stages, name)`` — ``tie`` numbers the
    shared parameters in the order the model first uses them (the same on every rank that
    partitions the same model), ``stages`` the stages using it (ascending), ``name`` its
    name in this stage (``stage.get_parameter(name)``). The runner sums each one's gradient
    over the ranks holding ``stages``; ``parallel.grad_norm`` counts it on the rank holding
    ``stages[0]`` only."""
    users: dict[int, list[int]] = {}  # id(parameter) -> the stages using it, in order
    order: list[int] = []
    for s, stage in enumerate(stages):
        for q in stage.parameters():  # (each parameter once per stage)
            if id(q) not in users:
                users[id(q)] = []
                order.append(id(q))
            users[id(q)].append(s)
    tie_of = {key: t for t, key in enumerate(k for k in order if len(users[k]) > 1)}
    for stage in stages:
        ties = tuple(
            (tie_of[id(q)], tuple(users[id(q)]), name)
            for name, q in stage.named_parameters()
            if id(q) in tie_of
        )
        stage.__dict__["partition_ties"] = ties


def has_running_stats(m: nn.Module) -> bool:
    """A norm module that keeps running statistics: torch's ``BatchNorm*``,
    ``SyncBatchNorm``, ``InstanceNorm*`` (``track_running_stats``, a ``running_mean``)."""
    return hasattr(m, "track_running_stats") and m._buffers.get("running_mean") is not None


def _record_shared_statistics(stages: list[nn.Sequential]) -> None:
    """Record on **every** stage the norm modules with running statistics that several
    stages use: ``stage.partition_shared_stats``, ``((stages, module), ...)`` (the module
    object itself, not registered as a submodule). Every rank's runner then sees the same
    facts, also a rank holding none of those stages, and refuses alike
    (``PipelineRunner.step``: each rank's copy of the module would get only its own
    stages' updates of the statistics)."""
    users: dict[int, tuple[nn.Module, list[int]]] = {}
    for s, stage in enumerate(stages):
        for m in stage.modules():  # (each module once per stage)
            if has_running_stats(m):
                users.setdefault(id(m), (m, []))[1].append(s)
    shared = tuple((tuple(s), m) for m, s in users.values() if len(s) > 1)
    for stage in stages:
        stage.__dict__["partition_shared_stats"] = shared


def _warn_shared_across_stages(stages: list[nn.Sequential]) -> None:
    """Warn of a parameter used in more than one stage — a module with parameters used
    twice, or a parameter tied between two modules (an input embedding reused as the
    output projection): on different ranks each holds a part of its gradient (the serial
    one is their sum), which the runner sums (:func:`_record_ties`) and a loop of one's
    own must."""
    seen: dict[int, tuple[int, nn.Module, str]] = {}  # id(parameter) -> first stage, module, name
    for s, stage in enumerate(stages):
        for m in stage:
            for name, q in m.named_parameters():
                first = seen.setdefault(id(q), (s, m, name))
                if first[0] == s:
                    continue
                what = (
                    f"{type(m).__name__} with parameters is used"
                    if first[1] is m
                    else f"a parameter is tied between {type(first[1]).__name__} (.{first[2]}, "
                    f"stage {first[0]}) and {type(m).__name__} (.{name}, stage {s}): it is used"
                )
                warnings.warn(
                    f"partition(): {what} in stages {first[0]} and {s}; where those stages run on "
                    "different ranks, each holds a part of its gradient: PipelineRunner.step sums "
                    "it over those ranks (each copy then holds the serial gradient) and "
                    "parallel.grad_norm/clip_grad_norm_(..., pipeline_group=) count it once, so do "
                    "not all-reduce it again (it would count twice); a training loop without "
                    "PipelineRunner must sum it itself",
                    UserWarning,
                    stacklevel=3,
                )
                return


def _balanced_sizes(costs: list[int], k: int) -> list[int]:
    """Contiguous split of ``costs`` into ``k`` non-empty parts minimising the largest sum
    (ties broken towards equal layer counts), by dynamic programming."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (max part cost, max part length) splitting the first i layers into j parts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, 0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for t in range(j - 1, i):
                prev = best[j - 1][t]
                cand = (max(prev[0], prefix[i] - prefix[t]), max(prev[1], i - t))
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, t
    sizes, i = [], n
    for j in range(k, 0, -1):
        t = cut[j][i]
        sizes.append(i - t)
        i = t
    return sizes[::-1]
