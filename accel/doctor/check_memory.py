"""Checks of a step's memory on the GPU: allocations from the driver in a steady-state step,
peak memory against the device, memory reserved and unused, and activations that activation
checkpointing would trade for a larger batch.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from accel.doctor.findings import Evidence, Finding, check

NEAR_CAPACITY = 0.85  # peak over the device's memory at which a larger batch no longer fits
UNUSED_RESERVED = 0.25  # reserved but never allocated, over reserved, worth a word


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks of the longest run of same-type modules in one container (a
    transformer's layers), the unit activation checkpointing recomputes; [] if none."""
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            kinds = Counter(type(child) for _, child in children)
            if not kinds:
                continue
            kind, count = kinds.most_common(1)[0]
            if count >= 2 and count > len(best) and kind not in (nn.ReLU, nn.GELU, nn.Dropout):
                prefix = f"{name}." if name else ""
                best = [f"{prefix}{n}" for n, c in children if type(c) is kind]
    return best


# fewer per step is an allocation now and then (a compiled step's pool growing once), not a
# step that allocates from the driver every time
DRIVER_ALLOCS_PER_STEP = 1.0


@check("memory")
def memory(evidence: Evidence) -> list[Finding]:
    m = evidence.memory
    if not evidence.cuda or not m:
        return []
    found = []
    drivers = m.get("device_allocs", 0.0) + m.get("retries", 0.0)
    if drivers >= DRIVER_ALLOCS_PER_STEP:
        found.append(Finding(
            kind="memory",
            title=f"{drivers:.1f} allocations from the driver per steady-state step",
            evidence=f"cudaMalloc {m.get('device_allocs', 0):.1f} and allocator retries "
            f"{m.get('retries', 0):.1f} per step after warm-up (each may wait for the device)",
            cost_model="not predicted: a cudaMalloc costs microseconds to milliseconds, a "
            "retry frees the cache and waits for the device",
            notebook="03_memory",
            change="keep shapes fixed from step to step, or\n"
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # set before starting Python",
        ))
    found += _capacity(evidence, m)
    return found


def _capacity(evidence: Evidence, m: dict) -> list[Finding]:
    total, resident, peak = m["total_bytes"], m["resident_bytes"], m["peak_bytes"]
    reserved, gib = m["reserved_bytes"], 2**30
    found = []
    blocks = [b for model in evidence.parts.models for b in repeated_blocks(model)]
    # a larger batch matters only where the batch can no longer grow: near the device's memory
    if resident + peak > NEAR_CAPACITY * total:
        found.append(Finding(
            kind="memory",
            title=f"activations are {peak / (resident + peak):.0%} of the step's peak memory",
            evidence=f"{(resident + peak) / gib:.2f} GiB at the peak of {total / gib:.0f} GiB "
            f"({resident / gib:.2f} GiB held before the step: weights, gradients, optimizer "
            f"state); {len(blocks)} repeated blocks to checkpoint",
            cost_model="checkpointing every block keeps only its input; the batch can grow "
            "until the freed memory is used again (try_fixes measures the step's peak with "
            "and without: its 'batch room')",
            notebook="03_memory",
            change="from accel.recompute import checkpoint_blocks\n"
            f"checkpoint_blocks(model, {blocks[:3] + (['...'] if len(blocks) > 3 else [])})",
            fixes=("checkpointing",) if blocks else (),
        ))
    unused = reserved - (resident + peak)
    # memory held and unused costs nothing until the device is nearly full
    if reserved > NEAR_CAPACITY * total and unused > UNUSED_RESERVED * reserved:
        found.append(Finding(
            kind="memory",
            title=f"{unused / gib:.2f} GiB reserved by the allocator and never used",
            evidence=f"reserved {reserved / gib:.2f} GiB against a peak of "
            f"{(resident + peak) / gib:.2f} GiB allocated (blocks split and cached)",
            cost_model="not a time cost: memory another process or a larger batch cannot use",
            notebook="03_memory",
            change="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ))
    return found
