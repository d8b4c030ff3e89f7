"""Context parallelism inside pipeline stages.

World 4 as a 2 x 2 mesh: pipeline groups {0, 2} and {1, 3} (stage = rank // 2), context
groups {0, 1} and {2, 3} (the two sequence shards of one stage). Stage 0 (a Linear) gets
the batch sharded along the sequence with ``parallel.shard(..., layout="zigzag")``; stage
1 projects q, k, v from the received activation and runs causal ring attention. The
reference is the serial float64 model on the whole sequence, the loss a sum over tokens
(so the context ranks' losses add up to it, diffcomm's sum convention), averaged over
micro-batches as the runner does.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import diffcomm as dc
from diffcomm import parallel
from diffcomm.pipeline import PipelineRunner

F64 = torch.float64
D, NH, S, B = 4, 2, 8, 2


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    r = dist.get_rank()
    groups = {k: dist.new_group(list(k)) for k in [(0, 2), (1, 3), (0, 1), (2, 3)]}
    return groups[(0, 2) if r % 2 == 0 else (1, 3)], groups[(0, 1) if r < 2 else (2, 3)]


class _Attention(nn.Module):
    """q, k, v projected from ``x`` ``(B, S_local, D)``; causal ring attention over ``cp``."""

    def __init__(self, cp: dist.ProcessGroup | None, layout: str | None) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, dtype=F64)
        self.cp, self.layout = cp, layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, NH, D // NH).permute(2, 0, 3, 1, 4)
        if self.cp is None:  # the serial reference: the whole sequence
            o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = parallel.ring_attention(q, k, v, self.cp, causal=True, layout=self.layout)
        return o.transpose(1, 2).reshape(b, s, D)


def _zigzag_stage1_matches_serial(n_micro: int) -> float:
    pp, cp = _groups()
    torch.manual_seed(0)
    lin, attn = nn.Linear(D, D, dtype=F64), _Attention(cp, "zigzag")
    ref_lin, ref_attn = copy.deepcopy(lin), copy.deepcopy(attn, {id(cp): cp})
    ref_attn.cp = None
    x = torch.randn(B, S, D, dtype=F64, generator=torch.Generator().manual_seed(1))
    stage = lin if dist.get_rank() < 2 else attn
    # (the batch is sharded where it is used: on stage 0's ranks only)
    inputs = parallel.shard(x, dim=1, group=cp, layout="zigzag") if dist.get_rank() < 2 else None
    runner = PipelineRunner(stage, "1f1b", group=pp, loss_fn=lambda o: o.pow(2).sum())
    loss = runner.step(inputs, None, n_micro=n_micro)
    assert loss is not None
    ref = sum(ref_attn(ref_lin(xm)).pow(2).sum() for xm in x.chunk(n_micro)) / n_micro
    ref.backward()
    torch.testing.assert_close(dc.all_reduce(loss, "sum", cp), ref.detach(), rtol=1e-12, atol=1e-12)
    worst = 0.0
    for p, q in zip(stage.parameters(), (ref_lin if dist.get_rank() < 2 else ref_attn).parameters()):
        assert p.grad is not None and q.grad is not None
        worst = max(worst, float((dc.all_reduce(p.grad, "sum", cp) - q.grad).abs().max()))
    return worst


@pytest.mark.parametrize("n_micro", [1, 2])
def test_ring_attention_in_a_later_stage_matches_serial(world4: dc.LocalWorld, n_micro: int) -> None:
    assert max(world4.run(_zigzag_stage1_matches_serial, n_micro)) < 1e-12


def _later_stage_refuses_the_guess(record: str) -> str:
    pp, cp = _groups()
    torch.manual_seed(0)
    stage = nn.Linear(D, D, dtype=F64)
    first = dist.get_rank() < 2
    inputs = None
    if first:  # the batch sharded on stage 0's ranks only
        s = S if record == "zigzag" else S - 1  # (7 positions: padded to 4 per rank)
        x = torch.randn(B, s, D, dtype=F64, generator=torch.Generator().manual_seed(1))
        inputs = parallel.shard(x, dim=1, group=cp, layout="zigzag" if record == "zigzag" else None)
    runner = PipelineRunner(stage, "1f1b", group=pp, loss_fn=lambda o: o.pow(2).sum())
    runner.step(inputs, None, n_micro=1)
    if first:
        return ""
    # what stage 1's attention is given: q, k, v projected (no placement), no layout= /
    # seq_len=: the default contiguous order and the length 2 x 4 would be guesses
    q = torch.randn(B, NH, S // 2, D // NH, dtype=F64)
    try:
        parallel.ring_attention(q, q, q, cp, causal=True)
    except ValueError as e:
        return str(e)
    return "ran"


@pytest.mark.parametrize("record", ["zigzag", "padded"])
def test_a_later_stage_knows_what_stage_0_sharded_with(world4: dc.LocalWorld, record: str) -> None:
    # The batch sharded zigzag on stage 0's ranks only: stage 1's ranks (other processes)
    # had no record of it, and their attention on the received activation ran it as
    # contiguous (loss 9.160 against the serial 8.763, gradients 4.7 off; no error). The
    # runner's first step shares the pipeline ranks' records: the guess is refused.
    out = world4.run(_later_stage_refuses_the_guess, record)
    match = (
        r"`layout` must be named.*layout='zigzag' by a stage on rank 0 of the pipeline's group"
        if record == "zigzag"
        else r"`seq_len`.*padded a sequence of length 7 to 4 positions per rank over 2 ranks"
    )
    for msg in out[2:]:
        assert msg != "ran"
        assert re.search(match, msg), msg
