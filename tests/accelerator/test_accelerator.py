"""Tests for diffcomm.accelerator: the same conformance suite runs on every available kind.

CUDA/XPU/MPS cases skip (with the reason) on machines without that hardware; the CPU
cases always run and check real behaviour (wall-clock events, RSS, profiler ranges).
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import torch

from diffcomm import _config, accelerator
from diffcomm._errors import DiffcommError
from diffcomm.accelerator import (
    Accelerator,
    CPUAccelerator,
    CPUEvent,
    CPUStream,
    CUDAAccelerator,
    MPSAccelerator,
    XPUAccelerator,
    available_accelerators,
    comm_accelerator,
    comm_device,
    get_accelerator,
    set_accelerator,
)

KINDS = ["cpu", "cuda", "xpu", "mps"]
# The conformance suite runs on every kind this machine has; each missing kind gets one
# skipped test below (test_conformance_suite_needs_hardware) instead of dozens.
AVAILABLE = available_accelerators()
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _keep_rng_state():
    """Leave torch's CPU generator as it was, whatever a test seeds."""
    with torch.random.fork_rng(devices=[]):
        yield


@pytest.fixture(params=AVAILABLE)
def acc(request: pytest.FixtureRequest) -> Accelerator:
    """The shared accelerator of each kind this machine has."""
    return get_accelerator(request.param)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "cpu"])
def test_conformance_suite_needs_hardware(kind: str) -> None:
    if kind not in AVAILABLE:
        pytest.skip(f"no {kind} device on this machine: the {kind} conformance suite did not run")
    assert get_accelerator(kind).device_count() >= 1


@pytest.fixture
def cpu() -> CPUAccelerator:
    result = get_accelerator("cpu")
    assert isinstance(result, CPUAccelerator)
    return result


@pytest.fixture
def env_accelerator(monkeypatch: pytest.MonkeyPatch):
    """Set DIFFCOMM_ACCELERATOR for one test; the setting is re-read before and after."""

    def set_env(value: str) -> None:
        monkeypatch.setenv("DIFFCOMM_ACCELERATOR", value)
        _config.ACCELERATOR.reload()

    yield set_env
    monkeypatch.undo()
    _config.ACCELERATOR.reload()


# ------------------------------------------------------------------------------ devices


def test_device_basics(acc: Accelerator) -> None:
    assert acc.is_available()
    assert acc.device_count() >= 1
    assert 0 <= acc.current_device() < acc.device_count()
    dev = acc.device()
    assert dev.type == acc.name
    assert acc.device(acc.current_device()) == dev
    assert torch.ones(2, device=dev).device.type == acc.name


def test_set_device_keeps_current(acc: Accelerator) -> None:
    index = acc.current_device()
    acc.set_device(index)
    assert acc.current_device() == index


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (99, ValueError, "out of range"),
        (-1, ValueError, "out of range"),
        ("meta", ValueError, "is not a"),
        (True, TypeError, "device must be"),
        (1.5, TypeError, "device must be"),
    ],
)
def test_bad_device_argument_is_named(
    acc: Accelerator, bad: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        acc.device(bad)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        acc.set_device(bad)  # type: ignore[arg-type]


def test_cpu_device_is_plain_cpu(cpu: CPUAccelerator) -> None:
    assert cpu.device() == torch.device("cpu")
    assert cpu.device(0) == torch.device("cpu")
    assert cpu.device("cpu") == torch.device("cpu")
    assert cpu.device_count() == 1
    assert cpu.current_device() == 0


# ------------------------------------------------------------------------ streams, events


def test_stream_context_switches_and_restores(acc: Accelerator) -> None:
    default = acc.default_stream()
    assert acc.current_stream() == default
    s = acc.stream()
    assert isinstance(s, acc.Stream)
    with acc.stream_context(s):
        if acc.name != "mps":  # MPS has a single queue: nothing to switch
            assert acc.current_stream() == s
        torch.ones(4, device=acc.device()).sum()
    assert acc.current_stream() == default


def test_started_stream_is_the_current_stream_once_the_runtime_runs(acc: Accelerator) -> None:
    """What the async engine runs its jobs under: ``None`` on the CPU (nothing to order)
    and on MPS (one queue); on a device-module accelerator whose runtime has started
    (``current_stream()`` starts it), this thread's current stream, in a context too."""
    if acc.name in ("cpu", "mps"):
        assert acc.started_stream() is None
        return
    assert acc.started_stream() == acc.current_stream()
    s = acc.stream()
    with acc.stream_context(s):
        assert acc.started_stream() == s


def test_started_stream_does_not_start_a_device_runtime() -> None:
    """A CPU-only process on a GPU machine: asking must not create a device context."""
    code = (
        "import torch\n"
        "from diffcomm.accelerator import get_accelerator\n"
        "acc = get_accelerator()\n"
        "assert acc.started_stream() is None, acc.name\n"
        "assert not (torch.cuda.is_available() and torch.cuda.is_initialized())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_stream_context_none_is_noop(acc: Accelerator) -> None:
    before = acc.current_stream()
    with acc.stream_context(None):
        assert acc.current_stream() == before
    assert acc.current_stream() == before


def test_stream_and_event_synchronisation(acc: Accelerator) -> None:
    s = acc.stream()
    with acc.stream_context(s):
        y = torch.ones(64, 64, device=acc.device()) @ torch.ones(64, 64, device=acc.device())
    e = s.record_event()
    e.synchronize()
    assert e.query()
    s.synchronize()
    assert s.query()
    acc.default_stream().wait_stream(s)
    acc.default_stream().wait_event(e)
    e2 = acc.event()
    e2.record()
    e2.wait(acc.default_stream())
    acc.synchronize()
    assert y[0, 0].item() == 64.0


def test_event_elapsed_time_is_real_milliseconds(acc: Accelerator) -> None:
    start, end = acc.event(enable_timing=True), acc.event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float)
    assert 40.0 <= elapsed < 5000.0


def test_cpu_event_errors_like_cuda(cpu: CPUAccelerator) -> None:
    untimed, timed = cpu.event(), cpu.event(enable_timing=True)
    untimed.record()
    timed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        untimed.elapsed_time(timed)
    with pytest.raises(RuntimeError, match="recorded"):
        cpu.event(enable_timing=True).elapsed_time(timed)
    assert cpu.event().query()  # like CUDA: an unrecorded event has nothing pending


def test_cpu_streams_interoperate_with_torch_cpu(cpu: CPUAccelerator) -> None:
    s = cpu.stream()
    assert isinstance(s, CPUStream) and isinstance(s, torch.cpu.Stream)
    assert s.device == torch.device("cpu")
    with torch.cpu.stream(s):  # torch's own context manager sees our stream
        assert cpu.current_stream() is s
        assert torch.cpu.current_stream() is s
    assert cpu.current_stream() is cpu.default_stream()
    assert isinstance(s.record_event(), CPUEvent)
    with pytest.raises(TypeError, match="stream must be"):
        cpu.stream_context("not a stream")


# ---------------------------------------------------------------------------------- RNG


def test_manual_seed_is_reproducible(acc: Accelerator) -> None:
    dev = acc.device()
    acc.manual_seed(123)
    a = torch.rand(8, device=dev)
    assert acc.initial_seed() == 123
    acc.manual_seed_all(123)
    b = torch.rand(8, device=dev)
    assert torch.equal(a, b)


def test_rng_state_roundtrip(acc: Accelerator) -> None:
    dev = acc.device()
    state = acc.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.rand(8, device=dev)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(8, device=dev), a)


def test_fork_rng_restores_state(acc: Accelerator) -> None:
    dev = acc.device()
    state = acc.get_rng_state()
    expected = torch.rand(8, device=dev)
    acc.set_rng_state(state)
    with acc.fork_rng():
        torch.rand(100, device=dev)
    assert torch.equal(torch.rand(8, device=dev), expected)

    acc.set_rng_state(state)
    with acc.fork_rng(devices=[acc.current_device()], enabled=False):
        torch.rand(100, device=dev)
    assert not torch.equal(torch.rand(8, device=dev), expected)


def test_fork_rng_restores_on_exception(acc: Accelerator) -> None:
    state = acc.get_rng_state()
    with pytest.raises(KeyError), acc.fork_rng():
        torch.rand(10, device=acc.device())
        raise KeyError("boom")
    assert torch.equal(acc.get_rng_state(), state)


def test_seed_returns_the_new_initial_seed(acc: Accelerator) -> None:
    new = acc.seed()
    assert isinstance(new, int)
    assert acc.initial_seed() == new


def test_generator_is_independent_and_seeded(acc: Accelerator) -> None:
    dev = acc.device()
    state = acc.get_rng_state()
    g1, g2 = acc.generator(7), acc.generator(7)
    assert g1.device.type == acc.name
    assert torch.equal(torch.rand(5, generator=g1, device=dev), torch.rand(5, generator=g2, device=dev))
    assert torch.equal(acc.get_rng_state(), state)  # the default generator did not move
    assert acc.generator().initial_seed() != acc.generator().initial_seed()


def test_cpu_rng_is_torch_default_generator(cpu: CPUAccelerator) -> None:
    cpu.manual_seed(3)
    assert torch.initial_seed() == 3
    reference = torch.rand(4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.rand(4), reference)
    assert torch.equal(cpu.get_rng_state(), torch.get_rng_state())


# ------------------------------------------------------------------------------- memory


def test_memory_numbers_are_consistent(acc: Accelerator) -> None:
    allocated = acc.memory_allocated()
    assert allocated >= 0
    assert acc.max_memory_allocated() >= acc.memory_allocated() >= 0
    assert acc.memory_reserved() >= acc.memory_allocated()
    total, available = acc.total_memory(), acc.available_memory()
    assert total > 0 and 0 <= available <= total
    stats = acc.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current"):
        assert isinstance(stats[key], int), key


def test_peak_follows_an_allocation_and_resets(acc: Accelerator) -> None:
    dev = acc.device()
    acc.reset_peak_memory_stats()
    before = acc.max_memory_allocated()
    x = torch.ones(64 * MiB // 4, device=dev)  # 64 MiB, every page touched
    acc.synchronize()
    acc.memory_allocated()  # a sample, for accelerators whose peak is sampled
    del x
    acc.synchronize()
    spike = acc.max_memory_allocated()
    assert spike >= before + 60 * MiB
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < spike - 32 * MiB


def test_cpu_memory_allocated_is_process_rss(cpu: CPUAccelerator) -> None:
    rss = psutil.Process().memory_info().rss
    assert abs(cpu.memory_allocated() - rss) < 16 * MiB
    assert cpu.memory_reserved() == pytest.approx(psutil.Process().memory_info().vms, rel=0.05)
    assert cpu.total_memory() <= psutil.virtual_memory().total


def test_cpu_peak_is_sampled_when_kernel_reset_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accelerator.cpu, "_reset_kernel_peak_rss", lambda: False)
    cpu = CPUAccelerator()  # a private instance: its sampled baseline is its own
    cpu.reset_peak_memory_stats()
    assert cpu.memory_stats()["peak_is_sampled"] is True
    before = cpu.max_memory_allocated()
    x = torch.ones(64 * MiB // 4)
    cpu.memory_allocated()  # the sample that sees the spike
    del x
    assert cpu.max_memory_allocated() >= before + 60 * MiB
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_allocated() < before + 32 * MiB


# ------------------------------------------------------------------------------- dtypes


def test_supported_dtypes(acc: Accelerator) -> None:
    dtypes = acc.supported_dtypes()
    assert torch.float32 in dtypes and torch.int64 in dtypes and torch.bool in dtypes
    assert acc.supported_dtypes() == dtypes
    dtypes.clear()  # the caller gets a copy; the cache is untouched
    assert torch.float32 in acc.supported_dtypes()
    if torch.bfloat16 not in acc.supported_dtypes():
        assert not acc.is_bf16_supported()


def test_cpu_supports_the_common_dtypes(cpu: CPUAccelerator) -> None:
    dtypes = cpu.supported_dtypes()
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.uint8):
        assert dtype in dtypes
    assert cpu.is_bf16_supported()
    assert cpu.is_fp16_supported()


# ----------------------------------------------------------------------------- profiler


def _profiled_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [event.name for event in prof.events()]


def test_range_shows_up_in_torch_profiler(acc: Accelerator) -> None:
    def work() -> None:
        with acc.range("diffcomm_myrange"):
            torch.ones(3, device=acc.device()).add_(1)

    assert "diffcomm_myrange" in _profiled_names(work)


def test_range_push_pop_show_up_in_torch_profiler(acc: Accelerator) -> None:
    def work() -> None:
        acc.range_push("diffcomm_outer")
        acc.range_push("diffcomm_inner")
        torch.ones(3, device=acc.device()).add_(1)
        acc.range_pop()
        acc.range_pop()

    names = _profiled_names(work)
    assert "diffcomm_outer" in names and "diffcomm_inner" in names


def test_range_pop_without_push_raises(acc: Accelerator) -> None:
    with pytest.raises(RuntimeError, match="without a matching range_push"):
        acc.range_pop()


def test_range_closes_when_block_raises(acc: Accelerator) -> None:
    with pytest.raises(ValueError, match="inside"), acc.range("diffcomm_failing"):
        raise ValueError("inside")
    with pytest.raises(RuntimeError, match="without a matching"):
        acc.range_pop()  # nothing left open


def test_range_name_must_be_str(cpu: CPUAccelerator) -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        cpu.range_push(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ communication


@pytest.mark.parametrize(
    ("cls", "backend"),
    [
        (CPUAccelerator, "gloo"),
        (CUDAAccelerator, "nccl"),
        (MPSAccelerator, "gloo"),
        (XPUAccelerator, "xccl"),
    ],
)
def test_communication_backend_name(cls: type[Accelerator], backend: str) -> None:
    # Constructing an accelerator never touches the hardware, so this runs anywhere.
    assert cls().communication_backend_name() == backend


# ---------------------------------------------------------------------------- selection


def test_get_accelerator_detects_and_caches(env_accelerator) -> None:
    env_accelerator("")
    acc = get_accelerator()
    assert acc.name == available_accelerators()[0]
    assert get_accelerator() is acc
    assert available_accelerators()[-1] == "cpu"


def test_get_accelerator_honours_environment(env_accelerator) -> None:
    env_accelerator("cpu")
    assert get_accelerator().name == "cpu"
    assert get_accelerator() is get_accelerator("cpu")


def test_unknown_accelerator_name_lists_legal_values(env_accelerator) -> None:
    env_accelerator("tpu")
    with pytest.raises(ValueError, match="legal values"):
        get_accelerator()
    with pytest.raises(ValueError, match="legal values"):
        get_accelerator("tpu")
    with pytest.raises(TypeError, match="name must be a str"):
        get_accelerator(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_unavailable_accelerator_is_a_clear_runtime_error(env_accelerator, kind: str) -> None:
    if kind in available_accelerators():
        pytest.skip(f"{kind} is available on this machine")
    env_accelerator(kind)
    with pytest.raises(RuntimeError, match=f"DIFFCOMM_ACCELERATOR='{kind}'.*not available"):
        get_accelerator()
    with pytest.raises(DiffcommError, match="available here: .*'cpu'"):
        get_accelerator(kind)


def test_set_accelerator_overrides_and_restores(env_accelerator) -> None:
    env_accelerator("")
    original = get_accelerator()
    custom = CPUAccelerator()
    assert accelerator.selected() is None
    with set_accelerator(custom) as selected:
        assert selected is custom
        assert get_accelerator() is custom and accelerator.selected() is custom
        with set_accelerator("cpu"):
            assert get_accelerator() is get_accelerator("cpu")
            assert accelerator.selected() == "cpu"  # a kind's shared instance: its name
        assert get_accelerator() is custom
    assert get_accelerator() is original and accelerator.selected() is None
    with pytest.raises(TypeError, match="accelerator must be"):
        set_accelerator(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="legal values"):
        set_accelerator("tpu")
    assert get_accelerator() is original


def test_accelerator_is_abstract() -> None:
    with pytest.raises(TypeError):
        Accelerator()  # type: ignore[abstract]


# ------------------------------------------------------------------------ communication


@pytest.mark.parametrize("name", ["gloo", "GLOO", "mpi", "ucc", "fake", "no-such-backend"])
def test_host_backends_communicate_on_the_cpu(name: str) -> None:
    assert comm_device(name) == torch.device("cpu")
    assert isinstance(comm_accelerator(name), CPUAccelerator)


@pytest.mark.parametrize(("name", "kind"), [("nccl", "cuda"), ("xccl", "xpu")])
def test_device_backends_communicate_on_their_accelerator(name: str, kind: str) -> None:
    if kind in AVAILABLE:
        acc = get_accelerator(kind)
        assert comm_accelerator(name) is acc
        assert comm_device(name) == torch.device(kind, acc.current_device())
    else:  # no such device here: the host is the fallback, never an error
        assert comm_device(name) == torch.device("cpu")
        assert comm_accelerator(name).name == "cpu"
    assert comm_device(name.upper()) == comm_device(name)


def test_backend_asks_the_accelerator_for_its_metadata_device() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from diffcomm import backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        expected = comm_device(dist.get_backend())
        assert expected == torch.device("cpu")
        # the group record and the backend protocol both take the device from the accelerator
        assert backend.group_info(None).device == expected
        assert backend.get_backend().comm_device(None) == expected
    finally:
        dist.destroy_process_group()
