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
    vit.compare_results(fast, base, flags, sizes=SIZES, steps=3)


def test_bf16_really_changes_numerics_within_its_tolerance(seed):
    base = run(seed=seed).result()
    bf16 = run(vit.Flags(bf16_autocast=True), seed=seed).result()
    assert not torch.allclose(bf16["logits"], base["logits"], **vit.FP32_LOGITS_TOLERANCE)
    vit.compare_results(bf16, base, vit.Flags(bf16_autocast=True), sizes=SIZES, steps=3)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_tolerance_catches_logits_off_by_twice_its_bound(bf16, seed):
    flags = vit.Flags(bf16_autocast=bf16)
    base = run(seed=seed).result()
    logits = base["logits"]
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    bound = vit.tolerance(flags, SIZES, 3)["logits"]
    if bf16:  # normwise: a perturbation of twice the bound's norm
        scale = 2 * bound["rel_norm"] * logits.norm() / noise.norm()
    else:  # elementwise: every logit off by twice its own allowed difference
        scale = 2 * (bound["atol"] + bound["rtol"] * logits.abs())
        noise = noise.sign()
    off = dict(base, logits=logits + scale * noise)
    with pytest.raises(AssertionError, match="logits"):
        vit.compare_results(off, base, flags, sizes=SIZES, steps=3)
    near = dict(base, logits=logits + 0.25 * scale * noise)
    vit.compare_results(near, base, flags, sizes=SIZES, steps=3)


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_two_adamw_runs_drift_apart_by_at_most_the_bound_and_nearly_reach_it(steps, seed):
    # opposite gradients of a steady size (m_hat / sqrt(v_hat) = 1 each step): near the worst case
    g = 1e-3 + torch.rand(1000, generator=torch.Generator().manual_seed(seed))
    a, b = (torch.randn(1000, generator=torch.Generator().manual_seed(seed)) for _ in "ab")
    a, b = a.requires_grad_(), b.requires_grad_()
    opt_a = torch.optim.AdamW([a], lr=vit.LEARNING_RATE, weight_decay=0.05)
    opt_b = torch.optim.AdamW([b], lr=vit.LEARNING_RATE, weight_decay=0.05)
    for _ in range(steps):
        a.grad, b.grad = g, -g
        opt_a.step()
        opt_b.step()
    tol = vit.tolerance(vit.Flags(), SIZES, steps)["some.weight"]
    torch.testing.assert_close(a, b, **tol)  # within the bound (and the weights' own rounding)
    assert (a - b).abs().max() > 0.9 * tol["atol"]  # and the bound is nearly reached


def test_it_learns_the_shapes(seed):
    step = run(seed=seed, steps=0, sizes=vit.Sizes(batches=8))
    for _ in range(150):
        step()
    first = torch.stack(step.losses[:8]).mean().item()
    # over 60 seeds the last 8 losses were at most 0.32 of the first 8 (log 8 = 2.08 at start);
    # after 100 steps up to 0.63 over 100 seeds, too near any bound
    assert step.mean_loss(last=8) < 0.6 * first, (first, step.mean_loss(last=8))


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
        (dict(batch=0), "Sizes.batch must be an int >= 1"),
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


def test_compile_is_cuda_only_and_sdpa_is_pytorchs_pick_by_default():
    assert "compile" in unavailable(vit.Flags, "cpu")
    assert vit.Flags().backend == "default"
    step = vit.build(vit.Flags(sdpa=True), SIZES)
    assert step.count == 0 and step.losses == []  # building runs no step
    assert all(a.backend == "default" for a in [block.attn for block in step.model.blocks])
    assert all(p.grad is None for p in step.model.parameters())


@pytest.mark.gpu
@needs_cuda
def test_bf16_configurations_at_the_gpu_preset_stay_within_the_bound():
    # 224 px, 12 blocks: logits of bf16 configurations differ from float32's by 1-4 bf16 units in
    # relative norm, and element by element by more than an elementwise bound allows
    # (results/sdpa-notes.md)
    sizes = vit.Sizes.preset("gpu")
    base = run(sizes=sizes, device="cuda").result()
    for flags in (vit.Flags(bf16_autocast=True, channels_last=True), all_on(vit.Flags, "cuda")):
        got = run(flags, sizes=sizes, device="cuda").result()
        vit.compare_results(got, base, flags, sizes=sizes, steps=3)


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
        try:
            vit.compare_results(fast, base, flags, sizes=SIZES, steps=3)
        except AssertionError as e:
            raise AssertionError(f"{label(flags)}: {e}") from None


def test_the_compile_mode_reaches_torch_compile(monkeypatch):
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: modes.append(mode) or model)
    sizes = vit.Sizes.preset("cpu")
    vit.Step(vit.Flags(compile=True), sizes, compile_mode="max-autotune")
    vit.Step(vit.Flags(compile=True), sizes)
    assert modes == ["max-autotune", "default"]
