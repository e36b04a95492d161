"""AdamW over many tensors and parameter groups in one Triton launch.

torch's ``AdamW(fused=True)`` launches its kernel once per parameter group (a group's learning
rate and weight decay are arguments of the launch), plus a step-count kernel per group. A model
whose learning rates are set per group (the nested optimizer's controller: 14 groups) pays those
launches, and in a CUDA graph each launch still costs its ramp-up and tail. ``_adamw_kernel``
updates every tensor of every group in one launch: a table holds, per tensor, the addresses of
its parameter, gradient, two moments and step count, its length and its group; a second table
maps each program to (tensor, first element). Learning rates and weight decays are read per group
from device tensors, each tensor's step count from the device, and the kernel advances the counts
itself (torch's fused AdamW launches a step-count kernel per group before its update): nothing is
read back, so the step can be captured in a CUDA graph.

Each tensor's count advances once every program updating it has read it: the programs of a
tensor of several blocks count themselves in an atomic counter once all their warps have read
it (a barrier), and the last one to arrive writes the new count (its acquire follows the
others' release) and resets the counter for the next launch. A tensor of one block writes its
count itself. One atomic per 1024 elements of a large tensor; no launch more.

The math is torch's AdamW (``torch/optim/adamw.py``, capturable form), in float32:
``t += 1; p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
p -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``, with torch's two-sided ``lerp``
(so inf gradients give torch's NaN or inf) and ``1 - b**t`` taken without cancellation
(:func:`_one_minus_power`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# 1024 elements on 8 warps: one 16-byte access per tensor per thread. The step's time against
# the copy bandwidth is in results/*.csv, phase=overhead, the adamw sweep's bandwidth rows.
BLOCK = 1024
NUM_WARPS = 8


@triton.jit
def _one_minus_power(log_beta, step):
    """``1 - beta**step`` to a few float32 units: ``-expm1(x)``, x = step log(beta), as a Taylor
    series where exp(x) is near 1 (written as ``1 - exp(x)`` it loses up to 5 digits there: at
    beta 0.999 and step 1 its rounding is 6e-5 of the result). The same formula as
    ``accel.optim.one_minus_power``."""
    x = step * log_beta
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(x > -0.2, series, 1.0 - tl.exp(x))


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, lr, wd, step_size, bc2_sqrt, weight1, beta2,
            weight2, eps, MASKED: tl.constexpr):  # fmt: skip
    """One block of one tensor: loads, the AdamW update, stores (masked only at a tensor's end,
    so whole blocks keep 16-byte accesses). ``weight1``, ``weight2``: 1 - beta, rounded once
    from float64 as torch's scalars are; the first moment's lerp is ATen's, from the nearer end."""
    mask = offs < n if MASKED else None
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p * (1.0 - lr * wd)
    m = tl.where(weight1 < 0.5, m + weight1 * (g - m), g - (g - m) * (1.0 - weight1))
    v = v * beta2 + weight2 * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


@triton.jit
def _adamw_kernel(
    table_ptr,  # (7, T) int64: p, grad, exp_avg, exp_avg_sq, step addresses; numel; group
    block_tensor_ptr,  # (programs,) int32: the tensor each program updates
    block_start_ptr,  # (programs,) int64: its first element
    arrived_ptr,  # (T,) int32: programs of each tensor that have read its count; 0 between launches
    lr_ptr,  # (groups,) float32
    wd_ptr,  # (groups,) float32
    T,
    weight1,  # 1 - beta1
    beta2,
    weight2,  # 1 - beta2
    log_beta1,  # log(beta) in float64 on the host: -inf for beta 0
    log_beta2,
    eps,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = tl.load(block_start_ptr + pid)
    p_ptr = tl.load(table_ptr + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(table_ptr + T + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(table_ptr + 2 * T + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 3 * T + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # lets whole blocks use 16-byte loads and stores
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    step_ptr = tl.load(table_ptr + 4 * T + t).to(tl.pointer_type(tl.float32))
    n = tl.load(table_ptr + 5 * T + t)
    group = tl.load(table_ptr + 6 * T + t)
    lr = tl.load(lr_ptr + group)
    wd = tl.load(wd_ptr + group)
    step = tl.load(step_ptr) + 1.0
    bias_correction1 = _one_minus_power(log_beta1, step)
    bias_correction2 = _one_minus_power(log_beta2, step)
    step_size = lr / bias_correction1
    bc2_sqrt = tl.sqrt(bias_correction2)
    offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, lr, wd, step_size, bc2_sqrt, weight1, beta2,
                weight2, eps, MASKED=False)  # fmt: skip
    else:
        _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, lr, wd, step_size, bc2_sqrt, weight1, beta2,
                weight2, eps, MASKED=True)  # fmt: skip
    if n <= BLOCK:  # this tensor's one program (an empty tensor has one too)
        tl.store(step_ptr, step)
    else:  # every warp of this program has read the count, then one thread counts it in
        tl.debug_barrier()
        arrived = tl.atomic_add(arrived_ptr + t, 1, sem="acq_rel")
        if arrived == tl.cdiv(n, BLOCK) - 1:  # every other program of it has read the count
            tl.store(step_ptr, step)
            tl.store(arrived_ptr + t, 0)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on ``device`` without a host sync: pinned, then copied non-blocking (a
    pageable copy waits for the device, which a CUDA graph's warm-up step must not)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class AdamWPlan:
    """The launch for one set of tensors: the address table and the program -> block map.

    Built once per set of (parameter, gradient, moments, step count) tensors, which the caller
    has checked (float32, contiguous, moments the parameter's size, counts of one element, all
    on one device); a step then launches one kernel. ``key`` identifies the tensors by address: a
    plan is valid while none of them moves.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
        groups: list[int],
    ):
        device = params[0].device
        lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
        self.key = tuple(t.data_ptr() for ts in lists for t in ts)
        numels = [p.numel() for p in params]
        rows = [[t.data_ptr() for t in ts] for ts in lists] + [numels, list(groups)]
        self.table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
        blocks = [max(1, triton.cdiv(n, BLOCK)) for n in numels]  # an empty tensor's count too
        owner = torch.repeat_interleave(torch.arange(len(params)), torch.tensor(blocks))
        first = torch.cat([torch.arange(b, dtype=torch.int64) * BLOCK for b in blocks])
        self.block_tensor = _to_device(owner.to(torch.int32), device)
        self.block_start = _to_device(first, device)
        self.arrived = torch.zeros(len(params), dtype=torch.int32, device=device)
        self.aligned = all(t.data_ptr() % 16 == 0 for ts in lists[:4] for t in ts)
        self.tensors = len(params)

    def launch(self, lrs: torch.Tensor, wds: torch.Tensor, betas, eps) -> None:
        """One step of every tensor: each one's count advanced, its update with the new count."""
        grid = (self.block_tensor.numel(),)
        _adamw_kernel[grid](
            self.table,
            self.block_tensor,
            self.block_start,
            self.arrived,
            lrs,
            wds,
            self.tensors,
            1.0 - betas[0],
            float(betas[1]),
            1.0 - betas[1],
            _log(betas[0]),
            _log(betas[1]),
            float(eps),
            BLOCK=BLOCK,
            ALIGNED=self.aligned,
            num_warps=NUM_WARPS,
        )
