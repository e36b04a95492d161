"""The advection workload's training step, its builder, the tolerances within which each flag
must match the baseline, and the workload as a task :mod:`accel.distributed` runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from accel import accumulate, memory
from accel.workloads.advection.data import batch_of, make_loader, rank_batch
from accel.workloads.advection.model import combined_loss, init_model, validation_error
from accel.workloads.advection.settings import (
    CUDA_GRAPHED,
    Flags,
    Sizes,
    check_flags,
    offload_optimizer_class,
)
from accel.workloads.compare import make_compare_results
from accel.workloads.compiling import own_code

# The gradient scaler's first scale: PyTorch's 2**16 overflows this model's fp16 backward (its
# gradients are O(1)) and the skipped steps would not train; 2**10 leaves 5 bits of headroom.
GRAD_SCALER_INIT = 2.0**10

# Tolerances after a few steps (the tests take 3, at lr 1e-3). Adam normalizes each update, so a
# rounding difference in a near-zero gradient moves a weight by a fraction of the learning rate:
# hence the absolute parts. fp32 flags sum in other orders or not at all.
FP32_TOLERANCE = {
    "losses": {"rtol": 1e-4, "atol": 1e-5},
    "params": {"rtol": 1e-4, "atol": 1e-4},
    "predictions": {"rtol": 1e-4, "atol": 1e-4},
}
# bf16 and fp16 round matrix-product inputs to 8 or 11 bits: weights may move a few learning
# rates apart where gradients are near zero.
LOW_PRECISION_TOLERANCE = {
    "losses": {"rtol": 2e-2, "atol": 1e-2},
    "params": {"rtol": 0.0, "atol": 1e-2},
    "predictions": {"rtol": 5e-2, "atol": 4e-2},
}
# aux_loss_every and query_subsample change the training on purpose: weights move up to ~2
# learning rates apart per step, the losses differ by the inverse term. The recipe bench
# compares what matters, the validation error after equal steps.
CHANGED_TRAINING_TOLERANCE = {
    "losses": {"rtol": 0.5, "atol": 0.25},
    "params": {"rtol": 0.0, "atol": 1e-2},
    "predictions": {"rtol": 0.2, "atol": 0.1},
}
# batch_multiplier and grad_accumulation train on other samples too: losses and predictions are
# another trajectory's (None: not compared); the weights stay within a few learning rates a step.
LARGER_BATCH_TOLERANCE = {
    "losses": None,
    "params": {"rtol": 0.0, "atol": 1e-2},
    "predictions": None,
}


class Step:
    """One training step per call. Losses stay on the device (one host read in ``mean_loss``).
    Sync-free but for ``fp16+scaler`` without fused AdamW (the scaler's inf check), the CPU
    offload optimizer (its copies) and ``loader_workers=0`` (batches made in the step).

    With ``compile``, :meth:`forward_loss` is compiled as one function, a graph (and backward)
    with and one without the inverse loss. Under CUDA graphs a graph's outputs (loss, gradients)
    live in memory the next replay overwrites: a step marks its start, keeps a clone of its
    loss, and drops the gradients after the optimizer step.
    """

    def __init__(self, flags: Flags = Flags(), sizes: Sizes = Sizes(), *, device="cpu", seed=0):  # noqa: B008
        device = torch.device(device)
        check_flags(flags, device)
        self.flags, self.sizes, self.device, self.seed = flags, sizes, device, seed
        self.micro_batch_size = sizes.batch * flags.batch_multiplier
        self.samples_per_step = self.micro_batch_size * flags.grad_accumulation
        self.aux_queries = max(1, sizes.queries // flags.query_subsample)
        self.loader = make_loader(flags, sizes, seed, self.samples_per_step)
        self._batches: Iterator | None = None
        self.epochs = 0

        self.model = init_model(sizes, seed).to(device)
        self.checkpointed = (
            memory.checkpoint_blocks(self.model, self.model.block_names())
            if flags.activation_checkpointing
            else None
        )
        self.optimizer = self._optimizer()
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=GRAD_SCALER_INIT)
            if flags.precision == "fp16+scaler"
            else None
        )
        held_out = batch_of(seed, range(sizes.validation_samples), sizes, stream=1)
        self.validation = {k: v.to(device) for k, v in held_out.items()}
        self.losses: list[torch.Tensor] = []  # device scalars: no sync per step
        self.count = self.aux_calls = 0
        self.compile_seconds = 0.0
        self.cudagraphs = flags.compile in CUDA_GRAPHED
        # a function called with self, not a bound method: no reference cycle, so a dropped
        # Step (and its loader's workers) goes at once, not at some later garbage collection
        self._forward_loss = Step.forward_loss
        if flags.compile != "none":
            mode = None if flags.compile == "default" else flags.compile
            # dynamic=False: one batch shape per Step, never made dynamic because another Step
            # compiled another batch size; own_code: each Step its own 1 or 2 graphs, so a bench
            # of a dozen compiled configurations does not run its last ones eagerly
            self._forward_loss = torch.compile(
                own_code(Step.forward_loss), mode=mode, dynamic=False
            )
            self.compile_seconds = self._untimed_passes(3 if self.cudagraphs else 1)

    def _optimizer(self) -> torch.optim.Optimizer:
        kwargs = {"lr": self.sizes.lr, "weight_decay": 0.01}
        if self.flags.fused_adamw:
            kwargs["fused"] = True
        if self.flags.cpu_offload_optimizer:
            offload, _ = offload_optimizer_class()
            # small tensors (norms, biases) stay on the GPU with the on-device AdamW
            return offload(self.model.parameters(), torch.optim.AdamW, **kwargs)
        # Before: AdamW's default implementation (foreach on CUDA)
        return torch.optim.AdamW(self.model.parameters(), **kwargs)

    def _autocast(self):
        if self.flags.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.flags.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: v.to(self.device, non_blocking=self.flags.non_blocking) for k, v in batch.items()
        }

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next training batch on the device (a new loader epoch when one ends)."""
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            batch = next(self._batches)
        except StopIteration:
            self.epochs += 1
            self._batches = iter(self.loader)  # without persistent workers: new processes
            batch = next(self._batches)
        return self._to_device(batch)

    def forward_loss(self, inputs, targets, inverse_targets, aux: bool) -> torch.Tensor:
        """The training loss: MSE of the field, plus ``aux_weight`` x MSE of the inverse net's
        estimate from the predicted field at the first ``aux_queries`` queries when ``aux``."""
        predictions = self.model.operator(inputs)
        loss = F.mse_loss(predictions.float(), targets)
        if aux:
            n, g = self.aux_queries, self.sizes.grid
            estimate = self.model.inverse(predictions[:, :n], inputs[:, g : g + n])
            inverse = F.mse_loss(estimate.float(), inverse_targets)
            loss = loss + self.sizes.aux_weight * inverse
        return loss

    def _loss(self, batch: dict[str, torch.Tensor], aux: bool) -> torch.Tensor:
        """The loss (compiled when asked) in the step's precision. Under CUDA graphs: a graph
        output, valid until the next step's mark."""
        with self._autocast():
            return self._forward_loss(
                self, batch["inputs"], batch["targets"], batch["inverse_targets"], aux
            )

    def _untimed_passes(self, passes: int) -> float:
        """``passes`` forwards and backwards of each variant on a warm-up batch, gradients
        dropped: weights, optimizer, data stream and random generators are left as they were.
        Seconds (compile, and under CUDA graphs their warm-up and recording)."""
        warm = batch_of(self.seed, range(self.micro_batch_size), self.sizes, stream=2)
        warm = self._to_device(warm)
        t0 = time.perf_counter()
        # CUDA graph trees: the 1st call of a graph warms up, the 2nd records, the 3rd replays
        # (a replay right after the recording: pytorch/pytorch#122192)
        for aux in (True,) if self.flags.aux_loss_every == 1 else (True, False):  # a graph each
            for _ in range(passes):
                self._begin_step()
                self._loss(warm, aux).backward()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sync: setup, outside any timed step
        return time.perf_counter() - t0

    def _begin_step(self) -> None:
        """Drop the gradients (no step adds to the last one's: under CUDA graphs those are
        outputs that are overwritten) and, under CUDA graphs, mark a new iteration. Accumulating
        under CUDA graphs, the gradients are zeroed in place instead: micro-batches add into
        tensors outside the graphs' memory, which the next replay cannot overwrite."""
        if self.cudagraphs and self.flags.grad_accumulation > 1:
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.optimizer.zero_grad(set_to_none=False)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()

    def __call__(self) -> None:
        batch = self.next_batch()
        aux = self.count % self.flags.aux_loss_every == 0  # host counter: no sync
        self._begin_step()
        if self.flags.grad_accumulation > 1:
            loss = self._accumulated_backward(batch, aux)
        else:
            loss = self._loss(batch, aux)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # sync: unless fused AdamW takes the inf check
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.cudagraphs and self.flags.grad_accumulation == 1:  # graph outputs: overwritten
            self.losses.append(loss.detach().clone())
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.losses.append(loss.detach())
        self.aux_calls += aux
        self.count += 1

    def _accumulated_backward(self, batch: dict[str, torch.Tensor], aux: bool) -> torch.Tensor:
        """Forward and backward of each of ``grad_accumulation`` equal micro-batches, the
        gradients the whole batch's; the batch's mean loss (unscaled), on the device."""
        losses = []

        def micro_loss(micro: dict[str, torch.Tensor]) -> torch.Tensor:
            if self.cudagraphs:  # each micro-batch one replay of the compiled graphs
                torch.compiler.cudagraph_mark_step_begin()
            loss = self._loss(micro, aux)
            losses.append(loss.detach().clone())  # under CUDA graphs the next replay's memory
            return loss if self.scaler is None else self.scaler.scale(loss)

        micro = accumulate.split_batch(batch, self.flags.grad_accumulation)
        accumulate.accumulate(micro_loss, micro, model=self.model)
        return torch.stack(losses).mean()  # equal micro-batches: the batch's mean

    def mean_loss(self, last: int | None = None) -> float:
        """Mean training loss over all steps (or the ``last`` few): one host read."""
        picked = self.losses[-last:] if last else self.losses
        return torch.stack(picked).mean().item() if picked else float("nan")  # sync: on request

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The field at the queries, eager (not the compiled graphs), in the step's precision."""
        with self._autocast():
            return self.model.operator(inputs).float()

    def validation_error(self) -> float:
        """Mean relative L2 error of the field on the held-out samples (one host read)."""
        inputs, targets = self.validation["inputs"], self.validation["targets"]
        return validation_error(self.predict, inputs, targets, self.sizes.batch)

    @torch.no_grad()
    def result(self) -> dict[str, torch.Tensor]:
        """What every flag must leave (near) unchanged: the losses, all parameters (flattened)
        and the predicted field on the first held-out batch."""
        params = torch.cat([p.detach().float().flatten().cpu() for p in self.model.parameters()])
        inputs = self.validation["inputs"][: self.sizes.batch]
        return {
            "losses": torch.stack(self.losses).float().cpu() if self.losses else torch.zeros(0),
            "params": params,
            "predictions": self.predict(inputs).cpu(),
        }

    def resident_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state held on the step's device."""
        tensors = list(self.model.parameters())
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in _optimizer_states(self.optimizer):
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == self.device.type]
        return memory.tensor_bytes(on_device)

    def close(self) -> None:
        """Stop the loader's workers now (they also stop when the step is garbage collected)."""
        self._batches = None


build = Step  # build(flags, sizes, *, device, seed): the contract's name for the step


def _optimizer_states(optimizer: Any) -> list[dict]:
    inner = [optimizer]
    if hasattr(optimizer, "optim_dict"):  # torchao's offload optimizer: one per large tensor
        inner = [*optimizer.optim_dict.values(), getattr(optimizer, "d_opt", None)]
    return [s for opt in inner if opt is not None for s in opt.state.values()]


def tolerance(flags: Flags, sizes: Sizes, steps: int) -> dict[str, dict[str, float] | None]:
    """Per entry of ``step.result()`` (None: not comparable), after a few ``steps``; the same
    at every size."""
    if flags.batch_multiplier != 1 or flags.grad_accumulation != 1:
        return LARGER_BATCH_TOLERANCE
    if (flags.aux_loss_every, flags.query_subsample) != (1, 1):
        return CHANGED_TRAINING_TOLERANCE
    if flags.precision != "fp32":
        return LOW_PRECISION_TOLERANCE
    return FP32_TOLERANCE


compare_results = make_compare_results(tolerance, relative=False)  # absolute


def distributed_task(preset: str, seed: int):
    """The operator with its inverse loss on every step, as an :class:`accel.distributed.Task`:
    ``model(inputs)`` gives the field and the inverse estimate packed (B, queries + 1 + 2 modes),
    ``targets`` the same layout; ``validate`` is the held-out relative error of the field."""
    from accel.distributed import Task  # the dataclass only: a light import

    sizes = Sizes.preset(preset)

    def batch(step: int, rank: int, world_size: int, device: torch.device):
        b = rank_batch(seed, step, rank, world_size, sizes)
        targets = torch.cat([b["targets"], b["inverse_targets"]], dim=1)
        return b["inputs"].to(device), targets.to(device)

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return combined_loss(output, targets, sizes)

    held_out = batch_of(seed, range(sizes.validation_samples), sizes, stream=1)

    @torch.no_grad()
    def validate(model: torch.nn.Module, device: torch.device) -> float:
        inputs, targets = held_out["inputs"].to(device), held_out["targets"].to(device)
        return validation_error(
            lambda x: model(x)[:, : sizes.queries].float(), inputs, targets, sizes.batch
        )

    return Task(model=init_model(sizes, seed), batch=batch, loss=loss, validate=validate)
