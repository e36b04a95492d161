"""The sdpa phase's masked rows: the mask's cost model, checks before timing, rows read back for
the notebook's figures, the panel's toggle."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from accel import attention as A
from accel.lab.bench import BenchContext
from accel.lab.cases import sdpa, sdpa_flex
from accel.measure.ceilings import Ceilings

CPU = torch.device("cpu")
FAKE_CEILINGS = Ceilings("cpu", 10.0, 0.5, "float32", 1 << 20, 256)
TINY = sdpa_flex.FlexSizes(1, 2, 8, torch.float32, 5, (17, 33), (33,), 3, 33, 33, repeats=2)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_caches():
    A.clear_masked_cache()
    yield
    A.clear_masked_cache()


def test_mask_costs_count_the_tiles_a_window_keeps():
    # S = 1024 is 8 x 8 tiles of 128; a window of 128 keeps the diagonal and the one before it
    costs = sdpa.mask_costs(A.SlidingWindow(128), batch=1, seq=1024)
    assert costs["tiles kept"] == pytest.approx((8 + 7) / 64)
    assert costs["predicted speedup"] == pytest.approx(64 / 15)
    assert costs["dense mask bytes"] == 1024 * 1024
    # int32 counts and indices: 4 x (8 + 8 x 8) x 4 bytes, no tensor of S x S
    assert costs["block mask bytes"] == 4 * (8 + 64) * 4


def test_a_documents_ids_count_in_its_mask_memory():
    lengths = sdpa.document_lengths(2, 1024, 8, seed=1)
    assert lengths.shape == (2, 8) and (lengths >= 1).all() and (lengths.sum(-1) == 1024).all()
    costs = sdpa.mask_costs(A.Document(lengths), batch=2, seq=1024)
    assert costs["block mask bytes"] == 2 * 4 * (8 + 64) * 4 + 2 * 1024 * 4  # + int32 ids
    assert costs["dense mask bytes"] == 2 * 1024 * 1024


def test_check_masked_says_which_path_is_wrong(monkeypatch):
    case = sdpa.AttnCase(2, 2, 33, 8, dtype=torch.float32)
    q, k, v, _ = sdpa.make_inputs(case, CPU)
    mask = A.Document(torch.tensor([[10, 23], [30, 3]]))
    checked = sdpa_flex.check_masked(q, k, v, mask, ("flex", "dense"))
    assert checked["flex"] < 1e-5 and checked["dense"] < 1e-5
    q.requires_grad_(True)  # FlexAttention has no backward on the CPU: said, not raised
    assert "no backward on the CPU" in sdpa_flex.check_masked(q, k, v, mask, ("flex",))["flex"]
    q.requires_grad_(False)
    real = sdpa_flex.attention.sdpa

    def off_by_one(q, k, v, *, mask=None, backend="default", **kw):
        out = real(q, k, v, mask=mask, backend=backend, **kw)
        return out + 1.0 if backend == "dense" else out

    monkeypatch.setattr(sdpa_flex.attention, "sdpa", off_by_one)
    point = sdpa.measure_masked(mask, case, CPU, ("flex", "dense"), repeats=2)
    assert point.checked["dense"].startswith("differs from float64 by up to 1")
    assert set(point.times) == {"flex"}  # a wrong path is never timed


def test_flex_rows_on_cpu_and_their_figures_read_back(monkeypatch):
    monkeypatch.setitem(sdpa_flex.FLEX_SIZES, "cpu", TINY)
    rows = sdpa_flex.flex_rows(BenchContext(CPU, "cpu", FAKE_CEILINGS), judged=False)
    by_case = {r.case: r for r in rows}
    window = by_case["flex sliding window 5 B=1 H=2 S=33 D=8 fwd"]
    assert window.target == ">= 3x" and window.met is None and window.optimized > 0
    assert "against float64" in window.note and "first calls" in window.note
    backward = by_case["flex sliding window 5 B=1 H=2 S=33 D=8 fwd+bwd"]
    assert math.isnan(backward.optimized) and "no backward on the CPU" in backward.note
    memory = by_case["flex sliding window 5 S=33 mask memory"]
    assert memory.baseline == pytest.approx(33 * 33 / 2**20)
    assert "flex causal document x3 B=1 H=2 S=33 D=8 fwd" in by_case
    causal = by_case["flex causal B=1 H=2 S=33 D=8 fwd+bwd"]
    assert causal.metric.endswith("vs SDPA causal kernel") and "default: error" in causal.note
    assert not any(" first call " in c for c in by_case)  # first calls are in the notes
    recorded = pd.DataFrame([r.as_dict() | {"device": "cpu"} for r in rows])
    frame = sdpa.flex_frame(recorded)
    times = frame[(frame["what"] == "ms") & (frame["kind"] == "sliding window 5")]
    assert set(times["S"]) == {17, 33} and set(times["path"]) == {"flex", "dense"}
    assert set(frame[frame["kind"] == "causal"]["path"]) == {"flex", "causal"}


def test_the_panel_toggles_dense_and_flex():
    from accel import lab

    case = sdpa.AttnCase(1, 2, 33, 8, dtype=torch.float32)
    mask = A.SlidingWindow(5)
    panel = lab.FeaturePanel(
        sdpa.MaskFlags,
        lambda flags: sdpa.masked_step(flags, mask, case, CPU),
        device=CPU,
        repeats=2,
        warmup=1,
        profile=False,
    )
    panel.controls["flex"].value = True
    panel.run()
    assert list(panel.results["label"]) == ["baseline", "flex"]
    from accel.attention import flex

    assert flex._DENSE_MASKS and flex._BLOCK_MASKS  # each path ran, its mask made once
