"""Project-level promises: light imports, one dependency list, clean notebooks, honest README."""

import importlib.util
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import accel
from accel.lab.bench import README_END, README_START, results_markdown

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("plotly", "ipywidgets", "pandas")
HAS_TRITON = importlib.util.find_spec("triton") is not None


KERNELS = "accel.kernels."  # Triton's own modules: imported only when a kernel is about to run


def all_modules() -> list[str]:
    return ["accel"] + [info.name for info in pkgutil.walk_packages(accel.__path__, "accel.")]


def first_import_of(names: list[str], heavy: tuple[str, ...]) -> str:
    """Imports ``names`` one by one in one fresh interpreter (a process per module would cost a
    torch import each) and says which first pulled in a ``heavy`` package ("" if none did)."""
    code = f"""
import importlib, sys
for name in {names!r}:
    importlib.import_module(name)
    heavy = [m for m in {heavy!r} if m in sys.modules]
    if heavy:
        print(name, "imported", ",".join(heavy))
        break
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_importing_a_component_pulls_in_no_notebook_stack():
    # every module outside the lab and the CLI: what a user imports into training code (the
    # measuring modules that answer in DataFrames import pandas themselves)
    outside = ("accel.lab", "accel.__main__", "accel.measure.profile", "accel.measure.attention")
    names = [n for n in all_modules() if not n.startswith(outside)]
    if not HAS_TRITON:
        names = [n for n in names if not n.startswith(KERNELS)]
    assert first_import_of(names, HEAVY) == ""


@pytest.mark.triton
def test_no_module_but_a_kernel_imports_triton():
    """Triton is optional: the components, the lab, the doctor and the command line import and
    decide their path without it (``accel.triton_support``); only a kernel about to run does."""
    assert first_import_of([n for n in all_modules() if not n.startswith(KERNELS)], ("triton",)) == ""


def test_environment_yml_installs_extras_that_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = re.findall(r"-e \.\[([a-z,]+)\]", (ROOT / "environment.yml").read_text())
    assert named, "environment.yml should install the package with its extras"
    for group in named:
        for extra in group.split(","):
            assert extra in extras, (
                f"environment.yml names extra {extra!r}; pyproject has {list(extras)}"
            )


def test_core_dependency_is_torch_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [re.split(r"[<>=;\s]", d)[0] for d in project["dependencies"]] == ["torch"]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


def quickstart() -> dict[str, list[str]]:
    """The Quickstart's bash blocks, by the bold heading before each: their commands (a trailing
    comment dropped)."""
    section = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"\*\*([^*]+)\*\*.*?```bash\n(.*?)```", section, re.S)
    return {
        title: [line.split("  #")[0].strip() for line in code.splitlines() if line.strip()]
        for title, code in blocks
    }


def test_readme_quickstart_gives_each_machine_a_complete_block():
    blocks = quickstart()
    assert list(blocks) == ["A GPU machine", "A CPU machine", "As root", "With conda"]
    for title, commands in blocks.items():
        assert sum("jupyter lab" in c for c in commands) == 1, title
        assert "pytest" in commands[-1], f"{title}: its last line runs the tests"
    assert "--allow-root" in blocks["As root"][2]
    readme = (ROOT / "README.md").read_text()
    cpu_lab = re.search(r"\n(.*jupyter lab.*#.*)\n.*--dist loadfile", readme)
    assert cpu_lab and "--allow-root" in cpu_lab[1], "the CPU block's lab line says what root adds"


def test_ci_runs_the_readme_cpu_block_as_written_then_the_full_extras():
    ci = (ROOT / ".ci" / "run").read_text()
    for command in quickstart()["A CPU machine"]:
        if "jupyter lab" not in command:  # .ci/quickstart-check serves the tour
            assert command in ci, f"CI must run the README's {command!r}"
    assert '.venv/bin/pip install -e ".[all]"' in ci and '-m "triton or torchao"' in ci


def test_readme_results_table_matches_results_dir():
    readme = (ROOT / "README.md").read_text()
    block = readme.split(README_START, 1)[1].split(README_END, 1)[0]
    assert block.strip() == results_markdown(ROOT / "results").strip(), (
        "README results table is stale: run `python -m accel table --readme README.md`"
    )
