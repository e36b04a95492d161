import os

import pytest
import torch

from accel import profiling
from accel.lab import profile_step
from accel.memory import peak_memory
from accel.profiling import quiet_profile


def test_profile_step_keeps_kinetos_start_and_stop_lines_off_stderr(capfd):
    x = torch.randn(64, 64)
    profile_step(lambda: x @ x, steps=2, warmup=1, device="cpu")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "USDT:" not in err


def test_the_cpu_memory_profile_keeps_them_off_stderr_too(capfd):
    peak_memory(lambda: torch.randn(256, 256).sum(), device="cpu")
    assert "USDT:" not in capfd.readouterr().err


def test_other_lines_written_to_stderr_while_profiling_still_come_through(capfd):
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        os.write(
            2,
            b"USDT:2026-11-24 11:46:24 7395:7395 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
            b"a warning worth seeing\n",
        )
        os.write(
            2, b"STAGE:2026-11-24 11:46:54 7491:7491 Controller.cpp:294] Completed Stage: Warm Up\n"
        )
    err = capfd.readouterr().err
    assert err == "a warning worth seeing\n"


def test_the_profilers_note_on_memory_allocated_before_it_started_is_kept_off_stderr(capfd):
    # c10's note when a block allocated before the profile is freed inside it: about the
    # profile's own bookkeeping, nothing the profiled code can act on
    note = (
        b"[W1126 01:03:22.590173902 CPUAllocator.cpp:245] Memory block of unknown size was "
        b"allocated before the profiling started, profiler results will not include the "
        b"deallocation event\n"
    )
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        os.write(2, note + b"[W1126 01:03:22.1 Foo.cpp:1] a warning worth seeing\n")
    assert capfd.readouterr().err == "[W1126 01:03:22.1 Foo.cpp:1] a warning worth seeing\n"


CPU_ONLY = [torch.profiler.ProfilerActivity.CPU]


CUDA_TOO = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def test_a_device_profile_asks_kineto_to_detach_cupti_when_it_stops_and_leaves_the_environment_as_found(
    monkeypatch,
):
    # an attached CUPTI slows every later kernel launch of the user's process
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    with profiling._cupti_detached_after(profiling._profiles_device(CUDA_TOO)):
        during = os.environ.get("TEARDOWN_CUPTI")
    assert during == "1"
    assert "TEARDOWN_CUPTI" not in os.environ


def test_a_host_profile_asks_for_no_teardown():
    """A teardown asked of a profile that attached nothing waits for a CUDA call that a process
    with no CUDA work never makes: its exit then hangs on it."""
    assert not profiling._profiles_device(CPU_ONLY)
    assert profiling._profiles_device(None) == torch.cuda.is_available()
    with quiet_profile(activities=CPU_ONLY):
        assert "TEARDOWN_CUPTI" not in os.environ


@pytest.mark.parametrize("theirs", ["0", "1"])
def test_the_users_own_teardown_setting_is_kept_and_a_device_profile_ends_with_a_cuda_call(
    monkeypatch, theirs
):
    """The user's "1" asks for the same teardown ours does, which ends in a CUDA call."""
    synced = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(True))
    monkeypatch.setenv("TEARDOWN_CUPTI", theirs)
    with profiling._cupti_detached_after(True):
        assert os.environ["TEARDOWN_CUPTI"] == theirs
    assert os.environ["TEARDOWN_CUPTI"] == theirs and synced == [True]


def test_a_teardown_setting_torch_makes_during_the_profile_is_kept(monkeypatch):
    # torch sets "0" where CUDA graphs and an old CUDA cannot survive the teardown
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    with profiling._cupti_detached_after(True):
        os.environ["TEARDOWN_CUPTI"] = "0"
    assert os.environ["TEARDOWN_CUPTI"] == "0"


def _fake_profile(monkeypatch, rounds, launch="cudaLaunchKernel"):
    """profiling.device_profile yielding, profile after profile, the events of ``rounds``: a step
    mark, a kernel launch inside it and, where the round says so, the kernel it launched."""
    import contextlib
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from accel import profiling

    def event(name, device_type, start, end):
        return SimpleNamespace(name=name, device_type=device_type,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    profiles = []

    @contextlib.contextmanager
    def device_profile(device, **kwargs):
        kernel = rounds[len(profiles)]
        events = [event(profiling.STEP_MARK, DeviceType.CPU, 0.0, 10.0),
                  event(launch, DeviceType.CPU, 1.0, 2.0)]  # fmt: skip
        events += [event("gemm", DeviceType.CUDA, 3.0, 8.0)] if kernel else []
        profiles.append(SimpleNamespace(events=lambda: events))
        yield profiles[-1]

    monkeypatch.setattr(profiling, "device_profile", device_profile)
    return profiles


def test_a_cuda_profile_that_lost_the_devices_events_is_taken_again(monkeypatch):
    """Kernels launched and none recorded: CUPTI was not attached for that profile (a teardown
    of the one before can still be under way). Profiled again, the steps show their kernels."""
    from accel.profiling import profile_steps

    profiles = _fake_profile(monkeypatch, rounds=[False, True])
    run = profile_steps(lambda: None, torch.device("cuda"), steps=1)
    assert len(profiles) == 2 and [e.name for e in run.work] == ["gemm"]


def test_a_cuda_profile_that_keeps_losing_them_says_so(monkeypatch):
    import pytest

    from accel.profiling import profile_steps

    _fake_profile(monkeypatch, rounds=[False, False])
    with pytest.raises(RuntimeError, match="no kernel"):
        profile_steps(lambda: None, torch.device("cuda"), steps=1)


def test_a_profile_of_graph_replays_alone_is_not_taken_again(monkeypatch):
    """Whether a CUDA graph's kernels are traced depends on the CUDA version: replays that show
    no kernel are not a lost profile."""
    from accel import profiling

    profiles = _fake_profile(monkeypatch, rounds=[False], launch="cudaGraphLaunch")
    run = profiling.profile_steps(lambda: None, torch.device("cuda"), steps=1)
    assert len(profiles) == 1 and run.work == []


def test_the_devices_copies_of_user_ranges_are_not_its_work():
    """The optimizer's ``Optimizer.step#AdamW.step`` range is copied onto the device's timeline,
    spanning the kernels it launched: counted as work, its time would count twice."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from accel.profiling import device_work

    def event(name, device_type, annotation=False):
        return SimpleNamespace(name=name, device_type=device_type, is_user_annotation=annotation)

    events = [event("Optimizer.step#AdamW.step", DeviceType.CUDA, annotation=True),
              event("multi_tensor_apply_kernel", DeviceType.CUDA),
              event("aten::add_", DeviceType.CPU), event("accel.step", DeviceType.CUDA)]  # fmt: skip
    work = device_work(events, frozenset({"accel.step"}))
    assert [e.name for e in work] == ["multi_tensor_apply_kernel"]


def test_a_probed_profile_measures_the_profilers_cost_per_event_apart_from_the_steps():
    from accel.profiling import profile_steps

    x = torch.randn(64, 64)
    state = torch.get_rng_state()
    plain = profile_steps(lambda: x @ x, torch.device("cpu"), steps=2)
    probed = profile_steps(lambda: x @ x, torch.device("cpu"), steps=2, probe=True)
    assert plain.event_us == 0.0 and 0.0 <= probed.event_us < 1e3
    assert len(probed.work) == len(plain.work)  # the probe's own adds are not the steps' work
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws nothing
