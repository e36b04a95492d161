"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) with ``get_state_dict`` and
``set_state_dict``, which name tensors by the unwrapped module's names: a save on N ranks loads on
M, and a DDP save loads into FSDP2 and back. A meta file, written last, marks a checkpoint complete
and says what saved it."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from accel.files import write_text_atomic

if TYPE_CHECKING:
    from accel.distributed.config import RunConfig

META = "accel-meta.json"


def save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    step: int,
    rank: int,
    world: int,
    directory: Path,
) -> None:
    """A DCP checkpoint into ``directory``; its meta file, written last, marks it complete and
    lists the checkpoint's files with their sizes (every rank's are written when DCP returns)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    if rank == 0:
        meta = {
            "task": config.task,
            "preset": config.preset,
            "seed": config.seed,
            "wrapper": config.wrapper,
            "world_size": world,
            "step": step,
            "files": {
                p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.name != META
            },
        }
        write_text_atomic(directory / META, json.dumps(meta))


def load(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig) -> int:
    """Load ``config.load_from`` into the (wrapped) model and optimizer; returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = checkpoint_meta(config.load_from)
    check_files(config.load_from)
    for key in ("task", "preset"):
        if meta[key] != getattr(config, key):
            raise ValueError(
                f"checkpoint {config.load_from} was saved by {key} {meta[key]!r}; this run has "
                f"{key} {getattr(config, key)!r}"
            )
    model_state, optim_state = get_state_dict(model, optimizer)  # shapes and shards to fill
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=config.load_from)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(meta["step"])


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it is a complete checkpoint, else the complete ``step-NNNNNN`` checkpoint
    under it with the highest step (one interrupted while saving has no meta file yet); a
    ValueError naming the file if one of its files is missing or truncated."""
    path = Path(path)
    steps = (
        [path]
        if (path / META).is_file()
        else [p for p in path.glob("step-*/") if (p / META).is_file()]
    )
    if not steps:
        raise ValueError(
            f"load_from={str(path)!r} holds no complete DCP checkpoint (no .metadata and {META}, "
            "there or in a step-NNNNNN directory under it)"
        )
    latest = max(steps, key=lambda p: checkpoint_meta(p)["step"])
    check_files(latest)
    return latest


def check_files(path: str | os.PathLike) -> None:
    """A ValueError naming the first file of the checkpoint at ``path`` that is missing or
    shorter than when it was saved (a copy cut short, a full disk), before DCP reads any."""
    sizes = checkpoint_meta(path).get("files", {".metadata": 0})  # saved before sizes were kept
    for name, size in sizes.items():
        file = Path(path) / name
        if not file.is_file():
            raise ValueError(f"checkpoint {path}: {name} is missing (saved with {size} bytes)")
        if file.stat().st_size < size:
            raise ValueError(
                f"checkpoint {path}: {name} is truncated: {file.stat().st_size} of the {size} "
                "bytes saved"
            )


def checkpoint_meta(path: str | os.PathLike) -> dict:
    """What saved a checkpoint: task, preset, seed, wrapper, world_size and step."""
    meta = Path(path) / META
    if not meta.is_file():
        raise ValueError(f"{path} was not saved by accel.distributed (no {META})")
    return json.loads(meta.read_text())


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it assumes one process when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield
