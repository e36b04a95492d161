"""GPT-2 small (124M) as nanoGPT's lineage writes it: first as the tutorial's first commit
(float32, attention written out under the ``bias`` mask, vocabulary 50257, default AdamW, the
loss read every step, a pageable batch), then as nanoGPT's later train.py (TF32, bf16, SDPA, the
vocabulary padded to 50304, fused AdamW with decay groups, ``torch.compile``, a pinned batch) and
compiled with CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from accel.doctor.ladder import Script, compiled, sizes, tuned_backends

SEED = 1337
losses: list[float] = []  # the training log


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # ground truth: odd_shape
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    flash: bool = False  # scaled_dot_product_attention in place of the written-out attention


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        self.n_head, self.n_embd, self.flash = config.n_head, config.n_embd, config.flash
        if not self.flash:  # the causal mask, named "bias" after OpenAI's checkpoints
            size = config.block_size
            self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # ground truth: attention
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = SEED):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))  # fmt: skip
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # drawn from a generator of its own, the tied embedding last (as lm_head): a padded
        # vocabulary only adds rows at the end, every other weight stays the same
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if module is not self.transformer.wte:
                self._init_weights(module, generator)

    def _init_weights(self, module: nn.Module, generator: torch.Generator) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "NANOGPT_SCALE_INIT"):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=generator)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def config_and_batch_size(preset: str) -> tuple[GPTConfig, int]:
    size = sizes(preset, gpu=dict(batch=8),
                 cpu=dict(batch=4, block_size=32, vocab_size=101, n_layer=2, n_head=2, n_embd=32))
    batch_size = size.pop("batch")
    return GPTConfig(**size), batch_size


def get_batch(config: GPTConfig, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens of the tokenizer's vocabulary, on the host: inputs and their next tokens."""
    gen = torch.Generator().manual_seed(SEED)
    data = torch.randint(config.vocab_size, (batch_size, config.block_size + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def first_written(device: torch.device, preset: str) -> Script:
    config, batch_size = config_and_batch_size(preset)
    with torch.random.fork_rng(devices=[]):
        model = GPT(config)  # ground truth: fusion
    model.to(device)
    optimizer = torch.optim.AdamW(  # ground truth: optimizer_unfused
        model.parameters(), lr=6e-4, weight_decay=0.1
    )

    def step(batch):
        x, y = batch
        x, y = x.to(device), y.to(device)  # ground truth: input
        optimizer.zero_grad()
        _, loss = model(x, y)  # ground truth: precision
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # ground truth: sync
        return loss

    return Script("gpt2", step, get_batch(config, batch_size))


def configure_optimizers(model: nn.Module, weight_decay: float, learning_rate: float):
    """nanoGPT's AdamW: decay on the matrices and embeddings only, one fused kernel a step."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, fused=True)


def hand_optimized(device: torch.device, preset: str) -> Script:
    config, batch_size = config_and_batch_size(preset)
    data = get_batch(config, batch_size)  # the tokenizer's vocabulary, as before
    # 50304 for GPT-2's 50257: the next multiple of 64, whose products tile evenly
    padded = replace(config, vocab_size=-(-config.vocab_size // 64) * 64, flash=True)
    with torch.random.fork_rng(devices=[]):
        model = GPT(padded)
    model.to(device)
    optimizer = configure_optimizers(model, weight_decay=0.1, learning_rate=6e-4)
    model = compiled(model, device)
    cuda = device.type == "cuda"
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def step(batch):
        with tuned_backends():
            x, y = batch
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with ctx:
                _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            return loss.detach()  # read when logged, every so many steps

    if cuda:
        data = tuple(t.pin_memory() for t in data)
    return Script("gpt2", step, data, compiled=True)
