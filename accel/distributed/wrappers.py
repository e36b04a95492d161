"""How a rank wraps its model: ``none`` (the plain module), ``ddp`` (every rank holds the whole
model, gradients are all-reduced in buckets during the backward), ``fsdp2`` (``fully_shard`` on
every block of each ``nn.ModuleList`` and on the root: parameters, gradients and optimizer state
are split over the ranks and gathered block by block)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from accel.distributed.config import RunConfig


def wrap(
    model: nn.Module, config: RunConfig, device: torch.device, world: int
) -> tuple[nn.Module, list[str]]:
    """``model`` wrapped as ``config.wrapper`` says, and notes on what was done or skipped."""
    if config.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        bucket = {} if config.bucket_cap_mb is None else {"bucket_cap_mb": config.bucket_cap_mb}
        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=config.gradient_as_bucket_view,
            static_graph=config.static_graph,
            **bucket,
        )
        if config.mixed_precision == "bf16" and config.backend == "nccl":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif config.mixed_precision == "bf16":
            warnings.warn(
                "DDP mixed_precision='bf16' skipped: the bf16 all-reduce hook needs NCCL "
                f"on CUDA; this run uses {config.backend}, gradients go in fp32",
                stacklevel=2,
            )
            return ddp, ["bf16 gradient all-reduce skipped: torch's hook needs NCCL"]
        return ddp, []
    if config.wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        mesh = init_device_mesh(device.type, (world,))
        units = fsdp_units(model)
        for unit in [*units, model]:  # the blocks, then the root
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=config.reshard_after_forward,
                mp_policy=policy,
            )
        return model, [f"fully_shard on {len(units)} blocks + root"]
    return model, []


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: every element of every ``nn.ModuleList`` (the
    transformer blocks), innermost first; what is left is sharded with the root."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            found += [(name.count(".") + 1, child) for child in module]
    return [m for _, m in sorted(found, key=lambda pair: -pair[0])]
