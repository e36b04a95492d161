"""The nested optimizer: a GPT-style byte-level language model trained with AdamW, gradient
clipping and a learned per-group learning-rate controller [DeepNestedOptimizer].

The text is the Python standard library's own source, read as bytes (no download). Every
``controller_update_every`` steps the per-group gradient and parameter norms (a group per block,
plus embeddings and head) go through a small MLP that outputs learning-rate multipliers in
``[1/max_lr_scale, max_lr_scale]``; it learns from the loss change since its last update, and
its backward touches only its own weights. A deliberately simple rule: the workload exists to
be made fast, not to tune learning rates.

``Flags()`` is the usual "before": Python loops over parameters for the statistics and clipping,
a for-loop AdamW with learning rates read back, fresh buffers, memset gradients, every activation
stored, fp32. Many parameter tensors (~150 at the ``gpu`` preset): the home of phases 2 (fusion)
and 3 (memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel import fusion, graphs, memory
from accel.errors import collection_of
from accel.optim import MultiTensorAdamW, load_state_in_place
from accel.workloads.byte_gpt import GPT, text_batches
from accel.workloads.compare import make_compare_results
from accel.workloads.flags import Presets, check_sizes, flag, option

# fp32 flags sum in other orders; Adam's normalized update carries that into the parameters.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# bf16_autocast and controller_update_every > 1 change numerics on purpose: bf16 keeps ~3 digits
# (Adam's sign-like updates of near-zero gradients may differ by 2 lr); a controller run every N
# steps learns N times less often, so its multipliers drift apart.
CHANGED = {
    "losses": {"rtol": 2e-2, "atol": 1e-2},
    "params": {"rtol": 0.0, "atol": 2e-2},
    "grad_norm": {"rtol": 1e-1, "atol": 1e-3},
}
BF16_TOLERANCE = {**CHANGED, "lr_multipliers": {"rtol": 2e-2, "atol": 1e-2}}
STALE_TOLERANCE = {**CHANGED, "lr_multipliers": {"rtol": 0.25, "atol": 5e-2}}


@dataclass(frozen=True)
class Flags:
    foreach_stats: bool = flag(
        "per-group gradient and parameter norms from one torch._foreach_norm over all tensors, "
        "instead of pow+sum kernels per tensor",
        "fusion",
    )
    fused_clip: bool = flag(
        "torch.nn.utils.clip_grad_norm_(foreach=True): foreach norms and one foreach multiply, "
        "instead of foreach=False's norm and multiply per tensor",
        "fusion",
    )
    fused_adamw: bool = flag(
        "AdamW(fused=True) with learning rates as device tensors: a few kernels per group "
        "instead of several per parameter, and no read-back of the multipliers",
        "fusion",
    )
    one_launch_adamw: bool = flag(
        "accel's MultiTensorAdamW: every group's AdamW step in one Triton launch instead of one "
        "per group, learning rates read on the device",
        "fusion",
        requires="cuda",
        adopted=False,
    )
    controller_update_every: int = option(
        "run the statistics and the LR controller every N steps and reuse its multipliers "
        "in between (changes numerics on purpose)",
        "fusion",
        default=1,
        choices=(1, 4, 16),
    )
    preallocated_buffers: bool = flag(
        "statistics, controller features and learning rates written into buffers allocated "
        "once, instead of fresh tensors every update",
        "memory",
    )
    set_to_none_grads: bool = flag(
        "drop gradients (zero_grad(set_to_none=True)) instead of zeroing them with a memset "
        "each; backward then writes fresh ones",
        "memory",
    )
    activation_checkpointing: str = option(
        "recompute the chosen blocks' activations in backward instead of storing them "
        "('selective': every block, keeping matmul and attention outputs, recomputing the rest)",
        "memory",
        default="none",
        choices=("none", "every_2nd", "all", "selective"),
    )
    bf16_autocast: bool = flag(
        "forward under torch.autocast(bfloat16): half the activation bytes, tensor-core "
        "matmuls (changes numerics on purpose; own tolerance)",
        "memory",
        adopted=False,
    )
    cuda_graph: str = option(
        "replay a CUDA graph of forward, backward, controller, clipping and step ('whole_step') "
        "instead of launching each kernel",
        "graphs",
        default="none",
        choices=("none", "whole_step"),
        requires="cuda",
    )


@dataclass(frozen=True)
class Sizes(Presets):
    """Model, batch and optimizer settings. Validated on creation."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    context: int = 128  # tokens (bytes) per sequence
    batch: int = 8
    batches: int = 8  # distinct batches, cycled
    text_bytes: int = 1 << 22  # how much standard-library source to read
    lr: float = 3e-4
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    controller_hidden: int = 32
    controller_lr: float = 1e-3
    max_lr_scale: float = 2.0

    def __post_init__(self):
        check_sizes(self, ("layers", "width", "heads", "context", "batch", "batches", "text_bytes"))
        check_sizes(self, positive=("lr", "max_grad_norm", "controller_lr"))
        if self.width % self.heads:
            raise ValueError(
                f"Sizes.width ({self.width}) must be a multiple of Sizes.heads ({self.heads})"
            )
        if self.text_bytes < self.context + 2:
            raise ValueError(
                f"Sizes.text_bytes ({self.text_bytes}) must exceed context + 1 ({self.context + 1})"
            )
        if self.weight_decay < 0:
            raise ValueError(f"Sizes.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.max_lr_scale >= 1:
            raise ValueError(f"Sizes.max_lr_scale must be >= 1, got {self.max_lr_scale}")

    @property
    def groups(self) -> int:
        """Parameter groups: the embeddings, one per block, the head."""
        return self.layers + 2


Sizes.PRESETS = {
    "cpu": Sizes(layers=3, width=48, heads=3, context=32, batch=4, text_bytes=1 << 18),
    "gpu": Sizes(),  # GPT-2 small's body: 149 parameter tensors
}


def checkpoint_names(choice: str, layers: int) -> list[str]:
    """Block names for the ``activation_checkpointing`` option."""
    if choice == "none":
        return []
    step = {"all": 1, "every_2nd": 2, "selective": 1}[choice]
    return [f"blocks.{i}" for i in range(0, layers, step)]


class LRController(nn.Module):
    """Per-group features (log gradient norm, log parameter norm, their log ratio, the group's
    depth in 0..1) -> a log learning-rate multiplier in ``[-log s, log s]``."""

    FEATURES = 4

    def __init__(self, hidden: int, max_scale: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(self.FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.log_scale = math.log(max_scale)

    @staticmethod
    def features(
        stats: torch.Tensor, depth: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(G, 4) from group statistics (G, 2) and depths (G,); no graph (stats have none)."""
        logs = stats.clamp_min(1e-12).log()  # (G, 2)
        columns = [logs[:, 0], logs[:, 1], logs[:, 0] - logs[:, 1], depth]
        return torch.stack(columns, dim=1, out=out)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.log_scale * torch.tanh(self.net(features).squeeze(-1))


def apply_ac(
    model: GPT, flags: Flags, sizes: Sizes, checkpoint: list[str] | None
) -> memory.CheckpointedBlocks:
    """``activation_checkpointing``: the chosen blocks recompute their activations in backward
    (``selective`` keeps matmul and attention outputs); ``checkpoint`` names blocks instead."""
    names = (
        collection_of(checkpoint, "block names")
        if checkpoint is not None
        else checkpoint_names(flags.activation_checkpointing, sizes.layers)
    )
    selective = flags.activation_checkpointing == "selective" and checkpoint is None
    return memory.checkpoint_blocks(
        model, names, save_ops=memory.SELECTIVE_SAVE if selective else None
    )


def apply_adamw(groups: list[dict], flags: Flags, sizes: Sizes) -> torch.optim.Optimizer:
    """The AdamW the flags ask for: accel's one-launch AdamW (``one_launch_adamw``), fused
    (``fused_adamw``), else the for-loop "before"; capturable under a CUDA graph, which replays
    its step count on the device."""
    hyper = dict(lr=sizes.lr, betas=(0.9, 0.95), weight_decay=sizes.weight_decay)
    if flags.one_launch_adamw:
        return MultiTensorAdamW(groups, **hyper)
    impl = {"fused": True} if flags.fused_adamw else {"foreach": False}
    if flags.cuda_graph != "none":
        impl["capturable"] = True
    return torch.optim.AdamW(groups, **hyper, **impl)


def apply_device_lrs(step: Step) -> bool:
    """Learning rates on the device when fused AdamW reads them there or a graph must see them
    change: the groups hold 0-d views of one tensor (a preallocated buffer when graphed), so
    the multipliers are never read back. False for the "before" (float learning rates)."""
    f, G = step.flags, step.sizes.groups
    graphed = f.cuda_graph != "none"
    if not (f.fused_adamw or f.one_launch_adamw or graphed):
        return False
    lrs = step.buffers.get("lrs", (G,)) if graphed else torch.empty(G, device=step.device)
    step._set_device_lrs(lrs.fill_(step.sizes.lr))
    return True


def apply_cuda_graph(step: Step) -> graphs.GraphedStep | None:
    """``cuda_graph``: the graphed whole step, None unless asked for. It is recaptured per
    controller schedule slot (``update`` changes the graph)."""
    if step.flags.cuda_graph != "whole_step":
        return None
    return graphs.GraphedStep(
        step._whole_step, on_new_shape="recapture", device=step.device, name="whole_step"
    )


class Step:
    """One training step per call: :meth:`forward_backward` then :meth:`optimizer_step`.
    ``checkpoint`` names the blocks to checkpoint (``"blocks.3"``), overriding the
    ``activation_checkpointing`` flag."""

    def __init__(self, flags=Flags(), sizes=Sizes(), *, device="cpu", seed=0, checkpoint=None):
        device = torch.device(device)
        self.flags, self.sizes, self.device = flags, sizes, device
        self.inputs = text_batches(sizes, (sizes.batches, sizes.batch), seed).to(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT(sizes)
            controller = LRController(sizes.controller_hidden, sizes.max_lr_scale)
        self.model, self.controller = model.to(device), controller.to(device)
        self.checkpointed = apply_ac(self.model, flags, sizes, checkpoint)
        named = self.model.param_groups()
        self.group_names = [n for n, _ in named]
        self.param_lists = [ps for _, ps in named]
        self.params = [p for ps in self.param_lists for p in ps]
        self.optimizer = apply_adamw([{"params": ps, "name": n} for n, ps in named], flags, sizes)
        # the controller's own optimizer is the same in every configuration (4 small tensors)
        graphed = flags.cuda_graph == "whole_step"
        self.controller_optimizer = torch.optim.Adam(
            self.controller.parameters(), lr=sizes.controller_lr, foreach=False, capturable=graphed
        )
        G = sizes.groups
        self.depth = torch.linspace(0, 1, G, device=device)
        self.buffers = memory.BufferCache(device)
        self.lr_multipliers = torch.ones(G, device=device)
        self.device_lrs = apply_device_lrs(self)
        # the controller's pending lesson: (log multipliers, loss, the features they came from);
        # under whole_step the features and loss saved in place instead (no graph across steps)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._features_then = torch.zeros(G, LRController.FEATURES, device=device)
        self._loss_then = torch.zeros((), device=device)
        self._has_last = False
        self.graphed_step = apply_cuda_graph(self)
        self.losses: list[torch.Tensor] = []
        self.grad_norm = torch.zeros((), device=device)
        self.steps = 0
        # a load copies into the state tensors (and device learning rates) a graph may hold
        load_state_in_place(self.optimizer)
        load_state_in_place(self.controller_optimizer)

    def __call__(self) -> None:
        if self.graphed_step is None:
            self.optimizer_step(self.forward_backward())
            return
        batch = self.inputs[self.steps % len(self.inputs)]
        update = self.steps % self.flags.controller_update_every == 0
        loss, self.grad_norm = self.graphed_step(batch, update)
        self.losses = [*self.losses[-15:], loss.clone()]  # the graph's output is overwritten
        self.steps += 1

    def _whole_step(self, batch: torch.Tensor, update: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything of a step on the device (graphed by ``cuda_graph='whole_step'``)."""
        loss = self.forward_backward(batch)
        return loss, self._after_backward(loss, update)

    def forward_backward(self, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Zero the gradients, run forward and backward on the next batch (or ``inputs``,
        (B, T + 1) bytes); returns the loss, detached, on the device."""
        batch = self.inputs[self.steps % len(self.inputs)] if inputs is None else inputs
        self.optimizer.zero_grad(set_to_none=self.flags.set_to_none_grads)
        bf16 = self.flags.bf16_autocast
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    def optimizer_step(self, loss: torch.Tensor) -> None:
        """Everything after backward: controller (on its schedule), clipping, AdamW."""
        update = self.steps % self.flags.controller_update_every == 0
        self.grad_norm = self._after_backward(loss, update)
        self.losses = [*self.losses[-15:], loss]
        self.steps += 1

    def _after_backward(self, loss: torch.Tensor, update: bool) -> torch.Tensor:
        if update:
            self.update_learning_rates(loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, self.sizes.max_grad_norm, foreach=self.flags.fused_clip
        )
        self.optimizer.step()
        return grad_norm

    def update_learning_rates(self, loss: torch.Tensor) -> None:
        """Group statistics -> controller -> per-group learning rates; the controller first learns
        from how the loss moved since its last update."""
        f, G = self.flags, self.sizes.groups
        if self.graphed_step is not None and self._has_last:
            # its last output recomputed from the saved features: the same value and gradient
            self._learn(self.controller(self._features_then), self._loss_then, loss)
        elif self.graphed_step is None and self._last is not None:
            # before this update overwrites the features (a preallocated buffer, in place)
            self._learn(self._last[0], self._last[1], loss)
        buf = self.buffers.get if f.preallocated_buffers else None
        stats = fusion.group_stats(
            self.param_lists, foreach=f.foreach_stats, out=buf("stats", (G, 2)) if buf else None
        )
        features = LRController.features(
            stats, self.depth, out=buf("features", (G, LRController.FEATURES)) if buf else None
        )
        if self.graphed_step is not None:  # keep inputs, not a graph, for the next update
            with torch.no_grad():
                log_mult = self.controller(features)
            self._features_then.copy_(features)
            self._loss_then.copy_(loss)
            self._has_last = True
        else:
            log_mult = self.controller(features)
            self._last = (log_mult, loss, features)
        mult = torch.exp(log_mult.detach(), out=buf("multipliers", (G,)) if buf else None)
        self.lr_multipliers = mult
        if self.device_lrs:
            graphed = f.cuda_graph != "none"
            lrs = torch.mul(
                mult, self.sizes.lr, out=self.buffers.get("lrs", (G,)) if buf or graphed else None
            )
            if self.optimizer.param_groups[0]["lr"].data_ptr() != lrs.data_ptr():
                self._set_device_lrs(lrs)  # preallocated: only the first time
        else:
            # sync: the usual "before" reads the multipliers back to set float learning rates
            for group, m in zip(self.optimizer.param_groups, mult.tolist(), strict=True):
                group["lr"] = self.sizes.lr * m

    def _learn(self, log_mult: torch.Tensor, loss_then: torch.Tensor, loss: torch.Tensor) -> None:
        """The controller's lesson: raise the multipliers where the loss fell since them."""
        ((loss - loss_then) * log_mult.mean()).backward()  # graph: controller only
        self.controller_optimizer.step()
        self.controller_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue as if never stopped: weights, both
        optimizers, the controller's pending lesson (its last features and loss: the output is
        recomputed from them, as the graphed step does), the multipliers and the step count."""
        graphed = self.graphed_step is not None
        pending = (self._features_then, self._loss_then) if graphed and self._has_last else None
        if not graphed and self._last is not None:
            pending = (self._last[2], self._last[1])
        return {
            "model": self.model.state_dict(),
            "controller": self.controller.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "controller_optimizer": self.controller_optimizer.state_dict(),
            "lr_multipliers": self.lr_multipliers.clone(),
            "grad_norm": self.grad_norm.clone(),
            "losses": [t.clone() for t in self.losses],
            "steps": self.steps,
            "pending": None if pending is None else [t.detach().clone() for t in pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` of a step built with the same flags and sizes."""
        self.model.load_state_dict(state["model"])
        self.controller.load_state_dict(state["controller"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.controller_optimizer.load_state_dict(state["controller_optimizer"])
        with torch.no_grad():
            self.lr_multipliers.copy_(state["lr_multipliers"])
            self.grad_norm.copy_(state["grad_norm"])
        self.losses = [t.to(self.device) for t in state["losses"]]
        self.steps = int(state["steps"])
        pending = state["pending"]
        if pending is None:
            self._last, self._has_last = None, False
            return
        features, loss = (t.to(self.device) for t in pending)
        if self.graphed_step is not None:
            self._features_then.copy_(features)
            self._loss_then.copy_(loss)
            self._has_last = True
        else:  # the controller's weights are the saved ones: the same output and gradient
            self._last = (self.controller(features), loss, features)

    def _set_device_lrs(self, lrs: torch.Tensor) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = lrs[i]  # a 0-d view: the fused optimizers read it on the device

    def resident_bytes(self) -> int:
        """Bytes that stay allocated between steps: parameters, gradients, optimizer state, data."""
        state = [t for s in self.optimizer.state.values() for t in s.values()]
        grads = [p.grad for p in self.params if p.grad is not None]
        return memory.tensor_bytes([*self.params, *grads, *state, self.inputs])

    def random_batch(self, batch: int, seed: int = 0) -> torch.Tensor:
        """``batch`` sequences of the text, (batch, T + 1), for probing other batch sizes."""
        return text_batches(self.sizes, (batch,), seed).to(self.device)

    def result(self) -> dict[str, torch.Tensor]:
        """What every flag must leave (near) unchanged: the recent losses, all parameters
        (flattened), the learning-rate multipliers and the last gradient norm."""
        with torch.no_grad():
            return {
                "losses": torch.stack(self.losses) if self.losses else torch.zeros(0),
                "params": torch.cat([p.detach().float().flatten() for p in self.params]),
                "lr_multipliers": self.lr_multipliers.clone(),
                "grad_norm": self.grad_norm.clone(),
            }


build = Step  # build(flags, sizes, *, device, seed, ...): the contract's name for the step


def tolerance(flags: Flags, sizes: Sizes, steps: int) -> dict[str, dict[str, float]]:
    """Per entry of ``step.result()``, after a few ``steps``; the same at every size."""
    if flags.bf16_autocast:
        return BF16_TOLERANCE
    if flags.controller_update_every != 1:
        return STALE_TOLERANCE
    return dict.fromkeys(("losses", "params", "lr_multipliers", "grad_norm"), TOLERANCE)


compare_results = make_compare_results(tolerance)
