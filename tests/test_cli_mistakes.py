"""The command line and the bench: user mistakes get one line and exit code 2, work is never lost."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from accel import phases
from accel.__main__ import main
from accel.lab import bench
from accel.lab.bench import COLUMNS, Row, write_results
from accel.measure import device as d

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def accel_cli(capsys, monkeypatch):
    """``python -m accel ARGS`` in this process (in ``cwd``, with ``env`` set): its exit code and
    output. One test below runs the real command in a subprocess."""

    def run(*args: str, cwd: Path | str = ROOT, env: dict | None = None) -> Ran:
        monkeypatch.chdir(cwd)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return Ran(code, out, err)

    return run


def _rows(phase: str, value: float, case: str = "case") -> list[Row]:
    return [Row(phase, case, "time", "ms", value, baseline=2 * value)]


@pytest.fixture
def readme_with_results(tmp_path) -> Path:
    """A copy of the README and its results/ in a directory of their own."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "results", tmp_path / "results")
    return tmp_path / "README.md"


def test_table_finds_the_results_beside_the_readme_from_any_directory(
    accel_cli, readme_with_results, tmp_path_factory
):
    before = readme_with_results.read_text()
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    run = accel_cli("table", "--readme", str(readme_with_results), cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    assert readme_with_results.read_text() == before  # the same results: nothing to change


def test_table_refuses_to_replace_the_table_with_an_emptier_one(
    accel_cli, readme_with_results, tmp_path
):
    empty = tmp_path / "empty"
    empty.mkdir()
    before = readme_with_results.read_text()
    run = accel_cli("table", "--readme", str(readme_with_results), "--results", str(empty))
    assert run.returncode == 2
    assert readme_with_results.read_text() == before
    assert "would drop" in run.stderr and "--force" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_table_with_force_replaces_it(readme_with_results, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        main(["table", "--readme", str(readme_with_results), "--results", str(empty), "--force"])
        == 0
    )
    assert "No results recorded yet" in readme_with_results.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["table", "--readme", "missing.md"], "missing.md: no such file"),
        (["table", "--results", "no-such-dir"], "no-such-dir: no such directory"),
    ],
)
def test_user_mistakes_get_one_line_and_exit_code_2(accel_cli, args, message, tmp_path):
    run = accel_cli(*args, cwd=tmp_path)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_readme_without_the_markers_is_one_line(accel_cli, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# nothing here\n")
    run = accel_cli("table", "--readme", str(readme), "--results", str(ROOT / "results"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "has no <!-- results:start -->" in run.stderr


def test_an_unwritable_out_is_refused_before_any_phase_runs(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(phases, "BENCH", (*phases.BENCH, "fake"))
    monkeypatch.setattr(bench, "phase_function", lambda name: lambda ctx: ran.append(name) or [])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", "--phase", "fake", "--out", str(blocker / "results")]) == 2
    assert ran == []


def test_each_phase_is_written_as_soon_as_it_ends(tmp_path, monkeypatch):
    def phase(name, value):
        return lambda ctx: _rows(name, value)

    def crashing(ctx):
        raise KeyboardInterrupt

    functions = {"first": phase("first", 1.0), "second": phase("second", 2.0), "third": crashing}
    monkeypatch.setattr(phases, "BENCH", (*phases.BENCH, *functions))
    monkeypatch.setattr(bench, "phase_function", functions.__getitem__)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(["first", "second", "third"], device="cpu", progress=False, out=tmp_path)
    (csv,) = tmp_path.glob("*.csv")
    assert set(pd.read_csv(csv)["phase"]) == {"first", "second"}
    assert csv.with_suffix(".html").is_file()


def test_the_html_report_needs_no_network(tmp_path):
    stamp = dict.fromkeys(COLUMNS[11:], "x")
    frame = pd.DataFrame([r.as_dict() | stamp for r in _rows("p", 1.0)], columns=COLUMNS)
    paths = write_results(frame, tmp_path, stem="m")
    html = paths["html"].read_text()
    assert "cdn" not in html.lower() and "https://" not in html.split("<body>")[0]
    script = tmp_path / "plotly.min.js"
    assert script.is_file() and script.stat().st_size > 1_000_000  # plotly.js itself, beside it
    assert '<script src="plotly.min.js"' in html


def test_a_gpu_preset_without_cuda_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(d.PRESET_ENV, "gpu")
    with pytest.raises(d.PresetError, match=r"ACCEL_PRESET=gpu needs a CUDA GPU.*use cpu"):
        d.preset("cpu")


def test_the_cli_refuses_a_bad_preset_in_one_line(tmp_path):
    # the real command, in a process of its own: what a user's shell shows
    env = dict(os.environ, ACCEL_PRESET="bogus")
    run = subprocess.run(
        [sys.executable, "-m", "accel", "info", "--no-ceilings"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "unknown preset 'bogus'" in run.stderr and "cpu, gpu" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def _conflicted_results(folder: Path) -> Path:
    """A results file as git leaves it after a conflicting merge."""
    lines = (ROOT / "results" / "nvidia-h200.csv").read_text().splitlines(keepends=True)
    csv = folder / "nvidia-h200.csv"
    csv.write_text("".join([*lines[:2], "<<<<<<< HEAD\n", lines[2], "=======\n", lines[3]]))
    with csv.open("a") as file:
        file.write(">>>>>>> other-machine\n" + "".join(lines[4:]))
    return csv


def test_table_refuses_a_results_file_with_merge_markers_naming_its_line(accel_cli, tmp_path):
    csv = _conflicted_results(tmp_path)
    run = accel_cli("table", "--results", str(tmp_path))
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"{csv}:3: a merge-conflict marker" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_bench_refuses_to_merge_into_a_results_file_with_merge_markers(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(phases, "BENCH", (*phases.BENCH, "fake"))
    monkeypatch.setattr(bench, "phase_function", lambda name: lambda ctx: ran.append(name) or [])
    monkeypatch.setattr(bench, "results_stem", lambda device=None: "nvidia-h200")
    csv = _conflicted_results(tmp_path)
    before = csv.read_text()
    with pytest.raises(bench.UsageError, match=r"nvidia-h200\.csv:3: a merge-conflict marker"):
        bench.run_bench(["fake"], device="cpu", progress=False, out=tmp_path)
    with pytest.raises(bench.UsageError, match=r"nvidia-h200\.csv:3: "):
        write_results(pd.read_csv(ROOT / "results" / "nvidia-h200.csv"), tmp_path, "nvidia-h200")
    assert ran == [] and csv.read_text() == before


NOT_A_STEP = """
def make():
    return 3, None
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps 0: expected a number of steps >= 1"),
        (["--steps", "-2"], "--steps -2: expected a number of steps >= 1"),
        ([], "not_a_step.py:make() returned a step of type int; expected the training step"),
    ],
    ids=["no steps", "negative steps", "a step that is not a function"],
)
def test_doctor_refuses_a_mistake_in_one_line_before_examining(
    accel_cli, tmp_path, monkeypatch, args, message
):
    examined = []
    monkeypatch.setattr("accel.doctor.examine", lambda *a, **k: examined.append(a))
    (tmp_path / "not_a_step.py").write_text(NOT_A_STEP)
    run = accel_cli("doctor", "not_a_step.py:make", *args, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert examined == []


@pytest.mark.parametrize(
    ("made", "said"),
    [
        ("lambda batch: batch", "make() returned the step alone, and it takes a batch: return "
         "(step, batch), or (step, None, loader)"),
        ("{'step': 1}", "or the step alone, where it draws its own batch; it returned dict"),
    ],
    ids=["step alone that takes a batch", "a dict"],
)
def test_doctor_says_what_the_maker_should_return_in_the_clis_words(tmp_path, made, said):
    from accel.doctor.cli import load_step
    from accel.errors import UsageError

    (tmp_path / "maker.py").write_text(f"def make():\n    return {made}\n")
    with pytest.raises(UsageError) as refused:
        load_step(f"{tmp_path / 'maker.py'}:make")
    assert said in str(refused.value), str(refused.value)


VIEW_AFTER_TRANSPOSE = """
import torch

model = torch.nn.Linear(4, 6)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(batch):
    logits = model(batch).transpose(0, 1)
    loss = logits.view(-1).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def make():
    return step, torch.randn(3, 4)


def make_sized(batch_size, lr=0.1):
    return step, torch.randn(batch_size, 4)


class Net(torch.nn.Module):  # a model class, built by a call of none
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 6)
"""


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("view_step.py:make", ("view_step.py:10", "RuntimeError: view size")),
        ("view_step.py:step", ("view_step.py:step takes an argument", "(step, batch)")),
        ("view_step.py:model", ("view_step.py:model is a model (Linear)", "(step, batch)")),
        ("view_step.py:make_sized", ("make_sized(batch_size, lr=0.1)",
                                     "def make(): return make_sized(...)")),
        ("view_step.py:Net", ("view_step.py:Net is a model class (a Module)", "(step, batch)")),
    ],
    ids=["the step's own error", "the step named instead of its maker", "the model named",
         "a maker that takes its sizes", "a model class named"],
)
def test_doctor_says_the_users_own_mistake_in_one_line(accel_cli, tmp_path, target, said):
    # the step's own mistake (a .view of a transposed tensor) and naming the step itself, which
    # needs the batch only a maker gives: one line saying what to change, not a traceback
    (tmp_path / "view_step.py").write_text(VIEW_AFTER_TRANSPOSE)
    run = accel_cli("doctor", target, "--out", str(tmp_path / "d.html"), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert all(part in run.stderr for part in said), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "d.html").exists()


@pytest.mark.parametrize("target", ["needs_a_package.py:make", "needs_a_package:make"])
def test_doctor_says_a_package_the_script_imports_is_missing_in_one_line(
    accel_cli, tmp_path, monkeypatch, target
):
    # named by its path or as a module: the same one line, the missing package in it
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "needs_a_package.py").write_text("import not_installed_anywhere\n")
    run = accel_cli("doctor", target, "--out", str(tmp_path / "d.html"), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "not_installed_anywhere" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


EXITS_AT_IMPORT = """
import sys
sys.exit("set DATA_DIR first")
"""
EXITS_IN_ITS_MAKER = """
def make():
    exit()
"""
RAISES_IN_ITS_MAKER = """
def make():
    raise FileNotFoundError("data/train.bin")
"""
EMPTY_LOADER = """
import torch
def make():
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(0, 4)))
    return (lambda batch: batch[0].sum()), None, empty
"""


@pytest.mark.parametrize(
    ("script", "said"),
    [(EXITS_AT_IMPORT, "importing it called sys.exit('set DATA_DIR first')"),
     (EXITS_IN_ITS_MAKER, "make() called sys.exit(None)"),
     (RAISES_IN_ITS_MAKER, "make() raised FileNotFoundError: data/train.bin (exits.py:3)"),
     (EMPTY_LOADER, "loader= gave no batch")],
    ids=["at import", "in its maker", "its maker raises", "an empty loader"],
)  # fmt: skip
def test_doctor_says_a_script_that_ends_before_its_step_in_one_line(
    accel_cli, tmp_path, monkeypatch, script, said
):
    # a script's own setup that ends the process (sys.exit or exit() where a setting is
    # missing) ended the doctor's command too, with the script's exit code (0 for exit()) and
    # no word that no report was written; one that raises printed a traceback
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "exits.py").write_text(script)
    run = accel_cli("doctor", "exits.py:make", "--out", str(tmp_path / "d.html"), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert said in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert script is EMPTY_LOADER or "no report" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "d.html").exists()
