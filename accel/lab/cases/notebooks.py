"""Bench phase ``notebooks``: how long each notebook takes to run, cell by cell, in a fresh kernel
through nbclient from its own folder (a failing cell fails its row, not the phase); a cell may run
long only with a progress bar (a widget among its outputs). ``--only 00 01`` times some notebooks;
the workbook's row then sums them with the others' recorded rows."""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from accel.lab.bench import BenchContext, Row

PHASE = "notebooks"
NOTEBOOK_TARGET_S = 120.0
WORKBOOK_TARGET_S = 720.0
CELL_TARGET_S = 30.0
CELL_TIMEOUT_S = 900
WIDGET = "application/vnd.jupyter.widget-view+json"
NOTEBOOK_DIR = Path(__file__).resolve().parents[3] / "notebooks"


def parts() -> list[str]:
    """The notebooks, by name: ``--only 05 07`` times those two (a prefix picks a notebook)."""
    return [path.stem for path in _notebooks()]


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def run(ctx: BenchContext) -> list[Row]:
    """One row per notebook ``ctx`` selects and one for the whole workbook."""
    paths = _notebooks()
    if not paths:  # an installed package has no notebooks beside it
        return []
    rows = []
    for path in paths:
        if ctx.selected(path.stem):
            seconds, cells, error = run_notebook(path)
            _say(path.stem, seconds, cells)
            rows.append(_notebook_row(ctx, path.stem, seconds, cells, error))
    return [*rows, _workbook_row(ctx, [p.stem for p in paths], rows)]


def _say(name: str, seconds: float, cells: list[CellTime]) -> None:
    """The notebook's time and its cells of over 5 s, on stderr as the bench goes."""
    slow = ", ".join(f"[{c.index}] {c.seconds:.0f} s{' (progress bar)' if c.progress else ''}"
                     for c in cells if c.seconds > 5)  # fmt: skip
    print(f"{name}: {seconds:.0f} s; cells over 5 s: {slow or 'none'}", file=sys.stderr)


def _workbook_row(ctx: BenchContext, names: list[str], rows: list[Row]) -> Row:
    """The notebooks' seconds summed: this run's, and for a notebook not run now, its recorded
    row (NaN while a notebook has neither)."""
    seconds = {r.case: r.optimized for r in rows}
    dates = set()
    if ctx.recorded is not None:
        earlier = ctx.recorded[ctx.recorded["phase"] == PHASE]
        for case, value, date in earlier[["case", "optimized", "date"]].itertuples(index=False):
            if case in names and case not in seconds:
                seconds[case] = value
                dates.add(date)
    missing = [n for n in names if n not in seconds]
    total = math.nan if missing else sum(seconds.values())
    note = f"{ctx.where}; {len(names)} notebooks, one after another"
    if dates:
        note += f"; {len(rows)} timed in this run, the rest recorded on {', '.join(sorted(dates))}"
    if missing:
        note += f"; not timed yet: {', '.join(missing)}"
    return Row(PHASE, "workbook", "seconds to run every notebook", "s", total,
               target=f"<= {WORKBOOK_TARGET_S:g} s",
               met=total <= WORKBOOK_TARGET_S if ctx.judged and not missing else None,
               note=note)  # fmt: skip


class CellTime(NamedTuple):
    index: int  # in the file, from 0
    seconds: float
    progress: bool  # it showed a widget (a progress bar) among its outputs


def run_notebook(path: Path) -> tuple[float, list[CellTime], str]:
    """Seconds to run every cell of ``path`` in a fresh kernel (start-up included), each code
    cell's time, and the error that stopped it ("" when none did)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(path.parent)}}
    )
    error = ""
    start = time.perf_counter()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        error = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    seconds = time.perf_counter() - start
    return seconds, cell_times(notebook), error


def cell_times(notebook) -> list[CellTime]:
    """Each executed code cell's seconds, from the timings nbclient records."""
    cells = []
    for index, cell in enumerate(notebook.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        began, ended = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if began and ended:
            spent = (_when(ended) - _when(began)).total_seconds()
            shown = any(WIDGET in out.get("data", {}) for out in cell.get("outputs", []))
            cells.append(CellTime(index, spent, shown))
    return cells


def slowest_unshown(cells: list[CellTime]) -> CellTime:
    """The slowest cell without a progress bar (index -1 if there is none)."""
    return max((c for c in cells if not c.progress), key=lambda c: c.seconds,
               default=CellTime(-1, 0.0, False))  # fmt: skip


def _when(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _notebook_row(
    ctx: BenchContext, name: str, seconds: float, cells: list[CellTime], error: str
) -> Row:
    slowest = slowest_unshown(cells)
    within = seconds <= NOTEBOOK_TARGET_S and slowest.seconds <= CELL_TARGET_S and not error
    note = f"{ctx.where}; slowest without a progress bar: cell {slowest.index} of the file"
    note += f" (from 0), {slowest.seconds:.1f} s"
    shown = [c for c in cells if c.progress and c.seconds > CELL_TARGET_S]
    if shown:
        note += "; with one: " + ", ".join(f"cell {c.index} {c.seconds:.1f} s" for c in shown)
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):  # a kernel's imports then compile anew
        note += "; Python bytecode not cached (PYTHONDONTWRITEBYTECODE): every process compiles"
        note += " the source it imports"
    note += f"; FAILED: {error}" if error else ""
    target = f"<= {NOTEBOOK_TARGET_S:g} s, no cell over {CELL_TARGET_S:g} s without a progress bar"
    return Row(PHASE, name, "seconds to run every cell", "s", seconds, target=target,
               met=within if ctx.judged else None, note=note)  # fmt: skip
