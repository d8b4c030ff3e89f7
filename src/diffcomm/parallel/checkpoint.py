"""Distributed checkpoints (``torch.distributed.checkpoint``) of diffcomm-parallel models.

A parallel layer's parameters are plain tensors, each holding this rank's shard of the
serial parameter. ``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``, and
``get_state_dict`` / ``set_state_dict``) reads a plain tensor as **replicated**: it
writes one rank's copy and loads that copy on every rank, so ``dcp.save(model.state_dict())``
of a tensor-parallel model kept rank 0's shard of every key and a load gave rank 1 rank
0's shard (no error; the loaded model computed no serial model's output).
:func:`dcp_state_dict` gives DCP what it needs: every shard as a ``DTensor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .._torch import local_tensor_mode_on
from ..backend import args as A
from ..backend.local_tensor import refuse
from ._module import ParallelModule
from .moe import ExpertParallelMoE

__all__ = ["dcp_state_dict", "dcp_optimizer_state"]


def dcp_state_dict(module: nn.Module) -> dict[str, Any]:
    """The state dict to give ``torch.distributed.checkpoint``: the serial model's names,
    every shard a ``DTensor``.

    Each entry of ``module.state_dict()`` (parameters and persistent buffers) appears
    under its **serial** name (an ``ExpertParallelMoE``'s local ``experts.i`` under
    ``serial_names()``'s ``experts.{rank * E / world + i}``; every other name as in
    ``state_dict()``): a tensor a layer shards (``_shard_dims``) as
    ``DTensor.from_local(shard, DeviceMesh.from_group(layer group), [Shard(dim)])``, whose
    global shape is the serial tensor's; a replica as the plain tensor (DCP writes one copy
    of it, which is right: it is equal on every rank). The values share storage with the
    module's parameters and buffers (detached), so ``dcp.load`` into this dict loads the
    module in place.

    Because the checkpoint holds the serial model (global shapes and names), it loads at
    any tensor- or expert-parallel size (DCP reshards), and into the serial model
    (``dcp.load(serial.state_dict(), ...)``).

    Call it on every rank (no communication; the ``DeviceMesh`` of a group is made once
    per call and group).

    Args:
        module: a model of diffcomm layers (``ParallelModule`` s, ``ExpertParallelMoE``,
            plain modules around them).

    Returns:
        ``{serial name: DTensor or tensor}``.

    Raises:
        LocalTensorModeError: under torch's ``LocalTensorMode`` (run the ranks with
            ``dc.LocalWorld(n, in_process=True)``).
        TypeError: ``module`` is not an ``nn.Module``; a shard that torch has made a
            ``DTensor`` as well (FSDP2's ``fully_shard`` over another mesh axis: not
            supported yet, where plain DCP would keep one tensor-parallel rank's copy).
        ValueError: a persistent buffer inside an ``ExpertParallelMoE``'s experts (it has
            no serial name; its key would be the same on every rank).

    Example::

        import torch.distributed.checkpoint as dcp
        dcp.save(parallel.dcp_state_dict(model), checkpoint_id=path)      # every rank
        ...
        model = build(tp=4)                                              # any TP size
        dcp.load(parallel.dcp_state_dict(model), checkpoint_id=path)      # in place
    """
    layout = _Layout("parallel.dcp_state_dict", module)
    out: dict[str, Any] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        out[layout.serial_name(key)] = layout.global_view(f"`{key}`", t, t)
    return out


def dcp_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer state of a diffcomm-parallel model, for ``torch.distributed.checkpoint``:
    a ``Stateful`` (``state_dict()`` / ``load_state_dict()``) to put next to
    :func:`dcp_state_dict` in the dict given to ``dcp.save`` and ``dcp.load``.

    Its ``state_dict()`` is torch's flattened optimizer state dict
    (``get_optimizer_state_dict(module, optimizer, flatten_optimizer_state_dict=True)``:
    keys ``state.<name>.<entry>`` and ``param_groups.<name>.<hyperparameter>``, a fresh
    optimizer's state made by a step with zero gradients and zero learning rate) with the
    serial names of :func:`dcp_state_dict`, and every state tensor of a sharded
    parameter's shape (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's momentum) a ``DTensor``
    sharded as the parameter; scalars (``step``) and hyperparameters are replicas.
    ``dcp.load`` fills it and calls its ``load_state_dict``, which gives each rank's own
    shards to ``set_optimizer_state_dict``. So the moments load at any tensor- or
    expert-parallel size, as the model does; ``optimizer.state_dict()`` itself holds shards
    and loads only on the rank and layout that saved it. A parameter without optimizer
    state at the save (no gradient yet) loads without state, as saved (torch's own flow
    failed there with "Missing key in checkpoint state_dict").

    Args:
        module: the model ``optimizer`` updates (diffcomm layers inside).
        optimizer: a ``torch.optim.Optimizer`` over ``module``'s parameters.

    Returns:
        A ``torch.distributed.checkpoint.stateful.Stateful``.

    Raises:
        TypeError: ``module`` is no ``nn.Module``, or ``optimizer`` no ``Optimizer``.
        ValueError: at ``state_dict()``, a state tensor of a sharded parameter that is
            neither of its shape nor a scalar (no sharding to give it).

    Example::

        state = {"model": parallel.dcp_state_dict(model),
                 "optim": parallel.dcp_optimizer_state(model, adam)}
        dcp.save(state, checkpoint_id=path)     # every rank
        ...                                     # any TP size, a fresh Adam:
        state = {"model": parallel.dcp_state_dict(model),
                 "optim": parallel.dcp_optimizer_state(model, adam)}
        dcp.load(state, checkpoint_id=path)     # the model in place, then the optimizer
    """
    op = "parallel.dcp_optimizer_state"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise A.arg_error(op, "optimizer", "a torch.optim.Optimizer", type(optimizer).__name__, TypeError)
    return _OptimizerState(_Layout(op, module), module, optimizer)


class _Layout:
    """How each tensor of ``module`` is laid out: its serial name (expert parallelism
    renames the local experts) and its shard spec (a ``ParallelModule``'s ``_shard_dims``)."""

    def __init__(self, op: str, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise A.arg_error(op, "module", "an nn.Module", type(module).__name__, TypeError)
        if local_tensor_mode_on():
            raise refuse(op, "a checkpoint is written by each process, and one program stands for every rank")
        self.op = op
        self.sharded: dict[int, tuple[int, Any]] = {}  # id(tensor) -> (dim, group)
        self.renamed: dict[str, str] = {}  # local name -> serial name
        self.expert_prefixes: list[str] = []
        self.meshes: dict[tuple[int, str], Any] = {}
        for prefix, m in module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            if isinstance(m, ParallelModule):
                for name, dim in m._shard_dims.items():
                    t = getattr(m, name, None)
                    if dim is not None and isinstance(t, Tensor):
                        self.sharded[id(t)] = (dim, m._pg)
            elif isinstance(m, ExpertParallelMoE):
                self.renamed.update({dot + k: dot + v for k, v in m.serial_names().items()})
                self.expert_prefixes.append(dot + "experts.")

    def serial_name(self, name: str) -> str:
        if name not in self.renamed and any(name.startswith(p) for p in self.expert_prefixes):
            raise ValueError(
                f"diffcomm.{self.op}(): `{name}` is a buffer of an ExpertParallelMoE's expert: it "
                "has no serial name, and under its local name every rank's expert would write "
                "the same key (make it a parameter or a non-persistent buffer)"
            )
        return self.renamed.get(name, name)

    def global_view(self, what: str, t: Tensor, owner: Tensor) -> Any:
        """``t`` (detached, sharing storage) as DCP must see it: a ``DTensor`` sharded as
        ``owner`` (a parameter or buffer) where ``owner`` is a shard, else ``t`` itself.
        ``what``: ``t`` in an error message."""
        local = t.detach()
        spec = self.sharded.get(id(owner))
        if spec is None:
            return local  # (a DTensor of torch's own, e.g. FSDP2's, describes itself)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        dim, pg = spec
        if isinstance(local, DTensor):
            raise TypeError(
                f"diffcomm.{self.op}(): {what} is a shard of a diffcomm layer (dim {dim}) that "
                f"torch has made a DTensor too (placements {tuple(local.placements)}, e.g. FSDP2's "
                "fully_shard over another mesh axis): its global tensor would be the shard, and "
                "DCP would keep one tensor-parallel rank's copy. A checkpoint of diffcomm's "
                "tensor parallelism composed with FSDP2 is not supported yet; shard the "
                "data-parallel axis with diffcomm (or save before fully_shard)"
            )
        where = (id(pg), local.device.type)
        if where not in self.meshes:
            import torch.distributed as dist

            group: Any = pg if pg is not None else dist.group.WORLD
            self.meshes[where] = DeviceMesh.from_group(group, local.device.type)
        return DTensor.from_local(local, self.meshes[where], [Shard(dim)], run_check=False)


#: What a checkpoint holds for each state entry of a parameter without optimizer state
#: (no gradient before the save): a load finds it there and leaves that parameter without
#: state, as saved (:class:`_OptimizerState`).
_NO_STATE = "diffcomm: no optimizer state (the parameter had no gradient before the save)"


class _OptimizerState:
    """:func:`dcp_optimizer_state`'s ``Stateful``.

    A parameter that got no gradient before the save has no optimizer state: torch's state
    dict has no key for it, while a fresh optimizer (given a state by a zero step, as
    ``get_optimizer_state_dict`` does before a load) asks for its keys, and ``dcp.load``
    failed ("Missing key in checkpoint state_dict"). Tolerating the missing keys would not
    do either: the fresh optimizer would keep the zero step's state for it (Adam's
    ``step`` 1, another bias correction at the next step than serially). So the save
    writes :data:`_NO_STATE` under each key the load will ask for (the entries of a
    parameter with state of the same group and rank, else of the group, else any), and
    the load leaves every parameter found so without state, as saved."""

    def __init__(self, layout: _Layout, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._layout, self._module, self._optimizer = layout, module, optimizer
        self._local_key: dict[str, str] = {}  # serial key -> torch's key
        self._names: list[str] = []  # the module's parameter names, longest first

    def _split(self, key: str) -> tuple[str, str, str]:
        """``"state.<name>.<entry>"`` -> ``("state", name, entry)`` (names hold dots: the
        longest parameter name that fits)."""
        kind, rest = key.split(".", 1)
        for name in self._names:
            if rest.startswith(name + "."):
                return kind, name, rest[len(name) + 1 :]
        raise ValueError(f"diffcomm.{self._layout.op}(): no parameter of the module for key {key!r}")

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        flat = get_optimizer_state_dict(self._module, self._optimizer, options=options)
        params = dict(self._module.named_parameters())
        self._names = sorted(params, key=len, reverse=True)
        out: dict[str, Any] = {}
        self._local_key = {}
        entries: dict[str, list[str]] = {}  # parameter name -> its state's entries
        for key, v in flat.items():
            kind, name, entry = self._split(key)
            serial_key = f"{kind}.{self._layout.serial_name(name)}.{entry}"
            self._local_key[serial_key] = key
            p = params[name]
            if kind == "state":
                entries.setdefault(name, []).append(entry)
            if kind == "state" and isinstance(v, Tensor) and id(p) in self._layout.sharded and v.dim():
                if v.shape != p.shape:
                    raise ValueError(
                        f"diffcomm.{self._layout.op}(): optimizer state `{entry}` of `{name}` has shape "
                        f"{tuple(v.shape)}, neither the shard's {tuple(p.shape)} nor a scalar: it "
                        "cannot be resharded"
                    )
                v = self._layout.global_view(f"optimizer state `{entry}` of `{name}`", v, p)
            out[serial_key] = v
        for name, like in self._without_state(params, entries).items():
            for entry in entries[like]:
                serial_key = f"state.{self._layout.serial_name(name)}.{entry}"
                self._local_key[serial_key] = f"state.{name}.{entry}"
                out[serial_key] = _NO_STATE
        return out

    def _without_state(
        self, params: dict[str, nn.Parameter], entries: dict[str, list[str]]
    ) -> dict[str, str]:
        """The parameters (requiring grad) without optimizer state, each with the parameter
        whose state's entries a fresh optimizer's would have: one with state in the same
        group and of the same number of dims, else in the same group, else any."""
        name_of = {id(p): n for n, p in params.items()}
        anyone = next(iter(entries), None)
        out: dict[str, str] = {}
        for group in self._optimizer.param_groups:
            names = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
            having = [n for n in names if n in entries]
            for n in names:
                p = params[n]
                if n in entries or not p.requires_grad:
                    continue
                like = next(
                    (m for m in having if params[m].dim() == p.dim()), having[0] if having else anyone
                )
                if like is not None:  # (none: no parameter has state, and torch saves none)
                    out[n] = like
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        if not self._local_key:  # (dcp.load calls state_dict() first; a direct call did not)
            self.state_dict()
        local: Any = {}  # (torch types the flattened form as the nested one)
        stateless: set[str] = set()  # saved without state
        for k, v in state_dict.items():
            if isinstance(v, str) and v == _NO_STATE:
                stateless.add(self._split(self._local_key[k])[1])
            else:
                local[self._local_key[k]] = v.to_local() if isinstance(v, DTensor) else v
        params = dict(self._module.named_parameters())
        for name in stateless:  # (torch loads the state it has; taken off after)
            for entry, v in self._optimizer.state[params[name]].items():
                local[f"state.{name}.{entry}"] = v
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(self._module, self._optimizer, local, options=options)
        for name in stateless:
            self._optimizer.state.pop(params[name], None)
