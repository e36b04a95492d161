"""The nested-optimizer workload: real text, determinism, every flag equal to the baseline within
its stated tolerance, host reads only where the "before" makes them, clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from accel import sync
from accel.workloads import nested_optimizer as no
from accel.workloads.byte_gpt import load_text
from accel.workloads.flags import all_on, describe

CPU = no.Sizes.preset("cpu")
STEPS = 4
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: syncs exist only there")
FAST = no.Flags(
    foreach_stats=True,
    fused_clip=True,
    fused_adamw=True,
    preallocated_buffers=True,
    set_to_none_grads=True,
)


BASELINE = no.Flags()


def run(flags=BASELINE, sizes=CPU, *, seed=0, steps=STEPS, device="cpu", checkpoint=None):
    step = no.build(flags, sizes, seed=seed, device=device, checkpoint=checkpoint)
    for _ in range(steps):
        step()
    return step.result()


@pytest.fixture(scope="module")
def baseline() -> dict[str, torch.Tensor]:
    return run()


def test_presets_match_the_issue():
    with torch.device("meta"):  # shapes only: no 85M-parameter init on a CPU
        gpu = no.GPT(no.Sizes.preset("gpu"))
    params = list(gpu.parameters())
    assert len(params) == 149 and 80e6 < sum(p.numel() for p in params) < 90e6
    assert len(gpu.param_groups()) == no.Sizes.preset("gpu").groups == 14
    assert sum(len(ps) for _, ps in gpu.param_groups()) == 149
    assert len(list(no.GPT(CPU).parameters())) == 41
    with pytest.raises(ValueError, match="unknown preset 'tpu'"):
        no.Sizes.preset("tpu")


def test_text_is_the_standard_library_source():
    text = load_text(1 << 16)
    assert text.dtype == torch.uint8 and len(text) == 1 << 16
    decoded = bytes(text.tolist()).decode("utf-8", errors="replace")
    assert "def " in decoded and "import " in decoded
    assert len(set(text.tolist())) > 60  # real text, not a constant
    assert torch.equal(load_text(1 << 16), text)


def test_result_is_finite_and_learning(baseline):
    for key, value in baseline.items():
        assert torch.isfinite(value).all(), key
    assert baseline["losses"].shape == (STEPS,)
    assert 4.5 < float(baseline["losses"][0]) < 6.0  # ~ln(256) = 5.5 at initialization
    mult = baseline["lr_multipliers"]
    assert mult.shape == (CPU.groups,)
    assert ((mult > 1 / CPU.max_lr_scale) & (mult < CPU.max_lr_scale)).all()
    assert not torch.allclose(mult, torch.ones_like(mult))


def test_same_seed_same_result_other_seed_differs(baseline):
    again, other = run(), run(seed=1)
    for key, value in baseline.items():
        assert torch.equal(again[key], value), key
    assert not torch.allclose(other["params"], baseline["params"])


FLAG_CASES = [info.name for info in describe(no.Flags) if info.is_bool] + [
    "controller_update_every=4",
    "controller_update_every=16",
    "activation_checkpointing=every_2nd",
    "activation_checkpointing=all",
    "activation_checkpointing=selective",
    "fast",
    "all",
]


def flags_for(case: str) -> no.Flags:
    if case == "all":
        return all_on(no.Flags)
    if case == "fast":
        return FAST
    name, _, value = case.partition("=")
    if not value:
        return no.Flags(**{name: True})
    return no.Flags(**{name: int(value) if value.isdigit() else value})


@pytest.mark.parametrize("case", FLAG_CASES)
def test_each_flag_keeps_the_baseline(case, baseline):
    flags = flags_for(case)
    errors = no.compare_results(run(flags), baseline, flags, sizes=CPU, steps=STEPS)
    if flags.activation_checkpointing != "none" and flags == dataclasses.replace(
        no.Flags(), activation_checkpointing=flags.activation_checkpointing
    ):
        assert max(errors.values()) == 0.0  # recomputation repeats the same arithmetic


def test_bf16_needs_its_own_tolerance(baseline):
    flags = no.Flags(bf16_autocast=True)
    result = run(flags)
    no.compare_results(result, baseline, flags, sizes=CPU, steps=STEPS)
    with pytest.raises(AssertionError, match="params"):  # not within the fp32 tolerance
        no.compare_results(result, baseline, BASELINE, sizes=CPU, steps=STEPS)


def test_explicit_checkpoint_names(baseline):
    result = run(checkpoint=["blocks.1"])
    assert all(torch.equal(result[k], baseline[k]) for k in baseline)
    with pytest.raises(ValueError, match=r"no submodule 'blocks.7'"):
        no.build(no.Flags(), CPU, checkpoint=["blocks.7"])


def skip_step_counters(t) -> bool:
    """Optimizer step counters live on the CPU without capturable=True: reading them is free."""
    return getattr(t, "_is_step_counter", False)


def mark_step_counters(step: no.Step) -> None:
    for optimizer in (step.optimizer, step.controller_optimizer):
        for state in optimizer.state.values():
            state["step"]._is_step_counter = True


def test_host_reads_per_step(count_host_reads):
    """Baseline: the multipliers' .tolist(); fast flags: none."""
    base, fast = no.build(no.Flags(), CPU), no.build(FAST, CPU)
    for step in (base, fast):
        step(), step()  # warm-up: optimizer state exists
        mark_step_counters(step)
    assert count_host_reads(base, skip_step_counters) == {"tolist": 1}
    assert sum(count_host_reads(fast, skip_step_counters).values()) == 0
    every4 = no.build(dataclasses.replace(no.Flags(), controller_update_every=4), CPU)
    every4(), every4()
    mark_step_counters(every4)
    reads = count_host_reads(every4, skip_step_counters)
    assert sum(reads.values()) == 0  # step 2: no controller update, no .tolist()


def test_memory_flags_change_what_they_say():
    base, fast = no.build(no.Flags(), CPU), no.build(FAST, CPU)
    for step in (base, fast):
        step()
    base.forward_backward()  # zero_grad keeps gradients (zeroed) ...
    assert all(p.grad is not None for p in base.params)
    fast.optimizer.zero_grad(set_to_none=True)  # ... set_to_none drops them
    assert all(p.grad is None for p in fast.params)
    fast()
    stats_before = fast.buffers.get("stats", (CPU.groups, 2)).data_ptr()
    fast()
    assert fast.buffers.get("stats", (CPU.groups, 2)).data_ptr() == stats_before
    assert fast.buffers.misses == 4  # stats, features, multipliers, lrs: allocated once
    assert base.resident_bytes() > 4 * sum(p.numel() * 4 for p in base.params)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"width": 50}, r"width \(50\) must be a multiple of Sizes.heads \(3\)"),
        ({"layers": 0}, "Sizes.layers must be an int >= 1"),
        ({"text_bytes": 10}, r"text_bytes \(10\) must exceed context \+ 1"),
        ({"lr": 0.0}, "Sizes.lr must be > 0"),
        ({"max_lr_scale": 0.5}, "max_lr_scale must be >= 1"),
    ],
)
def test_bad_sizes_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CPU, **change)


@pytest.mark.gpu
@needs_cuda
def test_fast_step_is_sync_free_on_cuda():
    sizes = no.Sizes.preset("gpu")
    base = no.build(no.Flags(), sizes, device="cuda")
    fast = no.build(FAST, sizes, device="cuda")
    for _ in range(2):
        base(), fast()
    assert sync.count_syncs(base) == 1  # the multipliers' read-back
    assert sync.count_syncs(fast) == 0
    with sync.no_sync():
        fast()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["fast", "all", "activation_checkpointing=all"])
def test_flags_keep_the_baseline_on_cuda(case):
    flags = flags_for(case)
    no.compare_results(run(flags, device="cuda"), run(device="cuda"), flags, sizes=CPU, steps=STEPS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("every", [1, 4])
def test_the_graphed_whole_step_keeps_the_eager_result(every):
    """Eager warm-up, capture, then replays: one graph per controller schedule slot."""
    eager = dataclasses.replace(FAST, controller_update_every=every)
    step = no.build(dataclasses.replace(eager, cuda_graph="whole_step"), CPU, device="cuda")
    steps = 20  # every schedule slot warms up (3 eager calls), is captured and replayed
    for _ in range(steps):
        step()
    graph = step.graphed_step
    assert graph.reason is None and graph.replays > 0
    assert graph.graphs == (2 if every > 1 else 1)
    reference = run(eager, device="cuda", steps=steps)
    no.compare_results(step.result(), reference, eager, sizes=CPU, steps=steps)


def test_selective_checkpointing_wraps_every_block_with_a_policy():
    step = no.build(no.Flags(activation_checkpointing="selective"), CPU)
    assert step.checkpointed.names == [f"blocks.{i}" for i in range(CPU.layers)]
    assert no.checkpoint_names("selective", 4) == no.checkpoint_names("all", 4)
