"""Command line: ``python -m accel info | bench | table | doctor``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _info(args: argparse.Namespace) -> int:
    from accel.measure.device import versions

    info = versions()
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    if not args.no_ceilings:
        from accel.measure.ceilings import measure_ceilings

        c = measure_ceilings()
        print(f"{'copy':<{width}}  {c.copy_gb_s:,.0f} GB/s (read + write, "
              f"{c.copy_bytes >> 20} MiB)\n{'matmul':<{width}}  {c.matmul_tflop_s:,.3g} TFLOP/s "
              f"({c.matmul_dtype}, n={c.matmul_n})")  # fmt: skip
    return 0


def _bench(args: argparse.Namespace) -> int:
    from accel.lab.bench import console_table, run_bench
    from accel.measure.device import results_stem

    frame = run_bench(args.phase, out=args.out, only=args.only)  # each phase written as it ends
    print(console_table(frame))
    paths = [args.out / f"{results_stem()}.{ext}" for ext in ("csv", "html")]
    print("wrote " + ", ".join(str(p) for p in paths))
    missed = frame[frame["met"].eq(False)]
    if len(missed):
        cases = ", ".join(missed["phase"] + "/" + missed["case"])
        print(f"{len(missed)} target(s) missed: {cases}")
    return 0


def _table(args: argparse.Namespace) -> int:
    from accel.files import check_writable
    from accel.lab.bench import results_markdown, update_readme

    if args.readme:
        check_writable(args.readme, "--readme")
        changed = update_readme(args.readme, args.results, force=args.force)
        print(f"{args.readme}: {'updated' if changed else 'already up to date'}")
    else:
        print(results_markdown(args.results))
    return 0


def plain(doc: str) -> str:
    """A docstring as a terminal shows it: the double backticks of its code dropped."""
    return doc.replace("``", "")


def parser() -> argparse.ArgumentParser:
    from accel.phases import BENCH

    p = argparse.ArgumentParser(prog="python -m accel", description=plain(__doc__))
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="device, versions, preset and measured ceilings")
    info.add_argument("--no-ceilings", action="store_true", help="skip measuring the ceilings")
    info.set_defaults(func=_info)
    bench = sub.add_parser("bench", help="run the phase benchmarks and write results/")
    bench.add_argument(
        "--phase", nargs="+", action="extend", choices=BENCH, metavar="NAME",
        help=f"phases to run (default: all, in this order): {', '.join(BENCH)}",
    )  # fmt: skip
    bench.add_argument(
        "--only", nargs="+", metavar="PART",
        help="run only these parts of phases that run in parts (a part's name or its start: 05 for "
        "notebook 05; a name that picks none is refused with the phase's parts); their rows "
        "replace the same cases' rows, the phase's other rows stay",
    )  # fmt: skip
    out_help = "where to write (results/)"
    bench.add_argument("--out", type=Path, default=Path("results"), help=out_help)
    bench.set_defaults(func=_bench)
    table = sub.add_parser("table", help="print the results table, or rewrite the README's")
    table.add_argument(
        "--results", type=Path, help="the bench's results directory (default: results/ beside "
        "--readme, else this checkout's)",
    )  # fmt: skip
    table.add_argument("--readme", type=Path, help="rewrite this file's results block")
    table.add_argument(
        "--force", action="store_true", help="replace the README's table even with fewer rows"
    )
    table.set_defaults(func=_table)
    from accel.doctor.cli import add_parser

    add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from accel.errors import UsageError

    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: a script's own arguments
    ours, theirs = argv[:cut], argv[cut + 1 :]
    args = parser().parse_args(ours)
    try:
        if theirs and args.command != "doctor":
            raise UsageError(f"arguments after -- are a script's, for doctor only, got {theirs}")
        args.script_args = theirs
        return args.func(args)
    except UsageError as mistake:  # a bug keeps its traceback
        print(f"accel: error: {mistake}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()  # here, where a closed pipe can still be caught
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
