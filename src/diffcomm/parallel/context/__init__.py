"""Context parallelism: attention over a sequence split across the ranks of a group.

Three ops, tensors in the ``scaled_dot_product_attention`` layout
``(batch, heads, seq_local, head_dim)``:

* :func:`ring_attention` — K/V blocks travel around the ring of the group; each rank
  folds every block into its queries' output with the online-softmax (log-sum-exp)
  merge. The next block's transfer runs on the communication engine while the current
  block is computed. Backward is a ring of its own: K/V travel again with their
  gradient accumulators, each rank recomputes its blocks from the saved log-sum-exp.
  Memory per rank is O(S/W): a few K/V blocks (the current one, the next in flight, in
  backward their gradient accumulators) and one query tile's scores. Full and causal
  pieces of a block run on torch's fused CPU attention kernel; masks, dropout and
  irregular patterns on dense math.
* :func:`ulysses_attention` — all_to_alls turn the sequence-sharded q, k, v into
  head-sharded ones over the whole sequence, any local attention runs, and one
  all_to_all turns the result back. Any number of heads and KV heads, any lengths.
* :func:`usp_attention` — both on a 2-D layout: Ulysses inside one group, the ring
  across another.

**Layouts.** Which global positions a rank holds is a *layout* (:func:`layout_index`):
``"contiguous"`` (rank ``r`` holds block ``r``) or ``"zigzag"`` (head-tail: the sequence
— or, with ``cu_seqlens``, every packed document on its own — is cut into ``2W`` chunks
and rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, which balances causal work).
Lengths that do not divide are padded, per layout, with positions that attend to nothing
and are attended by nothing (their output is zero, their gradient zero).
:func:`shard` / :func:`unshard` move inputs, position ids and outputs in and out of a
layout. ``docs/context_parallel.md`` draws them. Every entry point defaults to
``"contiguous"`` (:data:`DEFAULT_LAYOUT`); :func:`shard` and the attention ops attach a
:class:`Placement` to what they return, which the ops use when given no layout and which
makes a sequence placed one way and used another a ``ValueError``. Tensors that lost
their placement get the default, unless the program used another layout over as many
ranks: then the default would be a guess, and the ops ask for ``layout=`` instead.

**Gradient convention.** ``ring_attention`` and friends are ordinary SPMD functions
under the sum-of-per-rank-objectives convention of the core collectives: with
``loss = sum_r loss_r(out_r)``, ``q_r``'s gradient is the full-attention gradient of the
rows this rank holds, and so for ``k``/``v``. ``shard`` is a local selection (its
gradient scatters into zeros, no communication); ``unshard`` is an ``all_gather``
followed by a permutation (gradient: the permutation back, then ``reduce_scatter``).

**Why not a CommOp.** ``ring_attention`` fuses attention math with its communication
(it is not linear in any input), so it is a ``torch.autograd.Function`` with a
hand-written backward — a ring of the same shape as the forward — as in
:mod:`diffcomm.parallel.overlap`. That backward is first-order: differentiating it again
raises, whatever the loss (``diffcomm.parallel._once.first_order``);
:func:`ulysses_attention` is built from differentiable all_to_alls around a
differentiable local attention, so double backward works there.

Modules: ``layout`` (layouts, placements, shard/unshard), ``plan`` (the ring's block
plan), ``ring`` (the ring Function), ``ulysses`` (Ulysses, USP), ``reference`` (the
serial reference, the dropout mask), ``args`` (the checks they share).
"""

from __future__ import annotations

from .layout import DEFAULT_LAYOUT, LAYOUTS, Placement, layout_index, placement_of, shard, unshard
from .plan import ring_attention_work
from .reference import attention_reference, dropout_keep_mask
from .ring import ring_attention
from .ulysses import ulysses_attention, usp_attention

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "usp_attention",
    "shard",
    "unshard",
    "layout_index",
    "ring_attention_work",
    "attention_reference",
    "dropout_keep_mask",
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "Placement",
    "placement_of",
]
