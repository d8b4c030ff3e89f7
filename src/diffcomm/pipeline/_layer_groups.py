"""diffcomm's parallel layers inside pipeline stages: their group must not span stages.

A layer of :mod:`diffcomm.parallel` (an :class:`~diffcomm.parallel.ExpertParallelMoE`, a
tensor-parallel :class:`~diffcomm.parallel.ParallelModule`) communicates over its group
inside the stage's forward or backward, and its ranks hold parts of *one* layer. A group
holding two ranks of the pipeline (the pipeline's own group: an ``ExpertParallelMoE``
built with ``group=None`` on a pipeline over the world) puts two different stages in it:
the first rank to reach the layer's collective waits there for a rank that waits, before
its own forward, for this rank's activation — the step hung until the collective timeout
(the MoE's counts exchange against the next stage's receive, 30 s by default), and had it
run, it would have mixed two stages' experts. The runner refuses it at construction,
before any communication, on every rank whose stage holds such a layer. The layer's group
must be orthogonal to the pipeline's (one rank of each pipeline: a ``DeviceMesh`` axis
other than the pipeline's), as in ``tests/pipeline/test_pipeline_moe_overlap.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from ..backend import args as A
from ..parallel import ExpertParallelMoE, ParallelModule


def check_layer_groups(chunks: Sequence[nn.Module], pg: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` when a parallel layer in ``chunks`` has a group holding two
    ranks of the pipeline group ``pg`` (no communication: each rank reads the groups'
    ranks)."""
    stages = dist.get_process_group_ranks(pg)  # (None: the default group)
    where = {r: i for i, r in enumerate(stages)}
    for c, chunk in enumerate(chunks):
        for name, m in chunk.named_modules():
            if not isinstance(m, (ParallelModule, ExpertParallelMoE)):
                continue
            ranks = dist.get_process_group_ranks(m._pg)
            both = [where[r] for r in ranks if r in where]
            if len(both) < 2:
                continue
            layer = f"`{name}` ({type(m).__name__})" if name else type(m).__name__
            raise A.arg_error(
                "PipelineRunner",
                "stage",
                "stages whose parallel layers (ExpertParallelMoE, tensor-parallel layers) "
                "communicate over a group holding at most one rank of the pipeline, orthogonal "
                "to it (e.g. ExpertParallelMoE(..., group=mesh.get_group('ep')) on a mesh whose "
                "other axis is the pipeline's)",
                f"chunk {c}'s {layer} over the global ranks {list(ranks)}, which hold the "
                f"pipeline's stages {both}: its collective would wait for a rank running "
                "another stage (a hang until the collective timeout)",
            )
