"""What :func:`accel.distributed.launch` raises besides ValueError for bad arguments: no launcher,
a run past its timeout, a failed rank, a run that ended without results."""

from __future__ import annotations


class LaunchError(RuntimeError):
    """The run could not start, or ended without results."""


class LauncherNotFound(LaunchError):
    """Neither torchrun nor ``torch.distributed.run`` can be run here."""


class LaunchTimeout(LaunchError):
    """The run took longer than ``timeout``; every process of it was killed."""


class RankFailed(LaunchError):
    """A rank raised (or died): ``rank``, its ``traceback``, and the launcher's ``output``."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        traceback: str,
        output: str,
        exitcode: int | None,
        pids: tuple[int, ...] = (),
    ):
        super().__init__(message)
        self.rank, self.traceback, self.output = rank, traceback, output
        self.exitcode, self.pids = exitcode, pids
