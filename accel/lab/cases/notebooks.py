"""Bench phase ``notebooks``: how long each notebook takes to run, cell by cell, as a reader waits
for it. Targets on a GPU at the gpu preset: each notebook in at most 120 s, the whole workbook in at
most 12 minutes, and no cell over 30 s (a longer one must show a progress bar; the row names the
slowest cell so it can be checked).

Each notebook runs in a fresh kernel through nbclient (what nbval drives), from its own folder, its
outputs discarded; a failing cell fails the row rather than the phase. ``--only 00 01 02`` times
some notebooks (a GPU machine's command may be shorter than the workbook); the workbook's row then
sums them with the others' recorded rows.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from pathlib import Path

from accel.lab.bench import BenchContext, Row

PHASE = "notebooks"
NOTEBOOK_TARGET_S = 120.0
WORKBOOK_TARGET_S = 720.0
CELL_TARGET_S = 30.0
CELL_TIMEOUT_S = 900
NOTEBOOK_DIR = Path(__file__).resolve().parents[3] / "notebooks"


def parts() -> list[str]:
    """The notebooks, by name: ``--only 05 07`` times those two (a prefix picks a notebook)."""
    return [path.stem for path in _notebooks()]


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def run(ctx: BenchContext) -> list[Row]:
    """One row per notebook of :data:`NOTEBOOK_DIR` (those ``ctx`` selects) and one for the whole
    workbook, from this run's notebooks and, for the others, the rows already recorded."""
    paths = _notebooks()
    if not paths:  # an installed package has no notebooks beside it
        return []
    rows = []
    for path in paths:
        if ctx.selected(path.stem):
            seconds, slowest, error = run_notebook(path)
            rows.append(_notebook_row(ctx, path.stem, seconds, slowest, error))
    return [*rows, _workbook_row(ctx, [p.stem for p in paths], rows)]


def _workbook_row(ctx: BenchContext, names: list[str], rows: list[Row]) -> Row:
    """The notebooks' seconds summed: this run's, and for a notebook not run now, its recorded
    row (NaN while a notebook has neither)."""
    seconds = {r.case: r.optimized for r in rows}
    dates = set()
    if ctx.recorded is not None:
        earlier = ctx.recorded[ctx.recorded["phase"] == PHASE]
        for case, value, date in zip(
            earlier["case"], earlier["optimized"], earlier["date"], strict=True
        ):
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
    return Row(
        PHASE,
        "workbook",
        "seconds to run every notebook",
        "s",
        total,
        target=f"<= {WORKBOOK_TARGET_S:g} s",
        met=total <= WORKBOOK_TARGET_S if ctx.judged and not missing else None,
        note=note,
    )


def run_notebook(path: Path) -> tuple[float, tuple[int, float], str]:
    """Seconds to run every cell of ``path`` in a fresh kernel (start-up included), its slowest
    cell as (index, seconds), and the error that stopped it ("" when none did)."""
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
    return seconds, slowest_cell(notebook), error


def slowest_cell(notebook) -> tuple[int, float]:
    """(index, seconds) of the code cell that ran longest, from the timings nbclient records."""
    best = (-1, 0.0)
    for index, cell in enumerate(notebook.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        began, ended = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if began and ended:
            spent = (_when(ended) - _when(began)).total_seconds()
            best = max(best, (index, spent), key=lambda pair: pair[1])
    return best


def _when(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _notebook_row(
    ctx: BenchContext, name: str, seconds: float, slowest: tuple[int, float], error: str
) -> Row:
    cell, cell_s = slowest
    within = seconds <= NOTEBOOK_TARGET_S and cell_s <= CELL_TARGET_S and not error
    note = f"{ctx.where}; slowest: cell {cell} of the file (from 0), {cell_s:.1f} s"
    note += f"; FAILED: {error}" if error else ""
    return Row(
        PHASE,
        name,
        "seconds to run every cell",
        "s",
        seconds,
        target=f"<= {NOTEBOOK_TARGET_S:g} s, no cell over {CELL_TARGET_S:g} s",
        met=within if ctx.judged else None,
        note=note,
    )
