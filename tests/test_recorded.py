"""A notebook's quick figure beside the bench's record for the same machine."""

import pandas as pd
import pytest

from accel.lab.bench import COLUMNS, Row, write_results
from accel.lab.recorded import beside_recorded, result_sentence
from accel.measure.device import device_name

HERE = device_name("cpu")


def record(folder, device, speedup, date, stem):
    row = Row("sync", "window", "time", "ms", 1.0, baseline=speedup).as_dict()
    row |= dict.fromkeys(COLUMNS[11:], "x") | {"device": device, "date": date}
    write_results(pd.DataFrame([row], columns=COLUMNS), folder, stem=stem)


@pytest.mark.parametrize(
    ("measured", "band", "agrees", "says"),
    [
        (2.4, (2.2, 2.7), True, "they agree within this run's spread"),
        (1.6, (1.5, 1.8), False, "they disagree beyond this run's spread"),
        (2.4, None, None, "no spread measured here"),
    ],
)
def test_the_latest_record_of_this_machine_is_judged_by_the_quick_runs_spread(
    tmp_path, measured, band, agrees, says
):
    record(tmp_path, HERE, 2.0, "2026-01-01", "a")
    record(tmp_path, HERE, 2.5, "2026-02-01", "b")  # the latest: this one counts
    record(tmp_path, "Some GPU", 9.0, "2026-03-01", "c")
    found = beside_recorded("sync", "window", measured, band, device="cpu", results_dir=tmp_path)
    assert found.recorded == pytest.approx(2.5) and found.date == "2026-02-01"
    assert found.agrees is agrees and says in str(found)
    assert found.elsewhere == {"Some GPU": pytest.approx(9.0)}


def test_no_record_for_this_machine_names_the_others(tmp_path):
    record(tmp_path, "Some GPU", 9.0, "2026-03-01", "c")
    found = beside_recorded("sync", "window", 2.0, (1.9, 2.1), device="cpu", results_dir=tmp_path)
    assert found.recorded is None and found.agrees is None
    assert f"no bench row recorded for {HERE} (recorded on Some GPU: 9)" in str(found)


def test_an_unknown_metric_names_the_columns(tmp_path):
    record(tmp_path, HERE, 2.0, "2026-01-01", "a")
    with pytest.raises(ValueError, match=r"metric must be a results column .*speedup"):
        beside_recorded("sync", "window", 2.0, None, device="cpu", metric="x", results_dir=tmp_path)


def test_the_result_sentence_names_each_gpus_latest_row_and_its_verdict(tmp_path):
    def gpu_row(device, optimized, met, date, stem):
        row = Row("sync", "window", "time", "ms", optimized, baseline=10.0, target=">= 1.6x",
                  met=met).as_dict()  # fmt: skip
        row |= dict.fromkeys(COLUMNS[11:], "x") | {"device": device, "date": date}
        write_results(pd.DataFrame([row], columns=COLUMNS), tmp_path, stem=stem)

    gpu_row("GPU A", 5.0, True, "2026-01-01", "a")
    gpu_row("GPU A", 4.0, True, "2026-02-01", "b")  # the latest of GPU A
    gpu_row("GPU B", 8.0, False, "2026-01-01", "c")
    said = result_sentence("sync", "window", results_dir=tmp_path)
    assert said == (
        "on the GPU A (2026-02-01): 2.5x (4 ms), target >= 1.6x met; "
        "on the GPU B (2026-01-01): 1.25x (8 ms), target >= 1.6x missed"
    )
    with pytest.raises(LookupError, match="no row 'sync' / 'other'"):
        result_sentence("sync", "other", results_dir=tmp_path)


def test_the_result_sentence_skips_rows_not_run_and_asks_which_metric(tmp_path):
    def gpu_row(metric, optimized, date, stem):
        row = Row("sync", "window", metric, "ms", optimized, baseline=10.0).as_dict()
        row |= dict.fromkeys(COLUMNS[11:], "x") | {"device": "GPU A", "date": date}
        write_results(pd.DataFrame([row], columns=COLUMNS), tmp_path, stem=stem)

    gpu_row("time", 5.0, "2026-01-01", "a")
    gpu_row("time", float("nan"), "2026-02-01", "b")  # recorded as not run: no figure
    assert result_sentence("sync", "window", results_dir=tmp_path).endswith("2x (5 ms)")
    gpu_row("latency", 4.0, "2026-01-01", "c")
    with pytest.raises(ValueError, match="pass metric= one of 'latency', 'time'"):
        result_sentence("sync", "window", results_dir=tmp_path)
    said = result_sentence("sync", "window", metric="latency", figure="optimized", results_dir=tmp_path)
    assert said == "on the GPU A (2026-01-01): 4 ms"
