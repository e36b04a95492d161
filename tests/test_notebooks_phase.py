import nbformat
import pytest
import torch

from accel.lab.bench import BenchContext
from accel.lab.cases import notebooks
from accel.measure.ceilings import Ceilings


def write(path, *sources):
    cells = [nbformat.v4.new_markdown_cell("# a notebook")]
    cells += [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


@pytest.fixture
def ctx():
    ceilings = Ceilings("cpu", 10.0, 0.1, "float32", 1 << 20, 64)  # made up: no measuring here
    return BenchContext(torch.device("cpu"), "cpu", ceilings)


def test_each_notebook_gets_its_seconds_and_slowest_cell_and_the_workbook_its_sum(
    tmp_path, monkeypatch, ctx
):
    write(tmp_path / "01_quick.ipynb", "x = 1", "import time\ntime.sleep(0.6)", "y = x + 1")
    write(tmp_path / "02_broken.ipynb", "raise ValueError('the data is gone')", "z = 3")
    (tmp_path / "scratch.ipynb").write_text("not a workbook notebook: not run")
    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path)

    rows = notebooks.run(ctx)

    quick, broken, workbook = rows
    assert [r.case for r in rows] == ["01_quick", "02_broken", "workbook"]
    assert (
        quick.optimized >= 0.6
        and "slowest without a progress bar: cell 2 of the file" in quick.note
    )
    assert "FAILED" not in quick.note
    assert "FAILED" in broken.note and "the data is gone" in broken.note
    assert workbook.optimized == pytest.approx(quick.optimized + broken.optimized)
    assert all(r.met is None and r.note.startswith("not judged") for r in rows)  # a CPU run


def test_an_installed_package_without_notebooks_gives_no_rows(tmp_path, monkeypatch, ctx):
    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path / "absent")
    assert notebooks.run(ctx) == []


def test_on_a_gpu_a_slow_notebook_a_slow_cell_or_a_failure_misses_its_target(tmp_path, monkeypatch):
    write(tmp_path / "01_slow_cell.ipynb", "import time\ntime.sleep(0.5)")
    write(tmp_path / "02_fine.ipynb", "x = 1")
    write(tmp_path / "03_broken.ipynb", "1 / 0")
    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path)
    monkeypatch.setattr(notebooks, "CELL_TARGET_S", 0.3)
    monkeypatch.setattr(notebooks, "WORKBOOK_TARGET_S", 1e-3)
    ceilings = Ceilings("cuda", 10.0, 0.1, "bfloat16", 1 << 20, 64)
    ctx = BenchContext(torch.device("cuda"), "gpu", ceilings)  # judged; nothing runs on it

    slow, fine, broken, workbook = notebooks.run(ctx)

    assert (slow.met, fine.met, broken.met, workbook.met) == (False, True, False, False)


def test_a_slow_cell_that_shows_a_progress_bar_is_within_its_target(tmp_path, monkeypatch):
    bar = "import time\nfrom tqdm.auto import tqdm\nfor _ in tqdm(range(5)):\n    time.sleep(0.1)"
    write(tmp_path / "01_with_bar.ipynb", bar)
    write(tmp_path / "02_without.ipynb", "import time\ntime.sleep(0.5)")
    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path)
    monkeypatch.setattr(notebooks, "CELL_TARGET_S", 0.3)
    ceilings = Ceilings("cuda", 10.0, 0.1, "bfloat16", 1 << 20, 64)
    ctx = BenchContext(torch.device("cuda"), "gpu", ceilings)  # judged; nothing runs on it

    with_bar, without, _ = notebooks.run(ctx)

    assert (with_bar.met, without.met) == (True, False)
    assert "with one: cell 1" in with_bar.note
    assert "cell 1 of the file" in without.note


def test_a_run_whose_processes_cannot_cache_bytecode_says_so(tmp_path, monkeypatch, ctx):
    """Each kernel (and every process a notebook starts) then compiles torch's source anew."""
    write(tmp_path / "01_quick.ipynb", "x = 1")
    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    cached, _ = notebooks.run(ctx)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    uncached, _ = notebooks.run(ctx)

    assert "bytecode" not in cached.note
    assert "bytecode not cached" in uncached.note


def test_some_notebooks_timed_and_the_workbook_summed_with_the_others_recorded_rows(
    tmp_path, monkeypatch
):
    import pandas as pd

    for name in ("01_a", "02_b", "03_c"):
        write(tmp_path / f"{name}.ipynb", "x = 1")
    monkeypatch.setattr(notebooks, "NOTEBOOK_DIR", tmp_path)
    assert notebooks.parts() == ["01_a", "02_b", "03_c"]
    recorded = pd.DataFrame(
        {
            "phase": ["notebooks", "notebooks", "sdpa"],
            "case": ["01_a", "02_b", "03_c"],
            "optimized": [40.0, 50.0, 1e6],
            "date": ["2026-11-20", "2026-11-21", "2026-11-21"],
        }
    )
    ceilings = Ceilings("cpu", 10.0, 0.1, "float32", 1 << 20, 64)
    ctx = BenchContext(torch.device("cpu"), "cpu", ceilings, only=("02", "03"), recorded=recorded)

    b, c, workbook = notebooks.run(ctx)

    assert (b.case, c.case) == ("02_b", "03_c")
    assert workbook.optimized == pytest.approx(40.0 + b.optimized + c.optimized)
    assert "2 timed in this run, the rest recorded on 2026-11-20" in workbook.note
    ctx = BenchContext(torch.device("cpu"), "cpu", ceilings, only=("03",))
    *_, workbook = notebooks.run(ctx)  # nothing recorded for 01 and 02: no sum yet
    assert workbook.optimized != workbook.optimized and "not timed yet: 01_a, 02_b" in workbook.note


def test_the_overhead_phase_runs_only_the_parts_asked_for():
    from accel.lab.cases import overhead

    only_adamw = BenchContext(torch.device("cpu"), "cpu", only=("adamw sweep",))
    rows = overhead.run(only_adamw)
    assert rows and all(r.case.startswith("adamw") for r in rows)
    assert not only_adamw.selected("components") and only_adamw.selected("adamw sweep")
