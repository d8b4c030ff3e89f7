"""The B/W split of :class:`~diffcomm.pipeline.PipelineRunner`: which ``B`` steps split
(:func:`cooldown`), and where in a micro-batch's graph the input gradient ``I`` stops and
the weight gradients ``W`` begin (:func:`input_edge`, :func:`weight_plan`,
:func:`group_plan`, :func:`capture`) — as torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight`` find them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

from .. import _torch
from ..ops import p2p
from .schedules import Step


def cooldown(steps: Sequence[Step]) -> set[tuple[int, int]]:
    """``(micro, chunk)`` of the ``B`` steps after the rank's last ``F``: from there on the
    stages upstream run only backwards, each waiting for a gradient from here, so sending
    it before the weight gradients shortens the step by them."""
    last_f = max((i for i, st in enumerate(steps) if st.kind == "F"), default=-1)
    return {(st.micro, st.chunk) for st in steps[last_f + 1 :] if st.kind == "B"}


def input_edge(x: Tensor | None) -> Tensor | None:
    """The leaf the input gradient flows into: a stage-0 input that requires grad, or the
    anchor of the receive that produced ``x`` (so its backward, which sends the gradient
    on, runs in ``I``)."""
    if x is None or not x.requires_grad:
        return None
    if x.grad_fn is None:
        return x
    nexts = [n for n, _ in x.grad_fn.next_functions if n is not None]
    if len(nexts) == 1 and hasattr(nexts[0], "variable"):
        return nexts[0].variable
    return None


def reaches(root: Tensor, target: Tensor) -> bool:
    """Whether ``root``'s backward reaches ``target``'s gradient edge (the chunk's output
    depends on its input)."""
    if root.grad_fn is None:
        return False
    target_node = get_gradient_edge(target).node
    seen, todo = {root.grad_fn}, collections.deque([root.grad_fn])
    while todo:
        n = todo.popleft()
        if n is target_node:
            return True
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def is_compiled_region(node: Node) -> bool:
    """Whether ``node`` is the backward of a region ``torch.compile`` compiled with
    AOTAutograd (the ``aot_eager`` and ``inductor`` backends; the ``eager`` backend keeps
    eager nodes): ``CompiledFunctionBackward``, one node whose compiled backward computes
    the gradient of every input of the region at once. Run in ``I`` and again in ``W`` it
    would compute everything twice, and ``I`` must keep the graph (``retain_graph=True``),
    which AOTAutograd refuses for a backward compiled with donated buffers ("This backward
    function was compiled with non-empty donated buffers which requires
    create_graph=False and retain_graph=False") — it was, when the region's first backward
    ran without keeping the graph (a plain ``B``, or stage 0's ``W``)."""
    cls = getattr(node, "_forward_cls", None)
    return cls is not None and hasattr(cls, "compiled_bw") and hasattr(cls, "_aot_id")


@dataclass(frozen=True)
class Whole:
    """:func:`weight_plan`'s answer when no sound split exists — the input gradient's path
    runs through a compiled region (:func:`is_compiled_region`), or the graph holds an
    activation checkpoint (reentrant, or not: see :func:`weight_plan`): ``I`` runs the
    micro-batch's whole backward once (the graph freed) and ``W`` has nothing left."""

    node: Node  # the compiled region or the checkpoint's node found


def weight_plan(
    root: Tensor, target: Tensor, param_nodes: Sequence[Node]
) -> list[tuple[Node, list[Node]]] | Whole | None:
    """``[(node, param nodes), ...]``: the nodes on the path from ``root`` to ``target``
    at which a parameter's branch leaves that path (as in torch.distributed.pipelining's
    ``stage_backward_input``), or ``None`` when there is no such split. ``param_nodes``:
    the parameters' gradient nodes (``get_gradient_edge(p).node``, their
    ``AccumulateGrad``; the caller finds them once per step, not per micro-batch); every
    other leaf the graph reaches, ``target`` excepted, is planned after them.
    :class:`Whole` when no sound split exists: a compiled region lies on the path (``I``
    would run it, keeping the graph, and ``W`` again; see :func:`is_compiled_region`), or
    the graph holds a reentrant activation checkpoint
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, or Megatron-LM's or
    DeepSpeed's ``CheckpointFunction``): its backward recomputes the forward and runs a
    nested backward, which it refuses inside a backward restricted to ``inputs=`` (torch's
    RuntimeError pointing to ``use_reentrant=False``) — what both ``I`` and ``W`` are —, or
    a non-reentrant one (``use_reentrant=False``, :func:`diffcomm.rng.checkpoint`): it
    recomputes its region once per backward call, so in ``I`` and again in ``W``, and a
    forward with side effects (a ``BatchNorm``'s running statistics) ran one time more
    than serially. The
    caller runs that micro-batch's backward whole in ``I`` (input and weight gradients at
    once, as ``grad_first=False`` does), which sends the same messages at the same step."""
    root_node = root.grad_fn
    if root_node is None:
        return None
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen, todo = {root_node}, collections.deque([root_node])
    leaves: list[Node] = []  # every leaf's AccumulateGrad, in the order the walk meets them
    while todo:
        n = todo.popleft()
        if hasattr(n, "variable"):
            leaves.append(n)
        # (torch's, Megatron's, DeepSpeed's; by the node's class: a Function's ctx may set
        # an attribute `name`, which hides the node's name() method)
        if type(n).__name__ == "CheckpointFunctionBackward":
            return Whole(n)
        # a non-reentrant checkpoint recomputes its region once per backward call: I and W
        # are two, so its forward ran twice in backward, not once as serially (a BatchNorm
        # inside counted each micro-batch three times in its running statistics)
        if _torch.saved_in_checkpoint(n):
            return Whole(n)
        for nxt, _ in n.next_functions:
            if nxt is not None:
                parents[nxt].append(n)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    target_node = get_gradient_edge(target).node
    if target_node not in seen:
        return None
    on_path, todo = {target_node}, collections.deque([target_node])
    while todo:
        for par in parents[todo.popleft()]:
            if par not in on_path:
                on_path.add(par)
                todo.append(par)
    compiled = next((n for n in on_path if is_compiled_region(n)), None)
    if compiled is not None:
        return Whole(compiled)
    # W computes the gradient of every leaf the micro-batch's graph reaches but the input,
    # as the serial loss.backward() does: the chunk's parameters, and any other tensor
    # that requires grad — a loss_fn's own parameter (a learned temperature), a tensor the
    # stage reads from outside, the targets' micro-batches (their graph outside the step
    # gets its gradient once, after it). Restricted to the chunk's parameters, those got
    # no gradient from a split B (None under GPipe and ZB-H1, a partial one under 1F1B)
    known = set(param_nodes)
    nodes = [*param_nodes, *(n for n in leaves if n not in known and n is not target_node)]
    plan: dict[Node, list[Node]] = {}
    for pn in nodes:
        if pn not in seen:
            continue  # not used by this micro-batch's graph
        meet: set[Node] = set()
        visited, todo = {pn}, collections.deque([pn])
        while todo:
            for par in parents[todo.popleft()]:
                if par in on_path:
                    meet.add(par)
                elif par not in visited:
                    visited.add(par)
                    todo.append(par)
        if not meet or (root_node in meet and p2p.is_send_node(root_node)):
            return None  # the split would re-run the send's backward: do it all in W
        for n in meet:
            plan.setdefault(n, []).append(pn)
    return list(plan.items())


def group_plan(plan: list[tuple[Node, list[Node]]]) -> list[tuple[list[Node], list[Node]]]:
    """Merge the plan's nodes that share a parameter into one group (one W call each)."""
    groups: list[tuple[list[Node], list[Node]]] = []
    for node, pns in plan:
        hit = [g for g in groups if any(pn in g[1] for pn in pns)]
        nodes, params = [node], list(dict.fromkeys(pns))
        for g in hit:
            groups.remove(g)
            nodes += g[0]
            params += [pn for pn in g[1] if pn not in params]
        groups.append((nodes, params))
    return groups


def capture(store: dict[Node, tuple[Tensor | None, ...]], node: Node) -> Callable[..., None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        store[node] = tuple(grad_outputs)

    return hook
