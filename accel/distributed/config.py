"""What a run is asked (:class:`RunConfig`, the communication settings) and returns
(:class:`RunResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WRAPPERS: tuple[str, ...] = ("none", "ddp", "fsdp2")

# Communication settings away from torch's defaults, each measured alone by the bench's settings
# part (none paid beyond the spread of two default runs); ``launch(..., **COMM_SETTINGS)`` passes
# all of them, each wrapper reading its own.
COMM_SETTINGS: dict[str, Any] = {
    "bucket_cap_mb": 100,  # DDP: fewer, larger all-reduces (default 25 MB)
    "gradient_as_bucket_view": True,  # DDP: gradients live in the buckets, no copy in or out
    "static_graph": True,  # DDP: the same parameters get gradients every step
    "reshard_after_forward": False,  # FSDP2: keep gathered blocks for the backward (more memory)
    "mixed_precision": "bf16",  # DDP: bf16 gradients (CUDA); FSDP2: bf16 parameter gathers
    # what multi-host launch scripts commonly export; within one NVLink host only the channels
    # can change anything (sockets are for TCP between hosts, "disable=0" is NCCL's default)
    "nccl_env": {
        "NCCL_NSOCKS_PERTHREAD": "4",
        "NCCL_SOCKET_NTHREADS": "2",
        "NCCL_MIN_NCHANNELS": "4",
        "NCCL_P2P_DISABLE": "0",
        "NCCL_IB_DISABLE": "0",
    },
}
DEFAULT_TASK = "accel.distributed:toy_task"


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs, written as JSON for the ranks to read."""

    task: str = DEFAULT_TASK
    wrapper: str = "none"
    nprocs: int = 1
    steps: int = 10
    warmup: int = 2
    preset: str = "cpu"
    seed: int = 0
    lr: float = 1e-3
    scaling: str = "strong"
    backend: str = "gloo"
    autocast: str | None = None
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    reshard_after_forward: bool = True
    mixed_precision: str | None = None
    nccl_env: dict[str, str] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    checkpoint_at: int | None = None
    checkpoint_every: int | None = None
    load_from: str | None = None
    timeout: float = 600.0
    # several hosts (torchrun's names): nnodes agents of nprocs ranks each meet at rdzv_endpoint
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "accel"
    out_dir: str = ""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nprocs

    @property
    def local_ranks(self) -> range:
        """The global ranks of this node (torchrun numbers them after the lower nodes')."""
        return range(self.node_rank * self.nprocs, (self.node_rank + 1) * self.nprocs)


@dataclass
class RunResult:
    """A finished run, plain lists of dicts: ``steps``, the per-step rows of this node's first
    rank (rank 0 on one host), ``ranks``, the summary of each of this node's ranks. Losses are
    means over every rank of every node, the same on each node."""

    config: RunConfig
    steps: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    output: str = ""
    pids: tuple[int, ...] = ()

    @classmethod
    def from_records(
        cls, config: RunConfig, records: list[dict], *, output: str, pids: tuple[int, ...] = ()
    ) -> RunResult:
        """From every rank's record (``{"summary": ..., "steps": [...]}``), lowest rank first."""
        steps = list(records[0]["steps"])
        return cls(config, steps, [r["summary"] for r in records], output=output, pids=pids)

    @property
    def summary(self) -> dict[str, Any]:
        """This node's first rank's summary (rank 0's on one host)."""
        return dict(self.ranks[0])
