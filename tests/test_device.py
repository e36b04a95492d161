import pytest
import torch

from accel.measure import device as d


def test_preset_follows_the_device(monkeypatch):
    monkeypatch.delenv(d.PRESET_ENV, raising=False)
    assert d.preset("cpu") == "cpu"
    assert d.preset(torch.device("cuda")) == "gpu"


@pytest.mark.parametrize(("name", "device"), [("cpu", "cpu"), ("cpu", "cuda"), ("gpu", "cuda")])
def test_preset_forced_by_environment(monkeypatch, name, device):
    monkeypatch.setenv(d.PRESET_ENV, name)
    assert d.preset(torch.device(device)) == name


def test_unknown_preset_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv(d.PRESET_ENV, "huge")
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*expected one of cpu, gpu"):
        d.preset()


def test_versions_name_device_and_stack():
    info = d.versions("cpu")
    assert info["torch"] == torch.__version__
    assert info["device_type"] == "cpu"
    assert info["preset"] in d.PRESETS
    assert {"triton", "cuda", "driver", "python", "cpu"} <= set(info)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
        ("AMD EPYC 7B13 64-Core Processor", "amd-epyc-7b13-64-core-processor"),
        ("???", "unknown"),
    ],
)
def test_slug(name, expected):
    assert d.slug(name) == expected


def test_cpu_results_stem_is_marked_cpu():
    assert d.results_stem("cpu").startswith("cpu-")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU setup leaves the threads alone")
def test_setup_on_a_cpu_says_it_runs_torch_on_one_thread(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        here = d.setup()
        assert torch.get_num_threads() == 1 and not here.on_gpu
        assert "torch on 1 thread (was 2)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
