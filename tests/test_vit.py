"""The ViT workload: deterministic, learnable, and every flag keeps the baseline's result."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from accel.attention import BackendUnavailableError
from accel.workloads import vit
from accel.workloads.flags import all_on, describe, label, unavailable

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; this machine has none")


pytestmark = pytest.mark.usefixtures("one_thread")


SIZES = vit.Sizes(image=12, patch=4, dim=16, heads=2, depth=2, classes=4, batch=6, batches=2)
BOOL_FLAGS = [i.name for i in describe(vit.Flags) if i.is_bool and i.name != "compile"]
FLAG_SETS = [vit.Flags(**{name: True}) for name in BOOL_FLAGS]
FLAG_SETS += [vit.Flags(sdpa=True, backend=b) for b in ("default", "flash", "math")]
FLAG_SETS.append(all_on(vit.Flags, "cpu"))
FLAG_SETS.append(dataclasses.replace(all_on(vit.Flags, "cpu"), bf16_autocast=False))


def run(flags=None, seed=0, steps=3, sizes=SIZES, device="cpu"):
    step = vit.build(flags or vit.Flags(), sizes, device=device, seed=seed)
    for _ in range(steps):
        step()
    return step


def test_same_seed_same_result_and_another_seed_differs(seed):
    a, b, c = (run(seed=s).result() for s in (seed, seed, seed + 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["logits"], c["logits"])


@pytest.mark.parametrize("flags", FLAG_SETS, ids=label)
def test_every_flag_keeps_the_baseline_result(flags, seed):
    base, fast = run(seed=seed).result(), run(flags, seed=seed).result()
    assert fast.keys() == base.keys()  # fused q/k/v reports its weights as q, k and v
    for name, ref in base.items():
        # fp32 flags: summation order only (FP32_TOLERANCE); bf16: BF16_TOLERANCE, stated there
        torch.testing.assert_close(fast[name], ref, **vit.tolerance(flags), msg=name)


def test_bf16_really_changes_numerics_within_its_tolerance(seed):
    base = run(seed=seed).result()["logits"]
    bf16 = run(vit.Flags(bf16_autocast=True), seed=seed).result()["logits"]
    assert not torch.allclose(bf16, base, **vit.FP32_TOLERANCE)


def test_it_learns_the_shapes(seed):
    step = run(seed=seed, steps=0, sizes=vit.Sizes(batches=8))
    for _ in range(100):
        step()
    first = torch.stack(step.losses[:8]).mean().item()
    # over 16 seeds the last 8 losses were 0.32 to 0.51 of the first 8 (log 8 = 2.08 at start)
    assert step.mean_loss(last=8) < 0.7 * first, (first, step.mean_loss(last=8))


def test_images_are_random_shapes_with_balanced_labels():
    gen = torch.Generator().manual_seed(0)
    images, labels = vit.make_images(400, 16, 8, generator=gen)
    assert images.shape == (400, 3, 16, 16) and labels.shape == (400,)
    assert torch.isfinite(images).all() and images.std() > 0.5
    counts = torch.bincount(labels, minlength=8)
    assert counts.min() > 25  # about 50 each
    again, _ = vit.make_images(400, 16, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(images, again)
    # classes differ in shape, not colour: per-class mean brightness maps are distinct
    means = torch.stack([images[labels == c].mean(dim=(0, 1)) for c in range(8)])
    distances = torch.cdist(means.flatten(1), means.flatten(1))
    assert distances[~torch.eye(8, dtype=torch.bool)].min() > 0.5


def test_presets():
    gpu = vit.Sizes.preset("gpu")
    assert (gpu.image, gpu.patch, gpu.dim, gpu.heads, gpu.depth) == (224, 16, 384, 6, 12)
    assert gpu.tokens == 196
    assert vit.Sizes.preset("cpu").tokens == 49  # odd on purpose


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(image=30, patch=4), "not a multiple of patch"),
        (dict(dim=30, heads=4), "even size"),
        (dict(dim=18, heads=2), "even size"),
        (dict(classes=9), "between 2 and 8"),
        (dict(batch=0), "must be >= 1"),
    ],
)
def test_bad_sizes_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vit.Sizes(**kwargs)


def test_a_backend_without_sdpa_is_rejected():
    with pytest.raises(ValueError, match="backend='flash' needs sdpa=True"):
        vit.build(vit.Flags(backend="flash"), SIZES)


@pytest.mark.gpu
@needs_cuda
def test_a_forced_backend_that_cannot_run_says_so_at_the_first_step():
    step = vit.build(vit.Flags(sdpa=True, backend="flash"), SIZES, device="cuda")
    with pytest.raises(BackendUnavailableError, match=r"(?s)'flash' cannot run.*dtype"):
        step()  # float32 without autocast: CUDA's flash kernel takes fp16 and bf16 only


def test_compile_is_cuda_only_and_auto_is_tuned_outside_the_steps():
    assert "compile" in unavailable(vit.Flags, "cpu")
    step = vit.build(vit.Flags(sdpa=True), SIZES)
    assert step.tuning_seconds > 0 and step.count == 0 and step.losses == []
    assert all(a.last_backend in ("flash", "math") for a in step.model.attention_modules())
    assert all(p.grad is None for p in step.model.parameters())


@pytest.mark.gpu
@needs_cuda
def test_every_flag_keeps_the_baseline_on_cuda(seed):
    base = run(seed=seed, device="cuda").result()
    # on CUDA flash takes only fp16/bf16: forced flash runs under bf16 autocast there
    flag_sets = [f for f in FLAG_SETS if f.backend != "flash"]
    flag_sets += [
        vit.Flags(sdpa=True, backend="flash", bf16_autocast=True),
        all_on(vit.Flags, "cuda"),
    ]
    for flags in flag_sets:
        fast = run(flags, seed=seed, device="cuda").result()
        for name, ref in base.items():
            torch.testing.assert_close(
                fast[name], ref, **vit.tolerance(flags), msg=f"{label(flags)}: {name}"
            )
