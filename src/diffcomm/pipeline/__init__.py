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
(:class:`PipelineRunner`, timelines). Every public name is importable from here.
"""

from __future__ import annotations

from .partition import partition
from .runner import PipelineRunner, TimelineEntry, bubble_fraction
from .schedules import (
    SCHEDULES,
    Step,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    max_in_flight,
    one_f_one_b_schedule,
    theoretical_bubble,
    zb_h1_schedule,
)
from .validate import ScheduleError, check_schedule

__all__ = [
    "Step",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_1f1b_schedule",
    "zb_h1_schedule",
    "SCHEDULES",
    "check_schedule",
    "ScheduleError",
    "max_in_flight",
    "partition",
    "PipelineRunner",
    "TimelineEntry",
    "bubble_fraction",
    "theoretical_bubble",
]
