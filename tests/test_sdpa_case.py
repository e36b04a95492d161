"""The sdpa bench phase and its helpers: cost model, profiler read-out, every kernel measured at a
shape (``lab.sdpa_backends``), the phase's parts, the masked sweep's rows."""

from __future__ import annotations

import math

import pytest
import torch

from accel import attention as A
from accel.lab import plots
from accel.lab.bench import BenchContext
from accel.lab.cases import sdpa, sdpa_flex
from accel.lab.cases import sdpa_masked_sweep as sweep
from accel.measure.ceilings import Ceilings
from accel.workloads import vit

CPU = torch.device("cpu")
FAKE_CEILINGS = Ceilings("cpu", 10.0, 0.5, "float32", 1 << 20, 256)
# the CPU's masked default path takes the dense mask after one warning: expected here
QUIET_FALLBACK = pytest.mark.filterwarnings("ignore:accel.attention. FlexAttention cannot run here")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_cost_model_counts():
    # the shape: 4 * 4 * 16 * 4096^2 * 128 = 0.55 TFLOP per forward
    assert sdpa.attention_flops(4, 16, 4096, 4096, 128) == pytest.approx(5.4976e11, rel=1e-4)
    assert sdpa.attention_flops(1, 1, 8, 8, 4, causal=True) == 4 * 64 * 4 / 2
    assert sdpa.attention_flops(1, 1, 8, 8, 4, backward=True) == 3.5 * 4 * 64 * 4
    fused = sdpa.attention_bytes(1, 2, 8, 8, 4, elem_bytes=2)
    assert fused == 2 * (16 + 16) * 4 * 2
    manual = sdpa.attention_bytes(1, 2, 8, 8, 4, elem_bytes=2, manual=True)
    assert manual - fused == 6 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("variant", "expected"),
    [("flash", "flash"), ("math", "math"), ("manual", "none (manual)")],
)
def test_profiler_names_the_backend_that_ran(variant, expected):
    case = sdpa.AttnCase(1, 2, 33, 16, dtype=torch.float32)
    q, k, v, grad = sdpa.make_inputs(case, CPU)
    ran = sdpa.which_backend(sdpa.variant_fn(variant, case, q, k, v, grad), CPU)
    assert ran["backend"] == expected


def test_manual_path_needs_the_scores_in_memory_and_sdpa_does_not():
    case = sdpa.AttnCase(1, 4, 255, 16, dtype=torch.float32)
    q, k, v, grad = sdpa.make_inputs(case, CPU)
    scores = 4 * 255 * 255 * 4
    manual = sdpa.peak_memory_bytes(sdpa.variant_fn("manual", case, q, k, v, grad), CPU)
    fused = sdpa.peak_memory_bytes(sdpa.variant_fn("flash", case, q, k, v, grad), CPU)
    assert manual >= 2 * scores > 4 * fused


def test_check_backends_table(seed):
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    table = sdpa.check_backends(q, k, v, causal=True).set_index("backend")
    assert set(table.index) == {"manual", *A.BACKENDS}
    ran = table[table["ran"]]
    assert ran["within_tolerance"].all() and (ran["max_abs_error"] < 1e-5).all()
    assert not table.loc["cudnn", "ran"] and "CPU" in table.loc["cudnn", "reason"]


def test_measure_point_skips_with_reasons():
    case = sdpa.AttnCase(2, 2, 31, 16, causal=True, backward=True, dtype=torch.float32)
    point = sdpa.measure_point(case, CPU, ("manual", "default", "cudnn", "math"), repeats=2)
    assert set(point.times) >= {"manual", "default", "math"} and "cudnn" not in point.times
    assert all(t > 0 for t in point.times.values())
    assert "CPU" in point.skipped["cudnn"]


def test_sdpa_backends_measures_every_kernel_beside_pytorchs_pick(seed):
    from accel import lab

    q, k, v = (torch.randn(1, 2, 33, 16, requires_grad=True) for _ in range(3))
    state = torch.random.get_rng_state()
    rows = lab.sdpa_backends(q, k, v, causal=True, backward=True, repeats=3).set_index("backend")
    assert torch.equal(torch.random.get_rng_state(), state)  # no generator drawn from
    assert all(t.grad is None for t in (q, k, v))  # the backward ran on copies
    assert list(rows.index) == ["default", "default again", *A.FORCED]
    assert rows.loc["default", "kernel"] == A.picked_kernel(q, k, v, causal=True) == "flash"
    assert rows.loc["default", "speedup"] == 1.0 and rows.loc["default again", "speedup"] > 0
    timed = rows[rows["reason"] == ""]
    assert set(timed.index) == {"default", "default again", "flash", "math"}
    assert (timed["ms"] > 0).all() and (timed["speedup"] > 0).all()
    assert "CPU" in rows.loc["cudnn", "reason"] and math.isnan(rows.loc["cudnn", "ms"])
    spread = abs(rows.loc["default again", "speedup"] - 1)
    assert rows["spread"].tolist() == pytest.approx([spread] * len(rows))


def test_sdpa_backends_times_no_kernel_whose_output_differs(monkeypatch):
    from accel.measure import attention as lab_attention

    real = lab_attention.sdpa

    def off_by_one(q, k, v, *, backend="default", **kw):
        out = real(q, k, v, backend=backend, **kw)
        return out + 1.0 if backend == "math" else out

    monkeypatch.setattr(lab_attention, "sdpa", off_by_one)
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    rows = lab_attention.sdpa_backends(q, k, v, repeats=2).set_index("backend")
    assert rows.loc["math", "reason"].startswith("output differs from the default's by up to 1")
    assert math.isnan(rows.loc["math", "ms"])


def test_backend_frame_is_the_figures_long_format():
    cases = [sdpa.AttnCase(1, 2, s, 8, causal=True, dtype=torch.float32) for s in (15, 31)]
    frame = sdpa.backend_frame(CPU, cases, repeats=2)
    assert set(frame["S"]) == {15, 31} and (frame["direction"] == "fwd").all()
    ran = frame[frame["reason"] == ""]
    assert (ran["tflop_s"] > 0).all()
    fig = plots.sdpa_sweep(ran[ran["backend"] != "default again"], ceiling_tflop_s=0.5)
    assert len(fig.data) == 3  # default, flash, math in the one (fwd, causal) panel


@QUIET_FALLBACK
def test_run_on_cpu_gives_unjudged_sdpa_rows(monkeypatch):
    tiny = sdpa.BenchSizes(
        headline=sdpa.AttnCase(1, 2, 17, 8, dtype=torch.float32), repeats=1, vit_repeats=1
    )
    monkeypatch.setitem(sdpa.BENCH_SIZES, "cpu", tiny)
    small = vit.Sizes(image=8, patch=4, dim=8, heads=2, depth=1, classes=2, batch=2, batches=1)
    monkeypatch.setitem(vit.Sizes.PRESETS, "cpu", small)
    flex = sdpa_flex.FlexSizes(1, 2, 8, torch.float32, 5, (17,), (17,), 2, 17, 17, repeats=1)
    monkeypatch.setitem(sdpa_flex.FLEX_SIZES, "cpu", flex)
    masked = sweep.MaskedSweepSizes((16,), (8,), 2, 16, torch.float32, 4, 2, 1, directions=(False,))
    monkeypatch.setitem(sweep.MASKED_SWEEP, "cpu", masked)
    rows = sdpa.run(BenchContext(CPU, "cpu", FAKE_CEILINGS))
    assert {r.phase for r in rows} == {"sdpa"}
    assert all(r.met is None and r.note.startswith("not judged") for r in rows)
    cases = [r.case for r in rows]
    assert "vit step: all but compile" in cases and "sweep masked window fwd D=8 S=16" in cases
    assert "flex sliding window 5 B=1 H=2 S=17 D=8 fwd" in cases
    default = next(r for r in rows if r.case == "B=1 H=2 S=17 D=8 full fwd default")
    assert default.optimized > 0 and not math.isnan(default.fraction_of_ceiling)
    assert "profiler: flash ran" in default.note and default.target.startswith(">= 640")
    assert not any("best forced" in c or " first call " in c for c in cases)
    equal = [r for r in rows if r.case.startswith("vit step")]
    assert all("result equal" in r.note for r in equal), [r.note for r in equal]


def test_the_phase_runs_in_parts(monkeypatch):
    from accel.lab import bench

    assert sdpa.parts() == ["headline", "flex", "masked sweep", "vit", "max-autotune vit"]
    assert bench.phase_parts("sdpa") == sdpa.parts()
    ran = []
    for part in sdpa.parts():
        monkeypatch.setitem(sdpa._PARTS, part, lambda ctx, part=part: ran.append(part) or [])
    sdpa.run(BenchContext(CPU, "cpu", FAKE_CEILINGS, only=("masked sweep", "vit")))
    assert ran == ["masked sweep", "vit"]


def test_measure_point_times_variants_in_the_timers_rotated_and_reversed_rounds(monkeypatch):
    taken = []
    real = sdpa.interleaved
    monkeypatch.setattr(
        sdpa, "interleaved", lambda *a, **kw: taken.append(real(*a, **kw)) or taken[-1]
    )
    case = sdpa.AttnCase(1, 2, 15, 8, dtype=torch.float32)
    point = sdpa.measure_point(case, CPU, ("default", "flash", "math"), repeats=4)
    (samples,) = taken
    names = list(samples.samples)
    assert names == ["default", "flash", "math"]
    # round r: turned by r // 2 places, reversed when r is odd
    turned = names[1:] + names[:1]
    rounds = [names, names[::-1], turned, turned[::-1]]
    assert list(samples.schedule) == [name for order in rounds for name in order]
    assert all(len(t) == 4 for t in samples.samples.values())  # one sample per round, aligned
    assert point.times == samples.medians()


@QUIET_FALLBACK
def test_a_masked_sweep_point_is_sdpa_beside_the_users_own_flex_attention(monkeypatch):
    tiny = sweep.MaskedSweepSizes((16, 40), (8,), 2, 40, torch.float32, 4, 2, 1, directions=(False,))
    monkeypatch.setitem(sweep.MASKED_SWEEP, "cpu", tiny)
    rows = sweep.rows(BenchContext(CPU, "cpu", FAKE_CEILINGS))
    points = [r for r in rows if r.case.startswith("sweep masked ")]
    assert [r.case for r in points] == [
        f"sweep masked {kind} fwd D=8 S={s}" for kind in sweep.KINDS for s in (16, 40)
    ]
    assert all(r.optimized > 0 and r.baseline > 0 and "largest difference" in r.note
               for r in points)  # fmt: skip
    assert all("B=" in r.note and "round by round" in r.note for r in points)
    (summary,) = [r for r in rows if r not in points]
    assert summary.case.startswith("masked sweep: ") and "over 6 points" in summary.case
    assert summary.target == "median >= 0.95x, every point >= 0.9x" and summary.met is None


@QUIET_FALLBACK
def test_a_masked_sweep_point_whose_outputs_differ_is_not_timed(monkeypatch):
    real = sweep.attention.sdpa
    monkeypatch.setattr(sweep.attention, "sdpa", lambda *a, **kw: real(*a, **kw) + 1.0)
    tiny = sweep.MaskedSweepSizes((16,), (8,), 2, 16, torch.float32, 4, 2, 1, directions=(False,))
    monkeypatch.setitem(sweep.MASKED_SWEEP, "cpu", tiny)
    monkeypatch.setattr(BenchContext, "judged", property(lambda self: True))
    rows = sweep.rows(BenchContext(CPU, "cpu", FAKE_CEILINGS))
    assert all(math.isnan(r.optimized) and r.met is False for r in rows[:-1])
    assert "NOT timed" in rows[0].note and rows[-1].met is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_gpu_sdpa_backends_times_the_fused_kernels_beside_pytorchs_pick():
    from accel import lab

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = lab.sdpa_backends(q, k, v, causal=True, backward=True, repeats=5).set_index("backend")
    assert rows.loc["default", "kernel"] in A.FORCED
    assert (rows.loc[["flash", "efficient"], "reason"] == "").all(), rows["reason"]
    timed = rows[rows["reason"] == ""]
    assert (timed["ms"] > 0).all() and (timed["speedup"] > 0).all()


def test_the_masked_sweep_runs_at_the_cpu_preset():
    """The CPU preset is the one a user without a GPU gets from the bench: forward points only,
    FlexAttention having no backward there."""
    rows = sweep.rows(BenchContext(CPU, "cpu", FAKE_CEILINGS, only=("masked sweep",)))
    points = [r for r in rows if r.case.startswith("sweep masked")]
    assert points and all(" fwd " in r.case for r in points)


def test_the_max_autotune_row_leaves_the_vit_parts_rows_in_the_results(tmp_path):
    """Each part's rows replace only the same cases' (a group "<name>: ..." together): the
    max-autotune part, run on its own, must not take the vit part's rows with it."""
    import pandas as pd

    from accel.lab import bench

    columns = ["phase", "case", "metric"]
    old = pd.DataFrame([["sdpa", f"vit step: {name}", "time"]
                        for name in ("baseline", "all but compile", "all flags")], columns=columns)  # fmt: skip
    new = pd.DataFrame([["sdpa", sdpa.AUTOTUNED_CASE, "time"]], columns=columns)
    merged = bench._replace_cases(old, new)
    assert list(merged["case"]) == [*old["case"], sdpa.AUTOTUNED_CASE]
