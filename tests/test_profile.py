import json
import math

import pytest
import torch

from accel.measure.profile import profile_step
from accel.profiling import union_length


def three_matmuls(x, w):
    return lambda: ((x @ w) @ w) @ w


def test_profiler_counts_kernels_per_step(device, seed):
    x, w = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    report = profile_step(three_matmuls(x, w), steps=4, warmup=1, device=device)
    kernels = report.kernels
    if device.type == "cpu":
        mm = kernels[kernels["name"] == "aten::mm"]
        assert int(mm["count"].iloc[0]) == 12
        assert "aten::matmul" not in set(kernels["name"])  # it only dispatches to mm
        assert math.isnan(report.syncs_per_step)
    else:
        assert kernels["count"].sum() == 12
        assert report.launches_per_step == 3
        assert report.syncs_per_step == 0
    assert report.kernels["per_step"].sum() == 3
    assert 0.0 <= report.idle_fraction < 1.0
    assert report.window_us > 0 and report.busy_us > 0


def test_ops_table_sees_every_aten_call(device, seed):
    x = torch.randn(32, 32, device=device)
    report = profile_step(lambda: (x + 1).relu_().sum(), steps=2, warmup=0, device=device)
    counts = dict(zip(report.ops["name"], report.ops["count"], strict=True))
    assert counts["aten::add"] == 2 and counts["aten::relu_"] == 2 and counts["aten::sum"] == 2


def test_timeline_is_ordered_and_inside_the_window(device, seed):
    x = torch.randn(128, 128, device=device)
    report = profile_step(lambda: x.exp().sin().cos(), steps=3, warmup=1, device=device)
    t = report.timeline
    assert list(t["start_us"]) == sorted(t["start_us"])
    assert (t["end_us"] >= t["start_us"]).all()
    assert t["end_us"].max() <= report.window_us + 1e-6


def test_peak_memory_counts_a_large_temporary(device, seed):
    x = torch.randn(1024, 1024, device=device)  # 4 MiB; x * 2 allocates another
    report = profile_step(lambda: (x * 2).sum(), steps=2, warmup=1, device=device)
    assert report.peak_memory_bytes >= x.numel() * 4


def test_trace_export_is_chrome_json(tmp_path, device):
    x = torch.randn(16, device=device)
    path = tmp_path / "trace.json"
    report = profile_step(lambda: x * 2, steps=1, warmup=0, device=device, trace_path=path)
    assert report.trace_path == path
    assert "traceEvents" in json.loads(path.read_text())


def test_union_length_merges_overlaps():
    assert union_length([[0, 2], [1, 3], [5, 6], [5.5, 5.7]]) == 4
    assert union_length([]) == 0


def test_profile_step_names_a_step_that_is_not_callable():
    with pytest.raises(TypeError, match=r"profile_step\(fn\): expected a function.*got 42 \(int\)"):
        profile_step(42)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"warmup": -5}, ValueError, r"warmup must be an int >= 0, got -5"),
        ({"steps": 0}, ValueError, r"steps must be an int >= 1, got 0"),
        ({"steps": 2.5}, TypeError, r"steps must be an int >= 1, got 2\.5 \(float\)"),
        ({"warmup": "2"}, TypeError, r"warmup must be an int >= 0, got '2' \(str\)"),
        ({"steps": True}, TypeError, r"steps must be an int >= 1, got True \(bool\)"),
    ],
)
def test_profile_step_refuses_bad_counts_before_running_the_step(kwargs, error, message):
    ran = []
    with pytest.raises(error, match=message):
        profile_step(lambda: ran.append(1), device="cpu", **kwargs)
    assert ran == []


def test_profile_step_refuses_a_folder_as_trace_path_before_running_the_step(tmp_path):
    ran = []
    with pytest.raises(
        ValueError, match=r"trace_path .*: expected a file to write, found a folder"
    ):
        profile_step(lambda: ran.append(1), steps=1, warmup=0, device="cpu", trace_path=tmp_path)
    assert ran == [] and list(tmp_path.iterdir()) == []
