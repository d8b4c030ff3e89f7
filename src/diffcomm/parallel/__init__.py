"""Tensor- and sequence-parallel building blocks (Megatron-style, replicated objective).

* :mod:`~diffcomm.parallel.mappings` — the region mappings (``copy_to_region`` /
  ``reduce_from_region``, ``scatter_to_region`` / ``gather_from_region``,
  ``reduce_scatter_to_sequence`` / ``all_gather_from_sequence``, ``all_to_all_region``),
  each checking the assumption it rests on in debug mode;
* :mod:`~diffcomm.parallel.layers` — ``ColumnParallelLinear``, ``RowParallelLinear``,
  ``VocabParallelEmbedding``, ``SequenceParallelLayerNorm``, ``ParallelMLP``,
  ``ParallelSelfAttention`` and their serial
  references ``MLP`` / ``SelfAttention``, initialised and loadable as shards of the
  serial modules;
* :mod:`~diffcomm.parallel.loss` — ``vocab_parallel_cross_entropy``.

See ``docs/parallel.md``.
"""

from __future__ import annotations

from .layers import (
    MLP,
    ColumnParallelLinear,
    ParallelMLP,
    ParallelModule,
    ParallelSelfAttention,
    RowParallelLinear,
    SelfAttention,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
)
from .loss import vocab_parallel_cross_entropy
from .mappings import (
    MAPPINGS,
    all_gather_from_sequence,
    all_to_all_region,
    copy_to_region,
    copy_to_region_coalesced,
    gather_from_region,
    reduce_from_region,
    reduce_from_region_coalesced,
    reduce_scatter_to_sequence,
    scatter_to_region,
)

__all__ = [
    "MAPPINGS",
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "reduce_scatter_to_sequence",
    "all_gather_from_sequence",
    "all_to_all_region",
    "copy_to_region_coalesced",
    "reduce_from_region_coalesced",
    "ParallelModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "SequenceParallelLayerNorm",
    "ParallelMLP",
    "ParallelSelfAttention",
    "MLP",
    "SelfAttention",
    "vocab_parallel_cross_entropy",
]
