"""A ViT-S/16 classifying 224x224 images as timm writes it (ViT-S: a first-written ViT-B step
would take an examination past half a minute). First float32, attention written out, default
AdamW, gradients clipped one tensor at a time, the loss read every step, a pageable batch; then
as timm's train.py runs it (SDPA, bf16, TF32, fused AdamW, one ``clip_grad_norm_`` over every
gradient, ``torch.compile`` with CUDA graphs, a pinned batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accel.doctor.ladder import Script, compiled, sizes, tuned_backends

SEED = 0
losses: list[float] = []


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, fused_attn: bool):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)  # ground truth: attention
            attn = attn.softmax(dim=-1)
            x = attn @ v
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, fused_attn: bool, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, fused_attn)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = mlp_ratio * dim
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, img_size, patch_size, num_classes, embed_dim, depth, num_heads, fused_attn):
        super().__init__()
        num_patches = (img_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        blocks = [Block(embed_dim, num_heads, fused_attn) for _ in range(depth)]
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def settings(preset: str) -> dict:
    return sizes(
        preset,
        gpu=dict(batch=64, img_size=224, patch_size=16, num_classes=1000, embed_dim=384,
                 depth=12, num_heads=6),
        cpu=dict(batch=4, img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2,
                 num_heads=2),
    )  # fmt: skip


def make_model(size: dict, fused_attn: bool) -> VisionTransformer:
    """The network, its weights drawn from a seed of their own (the caller's random state kept)."""
    arguments = {k: v for k, v in size.items() if k != "batch"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return VisionTransformer(**arguments, fused_attn=fused_attn)


def get_batch(size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels as the data loader hands them over, on the host."""
    generator = torch.Generator().manual_seed(SEED)
    side = size["img_size"]
    images = torch.randn(size["batch"], 3, side, side, generator=generator)
    return images, torch.randint(size["num_classes"], (size["batch"],), generator=generator)


def first_written(device: torch.device, preset: str) -> Script:
    size = settings(preset)
    model = make_model(size, fused_attn=False).to(device)  # ground truth: fusion
    optimizer = torch.optim.AdamW(  # ground truth: optimizer_unfused
        model.parameters(), lr=1e-3, weight_decay=0.05
    )

    def step(batch):
        images, labels = batch
        images, labels = images.to(device), labels.to(device)  # ground truth: input
        loss = F.cross_entropy(model(images), labels)  # ground truth: precision
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 1.0)  # ground truth: clip_loop
        optimizer.step()
        losses.append(loss.item())  # ground truth: sync
        return loss

    return Script("vit", step, get_batch(size))


def hand_optimized(device: torch.device, preset: str) -> Script:
    size = settings(preset)
    cuda = device.type == "cuda"
    batch = get_batch(size)
    if cuda:  # pinned: copied while the device works
        batch = tuple(t.pin_memory() for t in batch)
    model = make_model(size, fused_attn=True).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
    model = compiled(model, device)

    def step(batch):
        with tuned_backends():
            images, labels = (t.to(device, non_blocking=True) for t in batch)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # one norm over every gradient, as timm clips (the loop clipped each tensor alone)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            return loss.detach()  # read when logged, every log_interval steps

    return Script("vit", step, batch, compiled=True)
