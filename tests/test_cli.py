import subprocess
import sys
import warnings

import pandas as pd
import pytest

from accel.__main__ import main
from accel.lab import bench
from accel.lab.bench import COLUMNS, Row, recorded_results, write_results


def test_info_prints_device_and_versions(capsys):
    assert main(["info", "--no-ceilings"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "preset" in out


def test_unknown_phase_exits_2_and_lists_the_valid_ones():
    run = subprocess.run(
        [sys.executable, "-m", "accel", "bench", "--phase", "nope"], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "invalid choice: 'nope'" in run.stderr and "ceilings" in run.stderr



def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`python -m accel table | head -1`: the reader closing the pipe is not an error."""
    run = subprocess.run(
        f"{sys.executable} -m accel table | head -c 1", shell=True, capture_output=True, text=True
    )
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr

def test_phase_function_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown phase 'x'; expected one of ceilings"):
        bench.phase_function("x")


@pytest.fixture
def small_ceilings(monkeypatch):
    from accel.measure import ceilings

    small = ceilings.CeilingSizes(copy_bytes=4 << 20, matmul_n=128, repeats=3)
    monkeypatch.setitem(ceilings.CEILING_SIZES, "cpu", small)
    monkeypatch.setitem(ceilings.CEILING_SIZES, "gpu", small)


def test_bench_writes_long_format_csv_and_html(tmp_path, capsys, small_ceilings):
    assert main(["bench", "--phase", "ceilings", "--out", str(tmp_path)]) == 0
    (csv,) = tmp_path.glob("*.csv")
    frame = pd.read_csv(csv)
    assert list(frame.columns) == COLUMNS
    assert set(frame["phase"]) == {"ceilings"} and len(frame) == 2
    assert (frame["optimized"] > 0).all()
    assert frame["date"].str.match(r"\d{4}-\d{2}-\d{2}").all()
    html = csv.with_suffix(".html").read_text()
    assert "plotly" in html and "ceilings" in html
    assert "wrote" in capsys.readouterr().out


def test_write_results_replaces_only_the_phases_it_holds(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x")

    def frame(phase, value):
        rows = [Row(phase, "case", "time", "ms", value, baseline=2 * value).as_dict() | stamp]
        return pd.DataFrame(rows, columns=COLUMNS)

    write_results(frame("a", 1.0), tmp_path, stem="m")
    write_results(frame("b", 2.0), tmp_path, stem="m")
    write_results(frame("a", 3.0), tmp_path, stem="m")
    result = pd.read_csv(tmp_path / "m.csv").set_index("phase")
    assert result.loc["a", "optimized"] == 3.0 and result.loc["b", "optimized"] == 2.0
    assert result.loc["a", "speedup"] == 2.0


def test_a_phase_judged_after_an_unjudged_one_keeps_met_as_true_or_false(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x")

    def frame(phase, met):
        rows = [Row(phase, "case", "time", "ms", 1.0, target="t", met=met).as_dict() | stamp]
        return pd.DataFrame(rows, columns=COLUMNS)

    write_results(frame("a", None), tmp_path, stem="m")  # every met empty: read back as floats
    write_results(frame("b", True), tmp_path, stem="m")
    write_results(frame("c", False), tmp_path, stem="m")
    lines = (tmp_path / "m.csv").read_text().splitlines()[1:]
    assert [line.split(",")[9] for line in lines] == ["", "True", "False"]
    assert list(recorded_results(results_dir=tmp_path)["met"]) == [None, True, False]


def test_rewriting_a_result_file_keeps_the_other_phases_rows_to_the_last_digit(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x")

    def frame(phase, value):
        rows = [Row(phase, "case", "time", "ms", value, baseline=1.0).as_dict() | stamp]
        return pd.DataFrame(rows, columns=COLUMNS)

    write_results(frame("a", 0.9846581923255463), tmp_path, stem="m")
    before = (tmp_path / "m.csv").read_text()
    write_results(frame("b", 2.0), tmp_path, stem="m")
    assert (tmp_path / "m.csv").read_text().splitlines()[1] == before.splitlines()[1]


@pytest.mark.parametrize(("higher", "expected"), [(False, 4.0), (True, 0.25)])
def test_row_speedup_direction(higher, expected):
    assert (
        Row("p", "c", "m", "u", optimized=1.0, baseline=4.0, higher_is_better=higher).speedup
        == expected
    )


def test_table_prints_markdown(tmp_path, capsys):
    assert main(["table", "--results", str(tmp_path)]) == 0
    assert "No results recorded yet" in capsys.readouterr().out


def test_readme_table_keeps_sweep_points_in_the_csv_only(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x") | {"date": "2026-01-01"}
    rows = [
        Row("p", case, "rate", "TFLOP/s", 2.0, baseline=1.0).as_dict() | stamp
        for case in ("main case", "sweep S=256", "sweep: worst ratio")
    ]
    write_results(pd.DataFrame(rows, columns=COLUMNS), tmp_path, stem="m")
    table = bench.results_markdown(tmp_path)
    assert "main case" in table and "sweep: worst ratio" in table
    assert "sweep S=256" not in table and "1 sweep points in the CSV" in table
    assert f"`{tmp_path.name}/m.csv`" in table  # the folder the table was read from


def test_readme_table_names_a_machine_of_several_gpus_by_its_count(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x") | {"device": "NVIDIA H100", "date": "2026-01-01"}
    row = Row("p", "c", "rate", "TFLOP/s", 2.0, baseline=1.0).as_dict() | stamp
    for stem in ("nvidia-h100", "nvidia-h100-x2"):
        write_results(pd.DataFrame([row], columns=COLUMNS), tmp_path, stem=stem)
    headings = [line for line in bench.results_markdown(tmp_path).splitlines() if line[:2] == "**"]
    assert sorted(h.split(" (")[0] for h in headings) == ["**2 x NVIDIA H100**", "**NVIDIA H100**"]


def test_write_results_by_case_replaces_only_the_cases_it_holds(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x")

    def frame(*cases):
        rows = [Row("a", case, "time", "ms", value).as_dict() | stamp for case, value in cases]
        return pd.DataFrame(rows, columns=COLUMNS)

    write_results(frame(("one", 1.0), ("two", 2.0), ("end", 9.0)), tmp_path, stem="m")
    b = pd.DataFrame([Row("b", "other", "time", "ms", 7.0).as_dict() | stamp], columns=COLUMNS)
    write_results(b, tmp_path, stem="m")  # another phase after it
    write_results(
        frame(("two", 5.0), ("three", 3.0), ("one", 6.0)), tmp_path, stem="m", by_case=True
    )
    result = pd.read_csv(tmp_path / "m.csv")
    # replaced in place, a new case after its phase's rows, the other phase untouched
    assert list(result["case"]) == ["one", "two", "end", "three", "other"]
    assert list(result["optimized"]) == [6.0, 5.0, 9.0, 3.0, 7.0]
    write_results(frame(("four", 4.0)), tmp_path, stem="m")  # a whole phase: the rest goes
    assert list(pd.read_csv(tmp_path / "m.csv")["case"]) == ["other", "four"]


def test_write_results_by_case_replaces_a_sweeps_points_together(tmp_path):
    """A sweep point's name holds its shape: a rerun whose points moved leaves no stale ones."""
    stamp = dict.fromkeys(COLUMNS[11:], "x")

    def frame(*cases):
        rows = [Row("a", case, "time", "ms", 1.0).as_dict() | stamp for case in cases]
        return pd.DataFrame(rows, columns=COLUMNS)

    old = ("one", "sweep x B=8", "sweep x B=16", "sweep y B=8", "sweep x: worst")
    write_results(frame(*old), tmp_path, stem="m")
    rerun = ("sweep x B=32", "sweep x B=8", "sweep x: worst")  # a moved point, a kept one
    write_results(frame(*rerun), tmp_path, stem="m", by_case=True)
    cases = list(pd.read_csv(tmp_path / "m.csv")["case"])
    assert cases == ["one", "sweep x B=32", "sweep x B=8", "sweep y B=8", "sweep x: worst"], cases


def test_write_results_by_case_replaces_a_named_groups_rows_together(tmp_path):
    """Rows named "<group>: <what>" are one part's: a rerun whose rows changed names (a
    prediction for another set of fixes) leaves none of the old ones behind."""
    stamp = dict.fromkeys(COLUMNS[11:], "x")

    def frame(*cases):
        rows = [Row("a", case, "time", "ms", 1.0).as_dict() | stamp for case in cases]
        return pd.DataFrame(rows, columns=COLUMNS)

    old = ("ladder g: share", "ladder g: prediction a+b", "ladder h: share", "other")
    write_results(frame(*old), tmp_path, stem="m")
    write_results(frame("ladder g: share", "ladder g: prediction a"), tmp_path, stem="m", by_case=True)
    cases = list(pd.read_csv(tmp_path / "m.csv")["case"])
    assert cases == ["ladder g: share", "ladder g: prediction a", "ladder h: share", "other"], cases


def test_only_is_refused_for_a_phase_that_runs_whole_and_for_a_part_that_is_not_there():
    from accel.errors import UsageError
    from accel.lab.bench import check_parts

    with pytest.raises(UsageError, match="sync runs whole"):
        check_parts(["notebooks", "sync"], ("05",))
    with pytest.raises(UsageError, match=r"--only 99: no such part; the parts: 00_tour"):
        check_parts(["notebooks"], ("05", "99"))
    check_parts(["notebooks", "overhead", "sdpa"], ("05", "adamw sweep", "masked sweep"))


# ---- what a person reads in a terminal ------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--help"], ["bench", "--help"]])
def test_help_reads_plainly(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out  # docstring markup, not what a terminal shows
    if argv[0] == "doctor":
        assert "(default: doctor.html)" in " ".join(out.split())


def test_bench_table_rounds_and_says_why_rows_are_not_judged():
    stamp = dict.fromkeys(COLUMNS[11:], "x")
    why = "not judged: the targets are for a CUDA GPU with the gpu preset, this is cpu"
    rows = [
        Row("p", "judged", "time", "ms", 23.17524049, baseline=90.6758075, target=">= 1.2x", met=True),
        Row("p", "missed", "time", "ms", 2.0, baseline=1.0, target=">= 1.2x", met=False),
        Row("p", "cpu", "time", "ms", 1.0, baseline=3.0, target=">= 1.2x", note=f"{why}; 16 steps"),
        Row("p", "cpu 2", "count", "n", 0.0, baseline=37.0, target="0", note=f"{why}; no syncs"),
        Row("p", "untargeted", "time", "ms", 1.0, baseline=1.5),
    ]  # fmt: skip
    frame = pd.DataFrame([r.as_dict() | stamp for r in rows], columns=COLUMNS)
    lines = bench.console_table(frame).splitlines()
    table = {line.split()[1]: line.split() for line in lines[1:6]}
    assert table["judged"][3:7] == ["90.7", "23.2", "ms", "3.91"]
    assert "23.17524" not in "\n".join(lines) and "None" not in "\n".join(lines)
    assert lines[1].endswith("yes") and lines[2].endswith("no")
    assert lines[3].endswith("not judged") and lines[4].endswith("not judged")
    assert not lines[5].rstrip().endswith(("yes", "no", "judged"))  # no target, no verdict
    assert lines[6:] == [why]  # the reason, once


def test_a_warning_during_the_bench_is_one_line_above_the_bar(monkeypatch, capsys):
    def phase(ctx):
        warnings.warn("no CUDA device here: nothing to count", UserWarning, stacklevel=1)
        return [Row("p", "c", "time", "ms", 1.0)]

    monkeypatch.setattr(bench, "phase_function", lambda name: phase)
    bench.run_bench(["sync"], device="cpu")
    err = capsys.readouterr().err
    assert "UserWarning: no CUDA device here: nothing to count\n" in err
    assert "warnings.warn(" not in err and "test_cli.py" not in err  # no source line


def test_the_recipes_seed_and_single_run_validation_rows_are_groups_apart():
    """A part's rerun replaces its groups' rows together ("<group>: ..."): each seed's quality row
    and the cumulative part's validation row must not share a group, or one rerun drops the
    other's."""
    from accel.lab.cases import recipe

    groups = {recipe.QUALITY_CASE.format(seed=s).split(": ")[0] for s in (1, 2)}
    assert len(groups) == 2 and recipe.VALIDATION_CASE.split(": ")[0] not in groups
