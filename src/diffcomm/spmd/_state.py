"""What the parts of ``dc.spmd_check`` share: the state one check holds (its attributes,
set by :class:`diffcomm.spmd.check.SPMDCheck`) and the methods each part calls on
another. The parts — the type lattice (:mod:`._lattice`), spmd_types' side
(:mod:`._with_spmd_types`), backward and gradients (:mod:`._gradients`) — are mixins of
this class; :class:`~diffcomm.spmd.check.SPMDCheck` joins them."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._records import _Cell, _Owner, _Param, _Rec


class _CheckState(TorchFunctionMode):
    """The state of one check and the methods its parts call on each other."""

    #: the tensor attribute (``x.__dict__[key]``) that holds this check's record
    key: str
    #: the checked process group (resolved on entry)
    pg: Any
    #: ``"loss"`` (the loss's type decides the objective) or ``"sum"`` (every objective is
    #: the sum of the per-rank objectives: the contract's sum convention)
    objective: str
    #: id(param) -> its entry (held until the block ends: the gradient check)
    _params: dict[int, _Param]
    #: leaf inputs (not parameters) that require grad: their gradient is checked when a
    #: backward of a replicated objective finishes
    _inputs: dict[int, tuple[Tensor, _Rec]]
    #: id(param) -> the layer that holds it (a name from it, its fix of a partial gradient)
    _owners: dict[int, _Owner]
    #: >0 while a typed op's forward runs (its inner ops are not typed)
    inside: int
    #: >0 while a backward runs
    in_backward: int
    #: (the default generator's state differed between the ranks when the check was
    #: entered, its initial seed then)
    _rng_entry: tuple[bool, int | None]
    #: (the user's line, the value's sum) of each loss typed replicated, in order: equal on
    #: every rank, or the data was per-rank where the check saw none (checked on leaving)
    _replicated_losses: list[tuple[str, float]]
    #: (record, the user's line) of each auxiliary loss attached with
    #: ``pipeline.add_aux_loss`` since the last backward: terms of its objective
    _aux_terms: list[tuple[_Rec, str]]

    @abstractmethod
    def rec(self, x: Tensor) -> _Rec:
        """``x``'s record; an untyped tensor is replicated (a parameter is registered)."""

    @abstractmethod
    def _world_pg(self) -> Any: ...

    @abstractmethod
    def _is_group(self, pg: Any) -> bool: ...

    @abstractmethod
    def _register_param(self, p: Tensor, name: str, r: _Rec) -> None: ...

    @abstractmethod
    def _from_spmd_types(self, x: Tensor) -> _Rec | None: ...

    @abstractmethod
    def _demand(self, cell: _Cell, kind: str, op: str, why: str) -> None: ...

    @abstractmethod
    def _union(self, a: _Cell, b: _Cell, op: str) -> _Cell: ...

    @abstractmethod
    def _check_summed(self, name: str, arg: str, r: _Rec, summing: bool, avg: bool, site: str) -> None: ...

    @abstractmethod
    def _check_sent(self, name: str, recs: list[tuple[str, Any, _Rec]]) -> None: ...
