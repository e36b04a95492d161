"""The memory phase's gradient-accumulation part: ``K`` micro-batches through
``accel.accumulate`` against the batch ``K`` times larger in one piece, on the nested optimizer's
byte GPT in float32: the gradients, the throughput and the activation peak."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accel import accumulate, memory
from accel.lab.bench import BenchContext, Row
from accel.measure.timer import Comparison, compare
from accel.workloads import nested_optimizer as no

K = 8
# sequences per micro-batch: on a GPU where the GPU bounds a micro-batch's step (as the
# checkpointing rows are judged), so the large batch's kernels are not just k times wider
MICRO_BATCH = {"gpu": 32, "cpu": None}  # None: the preset's batch
TARGET_THROUGHPUT = 0.95
# float32 sums over a batch's tokens in another order: far below any gradient's own scale
GRADIENT_TOLERANCE = 1e-4
# what the accumulated peak may exceed one micro-batch's plus the gradients by, besides the largest
# gradient (held twice while backward adds it into .grad): the loss scalars kept across
# micro-batches
PEAK_SLACK_BYTES = 64 * 1024


def gpt_loss(model: torch.nn.Module):
    """The byte GPT's next-byte cross entropy on a (B, T + 1) batch of bytes, in float32."""

    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    return loss


@dataclass
class AccumulationCosts:
    """One effective batch, as k micro-batches and in one piece."""

    micro_batch: int
    k: int
    peak_bytes: dict[str, int]  # "large batch", "accumulated", "one micro-batch"
    gradient_bytes: int
    largest_gradient_bytes: int  # the largest parameter's
    timing: Comparison  # "large batch" (the baseline) and "accumulated", whole training steps
    gradient_difference: float  # worst over tensors: max |accumulated - large| / max |large|

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.k

    @property
    def throughput_ratio(self) -> float:
        """Samples per second accumulated over the large batch's (the same samples per step)."""
        return self.timing.speedup("accumulated")

    @property
    def peak_bound(self) -> int:
        """The target's bound on the accumulated peak."""
        extra = self.largest_gradient_bytes + PEAK_SLACK_BYTES
        return self.peak_bytes["one micro-batch"] + self.gradient_bytes + extra

    def meets(self) -> dict[str, bool]:
        return {
            "gradients": self.gradient_difference <= GRADIENT_TOLERANCE,
            "throughput": self.throughput_ratio >= TARGET_THROUGHPUT,
            "peak": self.peak_bytes["accumulated"] <= self.peak_bound,
        }


class AccumulationBench:
    """The byte GPT at ``sizes`` with an AdamW, and its batches, for several k."""

    def __init__(self, sizes: no.Sizes, device: torch.device | str, *, micro_batch: int):
        self.device = torch.device(device)
        self.micro_batch = micro_batch
        step = no.build(no.Flags(), sizes, device=self.device)
        self.model, self.make_batch = step.model, step.random_batch
        self.loss = gpt_loss(self.model)
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=sizes.lr, fused=fused)

    def _step(self, batch: torch.Tensor, k: int):
        micro = accumulate.split_batch(batch, k)

        def accumulated() -> None:
            self.optimizer.zero_grad(set_to_none=True)
            accumulate.accumulate(self.loss, micro, model=self.model)
            self.optimizer.step()

        def large() -> None:
            self.optimizer.zero_grad(set_to_none=True)
            accumulate.large_batch(self.loss, batch)
            self.optimizer.step()

        return {"large batch": large, "accumulated": accumulated}

    def gradient_difference(self, batch: torch.Tensor, k: int) -> float:
        """The worst tensor's largest difference over its largest gradient, same weights."""
        grads = []
        for run, data in ((accumulate.large_batch, batch),
                          (accumulate.accumulate, accumulate.split_batch(batch, k))):  # fmt: skip
            self.optimizer.zero_grad(set_to_none=True)
            run(self.loss, data)
            grads.append([p.grad.detach().clone() for p in self.model.parameters()])
        self.optimizer.zero_grad(set_to_none=True)
        worst = torch.stack(
            [(a - b).abs().max() / b.abs().max() for a, b in zip(*grads, strict=True)]
        ).max()
        return float(worst)  # sync: one read, after the measurement

    def peak(self, fn) -> int:
        """``fn``'s peak above a start without gradients (dropped first, as a step does)."""
        self.optimizer.zero_grad(set_to_none=True)
        return memory.peak_memory(fn, device=self.device)

    def measure(self, k: int, *, repeats: int = 10) -> AccumulationCosts:
        batch = self.make_batch(self.micro_batch * k)
        difference = self.gradient_difference(batch, k)  # correctness before timing
        steps = self._step(batch, k)
        for fn in steps.values():
            fn()  # AdamW's state exists: the peaks below are the step's own
        micro = accumulate.split_batch(batch, k)
        peaks = {
            "large batch": self.peak(lambda: accumulate.large_batch(self.loss, batch)),
            "accumulated": self.peak(lambda: accumulate.accumulate(self.loss, micro)),
            "one micro-batch": self.peak(lambda: accumulate.large_batch(self.loss, micro[0])),
        }
        timing = compare(steps, baseline="large batch", repeats=repeats, device=self.device)
        params = list(self.model.parameters())
        largest = max(memory.tensor_bytes([p]) for p in params)
        return AccumulationCosts(
            self.micro_batch, k, peaks, memory.tensor_bytes(params), largest, timing, difference
        )


def sweep(
    sizes: no.Sizes, device, *, micro_batch: int, ks=(1, 2, 4, K), repeats: int = 10
) -> list[AccumulationCosts]:
    """The same micro-batch, k micro-batches per step for each k: peak and throughput against
    the effective batch, the large batch beside each."""
    bench = AccumulationBench(sizes, device, micro_batch=micro_batch)
    return [bench.measure(k, repeats=repeats) for k in ks]


def rows(ctx: BenchContext, sizes: no.Sizes) -> list[Row]:
    micro_batch = MICRO_BATCH[ctx.preset] or sizes.batch
    bench = AccumulationBench(sizes, ctx.device, micro_batch=micro_batch)
    costs = bench.measure(K, repeats=20)
    met = costs.meets() if ctx.judged else {}
    at = (
        f"{ctx.where}; {K} micro-batches of {micro_batch} x {sizes.context} against one batch "
        f"of {costs.effective_batch}; float32, AdamW step included"
    )
    mib = {k: v / memory.MiB for k, v in costs.peak_bytes.items()}
    ms = {k: t.median_ms for k, t in costs.timing.timings.items()}
    return [
        Row("memory", "accumulate_gradients", f"largest gradient difference, {K} micro-batches "
            "against the large batch, over the tensor's largest gradient", "relative",
            costs.gradient_difference, target=f"<= {GRADIENT_TOLERANCE:g} (float32 rounding)",
            met=met.get("gradients"), note=at),
        Row("memory", "accumulate_throughput", f"time per training step of "
            f"{costs.effective_batch} sequences: {K} micro-batches (speedup: throughput over the "
            "large batch's)", "ms", ms["accumulated"], baseline=ms["large batch"],
            target=f">= {TARGET_THROUGHPUT}x", met=met.get("throughput"), note=at),
        Row("memory", "accumulate_peak", "peak of forward + backward above the resident weights, "
            f"{K} micro-batches (baseline: the large batch in one piece)", "MiB",
            mib["accumulated"], baseline=mib["large batch"],
            target="<= one micro-batch's peak + the gradients (+ the largest one added in, 64 KiB)",
            met=met.get("peak"), note=f"{at}; one micro-batch {mib['one micro-batch']:.1f} MiB, "
            f"gradients {costs.gradient_bytes / memory.MiB:.1f} MiB"),
    ]  # fmt: skip
