"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), tensors named by the unwrapped
module: saved on N ranks, loaded on M, DDP into FSDP2 and back. A meta file, written last, marks
one complete and holds each file's size and SHA-256: DCP unpickles (any code can run), so a
checkpoint loads only if every file matches, checked first; load only checkpoints you trust."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    """A DCP checkpoint into ``directory``, its meta file written last."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        written = dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    if rank == 0:  # it writes .metadata once every rank's data files are written
        check_every_file_here(directory, written)
        files = [  # DCP's: its .metadata and data files, not another hidden one being written
            p
            for p in sorted(directory.iterdir())
            if p.is_file() and p.name != META and (p.name == ".metadata" or p.name[0] != ".")
        ]
        meta = {
            "task": config.task,
            "preset": config.preset,
            "seed": config.seed,
            "wrapper": config.wrapper,
            "world_size": world,
            "step": step,
            "sha256": {p.name: _sha256(p) for p in files},
            "files": {p.name: p.stat().st_size for p in files},
        }
        write_text_atomic(directory / META, json.dumps(meta))


def check_every_file_here(directory: Path, written: Any) -> None:
    """A ValueError naming the files of DCP's metadata ``written`` not in ``directory``: ranks on
    other hosts wrote into a folder of their own."""
    listed = {
        getattr(info, "relative_path", None)
        for info in (getattr(written, "storage_data", None) or {}).values()
    }
    missing = sorted(name for name in listed if name and not (directory / name).is_file())
    if missing:
        raise ValueError(
            f"checkpoint {directory}: {', '.join(missing)}, written by other ranks, are not in "
            "this folder: on several hosts checkpoint_dir must be a folder every host sees at "
            "the same path (a shared filesystem)"
        )


def load(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig) -> int:
    """Load ``config.load_from`` into the (wrapped) model and optimizer; returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = check_loadable(config)
    model_state, optim_state = get_state_dict(model, optimizer)  # shapes and shards to fill
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=config.load_from)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(meta["step"])


def check_loadable(config: RunConfig) -> dict:
    """The meta of ``config.load_from`` if this run may load it (every file as saved, by the
    run's task and preset), else a ValueError saying why; nothing unpickled."""
    meta = _verified_meta(Path(config.load_from))
    for key in ("task", "preset"):
        if meta.get(key) != getattr(config, key):
            raise ValueError(
                f"checkpoint {config.load_from} was saved by {key} {meta.get(key)!r}; this run has "
                f"{key} {getattr(config, key)!r}"
            )
    return meta


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it is a complete checkpoint, else the complete ``step-NNNNNN`` one under it
    of the highest step; a ValueError naming a file missing, truncated or changed."""
    path = Path(path)
    if (path / ".metadata").is_file() and not (path / META).is_file():
        raise ValueError(
            f"load_from={str(path)!r} holds a DCP checkpoint with no {META}: not saved by "
            f"accel.distributed, or its save was interrupted. {_UNPICKLES}"
        )
    candidates = [path] if (path / META).is_file() else path.glob("step-*/")
    steps = [p for p in candidates if (p / META).is_file()]
    if not steps:
        raise ValueError(
            f"load_from={str(path)!r} holds no complete DCP checkpoint (no .metadata and {META}, "
            "there or in a step-NNNNNN directory under it)"
        )
    latest = max(steps, key=lambda p: checkpoint_meta(p)["step"])
    _verified_meta(latest)
    return latest


def checkpoint_meta(path: str | os.PathLike) -> dict:
    """What saved a checkpoint (task, preset, seed, wrapper, world_size, step) and each file's
    size and SHA-256 (``files``, ``sha256``), read as JSON, unverified."""
    meta = Path(path) / META
    if not meta.is_file():
        raise ValueError(f"{path} was not saved by accel.distributed (no {META})")
    return json.loads(meta.read_text())


_UNPICKLES = "Refused: loading it would unpickle its files, which can run any code."


def _verified_meta(path: Path) -> dict:
    """The meta of the checkpoint at ``path`` if every file it records is there, whole, and
    matches its digest; else a ValueError naming the first file that does not."""
    try:
        meta = checkpoint_meta(path)
        digests, sizes = meta.get("sha256"), meta.get("files") or {}
    except (ValueError, AttributeError):
        raise ValueError(
            f"checkpoint {path}: no readable {META}: not saved by accel.distributed. {_UNPICKLES}"
        ) from None
    if not isinstance(digests, dict) or ".metadata" not in digests:
        raise ValueError(
            f"checkpoint {path}: its {META} records no SHA-256 digest of its files (saved by an "
            f"older accel.distributed, or not by it). {_UNPICKLES}"
        )
    for name, expected in digests.items():
        file, size, plain = path / str(name), sizes.get(name, 0), Path(str(name)).name == name
        if plain and not file.is_file():
            raise ValueError(f"checkpoint {path}: {name} is missing (saved with {size} bytes)")
        if plain and file.stat().st_size < size:
            raise ValueError(
                f"checkpoint {path}: {name} is truncated: {file.stat().st_size} of the {size} "
                "bytes saved"
            )
        if not plain or _sha256(file) != expected:
            raise ValueError(
                f"checkpoint {path}: {name} does not match the SHA-256 digest its {META} "
                f"recorded: changed (or removed) since it was saved. {_UNPICKLES}"
            )
    return meta


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _single_process_quiet():
    # DCP warns that it assumes one process when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield
