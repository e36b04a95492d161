"""AdamW whose step is one kernel launch for every parameter group.

``MultiTensorAdamW`` is ``torch.optim.AdamW`` (decoupled weight decay, no amsgrad) for float32
parameters on one CUDA device, stepped by :mod:`accel.kernels.adamw`: one Triton launch updates
every tensor of every group, with per-group learning rates and weight decays read on the device,
where ``AdamW(fused=True)`` launches per group. It is capturable by construction (the step count
lives on the device): wrap ``step`` in :class:`accel.graphs.GraphedOptimizerStep`.

The plain reference, :func:`adamw_reference`, is torch's per-tensor capturable AdamW written out;
it runs where the kernel cannot (no CUDA and no ``TRITON_INTERPRET=1``, or a tensor that is not
contiguous float32), after one warning that says why.

Differences from ``torch.optim.AdamW``, by design: one step count for all parameters (a
parameter whose gradient is None on some step is skipped, but the count still advances for it),
and ``betas`` and ``eps`` shared by all groups (the launch takes them once).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import torch

from accel.sync import to_device_without_sync

Implementation = Literal["auto", "triton", "reference"]


def adamw_reference(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    groups: list[int],
    *,
    step: torch.Tensor,
    lrs: torch.Tensor,
    weight_decays: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """One AdamW update per tensor, in place: torch's single-tensor capturable AdamW. ``step``
    is the count after this step; ``lrs`` and ``weight_decays`` hold one value per group, and
    ``groups[i]`` is tensor i's group."""
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step).sqrt()
    for p, g, m, v, k in zip(params, grads, exp_avgs, exp_avg_sqs, groups, strict=True):
        lr = lrs[k]
        p.mul_(1 - lr * weight_decays[k])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.sub_((lr / bias_correction1) * m / denom)


def _kernels_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device`` (None if it can)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        return f"parameters on {device.type}: the kernel needs CUDA (or TRITON_INTERPRET=1)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


class MultiTensorAdamW(torch.optim.Optimizer):
    """AdamW stepped by one kernel launch for all groups (see the module docstring).

    ``lr`` per group is a float or a 0-d float32 tensor on the parameters' device (a tensor can
    change between steps, also under a CUDA graph; a float is copied to the device when it
    changes). ``implementation="auto"`` takes the kernel where it can run, else the reference
    with a warning; ``"triton"`` raises instead; ``"reference"`` always takes the reference.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        implementation: Implementation = "auto",
    ):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0 or eps < 0:
            raise ValueError(f"expected 0 <= betas < 1 and eps >= 0, got {betas=} {eps=}")
        if implementation not in ("auto", "triton", "reference"):
            raise ValueError(
                f"implementation must be 'auto', 'triton' or 'reference', got {implementation!r}"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True)
        super().__init__(params, defaults)
        shared = {(tuple(g["betas"]), g["eps"]) for g in self.param_groups}
        if len(shared) > 1:
            raise ValueError(
                f"MultiTensorAdamW: every group must share betas and eps (one launch takes them "
                f"once); got {sorted(shared)}"
            )
        tensors = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in tensors}
        if len(devices) != 1:
            raise ValueError(f"MultiTensorAdamW: parameters on one device expected, got {devices}")
        self.device = devices.pop()
        why = _kernels_unavailable(self.device) if implementation != "reference" else None
        odd = [p for p in tensors if p.dtype != torch.float32 or not p.is_contiguous()]
        if why is None and odd and implementation != "reference":
            why = f"{len(odd)} parameter(s) not contiguous float32 (first: {odd[0].dtype})"
        if why is not None and implementation == "triton":
            raise RuntimeError(f"MultiTensorAdamW(implementation='triton'): {why}")
        if why is not None:
            warnings.warn(
                f"MultiTensorAdamW: {why}; using the reference (a loop over tensors)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.uses_kernel = implementation != "reference" and why is None
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.device)
        self._plan = None
        self._warned = False
        self._constants: dict[tuple, torch.Tensor] = {}

    def _on_device(self, values: tuple[float, ...]) -> torch.Tensor:
        """Floats as a float32 device tensor, made once per distinct tuple."""
        if values not in self._constants:
            host = torch.tensor(values, dtype=torch.float32)
            self._constants[values] = to_device_without_sync(host, self.device)
        return self._constants[values]

    def _group_values(self, name: str) -> torch.Tensor:
        values = [g[name] for g in self.param_groups]
        if not any(isinstance(v, torch.Tensor) for v in values):
            return self._on_device(tuple(float(v) for v in values))
        return torch.stack(
            [
                v.reshape(()).to(torch.float32)
                if isinstance(v, torch.Tensor)
                else self._on_device((float(v),))[0]
                for v in values
            ]
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, grads, exp_avgs, exp_avg_sqs, groups = [], [], [], [], []
        for k, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                groups.append(k)
        if not params:
            return loss
        self.step_count.add_(1)
        lrs, wds = self._group_values("lr"), self._group_values("weight_decay")
        hyper = dict(betas=self.param_groups[0]["betas"], eps=self.param_groups[0]["eps"])
        kernel_ready = self.uses_kernel and all(
            g.dtype == torch.float32 and g.is_contiguous() for g in grads
        )
        if self.uses_kernel and not kernel_ready and not self._warned:
            warnings.warn(
                "MultiTensorAdamW: a gradient is not contiguous float32; this step uses the "
                "reference (a loop over tensors)",
                RuntimeWarning,
                stacklevel=2,
            )
            self._warned = True
        if not kernel_ready:
            adamw_reference(
                params, grads, exp_avgs, exp_avg_sqs, groups,
                step=self.step_count, lrs=lrs, weight_decays=wds, **hyper,
            )  # fmt: skip
            return loss
        from accel.kernels.adamw import AdamWPlan

        key = tuple(t.data_ptr() for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts)
        if self._plan is None or self._plan.key != key:  # built once while nothing moves
            self._plan = AdamWPlan(params, grads, exp_avgs, exp_avg_sqs, groups)
        self._plan.launch(self.step_count, lrs, wds, **hyper)
        return loss
