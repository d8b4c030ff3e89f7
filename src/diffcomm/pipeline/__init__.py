"""Pipeline parallelism on diffcomm's differentiable send/recv.

A model (an ``nn.Sequential`` or a list of modules) is cut into contiguous stages with
:func:`partition`; rank ``s`` of the group runs stage ``s`` (or, with ``v`` virtual
stages per rank, the chunks ``s, s + p, ...``) under a :class:`PipelineRunner`. A step
splits the batch into micro-batches and runs a **schedule**: per rank, a list of
:class:`Step` s — ``F`` (forward of one micro-batch on one chunk), ``B`` (its backward), or
``I`` + ``W`` (the backward split into input and weight gradients). Schedules are plain
data (:func:`gpipe_schedule`, :func:`one_f_one_b_schedule`,
:func:`interleaved_1f1b_schedule`, :func:`zb_h1_schedule`), so they can be printed,
checked and swapped; :func:`check_schedule` (run before every step) proves that every
send has its receive and that no ranks wait for each other in a cycle.

Modules: ``schedules`` (the generators, :class:`Step`), ``validate``
(:func:`check_schedule`, :class:`ScheduleError`), ``partition``, ``runner``
(:class:`PipelineRunner`), ``timeline`` (timelines and bubbles), ``tables``
(torch.distributed.pipelining's schedule tables, CSV), ``overlap`` (the expert-parallel
overlap hook: :class:`MoEStage`, :func:`one_f_one_b_overlap_schedule`), ``aux``
(:func:`add_aux_loss`: an auxiliary loss of an earlier stage). Every public
name is importable from here.
"""

from __future__ import annotations

from . import aux, overlap, runner, schedules, tables, timeline, validate
from . import partition as _partition
from .aux import *  # noqa: F403 - the public names are each submodule's __all__
from .overlap import *  # noqa: F403
from .partition import *  # noqa: F403
from .runner import *  # noqa: F403
from .schedules import *  # noqa: F403
from .tables import *  # noqa: F403
from .timeline import *  # noqa: F403
from .validate import *  # noqa: F403

__all__ = [
    *schedules.__all__,
    *validate.__all__,
    *_partition.__all__,
    *runner.__all__,
    *timeline.__all__,
    *tables.__all__,
    *overlap.__all__,
    *aux.__all__,
]
