"""AdamW whose step is one kernel launch for every parameter group.

``MultiTensorAdamW`` is ``torch.optim.AdamW`` (no amsgrad, no maximize) for float32 parameters
on one CUDA device: one Triton launch (:mod:`accel.kernels.adamw`) updates every tensor of every
group, per-group learning rates and weight decays read on the device, so it is capturable (a
whole step under :class:`accel.graphs.GraphedStep`). As torch's, it keeps a step count per
parameter; ``betas`` and ``eps`` are shared by all groups. Where the kernel cannot run, the plain
:func:`adamw_reference` does, after one warning. The ``state_dict`` has torch's AdamW layout;
a loaded state is checked against the parameters before anything changes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import torch

from accel import triton_support
from accel.errors import checked_number
from accel.sync import to_device_without_sync

Implementation = Literal["auto", "triton", "reference"]


def adamw_reference(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    groups: list[int],
    *,
    lrs: torch.Tensor,
    weight_decays: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """One AdamW update per tensor, in place: torch's single-tensor capturable AdamW. Each
    tensor's count in ``steps`` (0-d float32) advances by one first; ``lrs`` and
    ``weight_decays`` hold one value per group, and ``groups[i]`` is tensor i's group."""
    beta1, beta2 = betas
    for p, g, m, v, step, k in zip(
        params, grads, exp_avgs, exp_avg_sqs, steps, groups, strict=True
    ):
        step.add_(1)
        bias_correction1 = one_minus_power(beta1, step)
        bias_correction2_sqrt = one_minus_power(beta2, step).sqrt()
        lr = lrs[k]
        p.mul_(1 - lr * weight_decays[k])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.sub_((lr / bias_correction1) * m / denom)


def one_minus_power(beta: float, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta**step`` in float32 to a few units in the last place, as ``-expm1(step log
    beta)`` (the plain form loses digits to cancellation when beta is near 1); the kernel
    evaluates the same formula."""
    log_beta = math.log(beta) if beta > 0 else -math.inf
    x = step * log_beta
    series = -x * (1 + x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120)))))
    return torch.where(x > -0.2, series, 1 - torch.exp(x))


class MultiTensorAdamW(torch.optim.Optimizer):
    """AdamW stepped by one kernel launch for all groups (see the module docstring).

    ``lr`` per group is a float (copied to the device when it changes) or a 0-d float32 tensor
    on the parameters' device (changed in place, also under a CUDA graph).
    ``implementation="auto"`` takes the kernel where it can run, else the reference with a
    warning; ``"triton"`` raises instead; ``"reference"`` always takes the reference.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        implementation: Implementation = "auto",
    ):
        _check_group({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                      "amsgrad": amsgrad, "maximize": maximize})  # torch's off switches pass
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
        self.register_state_dict_post_hook(_capturable_where_torch_can_step_it)
        # the kernel reads the state's addresses and a captured graph holds them: a load is
        # checked against the parameters first, then copied into the tensors the state has
        self.register_load_state_dict_pre_hook(_checked_loaded_state)
        load_state_in_place(self)
        self.register_load_state_dict_post_hook(_own_loaded_state, prepend=True)
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
        """torch's, then the group checked for one launch (hyperparameters, betas and eps
        shared, one device); a group refused is not added."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
            _check_groups_agree(self.param_groups)
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
        params, grads, exp_avgs, exp_avg_sqs, steps, groups = [], [], [], [], [], []
        for k, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue  # and its count stays, as torch's
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
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
            self._check_state(params, exp_avgs, exp_avg_sqs, steps, kernel=False)
            adamw_reference(
                params, grads, exp_avgs, exp_avg_sqs, steps, groups,
                lrs=lrs, weight_decays=wds, **hyper,
            )  # fmt: skip
            return loss
        from accel.kernels.adamw import AdamWPlan

        lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
        key = tuple(t.data_ptr() for ts in lists for t in ts)
        if self._plan is None or self._plan.key != key:  # built once while nothing moves
            self._check_state(params, exp_avgs, exp_avg_sqs, steps, kernel=True)
            self._plan = AdamWPlan(params, grads, exp_avgs, exp_avg_sqs, steps, groups)
        self._plan.launch(lrs, wds, **hyper)
        return loss

    def _check_state(self, params, exp_avgs, exp_avg_sqs, steps, *, kernel: bool) -> None:
        """Before the tensors are stepped (a state set by hand may break it): each moment of its
        parameter's shape, dtype and device (contiguous for the kernel), each count a 0-d
        float32 tensor there."""
        for p, m, v, step in zip(params, exp_avgs, exp_avg_sqs, steps, strict=True):
            if kernel and not (p.dtype == torch.float32 and p.is_contiguous()):
                raise ValueError(
                    f"MultiTensorAdamW: {_position(self, p)} is now {_describe(p)}; the kernel "
                    "it was built for steps contiguous float32 (build it again, or with "
                    "implementation='reference')"
                )
            for key, t in (("exp_avg", m), ("exp_avg_sq", v)):
                fits = (t.shape, t.dtype, t.device) == (p.shape, p.dtype, p.device)
                if not fits or (kernel and not t.is_contiguous()):
                    raise ValueError(
                        f"MultiTensorAdamW: {_position(self, p)} is {_describe(p)}, but its "
                        f"state's {key!r} is {_describe(t)}; expected the parameter's shape, "
                        f"dtype and device{', contiguous' if kernel else ''}"
                    )
            counts = isinstance(step, torch.Tensor) and step.dtype == torch.float32
            if not (counts and step.shape == () and step.device == p.device):
                raise ValueError(
                    f"MultiTensorAdamW: {_position(self, p)}'s state 'step' is "
                    f"{_describe(step)}; expected a 0-d float32 tensor on {p.device}"
                )


def load_state_in_place(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.load_state_dict`` copy into the state tensors it already has (moments,
    step counts, tensor learning rates), so that a CUDA graph captured earlier reads the loaded
    values. A loaded state missing a held tensor, or with one of another shape, is refused
    before anything changes. Returns the optimizer; a second call changes nothing."""
    if getattr(optimizer, "_accel_loads_in_place", False):
        return optimizer
    optimizer._accel_loads_in_place = True
    before: dict[str, Any] = {}

    def remember(opt: torch.optim.Optimizer, state_dict: dict) -> None:
        for where, p, saved, _ in _saved_states(opt, state_dict):
            held = {k: t for k, t in opt.state.get(p, {}).items() if isinstance(t, torch.Tensor)}
            missing = [k for k in held if not isinstance(saved.get(k), torch.Tensor)]
            if missing:
                raise ValueError(
                    f"load_state_dict: {where} has its {missing} held in place (a captured "
                    f"graph reads them there) and the loaded state has no {missing} for it; "
                    "load a state that has them, or build a new optimizer"
                )
            for key, kept in held.items():
                loaded = saved[key]
                if kept.shape != loaded.shape:
                    raise ValueError(
                        f"load_state_dict: state {key!r} of {where} has shape "
                        f"{tuple(loaded.shape)}, expected {tuple(kept.shape)} (another model?)"
                    )
        before["state"] = {p: dict(s) for p, s in opt.state.items()}
        before["lrs"] = [g.get("lr") for g in opt.param_groups]

    def copy_back(opt: torch.optim.Optimizer) -> None:
        for p, old in before.pop("state").items():
            new = opt.state.get(p)
            for key, kept in old.items():
                loaded = None if new is None else new.get(key)
                if not (isinstance(kept, torch.Tensor) and isinstance(loaded, torch.Tensor)):
                    continue
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


def _saved_states(optimizer: torch.optim.Optimizer, state_dict: dict):
    """(``"parameter i of group k"``, the parameter, its saved state or ``{}``, its saved id),
    paired as torch's ``load_state_dict`` pairs them; nothing where the groups do not pair."""
    saved_groups = state_dict.get("param_groups", [])
    saved = state_dict.get("state", {})
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(a["params"]) != len(b["params"])
        for a, b in zip(saved_groups, optimizer.param_groups, strict=True)
    ):
        return
    for k, (mine, theirs) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        for i, (p, saved_id) in enumerate(zip(mine["params"], theirs["params"], strict=True)):
            yield f"parameter {i} of group {k}", p, saved.get(saved_id) or {}, saved_id


def _check_hyperparameters(
    lr: float | torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """What ``torch.optim.AdamW`` refuses, refused here too."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"a tensor lr must hold one value, got shape {tuple(lr.shape)}")
    if not checked_number(lr, "lr") >= 0.0:  # sync: construction only, for a tensor lr
        raise ValueError(f"expected lr >= 0, got {float(lr)}")
    if not isinstance(betas, (tuple, list)):
        raise TypeError(f"betas must be two numbers, got {betas!r} ({type(betas).__name__})")
    beta_values = [checked_number(b, f"betas[{i}]") for i, b in enumerate(betas)]
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in beta_values)):
        raise ValueError(f"expected two betas with 0 <= beta < 1, got {betas}")
    if not checked_number(eps, "eps") >= 0.0:
        raise ValueError(f"expected eps >= 0, got {eps}")
    if not checked_number(weight_decay, "weight_decay") >= 0.0:
        raise ValueError(f"expected weight_decay >= 0, got {weight_decay}")


def _check_group(group: dict[str, Any]) -> None:
    """One group's hyperparameters, and no option the kernel does not implement."""
    _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    if any(isinstance(p, torch.Tensor) and p.dtype == torch.float64 for p in group.get("params", ())):
        raise ValueError("MultiTensorAdamW computes in float32, and float64 parameters would "
                         "get float32's accuracy: use torch.optim.AdamW for them")  # fmt: skip
    unsupported = [f"{k}=True" for k in ("amsgrad", "maximize") if group.get(k)]
    if unsupported:
        raise ValueError(
            f"MultiTensorAdamW does not implement {' or '.join(unsupported)}; use "
            "torch.optim.AdamW for it"
        )
    if group.get("decoupled_weight_decay") is False and group["weight_decay"] != 0:
        raise ValueError(
            f"MultiTensorAdamW decays weights as AdamW does (decoupled); got a group with "
            f"decoupled_weight_decay=False and weight_decay={group['weight_decay']} "
            "(torch.optim.Adam's L2 penalty)"
        )


def _check_groups_agree(groups: list[dict[str, Any]], *, devices: bool = True) -> None:
    """What every group must share: betas and eps, and the parameters' device."""
    shared = {(tuple(g["betas"]), g["eps"]) for g in groups}
    if len(shared) > 1:
        raise ValueError(
            f"MultiTensorAdamW: every group must share betas and eps (one launch takes them "
            f"once); got {sorted(shared)}"
        )
    found = {p.device for g in groups for p in g["params"]} if devices else set()
    if len(found) > 1:
        raise ValueError(f"MultiTensorAdamW: parameters on one device expected, got {found}")


def _capturable_where_torch_can_step_it(optimizer: MultiTensorAdamW, state_dict: dict) -> dict:
    """The saved groups say capturable only on CUDA: torch's AdamW refuses a capturable step on
    a CPU."""
    capturable = optimizer.device.type == "cuda"
    state_dict["param_groups"] = [
        g | {"capturable": capturable} for g in state_dict["param_groups"]
    ]
    return state_dict


def _checked_loaded_state(optimizer: MultiTensorAdamW, state_dict: dict) -> dict:
    """Before ``load_state_dict`` changes anything: the saved groups checked as
    :meth:`add_param_group` checks them, each saved state torch's AdamW's (a step count, two
    moments of the parameter's shape: the kernel would run past a smaller one). A parameter with
    a state here and none saved gets a fresh one (zeros, step 0) to be copied in place."""
    for group in state_dict.get("param_groups", []):
        _check_group(group)
    _check_groups_agree(state_dict.get("param_groups", []), devices=False)
    fresh = {}
    for where, p, saved, saved_id in _saved_states(optimizer, state_dict):
        if not saved:
            if optimizer.state.get(p):
                fresh[saved_id] = {"step": torch.zeros(())} | {
                    k: torch.zeros_like(p, memory_format=torch.contiguous_format)
                    for k in ("exp_avg", "exp_avg_sq")
                }
            continue
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in saved]
        if missing:
            raise ValueError(
                f"MultiTensorAdamW.load_state_dict: the state of {where} has no {missing} "
                "(expected 'step', 'exp_avg' and 'exp_avg_sq', as torch.optim.AdamW saves them; "
                "without the step count the bias correction would restart at step 1)"
            )
        for key in ("exp_avg", "exp_avg_sq"):
            t = saved[key]
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                raise ValueError(
                    f"MultiTensorAdamW.load_state_dict: {where} has shape {tuple(p.shape)}, "
                    f"but the state's {key!r} for it has shape {_shape(t)} (a state saved for "
                    "another model?)"
                )
        step = saved["step"]
        if not isinstance(step, (int, float)) and _shape(step) != ():
            raise ValueError(
                f"MultiTensorAdamW.load_state_dict: the state's 'step' of {where} has shape "
                f"{_shape(step)}; expected one number (a 0-d tensor, as torch.optim.AdamW saves)"
            )
    return {**state_dict, "state": {**state_dict.get("state", {}), **fresh}}


def _own_loaded_state(optimizer: MultiTensorAdamW) -> None:
    """After ``load_state_dict``: each count a 0-d float32 tensor on the device, each tensor
    contiguous and of one parameter's state only (a load may share them; the kernel would
    advance a shared count twice); the groups stay capturable."""
    for group in optimizer.param_groups:
        group["capturable"] = True
    held = {p.data_ptr() for g in optimizer.param_groups for p in g["params"]}
    for state in optimizer.state.values():
        if not state:
            continue
        state["step"] = torch.as_tensor(
            state["step"], dtype=torch.float32, device=optimizer.device
        ).reshape(())
        for key in ("step", "exp_avg", "exp_avg_sq"):
            t = state[key]
            if t.data_ptr() in held or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
            held.add(t.data_ptr())
            state[key] = t


def _position(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> str:
    for k, group in enumerate(optimizer.param_groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                return f"parameter {i} of group {k}"
    return "a parameter in no group"


def _shape(value: Any) -> tuple[int, ...] | str:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    layout = "" if t.is_contiguous() else ", not contiguous"
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}{layout}"
