"""Tensor- and sequence-parallel building blocks (Megatron-style, replicated objective).

* :mod:`~diffcomm.parallel.mappings` — the region mappings (``copy_to_region`` /
  ``reduce_from_region``, ``scatter_to_region`` / ``gather_from_region``,
  ``reduce_scatter_to_sequence`` / ``all_gather_from_sequence``, ``all_to_all_region``),
  each checking the assumption it rests on in debug mode;
* :mod:`~diffcomm.parallel.layers` — ``ParallelModule``, ``ColumnParallelLinear``,
  ``RowParallelLinear``, ``VocabParallelEmbedding``, ``SequenceParallelLayerNorm``,
  initialised and loadable as shards of the serial modules;
* :mod:`~diffcomm.parallel.blocks` — the ready-made blocks ``ParallelMLP`` and
  ``ParallelSelfAttention`` and their serial references ``MLP`` / ``SelfAttention``;
* :mod:`~diffcomm.parallel.loss` — ``vocab_parallel_cross_entropy``;
* :mod:`~diffcomm.parallel.context` — context parallelism: ``ring_attention``,
  ``ulysses_attention``, ``usp_attention`` and the layout helpers ``shard`` / ``unshard``.
* :mod:`~diffcomm.parallel.routing` — expert-parallel token routing: ``route``,
  ``dispatch`` / ``combine``, ``load_balancing_loss``;
* :mod:`~diffcomm.parallel.moe` — ``ExpertParallelMoE`` and its serial reference ``MoE``.

See ``docs/parallel.md``.
"""

from __future__ import annotations

from . import blocks, context, layers, loss, mappings, moe, routing
from .blocks import *  # noqa: F403 - the public names are each submodule's __all__
from .context import *  # noqa: F403
from .layers import *  # noqa: F403
from .loss import *  # noqa: F403
from .mappings import *  # noqa: F403
from .moe import *  # noqa: F403
from .routing import *  # noqa: F403

__all__ = [
    *mappings.__all__,
    *layers.__all__,
    *blocks.__all__,
    *loss.__all__,
    *context.__all__,
    *routing.__all__,
    *moe.__all__,
]
