"""Named RNG streams for model parallelism, built on the accelerator's RNG.

Tensor parallelism needs two kinds of randomness at once:

- **replicated** randomness (dropout on activations every TP rank holds in full, weight
  init of replicated parameters): the *default* generator, seeded the same on every TP
  rank;
- **sharded** randomness (dropout on a TP-sharded activation, init of a weight shard):
  a *named stream* seeded differently on each TP rank, so the shards get independent
  masks, yet the same on every data-parallel replica.

:class:`RNGStatesTracker` keeps the named streams. ``with tracker.fork(name):`` swaps the
stream's state into the accelerator's default generator for the block, so ordinary ops
(``torch.nn.functional.dropout``, ``torch.rand``, ``init.normal_``) draw from it, and
then restores the default generator untouched. :func:`model_parallel_seed` sets both up
the way Megatron-LM's ``model_parallel_cuda_manual_seed`` does, and :func:`checkpoint`
makes activation recomputation replay the named streams too.

Example (inside one rank of a TP x DP job)::

    from diffcomm import rng

    rng.model_parallel_seed(1234, tp_rank=tp_rank, dp_rank=dp_rank)
    y = F.dropout(x_full, 0.1)                 # same mask on every TP rank
    with rng.get_tracker().fork():             # "model-parallel" stream
        y_shard = F.dropout(x_shard, 0.1)      # different mask on every TP rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from . import _torch
from .accelerator import Accelerator, get_accelerator
from .backend import args as A
from .backend.in_process import current_rank, per_rank
from .backend.local_tensor import refuse

__all__ = [
    "MODEL_PARALLEL_RNG",
    "TP_SEED_OFFSET",
    "PP_SEED_STRIDE",
    "RNGStatesTracker",
    "get_tracker",
    "model_parallel_seed",
    "checkpoint",
]

MODEL_PARALLEL_RNG = "model-parallel"
"""Name of the stream :func:`model_parallel_seed` creates (different on every TP rank)."""

TP_SEED_OFFSET = 2718
"""Added to the seed of the model-parallel stream (Megatron-LM's constant)."""

PP_SEED_STRIDE = 100
"""Each pipeline stage's seeds are shifted by ``PP_SEED_STRIDE * pp_rank`` (as Megatron)."""


#: why the named streams and their seeding cannot run under torch's LocalTensorMode
_LOCAL_TENSOR_WHY = (
    "LocalTensorMode draws each simulated rank's random numbers from a generator state of "
    "its own, which this process's default generator (what a named stream is swapped into, "
    "and what model_parallel_seed seeds) does not reach: every simulated rank would draw "
    "the same numbers, neither the stream's nor its seed's (a real run's TP ranks draw "
    "different masks from the model-parallel stream)"
)


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class RNGStatesTracker:
    """Named RNG streams that can be swapped into the accelerator's default generator.

    Each stream is a saved generator state. :meth:`fork` makes one current for a block;
    the stream advances as the block draws numbers, and the default generator is left as
    if the block never ran.

    Args:
        accelerator: the accelerator whose default generator the streams replace
            (default: :func:`~diffcomm.accelerator.get_accelerator`, looked up at each use).

    Example::

        tracker = RNGStatesTracker()
        tracker.add("experts", seed=42 + ep_rank)
        with tracker.fork("experts"):
            torch.nn.init.normal_(expert_weight)
    """

    def __init__(self, accelerator: Accelerator | None = None) -> None:
        self._accelerator = accelerator
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {}
        self._active: set[str] = set()
        self._replaying: list[int] = []  # one entry per rng.checkpoint recomputation running
        self._seeded_as: dict[str, int] = {}  # model_parallel_seed's seed, tp_rank, pp_rank
        self._owner = current_rank()  # the in-process rank that made it (None: no rank)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy (pickled to an in-process rank, deep-copied) is its maker's own
        self.__dict__.update(state)
        self._owner = current_rank()

    def _check_owner(self) -> None:
        """In an in-process world, a tracker made outside this rank (at module level, or
        by another rank) would be every rank's, where each process has its own copy: the
        ranks' seeds and draws would mix (rank 0 drawing from rank 1's stream), silently."""
        rank = current_rank()
        if rank is None or rank == self._owner or self is _TRACKER:
            return
        made = "outside the ranks (module level?)" if self._owner is None else f"by rank {self._owner}"
        raise RuntimeError(
            f"this RNGStatesTracker was made {made} and is used by rank {rank} of an "
            "in-process world (dc.LocalWorld(..., in_process=True)), whose ranks would all "
            "share it where each process has its own copy: their seeds and draws would mix. "
            "Make it inside the function the world runs, pass it to run() as an argument "
            "(each rank gets its own copy), or use diffcomm.rng.get_tracker() (per rank)."
        )

    @property
    def accelerator(self) -> Accelerator:
        """The accelerator whose default generator the streams are swapped into."""
        return self._accelerator if self._accelerator is not None else get_accelerator()

    @property
    def names(self) -> list[str]:
        """Names of the streams, in the order they were added."""
        return list(self._states)

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def __repr__(self) -> str:
        return f"<RNGStatesTracker streams={self.names}>"

    def add(self, name: str, seed: int) -> None:
        """Create a stream seeded with ``seed``.

        The default generator is not changed.

        Args:
            name: the stream's name.
            seed: its seed. Two streams never share a seed (they would produce the same
                numbers).

        Raises:
            ValueError: ``name`` or ``seed`` is already used by a stream of this tracker.
            TypeError: ``name`` is not a str or ``seed`` not an int.
        """
        self._check_owner()
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        _check_int("seed", seed)
        if name in self._states:
            raise ValueError(f"RNG stream name={name!r} is already added to this tracker")
        if seed in self._seeds:
            raise ValueError(
                f"seed={seed} is already used by RNG stream {self._seeds[seed]!r}; "
                "streams with the same seed would produce the same numbers"
            )
        acc = self.accelerator
        with acc.fork_rng():
            acc.manual_seed(seed)
            self._states[name] = acc.get_rng_state()
        self._seeds[seed] = name

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Context manager: draw from stream ``name`` inside the block.

        On entry the default generator's state is saved and replaced by the stream's; on
        exit the advanced state is saved back into the stream and the default generator
        is restored, also when the block raises.

        Args:
            name: the stream (default: :data:`MODEL_PARALLEL_RNG`).

        Returns:
            A context manager yielding ``None``.

        Raises:
            KeyError: no stream has that name.
            RuntimeError: the block is already inside ``fork(name)`` (re-entering the same
                stream would lose the outer block's draws); or it runs during backward
                outside :func:`checkpoint`'s replay (``torch.utils.checkpoint``'s
                recomputation would draw other numbers than the forward did).
            LocalTensorModeError: under torch's ``LocalTensorMode`` (its simulated ranks
                draw from generator states of their own, which the swap does not reach).
        """
        if _torch.local_tensor_mode_on():
            raise refuse(f"rng.RNGStatesTracker.fork({name!r})", _LOCAL_TENSOR_WHY)
        self._check_owner()
        if name not in self._states:
            raise KeyError(f"no RNG stream named {name!r}; known streams: {self.names}")
        if name in self._active:
            raise RuntimeError(f"RNG stream {name!r} is already forked in an enclosing block")
        if not self._replaying and _torch.in_backward():
            raise RuntimeError(
                f"RNG stream {name!r} drawn from during backward: a recomputation "
                "(torch.utils.checkpoint?) would draw other random numbers than the forward did "
                "(the stream has moved on since), so dropout's mask and the gradient would be wrong. "
                "Checkpoint with diffcomm.rng.checkpoint(fn, *args), which replays the streams."
            )
        acc = self.accelerator
        outer = acc.get_rng_state()
        acc.set_rng_state(self._states[name])
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self._states[name] = acc.get_rng_state()
            acc.set_rng_state(outer)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's current state (for checkpointing, recomputation).

        Returns:
            ``{name: uint8 state tensor}``; changing it does not change the tracker.
        """
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams' states with ``states`` (from :meth:`get_states`).

        Args:
            states: ``{name: uint8 state tensor}``; the tracker takes copies. Streams
                not in ``states`` are dropped. Seeds recorded by :meth:`add` stay reserved.

        Raises:
            TypeError: a name is not a str or a state not a tensor.
        """
        self._check_owner()
        new: dict[str, torch.Tensor] = {}
        for name, state in states.items():
            if not isinstance(name, str) or not isinstance(state, torch.Tensor):
                raise TypeError("states must map str names to state tensors")
            new[name] = state.clone()
        # in place: the dict is a rank's own in an in-process world (registered per rank)
        self._states.clear()
        self._states.update(new)

    def _key(self, op: str) -> str:
        """The key of this rank's entry in :meth:`state_dict`: ``"tp{tp_rank}_pp{pp_rank}"``."""
        if not self._seeded_as:
            raise RuntimeError(
                f"RNGStatesTracker.{op}: the tracker was not seeded by "
                "diffcomm.rng.model_parallel_seed, so it does not know which TP / pipeline rank "
                "its streams belong to (a state loaded on another rank would give two ranks one "
                "stream: the same dropout masks). Call model_parallel_seed(seed, tp_rank=...) "
                "first; for streams added by hand, save get_states() per rank yourself."
            )
        return f"tp{self._seeded_as['tp_rank']}_pp{self._seeded_as['pp_rank']}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's RNG state, for a checkpoint: every stream, the default generators, and
        the ranks :func:`model_parallel_seed` seeded it as.

        Loading it with :meth:`load_state_dict` in a resumed job makes the job draw the
        random numbers the uninterrupted one would have drawn (dropout masks of step
        ``k + 1``, not those of step 0 again, which a fresh :func:`model_parallel_seed` gives).

        The one entry is keyed by the rank, ``{"tp{tp_rank}_pp{pp_rank}": entry}``, so a
        ``torch.distributed.checkpoint`` of it (which keeps one copy of a key that several
        ranks save) keeps each TP rank's and stage's own state; data-parallel replicas
        share the key, as their states agree. ``entry`` is ``{"streams": {name: uint8
        tensor}, "default_generator": uint8 tensor (the accelerator's, current device),
        "cpu_generator": uint8 tensor, "seed": int, "tp_rank": int, "pp_rank": int}``;
        all tensors are copies.

        Returns:
            ``{"tp{tp_rank}_pp{pp_rank}": entry}``.

        Raises:
            RuntimeError: the tracker was not seeded by :func:`model_parallel_seed`.
        """
        key = self._key("state_dict")
        return {
            key: {
                "streams": self.get_states(),
                "default_generator": self.accelerator.get_rng_state().clone(),
                "cpu_generator": torch.get_rng_state(),
                **self._seeded_as,
            }
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (saved by this TP rank and stage) into the tracker and
        the default generators.

        Call it after :func:`model_parallel_seed` with the same ranks as the saving job. It
        checks that the state is this rank's (the key ``"tp{tp_rank}_pp{pp_rank}"``) and
        that it holds the tracker's streams, before changing anything.

        Args:
            state_dict: from :meth:`state_dict`, possibly holding other ranks' entries too
                (only this rank's is read).

        Raises:
            RuntimeError: the tracker was not seeded by :func:`model_parallel_seed`.
            ValueError: no entry of this rank (the state of another TP rank or stage, e.g.
                one rank's file loaded on every rank, or a job at another TP size: another
                rank's stream would give two TP ranks the same dropout masks), or its
                streams are not the tracker's.
        """
        key = self._key("load_state_dict")
        if not isinstance(state_dict, dict) or key not in state_dict:
            held = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"RNGStatesTracker.load_state_dict: this rank is {key} (tp_rank, pp_rank as "
                f"seeded by model_parallel_seed) but the state dict holds {held}. Loading "
                "another rank's RNG state would give two TP ranks (or stages) one stream: the "
                "same dropout masks on every shard, silently. Load the state this rank saved "
                "(one file per rank, or torch.distributed.checkpoint of state_dict(), keyed by "
                "rank); a rank with no saved state (resumed at another TP size) keeps the "
                "fresh streams of model_parallel_seed (call it with a new seed to not repeat "
                "the first steps' masks)."
            )
        entry = state_dict[key]
        streams = entry["streams"]
        if sorted(streams) != sorted(self.names):
            raise ValueError(
                f"RNGStatesTracker.load_state_dict: the saved streams {sorted(streams)} are not "
                f"the tracker's {sorted(self.names)}"
            )
        self.set_states(streams)
        self.accelerator.set_rng_state(entry["default_generator"])
        torch.set_rng_state(entry["cpu_generator"])

    def _swap(
        self, states: dict[str, torch.Tensor], active: set[str]
    ) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Install the contents of ``states`` / ``active``; return the old contents. In
        place: the dict and the set are a rank's own in an in-process world (registered
        per rank; a new object would be every rank's, and the ranks' streams one)."""
        old = (dict(self._states), set(self._active))
        self._states.clear()
        self._states.update(states)
        self._active.clear()
        self._active.update(active)
        return old

    def reset(self) -> None:
        """Remove every stream (names and seeds can be added again)."""
        self._check_owner()
        self._states.clear()
        self._seeds.clear()
        self._seeded_as.clear()


_TRACKER = RNGStatesTracker()
# a rank's own, in-process
per_rank(_TRACKER._states, _TRACKER._seeds, _TRACKER._active, _TRACKER._replaying, _TRACKER._seeded_as)


def get_tracker() -> RNGStatesTracker:
    """The process-wide default :class:`RNGStatesTracker`.

    Returns:
        The tracker that :func:`model_parallel_seed` and :func:`checkpoint` use by default.
    """
    return _TRACKER


def model_parallel_seed(
    seed: int,
    tp_rank: int,
    dp_rank: int = 0,
    pp_rank: int = 0,
    tracker: RNGStatesTracker | None = None,
) -> RNGStatesTracker:
    """Seed the default generator and the model-parallel stream for one rank.

    The formula (Megatron-LM's ``_set_random_seed`` + ``model_parallel_cuda_manual_seed``)::

        base                  = seed + 100 * pp_rank            # PP_SEED_STRIDE
        default generator     = base                            # all devices of the accelerator
        "model-parallel"      = base + 2718 + tp_rank           # TP_SEED_OFFSET

    So the default generator agrees across TP and DP ranks (replicated dropout, init of
    replicated weights) and differs across pipeline stages; the ``"model-parallel"``
    stream differs across TP ranks (independent masks on each shard) and agrees across
    DP replicas. ``dp_rank`` enters neither seed; it is validated and documents the
    call. On a non-CPU accelerator the CPU generator is seeded with ``base`` too (weights
    are often initialised on the host).

    Args:
        seed: the job's seed (same on every rank), >= 0.
        tp_rank: this rank's tensor-parallel rank, >= 0.
        dp_rank: this rank's data-parallel rank, >= 0 (does not change any seed).
        pp_rank: this rank's pipeline stage, >= 0.
        tracker: the tracker to (re)fill (default: :func:`get_tracker`). It is reset
            first, so calling this again re-seeds cleanly.

    Returns:
        The tracker, now holding the :data:`MODEL_PARALLEL_RNG` stream.

    Raises:
        TypeError / ValueError: an argument is not a non-negative int.
        LocalTensorModeError: under torch's ``LocalTensorMode`` (the seeds would not
            reach its simulated ranks' generators).
    """
    _check_int("seed", seed, 0)
    _check_int("tp_rank", tp_rank, 0)
    _check_int("dp_rank", dp_rank, 0)
    _check_int("pp_rank", pp_rank, 0)
    if _torch.local_tensor_mode_on():
        raise refuse("rng.model_parallel_seed", _LOCAL_TENSOR_WHY)
    tracker = _TRACKER if tracker is None else tracker
    base = seed + PP_SEED_STRIDE * pp_rank
    acc = tracker.accelerator
    acc.manual_seed_all(base)
    if acc.name != "cpu":
        torch.default_generator.manual_seed(base)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, base + TP_SEED_OFFSET + tp_rank)
    tracker._seeded_as.update(seed=seed, tp_rank=tp_rank, pp_rank=pp_rank)
    return tracker


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    tracker: RNGStatesTracker | None = None,
    use_reentrant: bool = False,
    **kwargs: Any,
) -> Any:
    """Activation checkpointing that also replays the tracker's named RNG streams.

    ``torch.utils.checkpoint.checkpoint`` restores the default generator(s) before
    recomputing ``fn`` in backward, but not the streams of an :class:`RNGStatesTracker`:
    by then later layers have advanced them, so a dropout inside ``tracker.fork(...)``
    would draw a different mask during recomputation and the gradient would be wrong.
    This wrapper captures the tracker's states before the forward call of ``fn``; when
    torch re-runs ``fn`` it swaps those states in for the re-run and puts the tracker's
    then-current states back afterwards, so later layers are unaffected.

    Args:
        fn: the function to checkpoint.
        *args: its positional arguments.
        tracker: the tracker whose streams to replay (default: :func:`get_tracker`).
        use_reentrant: passed to torch (default ``False``, the recommended variant).
        **kwargs: passed to ``torch.utils.checkpoint.checkpoint`` (e.g. ``context_fn``)
            and, for the non-reentrant variant, unknown ones on to ``fn``.
            ``preserve_rng_state`` may only be ``True``.

    Returns:
        What ``fn(*args, **kwargs)`` returns.

    Raises:
        ValueError: ``preserve_rng_state`` other than ``True`` (the recomputation's
            default-generator draws would differ from the forward call's), before ``fn``
            runs.

    Gradient:
        The gradient of ``fn`` itself: the recomputation draws the same random numbers
        as the forward call, from the default generator and from every named stream.
    """
    if kwargs.get("preserve_rng_state", True) is not True:
        # torch would not restore the default generator before recomputing fn: its dropout
        # would draw another mask there than in the forward call (a wrong gradient, no error)
        raise A.arg_error(
            "rng.checkpoint",
            "preserve_rng_state",
            "True (the default): rng.checkpoint replays every random draw of fn, and without "
            "it the default generator would draw other numbers in the recomputation than in "
            "the forward call (another dropout mask: the gradient of another function); for a "
            "fn that draws no random numbers call torch.utils.checkpoint.checkpoint(fn, ..., "
            "preserve_rng_state=False)",
            repr(kwargs["preserve_rng_state"]),
        )
    tracker = _TRACKER if tracker is None else tracker
    states_at_forward = tracker.get_states()
    calls = 0

    def replaying_fn(*fn_args: Any, **fn_kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward call itself
            return fn(*fn_args, **fn_kwargs)
        # A recomputation (there may be several, e.g. backward with retain_graph): run on
        # the forward-time states, then put back the current ones. A new dict, the same
        # state tensors: the tracker never changes a state in place (fork stores a new
        # one), and a copy here would be a tensor op the forward did not run, which
        # shifts selective checkpointing's cache (context_fn): it matches the recomputed
        # ops to the saved ones by op and count, so every later aten.clone of fn would
        # get the one before's saved value: a wrong gradient, silently.
        saved = tracker._swap(dict(states_at_forward), set())
        tracker._replaying.append(1)
        try:
            return fn(*fn_args, **fn_kwargs)
        finally:
            tracker._replaying.pop()
            tracker._swap(*saved)

    return torch.utils.checkpoint.checkpoint(replaying_fn, *args, use_reentrant=use_reentrant, **kwargs)
