"""A ResNet-18 (BasicBlocks, BatchNorm) on 128x128 images, 100 classes, with the loop of
torchvision's classification reference: first float32 with the reference's SGD, the loss read
every step and a pageable batch; then with its fast flags (channels last, bf16, cudnn.benchmark
and TF32, ``torch.compile`` with CUDA graphs, fused SGD, a pinned batch, the loss left on the
device).
"""

from __future__ import annotations

import torch
from torch import nn

from accel.doctor.ladder import Script, compiled, sizes, tuned_backends

SEED = 0
metric_log: list[dict] = []  # what the metric logger keeps


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages, inplanes = [], width
        for i in range(4):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            blocks = BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)
            stages.append(nn.Sequential(*blocks))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def make_model(size: dict) -> ResNet18:
    """The network, its weights drawn from a seed of their own (the caller's random state kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return ResNet18(num_classes=size["classes"], width=size["width"])


def settings(preset: str) -> dict:
    return sizes(preset, gpu=dict(batch=128, image=128, classes=100, width=64),
                 cpu=dict(batch=8, image=32, classes=10, width=8))  # fmt: skip


def get_batch(size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the data loader hands it over: images and labels on the host."""
    generator = torch.Generator().manual_seed(SEED)
    images = torch.randn(size["batch"], 3, size["image"], size["image"], generator=generator)
    return images, torch.randint(size["classes"], (size["batch"],), generator=generator)


def first_written(device: torch.device, preset: str) -> Script:
    size = settings(preset)
    model = make_model(size).to(device)  # ground truth: fusion
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(  # ground truth: optimizer_unfused
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4
    )
    model.train()

    def step(batch):
        image, target = batch
        image, target = image.to(device), target.to(device)  # ground truth: input
        output = model(image)  # ground truth: precision, conv_layout
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        metric_log.append({"loss": loss.item(), "lr": lr})  # ground truth: sync
        return loss

    return Script("resnet", step, get_batch(size))


def hand_optimized(device: torch.device, preset: str) -> Script:
    size = settings(preset)
    model = make_model(size).to(device, memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True
    )
    model.train()
    model = compiled(model, device)
    cuda = device.type == "cuda"

    def step(batch):
        with tuned_backends(cudnn_benchmark=True):
            image, target = batch
            image = image.to(device, non_blocking=True, memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                output = model(image)
                loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.detach()  # the metric logger reads it every print_freq steps

    batch = get_batch(size)
    if cuda:
        batch = tuple(t.pin_memory() for t in batch)
    return Script("resnet", step, batch, compiled=True)
