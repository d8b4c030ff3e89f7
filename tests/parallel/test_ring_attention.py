"""The ring attention example equals full attention, forward and backward (float64)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import diffcomm as dc

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")

# numerics only (values and gradients against full attention): no real transport needed,
# so the shared worlds are in-process (docs/in_process.md)
pytestmark = pytest.mark.diffcomm_in_process


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_attention_equals_full_attention(
    local_worlds: Callable[[int], dc.LocalWorld], n: int, causal: bool
) -> None:
    def ring_vs_full(causal: bool, seq_local: int) -> None:
        if EXAMPLES not in sys.path:
            sys.path.insert(0, EXAMPLES)
        from ring_attention import ring_attention

        n, r = dc.get_world_size(), dc.get_rank()
        g = torch.Generator().manual_seed(42)
        shape = (2, 3, seq_local * n, 4)
        q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        w = torch.randn(shape, generator=g, dtype=torch.float64)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        (ref * w).sum().backward()

        blk = slice(seq_local * r, seq_local * (r + 1))
        ql, kl, vl = (t.detach()[:, :, blk].clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=causal)
        torch.testing.assert_close(out, ref.detach()[:, :, blk], rtol=1e-12, atol=1e-12)
        # the objective is the sum over ranks of <out_r, w_r> = <ref, w>
        (out * w[:, :, blk]).sum().backward()
        for mine, full in ((ql, q), (kl, k), (vl, v)):
            torch.testing.assert_close(mine.grad, full.grad[:, :, blk], rtol=1e-11, atol=1e-12)

    local_worlds(n).run(ring_vs_full, causal, 3)
