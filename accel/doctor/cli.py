"""``python -m accel doctor module:function`` (or ``file.py:function``): ``function()`` returns
the step and its batch (a ``(step, batch)`` or ``(step, batch, loader)`` tuple, or an object with
``step``, ``batch`` and ``loader``), or the step alone where it draws its own batch; a batch of
None means the loader's first batch, or none for a step that takes no argument; the report is
printed and written as one HTML file that opens offline. Importing the module and calling
``function()`` run the user's code once, as ``python`` would: what they change is theirs; what
the doctor keeps and puts back is what the steps it runs change."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accel.doctor.examine import callable_with
from accel.doctor.fixes import NO_BATCH
from accel.errors import UsageError

__all__ = ["add_parser", "load_step"]


def load_step(target: str) -> tuple[Any, Any, Any]:
    """(step, batch, loader) from ``module:function`` or ``path/to/file.py:function``."""
    module_name, _, function_name = target.rpartition(":")
    if not module_name or not function_name:
        raise UsageError(
            f"expected module:function or file.py:function (e.g. my_train:make_step), got {target!r}"
        )
    with _said_in_one_line(module_name, "importing it", errors=False):
        module = _load_file(Path(module_name)) if module_name.endswith(".py") else _import(module_name)
    make = getattr(module, function_name, None)
    if make is None and not hasattr(module, function_name):
        raise UsageError(f"{module_name} has no function {function_name!r}")
    if not callable(make):
        raise UsageError(f"{target} is a value ({type(make).__name__}: {make!r:.60}), not a "
                         "function that makes the step")  # fmt: skip
    model_class = isinstance(make, type) and issubclass(make, torch.nn.Module)
    if model_class or isinstance(make, torch.nn.Module):  # called as the step, it would fail
        what = "a model class (a Module)" if model_class else f"a model ({type(make).__name__})"
        raise UsageError(  # as the step's own mistake: said as what it is
            f"{target} is {what}, not a function that makes the step: name a function of none "
            "that returns (step, batch), e.g. def make(): return step, batch"
        )
    if not callable_with(make):
        raise UsageError(  # the step itself named, or a maker that takes its sizes
            f"{target} takes an argument, {function_name}{inspect.signature(make)}, and the "
            "doctor calls it with none: name a function of none that returns (step, batch), "
            f"e.g. def make(): return {function_name}, batch (where it is the step) or "
            f"def make(): return {function_name}(...) (where it makes the step)"
        )
    with _said_in_one_line(module_name, f"{function_name}()"):
        made = make()
    if callable(made) and not hasattr(made, "step"):  # the step alone: it draws its own batch
        if not callable_with(made):
            raise UsageError(f"{target}() returned the step alone, and it takes a batch: return "
                             "(step, batch), or (step, None, loader)")  # fmt: skip
        made = (made, NO_BATCH)
    if hasattr(made, "step"):
        parts = made.step, getattr(made, "batch", None), getattr(made, "loader", None)
    elif isinstance(made, tuple) and len(made) in (2, 3):
        parts = (*made, None) if len(made) == 2 else made
    else:
        raise UsageError(
            f"{target}() must return (step, batch), (step, batch, loader), an object with "
            "step and batch, or the step alone, where it draws its own batch; it returned "
            f"{type(made).__name__}"
        )
    if not callable(parts[0]):
        raise UsageError(
            f"{target}() returned a step of type {type(parts[0]).__name__}; expected the "
            "training step, a function (step(batch)), not its result"
        )
    loader = parts[2]
    if loader is not None and (isinstance(loader, (str, bytes)) or not hasattr(loader, "__iter__")):
        raise UsageError(
            f"{target}() returned a third item of type {type(loader).__name__}; expected the "
            "loader the step's batches come from (a DataLoader), or none: return (step, batch)"
        )
    if parts[1] is None and (parts[2] is not None or not callable_with(parts[0], None)):
        parts = (parts[0], NO_BATCH, parts[2])  # no batch: the loader's first, or none at all
    return parts


@contextlib.contextmanager
def _said_in_one_line(module_name: str, doing: str, *, errors: bool = True) -> Iterator[None]:
    """A UsageError where the script ends the process while it sets up (``sys.exit()`` where a
    setting is missing, argparse's ``--help``): said, not taken as the command's own exit; and
    where it raises (``errors``), said in one line with the line that raised, as a step's error
    is. An import's own errors keep their traceback: a syntax error wants it."""
    try:
        yield
    except SystemExit as exit:
        raise UsageError(
            f"{module_name}: {doing} called sys.exit({exit.code!r}), which ends the process "
            "before the doctor can run its step: no report written"
        ) from None
    except UsageError:
        raise
    except Exception as error:
        if not errors:
            raise
        frames = traceback.extract_tb(error.__traceback__)
        where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        raise UsageError(f"{module_name}: {doing} raised {type(error).__name__}: {error}{where}; "
                         "no report written") from None  # fmt: skip


def _import(module_name: str, root: Path | None = None) -> Any:
    root = root or Path.cwd()
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"cannot import {module_name!r} from {root}: {error}") from None
    finally:
        sys.path.pop(0)


def _load_file(path: Path) -> Any:
    """The file as a module, its folder importable while it runs (for its own imports); a file
    of a package (folders with ``__init__.py``) as the package's module, as ``python -m`` runs
    it, so that its relative imports work."""
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    root, names = _importing_root(path)
    if len(names) > 1:
        return _import(".".join(names), root)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its own classes pickled, as run alone
    sys.path.insert(0, str(root))
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise UsageError(f"cannot import {path}: {error}") from None
    finally:
        sys.path.pop(0)
    return module


def _importing_root(path: Path) -> tuple[Path, list[str]]:
    """The folder a file is imported from and its module's names: above its package, if any."""
    root, names = path.resolve().parent, [path.stem]
    while (root / "__init__.py").is_file():
        root, names = root.parent, [root.name, *names]
    return root, names


@contextlib.contextmanager
def _as_run_alone(target: str, script_args: list[str]) -> Iterator[None]:
    """``sys.argv`` and ``sys.path`` as the script would see them run alone (its own arguments,
    those after ``--``, and its folder importable), not the doctor's, while it loads and runs;
    put back after."""
    saved = sys.argv, list(sys.path)
    script = target.rpartition(":")[0]
    sys.argv = [script, *script_args]
    root = _importing_root(Path(script))[0] if script.endswith(".py") else Path.cwd()
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved


@contextlib.contextmanager
def _warnings_said_plainly() -> Iterator[None]:
    """A warning printed as its words alone: the line of the doctor's own that warned is no
    help to someone running a command."""
    shown = warnings.showwarning
    warnings.showwarning = lambda message, category, *_, **__: print(
        f"{category.__name__}: {message}", file=sys.stderr
    )
    try:
        yield
    finally:
        warnings.showwarning = shown


def _doctor(args: argparse.Namespace) -> int:
    from accel.doctor import examine
    from accel.doctor.page import trials_text
    from accel.files import check_writable

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: expected a number of steps >= 1")
    check_writable(args.out, "--out")  # before the examination, which takes a while
    out = Path(args.out).absolute()  # where the command runs, also if the script changes folder
    with _as_run_alone(args.target, args.script_args), _warnings_said_plainly():
        step, batch, loader = load_step(args.target)
        report = examine(step, batch, loader=loader, steps=args.steps, compile=args.compile,
                         allow_training=args.allow_training)
        untried = None
        if args.try_fixes:
            with warnings.catch_warnings():  # what the trials changed: the report's first line
                warnings.filterwarnings("ignore", "accel.doctor's trials", RuntimeWarning)
                try:
                    report.try_fixes()
                except UsageError as error:  # the report stands without them
                    untried = str(error)
    print(report)
    if untried:
        print(f"\nfixes not tried: {untried}")
    if report.trials is not None:
        if not report.trials.empty:
            print("\nfixes tried:\n" + trials_text(report))
        print(f"\nreached: {report.reached()}")
    report.to_html(out)
    print(f"\nwrote {args.out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser("doctor", help="examine your training step: findings, predicted "
                            "gains, fixes measured")  # fmt: skip
    add = doctor.add_argument
    add("target", help="module:function or file.py:function returning (step, batch[, loader]), "
        "or the step alone where it draws its own batch")
    add("--out", default="doctor.html", help="the HTML report (default: %(default)s)")
    add("--steps", type=int, default=5, help="steps profiled (default 5)")
    add("--try-fixes", action="store_true", help="apply and measure the fixes")
    add("--compile", action="store_true", help="also list torch.compile's graph breaks (empties dynamo's cache)")
    add("--allow-training", action="store_true",
        help="run on your own model where the doctor cannot copy what the step trains")  # fmt: skip
    doctor.epilog = ("arguments after -- are your script's own command line (its sys.argv); "
                     "importing it and calling the function run your code as python would: what "
                     "they write is not put back (what the doctor's steps change is)")
    doctor.set_defaults(func=_doctor)
