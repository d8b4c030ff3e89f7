"""Context-parallel records shared along a pipeline.

An op of :mod:`diffcomm.parallel.context` given tensors that carry no placement (q, k, v
projected from a received activation) and no ``layout=`` uses the default layout only
while this program has used no other over as many ranks, and infers the sequence length
only while this program padded no sequence to that many positions per rank; otherwise it
refuses to guess (``layout.note_layout`` / ``note_padding`` keep those records). In a
pipeline the records are each process's own: the stage that sharded the batch with
``parallel.shard(x, layout="zigzag")`` recorded it, the later stages, on other ranks,
did not, and their attention ran the zigzag-ordered activation as contiguous, silently
(loss 9.160 against the serial 8.763 in the probe of
``tests/pipeline/test_pipeline_context.py``). So the records travel with the data: the
runner sends :func:`records` to each rank it sends activations to, once, before its first
activation there, and the receiver notes them (:func:`note_records`) before its chunk
runs on its first activation from that rank (then forwards them with its own).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..parallel.context import layout as L

__all__: list[str] = []

_LAYOUT, _PADDING = 0, 1


def records() -> Tensor:
    """This program's context-parallel records as ``(n, 5)`` int64 rows: the layouts other
    than the default it used over ``W`` ranks, and the sequences ``shard`` padded."""
    rows = [[_LAYOUT, world, L.LAYOUTS.index(lay), 0, 0] for world, lay in L._IN_USE]
    rows += [
        [_PADDING, world, -1 if uworld is None else uworld, local, seq_len]
        for world, uworld, local, seq_len in L._PADDED
    ]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)


def note_records(rows: Tensor, src: int) -> None:
    """Note the records of :func:`records` received from pipeline rank ``src``: an
    attention op given unplaced tensors here then refuses the guesses it refuses there
    (the records only ever make ops raise; no value changes)."""
    how = f"a stage on rank {src} of the pipeline's group or before it (sent by PipelineRunner)"
    for kind, world, a, local, seq_len in rows.tolist():
        if kind == _LAYOUT:
            L.note_layout(L.LAYOUTS[a], world, how)
        else:
            L.note_padding(world, None if a < 0 else a, local, seq_len, how)
