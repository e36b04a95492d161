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

Its ``state_dict`` has torch's AdamW layout (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter),
so a checkpoint resumes exactly, also through ``torch.distributed.checkpoint``, and moves between
the two optimizers; a state whose parameters have different step counts is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import torch

from accel import triton_support
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
    bias_correction1 = one_minus_power(beta1, step)
    bias_correction2_sqrt = one_minus_power(beta2, step).sqrt()
    for p, g, m, v, k in zip(params, grads, exp_avgs, exp_avg_sqs, groups, strict=True):
        lr = lrs[k]
        p.mul_(1 - lr * weight_decays[k])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.sub_((lr / bias_correction1) * m / denom)


def one_minus_power(beta: float, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta**step`` in float32 to a few units in the last place: ``-expm1(step log beta)``
    (``1 - beta**step`` itself loses up to 5 digits to cancellation when beta is near 1: at beta
    0.999 and step 1 its rounding is 6e-5 of the result, and AdamW's first steps divide by it).
    The kernel evaluates the same formula."""
    log_beta = math.log(beta) if beta > 0 else -math.inf
    x = step * log_beta
    series = -x * (1 + x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120)))))
    return torch.where(x > -0.2, series, 1 - torch.exp(x))


class MultiTensorAdamW(torch.optim.Optimizer):
    """AdamW stepped by one kernel launch for all groups (see the module docstring).

    Host cost of a step: one pass over the parameters to collect what has a gradient (as
    torch's optimizers do), a key of their addresses, and one launch; beside
    ``AdamW(fused=True)`` in ``results/`` (rows ``phase=overhead``, ``adamw ...``).

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
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if implementation not in ("auto", "triton", "reference"):
            raise ValueError(
                f"implementation must be 'auto', 'triton' or 'reference', got {implementation!r}"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True)
        super().__init__(params, defaults)  # each group through add_param_group's checks
        tensors = [p for g in self.param_groups for p in g["params"]]
        self.device = tensors[0].device
        why = triton_support.unavailable(self.device) if implementation != "reference" else None
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
        # One count for every parameter, on the device: the kernel reads it and a captured graph
        # holds its address, so a load copies into it and never replaces it.
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.device)
        self.register_state_dict_post_hook(_step_count_per_parameter)
        load_state_in_place(self)
        # first: it checks the loaded counts are one, before copies merge them into step_count
        self.register_load_state_dict_post_hook(_share_loaded_step_count, prepend=True)
        self._plan = None
        self._warned = False
        self._constants: dict[tuple, torch.Tensor] = {}

    def _on_device(self, values: tuple[float, ...]) -> torch.Tensor:
        """Floats as a float32 device tensor, made once per distinct tuple."""
        if values not in self._constants:
            host = torch.tensor(values, dtype=torch.float32)
            self._constants[values] = to_device_without_sync(host, self.device)
        return self._constants[values]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then what one launch for every group needs: the group's hyperparameters
        checked, betas and eps shared with the other groups, every parameter on one device. A
        group refused is not added."""
        super().add_param_group(param_group)
        try:
            _check_groups(self.param_groups)
        except ValueError:
            self.param_groups.pop()
            raise

    def _group_values(self, name: str) -> torch.Tensor:
        values = [g[name] for g in self.param_groups]
        if not any(isinstance(v, torch.Tensor) for v in values):
            return self._on_device(tuple(float(v) for v in values))
        return torch.stack(
            [
                v.reshape(()).to(self.device, torch.float32)
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
                    state["step"] = self.step_count  # saved with each parameter, as torch's
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                groups.append(k)
        if not params:
            return loss
        try:
            kernel_ready = self.uses_kernel and all(
                g.dtype == torch.float32 and g.is_contiguous() for g in grads
            )
        except RuntimeError:  # a sparse gradient has no strides
            kernel_ready = False
        if not kernel_ready and any(g.layout != torch.strided for g in grads):
            raise RuntimeError(
                "MultiTensorAdamW does not support sparse gradients (nor does torch's AdamW); "
                "step those parameters with torch.optim.SparseAdam"
            )
        self.step_count.add_(1)
        lrs, wds = self._group_values("lr"), self._group_values("weight_decay")
        hyper = dict(betas=self.param_groups[0]["betas"], eps=self.param_groups[0]["eps"])
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


def load_state_in_place(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.load_state_dict`` copy into the state tensors it already has (moments,
    step counts, tensor learning rates) instead of replacing them, so that a CUDA graph captured
    earlier reads the loaded values. Returns the optimizer; a second call changes nothing."""
    if getattr(optimizer, "_accel_loads_in_place", False):
        return optimizer
    optimizer._accel_loads_in_place = True
    before: dict[str, Any] = {}

    def remember(opt: torch.optim.Optimizer, state_dict: dict) -> None:
        before["state"] = {p: dict(s) for p, s in opt.state.items()}
        before["lrs"] = [g.get("lr") for g in opt.param_groups]

    def copy_back(opt: torch.optim.Optimizer) -> None:
        for i, (p, old) in enumerate(before.pop("state").items()):
            new = opt.state.get(p)
            for key, kept in old.items():
                loaded = None if new is None else new.get(key)
                if not (isinstance(kept, torch.Tensor) and isinstance(loaded, torch.Tensor)):
                    continue
                if kept.shape != loaded.shape:
                    raise ValueError(
                        f"load_state_dict: state {key!r} of parameter {i} has shape "
                        f"{tuple(loaded.shape)}, expected {tuple(kept.shape)} (another model?)"
                    )
                if kept is not loaded:
                    kept.copy_(loaded)
                    new[key] = kept
        for group, kept in zip(opt.param_groups, before.pop("lrs"), strict=True):
            if isinstance(kept, torch.Tensor) and group.get("lr") is not kept:
                kept.copy_(torch.as_tensor(group["lr"]).reshape(kept.shape))
                group["lr"] = kept

    optimizer.register_load_state_dict_pre_hook(remember)
    optimizer.register_load_state_dict_post_hook(copy_back)
    return optimizer


def _check_hyperparameters(
    lr: float | torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """What ``torch.optim.AdamW`` refuses, refused here too."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"a tensor lr must hold one value, got shape {tuple(lr.shape)}")
    if not float(lr) >= 0.0:  # sync: construction only, for a tensor lr
        raise ValueError(f"expected lr >= 0, got {float(lr)}")
    if not (len(betas) == 2 and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"expected two betas with 0 <= beta < 1, got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"expected eps >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"expected weight_decay >= 0, got {weight_decay}")


def _check_groups(groups: list[dict[str, Any]]) -> None:
    """The newest group's hyperparameters, and what every group must share."""
    g = groups[-1]  # groups may carry their own values
    _check_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"])
    shared = {(tuple(g["betas"]), g["eps"]) for g in groups}
    if len(shared) > 1:
        raise ValueError(
            f"MultiTensorAdamW: every group must share betas and eps (one launch takes them "
            f"once); got {sorted(shared)}"
        )
    devices = {p.device for g in groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(f"MultiTensorAdamW: parameters on one device expected, got {devices}")


def _step_count_per_parameter(optimizer: MultiTensorAdamW, state_dict: dict) -> dict:
    """Each parameter's saved state gets its own copy of the step count: torch's AdamW, loading
    it, increments every parameter's count in place, and a shared one would advance once per
    parameter. The groups say capturable only on CUDA: torch's AdamW refuses a capturable step
    on a CPU."""
    state_dict["state"] = {
        k: {**v, "step": v["step"].clone()} if "step" in v else v
        for k, v in state_dict["state"].items()
    }
    capturable = optimizer.device.type == "cuda"
    state_dict["param_groups"] = [
        g | {"capturable": capturable} for g in state_dict["param_groups"]
    ]
    return state_dict


def _share_loaded_step_count(optimizer: MultiTensorAdamW) -> None:
    """After ``load_state_dict``: the one device step count takes the loaded value, in place,
    and every parameter's state points at it again; the groups stay capturable (ours is, by
    construction), whatever the saved ones said."""
    _check_groups(optimizer.param_groups)  # a loaded group with its own betas would be ignored
    for group in optimizer.param_groups:
        group["capturable"] = True
    states = [s for s in optimizer.state.values() if s]
    if not states:
        return
    if any("step" not in s for s in states):
        raise ValueError(
            "MultiTensorAdamW.load_state_dict: the state has no step count for some parameters "
            "(expected 'step' beside 'exp_avg' and 'exp_avg_sq', as torch.optim.AdamW saves it); "
            "without it the bias correction would restart at step 1"
        )
    steps = {float(s["step"]) for s in states}  # sync: loading only
    if len(steps) > 1:
        raise ValueError(
            f"MultiTensorAdamW keeps one step count for every parameter; the state has "
            f"{len(steps)} different ones ({sorted(steps)[:4]}...), e.g. from a torch.optim.AdamW "
            f"whose parameters skipped different steps"
        )
    optimizer.step_count.fill_(steps.pop())
    for state in states:
        state["step"] = optimizer.step_count
