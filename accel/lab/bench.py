"""The bench command's machinery: the phases' runs, their rows, the result files.

Each bench phase of ``accel.phases.PHASES`` has a case module (imported when the phase runs)
whose ``run`` takes a :class:`BenchContext` and returns :class:`Row`\\ s, and whose ``parts()``,
where it has one, names what ``--only`` can pick. Rows are written in long format to
``<out>/<machine>.csv`` as each phase ends (other phases' rows kept), with an HTML report beside
it that loads plotly.js from the same directory (no network needed).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import importlib
import io
import math
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from accel import phases as registry
from accel.errors import UsageError, collection_of
from accel.files import check_writable, write_text_atomic
from accel.measure.ceilings import Ceilings, measure_ceilings
from accel.measure.device import (
    Preset,
    default_device,
    gpus_of_stem,
    preset,
    results_stem,
    targets_judged,
    versions,
)
from accel.measure.show import readable
from accel.measure.timer import Comparison

COLUMNS = [
    "phase", "case", "metric", "unit", "baseline", "optimized", "speedup", "fraction_of_ceiling",
    "target", "met", "note", "device", "preset", "torch", "triton", "cuda", "driver", "date",
]  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One measured case. ``speedup`` is derived: baseline over optimized for times, the
    inverse for rates (``higher_is_better``); NaN when there is no baseline."""

    phase: str
    case: str
    metric: str
    unit: str
    optimized: float
    baseline: float = math.nan
    higher_is_better: bool = False
    fraction_of_ceiling: float = math.nan
    target: str = ""  # e.g. ">= 1.6x"; empty when the case has none
    met: bool | None = None
    note: str = ""
    speedup: float = field(init=False)

    def __post_init__(self):
        over, under = (self.optimized, self.baseline)[:: 1 if self.higher_is_better else -1]
        object.__setattr__(self, "speedup", over / under if self.optimized else math.nan)

    def as_dict(self) -> dict:
        row = asdict(self)
        del row["higher_is_better"]
        return row


@dataclass
class BenchContext:
    device: torch.device
    preset: Preset
    _ceilings: Ceilings | None = None
    only: tuple[str, ...] = ()  # the parts to run (names or their prefixes); () runs every part
    recorded: pd.DataFrame | None = None  # the rows already in the results file written to

    def selected(self, part: str) -> bool:
        """Whether this run takes ``part`` of a phase that runs in parts."""
        return not self.only or any(part.startswith(name) for name in self.only)

    @property
    def ceilings(self) -> Ceilings:
        """Measured once per bench run, shared by every phase that reports against them."""
        if self._ceilings is None:
            self._ceilings = measure_ceilings(self.device, self.preset)
        return self._ceilings

    @property
    def judged(self) -> bool:
        return targets_judged(self.device, self.preset)

    def judge(self, rows: list[Row]) -> list[Row]:
        """``rows`` as this run stands: unchanged where it is judged, else without a verdict and
        with the reason in front of each note."""
        if self.judged:
            return rows
        return [dataclasses.replace(r, met=None, note=f"{self.where}; {r.note}") for r in rows]

    @property
    def where(self) -> str:
        """Where the rows were measured, and why they are not judged when they are not."""
        if self.judged:
            return f"{self.device.type}, preset {self.preset}"
        return (
            f"not judged: the targets are for a CUDA GPU with the gpu preset, this is "
            f"{self.device.type} with preset {self.preset}"
        )


def speedup_row(
    ctx: BenchContext,
    phase: str,
    case: str,
    metric: str,
    timing: Comparison,
    fast: str,
    target: float | None,
    note: str,
    baseline: str | None = None,
) -> Row:
    """A timed row: ``fast``'s median against the baseline's (``timing.baseline`` unless named),
    judged against ``>= target``x where the run is judged (no target: never judged);
    ``ctx.where`` leads the note."""
    fast_ms = timing.timings[fast].median_ms
    baseline_ms = timing.timings[baseline or timing.baseline].median_ms
    judged = ctx.judged and target is not None
    return Row(phase, case, metric, "ms", fast_ms, baseline=baseline_ms,
               target=f">= {target}x" if target is not None else "",
               met=baseline_ms / fast_ms >= target if judged else None,
               note=f"{ctx.where}; {note}")  # fmt: skip


def release_memory(device: torch.device) -> None:
    """Give cached GPU memory back between cases (a large case next to a small one fragments the
    cache)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def phase_function(name: str) -> Callable[[BenchContext], list[Row]]:
    return _case(name).run


def phase_parts(name: str) -> list[str] | None:
    """The parts ``--only`` can pick of phase ``name``; None where it runs whole."""
    parts = getattr(_case(name), "parts", None)
    return parts() if parts is not None else None


def _case(name: str):
    registry.checked_phase(name, registry.BENCH)
    return importlib.import_module(registry.BY_NAME[name].case)


def run_bench(
    phases: Iterable[str] | None = None,
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    out: str | Path | None = None,
    only: Iterable[str] | None = None,
) -> pd.DataFrame:
    """Run the named phases (every bench phase by default) and return their rows with the run's
    versions. With ``out`` (checked first), each phase's rows are merged into it as the phase
    ends. ``only``: the parts to run (:func:`phase_parts`); their rows replace the same cases'."""
    from tqdm.auto import tqdm

    names = list(collection_of(phases, "phase names") if phases is not None else registry.BENCH)
    functions = {n: phase_function(n) for n in names}  # unknown names fail before any work
    parts = tuple(collection_of(only, "parts")) if only is not None else ()
    if parts:
        check_parts(names, parts)
    dev = torch.device(device) if device is not None else default_device()
    ctx = BenchContext(dev, preset(dev), only=parts)
    if out is not None:
        files = result_files(Path(out), results_stem(dev))
        for path in files:  # before any folder is made or phase run
            check_writable(path, "--out")
        out = prepare_out_dir(out)
        ctx.recorded = read_results(files[0]) if files[0].exists() else None
    info = versions(dev)
    stamp = {k: info[k] for k in ("device", "preset", "torch", "triton", "cuda", "driver")}
    stamp["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    frames = []
    with warnings.catch_warnings():  # a warning as one line above the bar, not inside it
        warnings.showwarning = lambda message, category, *_, **__: tqdm.write(
            f"{category.__name__}: {message}", file=sys.stderr
        )
        for name in tqdm(names, desc="bench", disable=not progress):
            rows = [r.as_dict() | stamp for r in functions[name](ctx)]
            frames.append(pd.DataFrame(rows, columns=COLUMNS))
            if out is not None and rows:
                write_results(frames[-1], out, stem=results_stem(dev), by_case=bool(parts))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def check_parts(names: list[str], only: tuple[str, ...]) -> None:
    """A UsageError unless every phase runs in parts and every name in ``only`` picks one."""
    parts = {name: phase_parts(name) for name in names}
    whole = [name for name, its in parts.items() if its is None]
    if whole:
        in_parts = [name for name in registry.BENCH if phase_parts(name) is not None]
        raise UsageError(
            f"--only picks parts of the phases {', '.join(in_parts)}; {', '.join(whole)} "
            "runs whole (leave --only out for it)"
        )
    known = [part for its in parts.values() for part in its]
    unknown = [o for o in only if not any(part.startswith(o) for part in known)]
    if unknown:
        raise UsageError(f"--only {' '.join(unknown)}: no such part; the parts: {', '.join(known)}")


def prepare_out_dir(out: str | Path) -> Path:
    """``out`` created if needed, or a UsageError saying why results cannot be written there."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path}: expected a directory, found a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write results there ({e.strerror or e})") from None
    return path


def result_files(out: Path, stem: str) -> tuple[Path, Path, Path]:
    """What a bench run writes in ``out``: its rows, their report and the report's plotly.js."""
    return out / f"{stem}.csv", out / f"{stem}.html", out / PLOTLY_JS


def write_results(
    frame: pd.DataFrame, out_dir: str | Path, stem: str | None = None, *, by_case: bool = False
) -> dict[str, Path]:
    """Merge ``frame`` into ``<out_dir>/<stem>.csv`` (replacing the phases it holds, or with
    ``by_case`` only the rows of the same phase and case) and write the HTML report of the whole
    file beside it, with plotly.js."""
    out = prepare_out_dir(out_dir)
    csv, report, _ = result_files(out, stem or results_stem())
    if csv.exists():
        old = read_results(csv)
        if by_case:
            frame = _replace_cases(old, frame)
        else:
            frame = pd.concat([old[~old["phase"].isin(frame["phase"])], frame], ignore_index=True)
    frame = frame[COLUMNS]
    write_text_atomic(csv, frame.to_csv(index=False))
    _write_plotly_js(out)
    write_text_atomic(report, html_report(frame))
    return {"csv": csv, "html": report}


def _replace_cases(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """``old`` with each row of ``new`` in the place of the old row of its (phase, case) (a new
    case after its phase's last row, a new phase at the end); a sweep's points ("sweep <name>
    ...") and a group's rows ("<group>: ...") are replaced together, in the place of the first
    old one."""
    old_keys = list(zip(old["phase"], old["case"], strict=True))
    new_keys = list(zip(new["phase"], new["case"], strict=True))
    at = {key: float(i) for i, key in enumerate(old_keys)}
    phase_end = {phase: float(i) for i, phase in enumerate(old["phase"])}
    old_families = [_family(key) for key in old_keys]
    new_families = [_family(key) for key in new_keys]
    family_at: dict[tuple, float] = {}
    for i, family in enumerate(old_families):
        family_at.setdefault(family, float(i))
    fresh, rerun = set(new_keys), set(new_families) - {None}
    stays = [
        key not in fresh and family not in rerun
        for key, family in zip(old_keys, old_families, strict=True)
    ]
    place = [at[key] for key, kept in zip(old_keys, stays, strict=True) if kept]
    for j, (key, family) in enumerate(zip(new_keys, new_families, strict=True)):
        if family is not None and family in family_at:  # a sweep's points, where it stood
            place.append(family_at[family] + (j + 1) / (len(new) + 1))
        else:
            at_end = phase_end.get(key[0], len(old)) + (j + 1) / (len(new) + 1)
            place.append(at.get(key, at_end))
    merged = pd.concat([old[stays], new], ignore_index=True)
    return merged.iloc[sorted(range(len(merged)), key=place.__getitem__)].reset_index(drop=True)


def _family(key: tuple[str, str]) -> tuple[str, str] | None:
    """(phase, "sweep <name>") of a sweep point's (phase, case), (phase, "<group>") of a group's
    row "<group>: ..."; None for any other case."""
    phase, case = key
    words = case.split(" ", 2)
    if words[0] == "sweep" and len(words) > 2:
        return phase, " ".join(words[:2])
    return (phase, case.split(": ", 1)[0]) if ": " in case else None


PLOTLY_JS = "plotly.min.js"


def _write_plotly_js(out: Path) -> None:
    """plotly.js beside the reports (the machines that write them are offline), if it differs."""
    from plotly.offline import get_plotlyjs

    script = get_plotlyjs()
    path = out / PLOTLY_JS
    if not path.is_file() or path.read_text() != script:
        write_text_atomic(path, script)


def html_report(frame: pd.DataFrame) -> str:
    """The report's page; it loads ``plotly.min.js`` from its own directory."""
    from accel.lab import plots

    parts = []
    for phase, rows in frame.groupby("phase", sort=False):
        if phase == "ceilings":
            fig = plots.ceilings(ceilings_frame(rows))
        else:
            fig = plots.speedups(rows, title=f"{phase}: speedup over the baseline")
        parts.append(f"<h2>{phase}</h2>" + fig.to_html(full_html=False, include_plotlyjs=False))
    device = frame["device"].iloc[0] if len(frame) else "?"
    return (
        f"<html><head><meta charset='utf-8'><title>accel bench: {device}</title>"
        f'<script src="{PLOTLY_JS}" charset="utf-8"></script></head>'
        f"<body><h1>accel bench: {device}</h1>{frame.to_html(index=False, na_rep='')}"
        f"{''.join(parts)}</body></html>"
    )


def ceilings_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The ceilings phase's rows as one row per device, for :func:`accel.lab.plots.ceilings`."""
    out = []
    for device, part in rows.groupby("device", sort=False):
        copy = part[part["case"] == "copy"]["optimized"].iloc[0]
        mm = part[part["case"].str.startswith("matmul")].iloc[0]
        out.append({"device": device, "copy_gb_s": copy, "matmul_tflop_s": mm["optimized"],
                    "matmul_dtype": mm["case"].split()[1]})  # fmt: skip
    return pd.DataFrame(out, columns=["device", "copy_gb_s", "matmul_tflop_s", "matmul_dtype"])


def default_results_dir() -> Path:
    """``results/`` of the checkout this package runs from, else of the working directory."""
    beside_package = Path(__file__).resolve().parents[2] / "results"
    return beside_package if beside_package.is_dir() else Path("results")


NUMBER_COLUMNS = ("baseline", "optimized", "speedup", "fraction_of_ceiling")
# the lines git leaves in a file whose merge conflicted
CONFLICT_MARKER = re.compile(r"(<{7}|={7}|>{7}|\|{7})( |$)")


def _exact_float(text: str) -> float:
    return float(text) if text else math.nan


def read_results(csv: str | Path) -> pd.DataFrame:
    """A result file's rows, ``met`` as True, False or None (read as text: pandas would make an
    all-empty column float), numbers parsed exactly by Python (some pandas versions' parser is
    off by a unit in the last place), so a rewrite keeps them; merge-conflict markers refused."""
    text = Path(csv).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if CONFLICT_MARKER.match(line):
            raise UsageError(
                f"{csv}:{number}: a merge-conflict marker ({line[:7]}); expected rows only: "
                "resolve the conflict (keep one side's rows, or rerun the phase) first"
            )
    converters = dict.fromkeys(NUMBER_COLUMNS, _exact_float)
    frame = pd.read_csv(io.StringIO(text), dtype={"met": object}, converters=converters)
    frame["met"] = [{"True": True, "False": False}.get(met) for met in frame["met"]]
    return frame


def recorded_results(
    phase: str | None = None, results_dir: str | Path | None = None
) -> pd.DataFrame:
    """Every row recorded under ``results/`` (all machines), optionally of one phase only: what
    notebooks show beside this machine's run, so a CPU run still shows the GPU's."""
    files = sorted(Path(results_dir or default_results_dir()).glob("*.csv"))
    frames = [read_results(f) for f in files]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    return frame if phase is None else frame[frame["phase"] == phase].reset_index(drop=True)


SHOWN = ["phase", "case", "metric", "baseline", "optimized", "unit", "speedup", "target", "met"]


def console_table(frame: pd.DataFrame) -> str:
    """The rows as the command line prints them: numbers as in the README's table, ``met`` as
    yes, no or "not judged" (a target without a verdict), and why not judged said once below:
    the first clause of those rows' notes (each CSV row keeps its whole note)."""
    shown = frame[SHOWN].apply(lambda column: column.map(readable))
    unjudged = frame["met"].isna() & frame["target"].fillna("").ne("")
    shown["met"] = ["not judged" if u else "" if pd.isna(m) else "yes" if m else "no"
                    for m, u in zip(frame["met"], unjudged, strict=True)]  # fmt: skip
    reasons = dict.fromkeys(str(note).split(";")[0] for note in frame.loc[unjudged, "note"])
    return "\n".join([shown.to_string(index=False), *reasons])


def results_markdown(results_dir: str | Path | None = None) -> str:
    """The README's results table: every CSV under ``results_dir`` (default: the checkout's
    ``results/``), one section per machine, without sweep points (cases named ``sweep ...``)."""
    directory = Path(results_dir) if results_dir is not None else default_results_dir()
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory (expected the bench's results/)")
    files = sorted(directory.glob("*.csv"))
    if not files:
        return "_No results recorded yet: run `python -m accel bench` on a GPU._\n"
    lines = []
    for csv in files:
        frame = read_results(csv)
        first = frame.iloc[0]
        points = frame["case"].str.startswith("sweep ")
        gpus = gpus_of_stem(csv.stem)
        machine = f"{gpus} x {first['device']}" if gpus > 1 else first["device"]
        lines += [
            f"**{machine}** (preset {first['preset']}, torch {first['torch']}, "
            f"measured {frame['date'].max()}, `{directory.name}/{csv.name}`"
            + (f"; {points.sum()} sweep points in the CSV" if points.any() else "")
            + ")",
            "",
            "| " + " | ".join(SHOWN) + " |",
            "|" + "---|" * len(SHOWN),
        ]
        for _, row in frame[~points].iterrows():
            lines.append("| " + " | ".join(readable(row[c]) for c in SHOWN) + " |")
        lines.append("")
    return "\n".join(lines)


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def update_readme(
    readme: str | Path, results_dir: str | Path | None = None, *, force: bool = False
) -> bool:
    """Rewrite the block between the results markers from ``results_dir`` (default: the
    ``results/`` beside the README); True if the file changed. A table of fewer rows is refused
    unless ``force``: most often it is the wrong directory, not fewer results."""
    path = Path(readme)
    if not path.is_file():
        raise UsageError(f"{path}: no such file (expected the README to update)")
    directory = Path(results_dir) if results_dir is not None else path.parent / "results"
    text = path.read_text()
    try:
        head, rest = text.split(README_START, 1)
        old, tail = rest.split(README_END, 1)
    except ValueError:
        raise UsageError(f"{path} has no {README_START} ... {README_END} block") from None
    table = results_markdown(directory)
    dropped = _table_rows(old) - _table_rows(table)
    if dropped > 0 and not force:
        raise UsageError(
            f"{path}: the table from {directory} would drop {dropped} of {_table_rows(old)} rows; "
            f"check the directory, or pass --force to replace it anyway"
        )
    new = f"{head}{README_START}\n{table}{README_END}{tail}"
    if new != text:
        write_text_atomic(path, new)
    return new != text


def _table_rows(markdown: str) -> int:
    lines = markdown.splitlines()
    return sum(line.startswith("| ") and not line.startswith("| phase") for line in lines)
