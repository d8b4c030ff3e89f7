"""Ring attention on 16-bit inputs is as accurate as one device's attention.

The reference is attention in float32 on the same bfloat16 / float16 inputs, and the bar
is torch's own ``scaled_dot_product_attention`` run on one device in the input dtype: the
ring merges ``W`` blocks with the online softmax and sums dQ/dK/dV over them (dK/dV carried
around the ring), which must happen in float32 as in a flash kernel. Accumulated in
bfloat16 (before) the output was 16x and dQ 57x SDPA's own error at world 3.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import diffcomm as dc

# Correctness on in-process ranks (the same values as gloo processes: tests/runtime/test_in_process.py).
pytestmark = pytest.mark.diffcomm_in_process


def _errors(dtype: torch.dtype, layout: str) -> list[tuple[str, float, float]]:
    """(name, ring's error, one-device SDPA's error) for the output and each gradient of
    this rank's positions, against float32 attention on the same 16-bit inputs."""
    from diffcomm import parallel

    r, W = dc.get_rank(), dc.get_world_size()
    g = torch.Generator().manual_seed(1)
    S, H = 96, 4
    q = torch.randn(1, H, S, 16, generator=g).to(dtype)
    k = (torch.randn(1, 2, S, 16, generator=g) * 3).to(dtype)  # GQA 2:1, peaked rows
    v = torch.randn(1, 2, S, 16, generator=g).to(dtype)
    w = torch.randn(1, H, S, 16, generator=g)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    full32 = [t.float().requires_grad_() for t in (q, k, v)]
    ref = sdpa(*full32)
    ref_grads = torch.autograd.grad((ref * w).sum(), full32)
    full16 = [t.clone().requires_grad_() for t in (q, k, v)]
    one = sdpa(*full16)
    one_grads = torch.autograd.grad((one.float() * w).sum(), full16)

    idx = parallel.layout_index(S, W, layout=layout)[r]
    assert bool((idx >= 0).all())  # (no padding at S = 96)
    local = [t.index_select(2, idx).requires_grad_() for t in (q, k, v)]
    out = parallel.ring_attention(*local, causal=True, layout=layout, seq_len=S)
    assert out.dtype == dtype
    grads = torch.autograd.grad((out.float() * w.index_select(2, idx)).sum(), local)
    rows = []
    for name, mine, one_dev, exact in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (one, *one_grads), (ref, *ref_grads), strict=True
    ):
        assert mine.dtype == dtype
        exact = exact.detach().index_select(2, idx)
        rows.append(
            (
                name,
                float((mine.float() - exact).abs().max()),
                float((one_dev.detach().float().index_select(2, idx) - exact).abs().max()),
            )
        )
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_in_16_bit_is_as_accurate_as_sdpa(
    local_worlds: Callable[[int], dc.LocalWorld], dtype: torch.dtype, layout: str
) -> None:
    for rank, rows in enumerate(local_worlds(3).run(_errors, dtype, layout)):
        for name, ring, sdpa in rows:
            # the ring rounds each block's output to the input dtype once more than SDPA
            assert ring <= 3 * sdpa, (rank, name, ring, sdpa)
