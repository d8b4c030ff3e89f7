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
* :mod:`~diffcomm.parallel.moe` — ``ExpertParallelMoE`` and its serial reference ``MoE``;
* :mod:`~diffcomm.parallel.grads` — before the optimizer step: ``grad_norm`` and
  ``clip_grad_norm_`` (the serial model's gradient norm, and clipping by it, on every
  rank), ``sync_found_inf`` (a ``GradScaler``'s skip decision, the same on every rank).
* :mod:`~diffcomm.parallel.checkpoint` — ``dcp_state_dict`` and ``dcp_optimizer_state``:
  the model and optimizer state to give ``torch.distributed.checkpoint`` (the serial
  names, every shard a ``DTensor``).

Each public name is listed below, one `name as name` import each. See ``docs/parallel.md``.
"""

from __future__ import annotations

from . import blocks, checkpoint, context, grads, layers, loss, mappings, moe, routing
from . import precision as _precision  # noqa: F401  (registers the mappings' precision= forms)
from .blocks import MLP as MLP
from .blocks import ParallelMLP as ParallelMLP
from .blocks import ParallelSelfAttention as ParallelSelfAttention
from .blocks import SelfAttention as SelfAttention
from .checkpoint import dcp_optimizer_state as dcp_optimizer_state
from .checkpoint import dcp_state_dict as dcp_state_dict
from .context import DEFAULT_LAYOUT as DEFAULT_LAYOUT
from .context import LAYOUTS as LAYOUTS
from .context import Placement as Placement
from .context import attention_reference as attention_reference
from .context import dropout_keep_mask as dropout_keep_mask
from .context import layout_index as layout_index
from .context import placement_of as placement_of
from .context import ring_attention as ring_attention
from .context import ring_attention_work as ring_attention_work
from .context import shard as shard
from .context import ulysses_attention as ulysses_attention
from .context import unshard as unshard
from .context import usp_attention as usp_attention
from .grads import clip_grad_norm_ as clip_grad_norm_
from .grads import grad_norm as grad_norm
from .grads import sync_found_inf as sync_found_inf
from .layers import ColumnParallelLinear as ColumnParallelLinear
from .layers import LayerOptions as LayerOptions
from .layers import ParallelModule as ParallelModule
from .layers import RowParallelLinear as RowParallelLinear
from .layers import SequenceParallelLayerNorm as SequenceParallelLayerNorm
from .layers import SequenceParallelRMSNorm as SequenceParallelRMSNorm
from .layers import VocabParallelEmbedding as VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .mappings import MAPPINGS as MAPPINGS
from .mappings import all_gather_from_sequence as all_gather_from_sequence
from .mappings import all_to_all_region as all_to_all_region
from .mappings import copy_to_region as copy_to_region
from .mappings import copy_to_region_coalesced as copy_to_region_coalesced
from .mappings import gather_from_region as gather_from_region
from .mappings import gather_from_sequence as gather_from_sequence
from .mappings import reduce_from_region as reduce_from_region
from .mappings import reduce_from_region_coalesced as reduce_from_region_coalesced
from .mappings import reduce_scatter_to_sequence as reduce_scatter_to_sequence
from .mappings import scatter_to_region as scatter_to_region
from .mappings import scatter_to_sequence as scatter_to_sequence
from .moe import ExpertParallelMoE as ExpertParallelMoE
from .moe import MoE as MoE
from .routing import DispatchPlan as DispatchPlan
from .routing import combine as combine
from .routing import dispatch as dispatch
from .routing import load_balancing_loss as load_balancing_loss
from .routing import route as route

#: each module's public names (its own ``__all__``), re-exported by name above
__all__ = [
    *mappings.__all__,
    *layers.__all__,
    *blocks.__all__,
    *loss.__all__,
    *context.__all__,
    *routing.__all__,
    *moe.__all__,
    *grads.__all__,
    *checkpoint.__all__,
]
