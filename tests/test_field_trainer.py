"""The field-trainer workload: determinism, every flag equal to the baseline, clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from accel import sync
from accel.workloads import field_trainer as ft
from accel.workloads.flags import all_on, describe

CPU = ft.Sizes.preset("cpu")
BASELINE = ft.Flags()
WINDOWS = 3
FLAG_NAMES = [info.name for info in describe(ft.Flags)]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: syncs exist only there")
# torch.compile's own imports still touch torch.jit; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")


def run(
    flags: ft.Flags = BASELINE,
    sizes: ft.Sizes = CPU,
    *,
    seed: int = 0,
    windows: int = WINDOWS,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    step = ft.build(flags, sizes, seed=seed, device=device)
    for _ in range(windows):
        step()
    return step.result()


@pytest.fixture
def baseline(seed) -> dict[str, torch.Tensor]:
    return run(seed=seed)


def test_presets_and_seed_defaults():
    gpu = ft.Sizes.preset("gpu")
    assert (gpu.steps_per_window, gpu.progress_every, gpu.rotor_k) == (64, 8, 6)
    assert CPU.readouts_per_window == 2 * (CPU.steps_per_phase // CPU.progress_every)
    with pytest.raises(ValueError, match="unknown preset 'tpu'"):
        ft.Sizes.preset("tpu")


def test_result_is_finite_nonzero_and_shaped(baseline):
    result = baseline
    assert result["metrics"].shape == (2, 3)
    assert result["progress"].shape == (CPU.readouts_per_window, 3)
    assert result["theta"].shape == (CPU.rotor_layers, CPU.rotor_k)
    for key, value in result.items():
        assert torch.isfinite(value).all(), key
        assert (value != 0).any(), key
    assert (result["metrics"] > 0).all()  # curvature (softplus) and speed (sqrt) are positive


def test_same_seed_same_result_other_seed_differs(baseline, seed):
    again, other = run(seed=seed), run(seed=seed + 1)
    for key, value in baseline.items():
        assert torch.equal(again[key], value), key
    for key in ("metrics", "theta", "field"):
        assert not torch.allclose(other[key], baseline[key]), key


@pytest.mark.parametrize("name", [*FLAG_NAMES, "all"])
@pytest.mark.parametrize("seed_offset", [0, 1])
def test_each_flag_keeps_the_baseline(name, seed, seed_offset):
    flags = all_on(ft.Flags) if name == "all" else ft.Flags(**{name: True})
    result, reference = run(flags, seed=seed + seed_offset), run(seed=seed + seed_offset)
    ft.compare_results(result, reference, flags, sizes=CPU, steps=WINDOWS)


@pytest.mark.parametrize(
    "sizes",
    [
        dataclasses.replace(CPU, metric="diag"),
        dataclasses.replace(CPU, nudge_every_windows=2, progress_every=0),
        dataclasses.replace(CPU, rotor_layers=1, rotor_k=CPU.dim // 2, progress_every=1),
    ],
    ids=["diag metric", "rotor every 2nd window, no read-outs", "all coordinates rotated"],
)
def test_phase1_flags_keep_the_baseline_at_other_settings(sizes, seed):
    fast = ft.Flags(
        batched_progress=True, vectorized_rotor=True, fused_lior=True, inplace_accumulate=True
    )
    result, reference = run(fast, sizes, seed=seed), run(ft.Flags(), sizes, seed=seed)
    ft.compare_results(result, reference, fast, sizes=sizes, steps=WINDOWS)


def test_progress_rows_match_and_count(seed):
    base = ft.build(ft.Flags(), CPU, seed=seed)
    fast = ft.build(ft.Flags(batched_progress=True), CPU, seed=seed)
    for _ in range(2):
        base()
        fast()
    assert len(base.progress()) == len(fast.progress()) == 2 * CPU.readouts_per_window
    assert base.progress() == fast.progress()  # the same float32 values, read differently


def test_item_calls_per_window(monkeypatch, seed):
    """Baseline: three .item() per read-out and four per rotor plane plus one; phase 1: none."""
    base = ft.build(ft.Flags(), CPU, seed=seed)
    fast = ft.build(ft.Flags(batched_progress=True, vectorized_rotor=True), CPU, seed=seed)
    base(), fast()  # warm-up
    calls = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: calls.append(1) or original(t))
    base()
    planes = CPU.rotor_layers * CPU.rotor_k
    assert len(calls) == 3 * CPU.readouts_per_window + 4 * planes + 1
    calls.clear()
    fast()
    assert calls == []


def test_compile_failure_falls_back_with_a_warning(monkeypatch, baseline, seed):
    def broken(fn, **options):  # compiles lazily: fails at the first call, as inductor does
        def call(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return call

    monkeypatch.setattr(ft, "_COMPILED_STEPS", {})
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(
        RuntimeWarning,
        match="compiled_step: torch.compile cannot run here or differs from eager "
        r"\(RuntimeError: no compiler here\)",
    ):
        step = ft.build(ft.Flags(compiled_step=True), CPU, seed=seed)
    assert step._compiled_step is None
    for _ in range(WINDOWS):
        step()
    ft.compare_results(step.result(), baseline, step.flags, sizes=CPU, steps=WINDOWS)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"progress_every": -1},
            r"Sizes.progress_every must be an int in 0\.\.8 \(steps of a phase",
        ),
        ({"progress_every": 9}, r"Sizes.progress_every must be an int in 0\.\.8"),
        ({"rotor_k": 0}, r"Sizes.rotor_k must be an int in 1\.\.8"),
        ({"rotor_k": 9}, r"Sizes.rotor_k must be an int in 1\.\.8 \(disjoint planes"),
        ({"steps_per_window": 15}, "Sizes.steps_per_window must be even"),
        ({"batch": 0}, "Sizes.batch must be an int >= 1"),
        ({"metric": "sparse"}, "Sizes.metric must be 'full' or 'diag'"),
        ({"damping": 1.0}, r"Sizes.damping must be in \[0, 1\)"),
        ({"beta": -2.0}, "Sizes.beta must be > 0"),
    ],
)
def test_bad_sizes_name_the_field_and_range(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CPU, **change)


def _spd(d: int, seed: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(seed))
    return a @ a.T + torch.eye(d)


@pytest.mark.parametrize(
    ("g0", "sizes", "match"),
    [
        (-_spd(16, 0), CPU, "positive definite.*smallest is -"),
        (_spd(16, 0) + torch.triu(torch.ones(16, 16), 1), CPU, "g0 must be symmetric"),
        (_spd(8, 0), CPU, r"shape \(16, 16\), got \(8, 8\)"),
        (-torch.rand(16) - 0.1, dataclasses.replace(CPU, metric="diag"), "every entry > 0"),
        (_spd(16, 0), dataclasses.replace(CPU, metric="diag"), r"shape \(16,\)"),
    ],
    ids=["negative definite", "not symmetric", "wrong shape", "diag not positive", "diag shape"],
)
def test_bad_metric_is_rejected(g0, sizes, match):
    with pytest.raises(ValueError, match=match):
        ft.build(ft.Flags(), sizes, g0=g0)


def test_given_metric_and_planes_are_used():
    g0, planes = _spd(16, 1) / 16, [[[0, 15], [3, 4], [7, 9]], [[1, 2], [5, 6], [8, 10]]]
    step = ft.build(ft.Flags(), CPU, g0=g0, planes=planes)
    assert torch.equal(step.planes, torch.tensor(planes))
    torch.testing.assert_close(step.g0, g0)


def test_bad_planes_are_rejected():
    with pytest.raises(ValueError, match=r"planes: coordinates must be in 0\.\.15"):
        ft.build(ft.Flags(), CPU, planes=[[[0, 16]]])


@pytest.mark.gpu
@needs_cuda
def test_phase1_window_is_sync_free_on_cuda(seed):
    sizes = ft.Sizes.preset("gpu")
    base = ft.build(ft.Flags(), sizes, device="cuda", seed=seed)
    fast = ft.build(
        ft.Flags(batched_progress=True, vectorized_rotor=True), sizes, device="cuda", seed=seed
    )
    for _ in range(2):  # warm-up: pinned host buffers, allocator
        base()
        fast()
    planes = sizes.rotor_layers * sizes.rotor_k
    assert sync.count_syncs(base) == 3 * sizes.readouts_per_window + 4 * planes + 1
    assert sync.count_syncs(fast) == 0
    with sync.no_sync():
        fast()


def test_overlapped_launches_compile_their_own_step_and_need_compiled_step(seed):
    """The launch style is a compile option: the overlapped step is a compilation of its own
    beside the plain one (same function); asked for without compiled_step it says it does
    nothing, and the window is the baseline's."""
    flags = ft.Flags(vectorized_rotor=True, fused_lior=True, inplace_accumulate=True)
    overlapped = dataclasses.replace(flags, compiled_step=True, overlapped_launches=True)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

    ft.build(dataclasses.replace(overlapped, overlapped_launches=False), CPU, seed=seed)
    plain_graphs = len(cache_entries(ft.accumulating_step.__code__))
    step = ft.build(overlapped, CPU, seed=seed)
    # its graphs live on a code object of its own: the plain step's recompile budget is untouched
    assert len(cache_entries(ft.accumulating_step.__code__)) == plain_graphs
    assert step._compiled_step is not None
    assert (
        ft._COMPILED_STEPS[(ft.accumulating_step, True)]
        is not (ft._COMPILED_STEPS[(ft.accumulating_step, False)])
    )
    for _ in range(2):
        step()
    ft.compare_results(
        step.result(), run(flags, seed=seed, windows=2), overlapped, sizes=CPU, steps=2
    )
    with pytest.warns(RuntimeWarning, match="without compiled_step it does nothing"):
        alone = ft.build(ft.Flags(overlapped_launches=True), CPU, seed=seed)
    assert alone._compiled_step is None


@pytest.mark.gpu
@needs_cuda
def test_flags_keep_the_baseline_on_cuda(seed):
    flags = all_on(ft.Flags)
    result, reference = run(flags, seed=seed, device="cuda"), run(seed=seed, device="cuda")
    ft.compare_results(result, reference, flags, sizes=CPU, steps=WINDOWS)


@pytest.mark.gpu
@needs_cuda
def test_graphed_window_equals_eager_and_is_sync_free(seed):
    """Two eager warm-up windows, a capture, then replays: equal to the eager window throughout,
    progress rows included (a replay runs no record() on the host)."""
    sizes = ft.Sizes.preset("gpu")
    eager = dataclasses.replace(all_on(ft.Flags, "cuda"), cuda_graph=False)
    graphed = ft.build(all_on(ft.Flags, "cuda"), sizes, device="cuda", seed=seed)
    reference = ft.build(eager, sizes, device="cuda", seed=seed)
    for window in range(8):
        graphed(), reference()
        ft.compare_results(
            graphed.result(), reference.result(), graphed.flags, sizes=sizes, steps=window + 1
        )
        assert len(graphed.progress()) == (window + 1) * sizes.readouts_per_window
    assert graphed.window.replays == 6 and graphed.window.reason is None
    assert sync.count_syncs(graphed) == 0


@pytest.mark.gpu
@needs_cuda
def test_graphed_window_with_host_reads_falls_back(seed):
    from accel.graphs import GraphCaptureWarning

    flags = ft.Flags(vectorized_rotor=True, cuda_graph=True)  # .item() read-outs inside
    with pytest.warns(GraphCaptureWarning, match="host-device sync"):
        result = run(flags, seed=seed, device="cuda", windows=4)
    reference = run(ft.Flags(vectorized_rotor=True), seed=seed, device="cuda", windows=4)
    ft.compare_results(result, reference, flags, sizes=CPU, steps=4)


def test_the_target_buffer_holds_a_pattern_from_the_start(seed):
    """The compiled step's build check runs the nudged phase before any window has copied its
    pattern in: an uninitialized target (NaN at times) made that check fail spuriously."""
    step = ft.build(ft.Flags(), CPU, seed=seed)
    assert torch.equal(step.target, step.targets[0])


def test_compiled_step_is_compiled_once_for_every_step(seed):
    """The step function is module-level: a second Step of the same sizes reuses the graphs the
    first compiled (a bound method would recompile per instance and exhaust dynamo's cache)."""
    from torch._dynamo.utils import counters

    flags = ft.Flags(vectorized_rotor=True, fused_lior=True, inplace_accumulate=True)
    fast = dataclasses.replace(flags, compiled_step=True)
    first = ft.build(fast, CPU, seed=seed)
    graphs_before = counters["stats"]["unique_graphs"]
    second = ft.build(fast, CPU, seed=seed + 1)
    assert first._compiled_step is not None and second._compiled_step is not None
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing compiled again
    for _ in range(2):
        first()
    ft.compare_results(first.result(), run(flags, seed=seed, windows=2), fast, sizes=CPU, steps=2)
