"""The expert-parallel overlap hook: a stage's forward split around its MoE all_to_alls.

A chunk with a ``forward_phases(x)`` generator method (``yield`` where a communication
is in flight, ``return`` the output) is run by :class:`~diffcomm.pipeline.PipelineRunner`
in phases when its forward is the ``F`` of an :class:`~diffcomm.pipeline.Overlap` step:
the first phase (up to the first ``yield``), then a piece of the step's backward
(another micro-batch's: its ``I``, then at the next ``yield`` its ``W``), then the rest.
:class:`MoEStage` is such a chunk: ``pre``, an
:class:`~diffcomm.parallel.ExpertParallelMoE`, ``post``; its first phase routes and posts
the dispatch all_to_all (``async_op``), its second the combine's, so one micro-batch's
dispatch travels while another micro-batch's input gradient computes and its combine
while that micro-batch's weight gradients compute (the pattern torchtitan and Megatron
use for MoE pipelines). Outside an ``Overlap`` (or with ``forward``) it runs in one go.
:func:`one_f_one_b_overlap_schedule` is 1F1B with every steady-state ``F, B`` pair fused
into an ``Overlap``.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import Tensor, nn

from ..backend import args as A
from ..parallel import ExpertParallelMoE
from ..parallel.routing import combine, dispatch, load_balancing_loss, route
from .schedules import Overlap, Step, one_f_one_b_schedule

__all__ = ["MoEStage", "one_f_one_b_overlap_schedule"]


class MoEStage(nn.Module):
    """A pipeline chunk ``post(moe(pre(x)))`` whose forward splits at the MoE dispatch.

    Args:
        pre: the modules before the MoE layer (``nn.Identity()`` for none).
        moe: an :class:`~diffcomm.parallel.ExpertParallelMoE` (its expert-parallel group
            is other ranks than the pipeline's: e.g. the same stage of another
            data shard); its shared expert, if any, runs in the first phase.
        post: the modules after it.

    Shapes:
        ``x``: ``(..., H)`` tokens; output ``post``'s.

    Gradient:
        that of ``post(moe(pre(x)))`` (the MoE's under diffcomm's sum convention: the
        router's gradient is this rank's share, see
        :meth:`~diffcomm.parallel.ExpertParallelMoE.sync_replicated_grads`).
    """

    def __init__(self, pre: nn.Module, moe: ExpertParallelMoE, post: nn.Module) -> None:
        super().__init__()
        if not isinstance(moe, ExpertParallelMoE):
            raise A.arg_error("MoEStage", "moe", "an ExpertParallelMoE", type(moe).__name__, TypeError)
        self.pre, self.moe, self.post = pre, moe, post

    def forward(self, x: Tensor) -> Tensor:
        return self.post(self.moe(self.pre(x)))

    def forward_phases(self, x: Tensor) -> Generator[None, None, Tensor]:
        """The forward in three phases: ``pre``, routing and the posted dispatch
        all_to_all (then ``yield``: the all_to_all is in flight); the wait, the experts
        and the posted combine all_to_all (``yield`` again); the shared expert's sum and
        ``post``. In an :class:`~diffcomm.pipeline.Overlap` the runner runs the other
        micro-batch's ``I`` at the first ``yield`` and its ``W`` at the second."""
        moe = self.moe
        h0 = self.pre(x)
        x2 = h0.reshape(-1, moe.hidden_size)
        gate, index, probs = route(moe.router(x2), moe.k, renormalize=moe.renormalize)
        h, plan = dispatch(
            x2, index, moe.num_experts, moe._pg, capacity_factor=moe.capacity_factor, async_op=True
        )
        shared = moe.shared_expert(x2) if moe.shared_expert is not None else None
        yield  # the dispatch travels while the runner computes another micro-batch's step
        h = h.wait()  # type: ignore[attr-defined]
        outs = [expert(part) for expert, part in zip(moe.experts, h.split(list(plan.expert_splits)))]
        y = combine(torch.cat(outs) if outs else h, gate, plan, async_op=True)
        moe.aux_loss = load_balancing_loss(probs, plan)  # (local: no communication)
        yield  # the combine travels while the runner computes another micro-batch's W
        y = y.wait()  # type: ignore[attr-defined]
        if shared is not None:
            y = y + shared
        moe.tokens_per_expert, moe.dropped, moe.plan = plan.tokens_per_expert, plan.dropped, plan
        return self.post(y.reshape(h0.shape[:-1] + (y.shape[-1],)))


def one_f_one_b_overlap_schedule(n_stages: int, n_micro: int) -> list[list[Step | Overlap]]:
    """1F1B with each steady-state ``F`` and the ``B`` after it (of another micro-batch)
    fused into an :class:`Overlap` on every rank but the last, so a :class:`MoEStage`'s
    dispatch of the forward's micro-batch runs under the backward's compute. The order
    and the activation bound are 1F1B's. The last rank stays plain: its 1F1B pairs each
    ``F`` with its own ``B``, and fusing ``F{i+1}`` with ``B{i}`` there would make the
    previous rank's overlapped step wait for an activation it sends only at its end.

    Example::

        >>> one_f_one_b_overlap_schedule(2, 3)
        [[F0, (F1;B0), (F2;B1), B2], [F0, B0, F1, B1, F2, B2]]
    """
    out: list[list[Step | Overlap]] = []
    for steps in one_f_one_b_schedule(n_stages, n_micro):
        fused: list[Step | Overlap] = []
        i = 0
        while i < len(steps):
            st = steps[i]
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            if st.kind == "F" and nxt is not None and nxt.kind == "B" and nxt.micro != st.micro:
                fused.append(Overlap(st, nxt))
                i += 2
            else:
                fused.append(st)
                i += 1
        out.append(fused)
    return out
