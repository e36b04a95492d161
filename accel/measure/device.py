"""Which device we run on, which size preset that implies, and the software stack's versions."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import subprocess
from typing import Literal, NamedTuple, get_args

import torch

from accel.errors import UsageError

Preset = Literal["cpu", "gpu"]
PRESETS: tuple[str, ...] = get_args(Preset)
PRESET_ENV = "ACCEL_PRESET"


def default_device() -> torch.device:
    """The first CUDA device if there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class PresetError(UsageError):
    """A preset that does not exist, or does not fit the device."""


def preset(device: torch.device | str | None = None) -> Preset:
    """The size preset: ``$ACCEL_PRESET`` if set, else ``gpu`` on CUDA and ``cpu`` elsewhere.
    A forced preset must fit the device: ``gpu`` sizes on a CPU would run for many minutes."""
    device = torch.device(device) if device is not None else default_device()
    forced = os.environ.get(PRESET_ENV, "").strip()
    if not forced:
        return "gpu" if device.type == "cuda" else "cpu"
    name = check_preset(forced, source=f"${PRESET_ENV}")
    if name == "gpu" and device.type != "cuda":
        raise PresetError(
            f"{PRESET_ENV}=gpu needs a CUDA GPU, and this run is on {device.type} "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()}): use cpu, or unset "
            f"{PRESET_ENV} to pick by device"
        )
    return name


def check_preset(name: str, source: str = "an argument") -> Preset:
    """Return ``name`` if it is a preset, else raise a PresetError listing the valid ones."""
    if name not in PRESETS:
        raise PresetError(
            f"unknown preset {name!r} (from {source}); expected one of {', '.join(PRESETS)}"
        )
    return name  # type: ignore[return-value]


def targets_judged(device: torch.device | str, preset: str) -> bool:
    """Whether a run is judged against its targets: every target is set for a CUDA GPU at the gpu
    preset, the sizes the targets were argued for; elsewhere a run shows its findings unjudged."""
    return torch.device(device).type == "cuda" and preset == "gpu"


class Setup(NamedTuple):
    """Where a notebook runs: ``device, size_preset, on_gpu, judged = lab.setup()``."""

    device: torch.device
    preset: Preset
    on_gpu: bool
    judged: bool  # whether targets are judged here (targets_judged)


def setup(*, interpret_triton: bool = False) -> Setup:
    """Pick the device and preset for a notebook and say so in one line.

    On a CPU the notebook runs on one thread: the cpu preset's ops take microseconds, and more
    threads only add hand-offs (and stall each other on a shared machine). ``interpret_triton``
    runs Triton kernels in Triton's interpreter where there is no GPU to compile them for.
    """
    device = default_device()
    name = preset(device)
    here = Setup(device, name, device.type == "cuda", targets_judged(device, name))
    threads = ""
    if not here.on_gpu:
        if torch.get_num_threads() != 1:
            threads = f", torch on 1 thread (was {torch.get_num_threads()})"
        torch.set_num_threads(1)
        if interpret_triton:
            os.environ["TRITON_INTERPRET"] = "1"
    verdict = "judged" if here.judged else "not judged (they are for a CUDA GPU, gpu preset)"
    print(
        f"{versions(device)['device']} ({device.type}), preset {here.preset!r}, targets {verdict}"
        + threads
    )
    return here


def device_name(device: torch.device | str | None = None) -> str:
    """A human name: the GPU's marketing name, or the CPU model."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model()


def slug(name: str) -> str:
    """File-name form of a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def results_stem(device: torch.device | str | None = None) -> str:
    """The stem of this machine's files under ``results/``: the GPU's name (with '-xN' on a
    machine of N > 1 GPUs, whose multi-GPU rows must not replace a one-GPU machine's), or
    'cpu-' + model."""
    device = torch.device(device) if device is not None else default_device()
    name = slug(device_name(device))
    if device.type != "cuda":
        return f"cpu-{name}"
    count = torch.cuda.device_count()
    return f"{name}-x{count}" if count > 1 else name


def gpus_of_stem(stem: str) -> int:
    """How many GPUs the machine of a :func:`results_stem` has (1 without an '-xN')."""
    match = re.fullmatch(r".+-x(\d+)", stem)
    return int(match.group(1)) if match else 1


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _driver_version() -> str | None:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def versions(device: torch.device | str | None = None) -> dict[str, str | None]:
    """Device, preset and software versions, as written beside every measurement."""
    device = torch.device(device) if device is not None else default_device()
    on_cuda = device.type == "cuda"
    info: dict[str, str | None] = {
        "device": device_name(device), "device_type": device.type, "preset": preset(device),
        "torch": torch.__version__, "triton": _package_version("triton"),
        "cuda": torch.version.cuda, "driver": _driver_version() if on_cuda else None,
        "python": platform.python_version(),
        "cpu": _cpu_model(), "cpu_threads": str(torch.get_num_threads()),
    }  # fmt: skip
    if on_cuda:
        props = torch.cuda.get_device_properties(device)
        info["capability"] = f"{props.major}.{props.minor}"
        info["sms"] = str(props.multi_processor_count)
        info["memory_gib"] = f"{props.total_memory / 2**30:.1f}"
    return info
