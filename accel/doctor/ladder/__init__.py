"""A ladder of training scripts as people write them, each beside its hand-optimized twin: what
the doctor's fixes are measured against (the twin's speedup is the headroom there was).

Each module is one script with two builders of the same signature, ``first_written(device,
preset)`` (the step as a tutorial's first commit writes it) and ``hand_optimized(device,
preset)`` (the same model, sizes, data and initial weights, written as the field's best public
version writes it), both returning a :class:`Script`. Every line the hand-optimization changes
carries ``# ground truth: <kind>`` (the doctor's finding kinds); :func:`ground_truth` reads them.

- ``gpt2``: GPT-2 small in nanoGPT's lineage;
- ``resnet``: a ResNet-18 with BatchNorm and a torchvision-reference loop;
- ``bert``: a BERT-base masked-LM step with a padding mask;
- ``vit``: a ViT-S/16 with per-parameter gradient clipping;
- ``rnn_lm``: PyTorch's word-language-model LSTM.

Presets: ``"gpu"`` (the real sizes) and ``"cpu"`` (tiny, for tests). No script draws from the
global random state, and a twin's ``torch.backends`` settings hold only during its step's calls.
Dropout is left out: it would draw from the caller's random state, and costs both versions alike.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accel.doctor.products import backend_flags
from accel.measure.device import check_preset, default_device

__all__ = ["SCRIPTS", "Script", "build", "compiled", "ground_truth", "marked_lines", "sizes",
           "tuned_backends"]  # fmt: skip

SCRIPTS = ("gpt2", "resnet", "bert", "vit", "rnn_lm")


@dataclass
class Script:
    name: str
    step: Callable[[Any], Any]  # one training step: step(batch) -> the loss tensor
    batch: Any  # what step takes (host tensors where the script moves them itself)
    compiled: bool = False  # whether step compiles on its first calls (time it after warm-up)


def build(
    name: str,
    *,
    optimized: bool = False,
    device: torch.device | str | None = None,
    preset: str = "gpu",
) -> Script:
    """Script ``name`` as first written or ``optimized``, on ``device`` (a GPU if any)."""
    _check_script(name)
    module = importlib.import_module(f"{__name__}.{name}")
    builder = module.hand_optimized if optimized else module.first_written
    return builder(torch.device(device) if device is not None else default_device(), preset)


def ground_truth(name: str) -> dict[str, list[int]]:
    """kind -> the lines of script ``name`` marked ``# ground truth: <kind>[, ...]``."""
    _check_script(name)
    found: dict[str, list[int]] = {}
    path = Path(__file__).parent / f"{name}.py"
    for number, match in marked_lines(path, r"# ground truth: ([\w, ]+)$"):
        for kind in match[1].split(","):
            found.setdefault(kind.strip(), []).append(number)
    return found


def _check_script(name: str) -> None:
    if name not in SCRIPTS:
        raise ValueError(f"unknown ladder script {name!r}; expected one of {', '.join(SCRIPTS)}")


def marked_lines(path: Path, pattern: str) -> list[tuple[int, re.Match]]:
    """(line number, match) of each line of code in ``path`` with a comment matching ``pattern``."""
    lines = enumerate(path.read_text().splitlines(), 1)
    matches = ((n, re.search(pattern, line), line) for n, line in lines)
    return [(n, m) for n, m, line in matches if m and not line.lstrip().startswith("#")]


def sizes(preset: str, *, gpu: dict, cpu: dict) -> dict:
    """The preset's sizes (a copy); ``cpu``: a step well under half a second."""
    check_preset(preset, "the ladder's preset argument")
    return dict(gpu if preset == "gpu" else cpu)


def tuned_backends(*, cudnn_benchmark: bool = False) -> contextlib.AbstractContextManager:
    """TF32 (and cuDNN's autotuner if asked) for one call, as a twin sets them."""
    return backend_flags(tf32=True, **({"cudnn_benchmark": True} if cudnn_benchmark else {}))


def compiled(model: torch.nn.Module, device: torch.device) -> Callable[..., Any]:
    """The twin's model compiled, with CUDA graphs on a GPU (``mode="reduce-overhead"``): once
    the rest of the hand-optimization has shortened the device's work, launching it is what an
    expert removes next, and a twin without it is not the headroom the doctor is judged against."""
    return torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default")
