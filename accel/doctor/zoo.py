"""Small training steps with planted problems, each beside a clean twin: what the doctor's tests,
its bench phase and notebook 09 examine. Every planted line carries ``# planted[<model>]: <kind>``
(a planted float32 product has no line: it is the autocast left out). ``gpt``: a small GPT with
a host read, per-tensor clipping and updates, zeroed gradients, hand-written attention, float32;
``cnn``: a BatchNorm CNN fed by a main-process DataLoader; ``mlp``: an MLP under a hand-written
per-tensor optimizer; ``rnn``: a GRU cell stepped in Python with an ``if`` on a tensor;
``shapes``: sequences of a new length every batch. ``build(name, planted=...)`` plants all,
none, or the kinds named, so one problem can be removed at a time and its gain measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel.doctor.ladder import marked_lines, sizes
from accel.measure import device as devices

__all__ = ["GPU_ONLY", "MODELS", "ZooCase", "build", "example", "planted_lines"]


@dataclass
class ZooCase:
    name: str
    planted: frozenset[str]  # the kinds planted
    step: Callable[..., Any]
    batch: Any
    loader: Iterable[Any] | None
    expected: frozenset[str]  # finding kinds planted and visible on this device


def planted_lines(model: str | None = None) -> dict[str, list[int]]:
    """kind -> the lines marked ``# planted[<model>]: <kind>`` (of the model named)."""
    found: dict[str, list[int]] = {}
    for number, match in marked_lines(Path(__file__), r"# planted\[(\w+)\]: (\w+)"):
        if model in (None, match[1]):
            found.setdefault(match[2], []).append(number)
    return found


# The gpu sizes keep the device busy in each clean twin (its kernels outlast their launches): a
# launch-bound twin would be a true finding.


def _regression_step(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                     bf16: bool | None = None):  # fmt: skip
    """A plain training step on a mean-squared error, in bf16 on a GPU unless ``bf16=False``."""
    bf16 = device.type == "cuda" if bf16 is None else bf16

    def step(batch):
        inputs, targets = batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.mse_loss(model(inputs), targets)  # planted[mlp]: precision
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


# ---- gpt ------------------------------------------------------------------------------------------
class ZooAttention(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int, manual: bool):
        super().__init__()
        self.heads, self.manual, self.scale = heads, manual, (dim // heads) ** -0.5
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.manual:
            scores = (q @ k.transpose(-2, -1)) * self.scale  # planted[gpt]: attention
            scores = scores.masked_fill(self.future[:s, :s], float("-inf"))
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class ZooBlock(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int, manual: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ZooAttention(dim, heads, seq, manual)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ZooGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, manual: bool):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(ZooBlock(dim, heads, seq, manual) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _gpt(plant: frozenset[str], device: torch.device, preset: str) -> ZooCase:
    size = sizes(preset, gpu=dict(vocab=512, dim=1024, heads=16, layers=4, seq=256, batch=64),
                 cpu=dict(vocab=96, dim=32, heads=4, layers=2, seq=16, batch=4))
    batch_size = size.pop("batch")
    model = ZooGPT(**size, manual="attention" in plant).to(device)
    cuda = device.type == "cuda"
    if "optimizer_loop" in plant:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda)
    clip_foreach = False if "clip_loop" in plant else None
    zero_to_none = "zero_grad" not in plant
    params = list(model.parameters())
    bf16 = cuda and "precision" not in plant
    history: list[float] = []

    def step(batch):
        tokens, targets = batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=clip_foreach)  # planted[gpt]: clip_loop
        opt.step()  # planted[gpt]: optimizer_loop
        opt.zero_grad(set_to_none=zero_to_none)  # planted[gpt]: zero_grad
        if "sync" in plant:
            history.append(loss.item())  # planted[gpt]: sync
        return loss.detach()

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(size["vocab"], (batch_size, size["seq"] + 1), generator=gen)
    tokens = tokens.to(device)
    return ZooCase("gpt", plant, step, (tokens[:, :-1], tokens[:, 1:]), None, frozenset())


# ---- cnn ------------------------------------------------------------------------------------------
class NoisyShapes(torch.utils.data.Dataset):
    """Images made on demand in the loading process: a bright square on noise, 10 classes by
    its place; each item costs a few small host operations, as decoding and augmenting do, and
    ``read_s`` of waiting, as a read from disk does."""

    def __init__(self, count: int, side: int, read_s: float = 0.0):
        self.count, self.side, self.read_s = count, side, read_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        time.sleep(self.read_s)
        gen = torch.Generator().manual_seed(i)
        image = torch.randn(3, self.side, self.side, generator=gen)
        label = i % 10
        cell = self.side // 4
        row, col = divmod(label % 8, 4)
        image[:, row * cell : (row + 1) * cell, col * cell : (col + 1) * cell] += 2.0
        for _ in range(4):  # augmentation: jitter and blur
            image = F.avg_pool2d(image[None], 3, 1, 1)[0] + 0.1 * torch.randn_like(image)
        return image, label


def _cnn(plant: frozenset[str], device: torch.device, preset: str) -> ZooCase:
    # images small enough that each item's operators run on one thread (below ATen's grain size),
    # as decoding does: the loader's time then moves with the host less than a thread pool does
    # on a CPU the step shares the cores with the workers: a read's wait lets them pay there too
    size = sizes(preset, gpu=dict(side=64, width=64, batch=256, read_s=0.0),
                 cpu=dict(side=32, width=16, batch=16, read_s=2e-4))
    w = size["width"]
    model = nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, 10),
    ).to(device)  # fmt: skip
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = NoisyShapes(size["batch"] * 16, size["side"], size["read_s"])

    def step(batch):
        images, labels = batch
        images = images.to(device)  # planted[cnn]: input
        labels = labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if "input" in plant:
        loader = torch.utils.data.DataLoader(data, batch_size=size["batch"], shuffle=True)
    else:  # the data made once, on the device, and served from there
        made = torch.utils.data.default_collate([data[i] for i in range(size["batch"] * 4)])
        images, labels = (t.to(device) for t in made)
        loader = [
            (images[i : i + size["batch"]], labels[i : i + size["batch"]])
            for i in range(0, len(labels), size["batch"])
        ]
    return ZooCase("cnn", plant, step, next(iter(loader)), loader, frozenset())


# ---- mlp ------------------------------------------------------------------------------------------
class LoopMomentum(torch.optim.Optimizer):
    """SGD with momentum written the obvious way: one update per tensor."""

    def __init__(self, params, lr: float, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)  # planted[mlp]: tensor_loop
                p.add_(buf, alpha=-group["lr"])


def _mlp(plant: frozenset[str], device: torch.device, preset: str) -> ZooCase:
    size = sizes(preset, gpu=dict(dim=1024, depth=12, batch=65536),
                 cpu=dict(dim=64, depth=8, batch=32))
    dim = size["dim"]
    layers = [m for _ in range(size["depth"]) for m in (nn.Linear(dim, dim), nn.SiLU())]
    model = nn.Sequential(*layers, nn.Linear(dim, 1)).to(device)
    cuda = device.type == "cuda"
    if "tensor_loop" in plant:
        opt = LoopMomentum(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=cuda or None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size["batch"], dim, generator=gen).to(device)
    y = x.square().mean(1, keepdim=True)
    step = _regression_step(model, opt, device, bf16=cuda and "precision" not in plant)
    return ZooCase("mlp", plant, step, (x, y), None, frozenset())


# ---- rnn ------------------------------------------------------------------------------------------
class StepwiseGRU(nn.Module):
    """A GRU stepped through time by a cell in Python (``stepwise``; else cuDNN's whole-sequence
    kernel), its state clamped when it grows: with an ``if`` on a tensor (``sync``) or without."""

    def __init__(self, dim: int, stepwise: bool, check_on_host: bool):
        super().__init__()
        self.check_on_host = check_on_host
        self.cell = nn.GRUCell(dim, dim) if stepwise else None
        self.gru = None if stepwise else nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cell is None:
            h = self.gru(x)[0][:, -1]
            return self.head(self._bounded(h))
        h = x.new_zeros(x.shape[0], x.shape[2])
        for t in range(x.shape[1]):
            h = self._bounded(self.cell(x[:, t], h))
        return self.head(h)

    def _bounded(self, h: torch.Tensor) -> torch.Tensor:
        if not self.check_on_host:
            return h.clamp(-50, 50)
        if h.abs().max() > 50:  # planted[rnn]: sync
            h = h.clamp(-50, 50)
        return h


def _rnn(plant: frozenset[str], device: torch.device, preset: str) -> ZooCase:
    size = sizes(preset, gpu=dict(dim=1024, seq=256, batch=1024), cpu=dict(dim=16, seq=12, batch=8))
    model = StepwiseGRU(size["dim"], "stepwise" in plant, "sync" in plant).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size["batch"], size["seq"], size["dim"], generator=gen).to(device)
    y = x.mean((1, 2))[:, None]

    return ZooCase("rnn", plant, _regression_step(model, opt, device), (x, y), None, frozenset())


# ---- shapes ---------------------------------------------------------------------------------------
def _shapes(plant: frozenset[str], device: torch.device, preset: str) -> ZooCase:
    size = sizes(preset, gpu=dict(dim=512, longest=512, batch=256),
                 cpu=dict(dim=32, longest=48, batch=8))
    dim, longest = size["dim"], size["longest"]
    model = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    varying = "shapes" in plant

    def sequence_batch(i: int):
        length = int(longest * (0.4 + 0.6 * ((i * 7919) % 97) / 96)) if varying else longest
        x = torch.randn(size["batch"], length, dim, generator=gen)
        return x.to(device), x.flip(-1).to(device)

    loader = [sequence_batch(i) for i in range(8)]

    step = _regression_step(model, opt, device)
    return ZooCase("shapes", plant, step, loader[0], loader, frozenset())


Builder = Callable[[frozenset, torch.device, str], ZooCase]
# planted kinds only a GPU run sees (a stepwise loop is found as a launch-bound step)
GPU_ONLY = frozenset({"precision", "stepwise"})
# each model's builder and the kinds it can plant
MODELS: dict[str, tuple[Builder, frozenset[str]]] = {
    "gpt": (_gpt, frozenset({"sync", "attention", "optimizer_loop", "clip_loop", "precision",
                             "zero_grad"})),
    "cnn": (_cnn, frozenset({"input"})),
    "mlp": (_mlp, frozenset({"tensor_loop", "precision"})),
    "rnn": (_rnn, frozenset({"sync", "stepwise"})),
    "shapes": (_shapes, frozenset({"shapes"})),
}  # fmt: skip
FINDING_OF = {"stepwise": "launch_bound"}  # planted kind -> the finding that reports it


def build(
    name: str,
    planted: bool | Iterable[str] = True,
    *,
    device: torch.device | str = "cpu",
    preset: str = "cpu",
) -> ZooCase:
    """One zoo model's step, batch and loader, seeded: every problem it can plant (``True``),
    none (``False``: the clean twin) or the kinds named."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {', '.join(MODELS)}")
    builder, plantable = MODELS[name]
    kinds = plantable if planted is True else frozenset(planted or ())
    if kinds - plantable:
        raise ValueError(
            f"{name} cannot plant {sorted(kinds - plantable)}; it plants {sorted(plantable)}"
        )
    device = torch.device(device)
    torch.manual_seed(0)
    case = builder(kinds, device, preset)
    visible = kinds if device.type == "cuda" else kinds - GPU_ONLY
    case.expected = frozenset(FINDING_OF.get(k, k) for k in visible)
    return case


def example() -> ZooCase:
    """The planted GPT on this machine's device: ``python -m accel doctor accel.doctor.zoo:example``."""
    device = devices.default_device()
    return build("gpt", True, device=device, preset=devices.preset(device))
