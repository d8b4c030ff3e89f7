"""A Llama-style decoder block made tensor parallel (Megatron layout).

The serial block is ``examples/context_parallel_llama.py``'s (RMSNorm, RoPE, grouped-query
attention, SwiGLU). Here the q/k/v, gate and up projections become
``ColumnParallelLinear`` (each rank its heads / hidden units), the o and down projections
``RowParallelLinear`` (their outputs reduced by ``reduce_from_region``); the norms stay
replicated. Used by ``tests/spmd/test_spmd.py`` (no false positive under ``dc.spmd_check``) and
``benchmarks/bench_spmd.py`` (the check's cost).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import diffcomm as dc
from diffcomm import parallel as par

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_parallel_llama import Block


def _rows(lin: nn.Linear, i: int, parts: int) -> nn.Linear:
    """Rows ``i`` of ``parts`` of ``lin`` as a Linear of its own (k or v of the fused wkv)."""
    out = lin.out_features // parts
    new = nn.Linear(lin.in_features, out, bias=False, dtype=lin.weight.dtype)
    new.weight.data.copy_(lin.weight.data[i * out : (i + 1) * out])
    return new


class TPBlock(nn.Module):
    """``serial`` (a :class:`Block`) split over the default group; heads and kv heads
    must divide by the group size."""

    def __init__(self, serial: Block) -> None:
        super().__init__()
        n = dc.get_world_size()
        s = serial
        self.heads, self.kv_heads, self.hd = s.heads // n, s.kv_heads // n, s.hd
        self.norm1, self.norm2 = s.norm1, s.norm2
        self.wq = par.ColumnParallelLinear.from_serial(s.wq)
        self.wk = par.ColumnParallelLinear.from_serial(_rows(s.wkv, 0, 2))
        self.wv = par.ColumnParallelLinear.from_serial(_rows(s.wkv, 1, 2))
        self.wo = par.RowParallelLinear.from_serial(s.wo, input_is_parallel=True)
        self.w1 = par.ColumnParallelLinear.from_serial(s.w1)
        self.w3 = par.ColumnParallelLinear.from_serial(s.w3)
        self.w2 = par.RowParallelLinear.from_serial(s.w2, input_is_parallel=True)

    def rope(self, x: Tensor, pos: Tensor) -> Tensor:
        """The serial block's rotary embedding (it reads only ``hd``). Not ``s.rope``: a
        bound method would keep the whole serial block, every full weight, alive on each rank."""
        return Block.rope(self, x, pos)  # type: ignore[arg-type]

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        B, S, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(B, S, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(h).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, S, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def make(
    dim: int = 32, heads: int = 4, kv_heads: int = 2, hidden: int = 64, dtype: torch.dtype = torch.float64
) -> TPBlock:
    """The TP block of a serial block seeded alike on every rank."""
    torch.manual_seed(0)
    return TPBlock(Block(dim, heads, kv_heads, hidden).to(dtype))
