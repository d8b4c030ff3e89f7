"""The argument checks shared by the context-parallel ops (:func:`ring_attention`,
:func:`ulysses_attention`, :func:`usp_attention`, :func:`attention_reference`): public
to the sibling modules, so none reaches into another's privates."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ...backend import args as A

__all__ = ["check_qkv", "check_scale", "check_causal"]


def check_qkv(q: Any, k: Any, v: Any, op: str) -> tuple[Tensor, Tensor, Tensor]:
    """``q``, ``k``, ``v`` as 4-D floating tensors of one dtype in the SDPA layout, with
    matching batch, sequence and (k) head dims and ``kv_heads`` dividing ``heads``."""
    q = A.check_tensor(q, op, "q")
    k = A.check_tensor(k, op, "k")
    v = A.check_tensor(v, op, "v")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise A.arg_error(op, name, "4-D (batch, heads, seq_local, head_dim)", f"shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise A.arg_error(op, name, "a floating-point tensor", t.dtype, TypeError)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise A.arg_error(op, "k/v", f"of q's dtype {q.dtype}", f"{k.dtype}/{v.dtype}", TypeError)
    if (
        k.shape[:3] != v.shape[:3]
        or k.shape[0] != q.shape[0]
        or k.shape[2] != q.shape[2]
        or k.shape[3] != q.shape[3]
    ):
        raise A.arg_error(
            op,
            "k/v",
            f"(batch, kv_heads, seq_local, head_dim) matching q {tuple(q.shape)} in batch, sequence "
            "and (k) head_dim, with the same kv_heads",
            f"k {tuple(k.shape)}, v {tuple(v.shape)}",
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise A.arg_error(op, "k", f"a number of heads dividing q's {q.shape[1]} (GQA)", k.shape[1])
    return q, k, v


def check_scale(scale: Any, head_dim: int, op: str) -> float:
    """The softmax scale: ``scale`` as a float, default ``1 / sqrt(head_dim)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise A.arg_error(op, "scale", "a float or None", type(scale).__name__, TypeError)
    return float(scale)


def check_causal(causal: Any, op: str) -> bool:
    if not isinstance(causal, bool):
        raise A.arg_error(op, "causal", "a bool", type(causal).__name__, TypeError)
    return causal
