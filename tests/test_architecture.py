"""The shape of the house (ARCHITECTURE.md): small modules, one direction of imports, a lab front
door that imports lazily, notebooks that start short."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "accel"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_FIRST_CELL_LINES = 6
VIEWERS = ("pandas", "plotly", "ipywidgets")  # the lab's libraries, never a component's


def _modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(under.rglob("*.py"))


def _components() -> list[Path]:
    """The package minus the measuring library, the bench, the workloads, the doctor and the
    command line: what a user imports."""
    skip = {PACKAGE / "measure", PACKAGE / "lab", PACKAGE / "workloads", PACKAGE / "doctor"}
    return [
        p for p in _modules() if not skip.intersection(p.parents) and p != PACKAGE / "__main__.py"
    ]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_module_is_longer_than_a_sitting():
    long = {
        _rel(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_longer_than_a_screen():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{_rel(path)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_kernels_import_only_torch_triton_and_the_standard_library():
    for path in _modules(PACKAGE / "kernels"):
        foreign = {
            m
            for m in _imports(path)
            if m.split(".")[0] not in ("torch", "triton", "__future__")
            and m.split(".")[0] not in sys.stdlib_module_names
        }
        assert not foreign, f"{_rel(path)} imports {sorted(foreign)}"


def test_components_import_neither_the_lab_nor_its_viewers():
    for path in _components():
        bad = {
            m
            for m in _imports(path)
            if m.startswith(("accel.measure", "accel.lab", "accel.workloads", "accel.doctor"))
            or m.split(".")[0] in VIEWERS
        }
        assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize(
    ("layer", "below"),
    [("measure", ("accel.lab", "accel.doctor")), ("doctor", ("accel.lab",))],
)
def test_the_measuring_library_is_below_the_doctor_and_the_doctor_below_the_bench(layer, below):
    """The doctor measures with ``accel.measure`` and never imports the bench (``accel.lab``),
    whose doctor case imports the doctor; the measuring library imports neither."""
    for path in _modules(PACKAGE / layer):
        bad = {m for m in _imports(path) if m.startswith(below)}
        assert not bad, f"{_rel(path)} imports {sorted(bad)}"


def test_using_the_components_loads_no_viewer():
    """A user who only wants the components pays for no pandas, plotly or widgets, even when the
    components run (the static check above misses an import through a third package)."""
    code = f"""
import sys, torch
from accel import attention, diversity, fusion, graphs, memory, optim, sync
x = torch.randn(2, 3, 8, 16)
attention.sdpa(x, x, x, causal=True)
diversity.mean_diversity(torch.randn(4, 3, 16))
model = torch.nn.Linear(8, 8)
model(torch.randn(4, 8)).sum().backward()
fusion.group_stats([list(model.parameters())])
opt = optim.MultiTensorAdamW(model.parameters(), implementation="reference")
opt.step()
memory.peak_memory(lambda: torch.randn(64, 64) @ torch.randn(64, 64), device="cpu")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {set(VIEWERS)!r})
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_lab_front_door_names_resolve_and_import_lazily():
    code = f"""
import sys
from accel import lab
assert not any(m.split(".")[0] in {set(VIEWERS)!r} for m in sys.modules)
lab.compare, lab.setup, lab.time_fn
assert "plotly" not in sys.modules and "ipywidgets" not in sys.modules
for name in lab.__all__:
    getattr(lab, name)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    from accel import lab

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        lab.nope  # noqa: B018


def test_setup_says_where_it_runs_and_whether_targets_are_judged(capsys, monkeypatch):
    import torch

    from accel import lab

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCEL_PRESET", raising=False)
    threads = torch.get_num_threads()
    try:
        here = lab.setup()
        assert (here.device.type, here.preset, here.judged, here.on_gpu) == (
            "cpu",
            "cpu",
            False,
            False,
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert "preset 'cpu', targets not judged" in capsys.readouterr().out


@pytest.mark.parametrize(
    "notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem
)
def test_a_notebook_starts_with_a_short_first_cell(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    lines = "".join(first["source"]).strip().splitlines()
    assert len(lines) <= MAX_FIRST_CELL_LINES, (
        f"{notebook.name}: {len(lines)} lines:\n" + "\n".join(lines)
    )


def test_code_and_notebooks_speak_of_the_project_not_of_issues():
    found = []
    for path in [*_modules(), *sorted((ROOT / "notebooks").glob("*.ipynb"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bissues?\b|issue #\d", line, re.IGNORECASE):
                found.append(f"{_rel(path)}:{number}: {line.strip()[:80]}")
    assert not found, "\n".join(found)


# ---- the import graph: one direction, public names only ------------------------------------------
def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> list[tuple[str, str]]:
    """(module of the package, name taken from it) for each import in ``path``, at the top or
    inside a function, relative imports resolved; the name is "" for ``import x``."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                if whole in modules:
                    found.append((whole, ""))
                elif base in modules:
                    found.append((base, alias.name))
    return [(m, name) for m, name in found if m != here]


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in _modules()}
    return {m: {t for t, _ in _imported(p, set(paths))} for m, p in paths.items()}


def test_no_module_imports_another_that_leads_back_to_it():
    graph = _graph()
    cycles = []
    for start in graph:
        seen, todo = set(), [(start, (start,))]
        while todo:
            node, path = todo.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, (*path, nxt)))
    assert not cycles, cycles[:5]


def test_no_private_name_is_taken_from_another_module():
    modules = set(_graph())
    taken = [
        f"{_rel(p)} takes {name} from {module}"
        for p in _modules()
        for module, name in _imported(p, modules)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not taken, taken


# ---- code text states why, results/ states what was measured ---------------------------------------
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# a number, or a range of two, with the unit of a timing, a rate or a ratio
FIGURE = re.compile(
    r"(?<![\w.^/])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?\s?"
    r"(?:x|ms|us|µs|μs|GB/s|TB/s|TFLOP/s|%|of (?:the )?copy)(?![\w/^])"
)
# words that say a sentence reports a run
MEASURED = re.compile(r"\b(?:measured|recorded|[HAB]\d00|on (?:the|this) (?:GPU|card))\b", re.I)
# what makes a figure a target, a threshold or a bound rather than a result: a comparator in its
# clause before it, or "or more" in its clause after it
BOUND_BEFORE = re.compile(
    r"(?:>=|<=|≥|≤|[<>]|\bat (?:least|most)\b|\btargets?\b|\bwithin\b|\bunder\b|\bbelow\b|"
    r"\babove\b|\bdefaults?\b)[^,;:()]*$",
    re.I,
)
BOUND_AFTER = re.compile(r"^[^,;:()]*?\b(?:or (?:more|less|fewer)|targets?)\b", re.I)
SENTENCE = re.compile(r"(?:[^.!?]|[.!?](?!\s|$))+[.!?]?", re.S)  # a point inside 1.5x ends none


def code_text(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each comment block (consecutive comment lines) and docstring."""
    source = path.read_text()
    blocks: list[tuple[int, list[str]]] = []
    last = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, text = token.start[0], token.string.lstrip("#").strip()
            if blocks and row == last + 1:
                blocks[-1][1].append(text)
            else:
                blocks.append((row, [text]))
            last = row
    found = [(row, "\n".join(lines)) for row, lines in blocks]
    for node in ast.walk(ast.parse(source)):
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, documented) and (doc := ast.get_docstring(node, clean=False)):
            found.append((node.body[0].lineno, doc))
    return found


def measured_figures(text: str) -> list[tuple[int, str]]:
    """(line within ``text``, what) for each date and each measured figure: a number with a unit
    in a sentence that speaks of a run, unless a comparator makes it a target or a bound."""
    found = [(text.count("\n", 0, m.start()), m.group()) for m in DATE.finditer(text)]
    for sentence in SENTENCE.finditer(text):
        if not MEASURED.search(sentence.group()):
            continue
        for figure in FIGURE.finditer(sentence.group()):
            before = sentence.group()[: figure.start()]
            after = sentence.group()[figure.end() :]
            if not BOUND_BEFORE.search(before) and not BOUND_AFTER.search(after):
                start = sentence.start() + figure.start()
                found.append((text.count("\n", 0, start), figure.group()))
    return found


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("Measured on an H100 (2026-11-24): 3.2x the loop.", ["2026-11-24", "3.2x"]),
        ("the pipelined launch took 7x\nat D=100, as measured", ["7x"]),
        ("reads at 0.61-0.98 of copy on the H200", ["0.61-0.98 of copy"]),
        ("a launch costs 5 us on the GPU; the next one 4.1 µs", ["5 us", "4.1 µs"]),
        ("padded on the host, 15% of the tokens masked", []),
        ("Target on an H100: >= 1.5x the compiled form.", []),
        ("measured is 3% of the step or more", []),
        ("recorded at most 20 µs a call, within 1.3x of the copy", []),
        ("a 4x MLP, 128 x 128 tiles, the default 64 rows", []),
        ("42 rows, 3 warps: measured, not assumed", []),
    ],
)
def test_the_measured_figure_rule_tells_a_result_from_a_target(text, caught):
    assert [what for _, what in measured_figures(text)] == caught


def test_code_text_states_no_measured_figure_or_date():
    """A figure measured on some GPU on some day ages in a comment; its place is the bench's rows
    and ``results/<phase>-notes.md``, which a comment may point at."""
    found = [
        f"{_rel(path)}:{first + offset}: {what}"
        for path in _modules()
        for first, text in code_text(path)
        for offset, what in measured_figures(text)
    ]
    assert not found, "measured figures or dates in comments and docstrings:\n" + "\n".join(found)


def test_every_results_file_named_exists():
    """A pointer into results/ from code, tests, notebooks or the two maps names a file that is
    there (``*`` matches; a placeholder such as ``<phase>`` is not a name)."""
    texts = [*_modules(), *sorted((ROOT / "tests").glob("*.py"))]
    texts += [*sorted((ROOT / "notebooks").glob("*.ipynb")), ROOT / "README.md"]
    texts.append(ROOT / "ARCHITECTURE.md")
    missing = [
        f"{_rel(path)}:{number}: results/{name}"
        for path in texts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for name in re.findall(r"results/([\w.*-]+\.(?:md|csv|html|txt|json))", line)
        if not any((ROOT / "results").glob(name))
    ]
    assert not missing, "\n".join(missing)
