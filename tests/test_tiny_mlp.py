import dataclasses

import pytest
import torch

from accel.workloads import tiny_mlp
from accel.workloads.flags import all_on, describe

SIZES = tiny_mlp.Sizes(batch=16, width=32, depth=3, batches=3)
FLAG_SETS = [tiny_mlp.Flags(**{i.name: True}) for i in describe(tiny_mlp.Flags)]
FLAG_SETS.append(all_on(tiny_mlp.Flags))


def run(flags, seed, steps=6):
    step = tiny_mlp.build(flags, SIZES, seed=seed)
    for _ in range(steps):
        step()
    return step


def test_same_seed_same_result_and_another_seed_differs(seed):
    a, b, c = (run(tiny_mlp.Flags(), s).result() for s in (seed, seed, seed + 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize(
    "flags", FLAG_SETS, ids=lambda f: "+".join(k for k, v in dataclasses.asdict(f).items() if v)
)
@pytest.mark.parametrize("seed_offset", [0, 1])
def test_every_flag_keeps_the_baseline_result(flags, seed, seed_offset):
    base = run(tiny_mlp.Flags(), seed + seed_offset)
    fast = run(flags, seed + seed_offset)
    tiny_mlp.compare_results(fast.result(), base.result(), flags, sizes=SIZES, steps=6)
    assert fast.mean_loss() == pytest.approx(base.mean_loss(), rel=1e-5)


def test_presets_exist():
    assert tiny_mlp.Sizes.preset("cpu").width < tiny_mlp.Sizes.preset("gpu").width
