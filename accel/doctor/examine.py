"""``examine(step, batch)``: measure a user's training step on a copy of its model and optimizer,
and return a :class:`~accel.doctor.report.Report` of what the checks found."""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import pickle
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from accel.doctor import (  # noqa: F401 - importing a check module registers its checks
    check_attention,
    check_compile,
    check_compute,
    check_host,
    check_kernels,
    check_memory,
)
from accel.doctor.check_host import LOADER_WAIT_SHARE, proposed_workers
from accel.doctor.drawn import loop_source, serve_batch
from accel.doctor.findings import CHECKS, Evidence, Finding
from accel.doctor.fixes import NO_BATCH, batch_for_a_call, own_batch
from accel.doctor.isolation import Session, refuse_unplain_result, refuse_unplain_step
from accel.doctor.kept_files import TooLargeToKeep
from accel.doctor.own_scope import own_names
from accel.doctor.parts import (
    StepParts,
    copy_step,
    find_parts,
    loader_copies_ended,
    without_kept_iterator,
)
from accel.doctor.reach import is_array, kind, where_raised
from accel.doctor.recorder import record_calls, record_step
from accel.doctor.timeline import CALLS, profile_timeline
from accel.doctor.trial import replay_device_savings
from accel.doctor.untouched import Untouched
from accel.errors import UsageError
from accel.measure.device import default_device

__all__ = ["callable_with", "detect", "examine", "step_device"]

LOADER_BATCHES = 8  # batches timed through the step after the first


def detect(evidence: Evidence, *, only: tuple[str, ...] | None = None) -> list[Finding]:
    """Every registered check's findings, by predicted saving (unpredicted last); a saving of the
    device's kernels alone as the step keeps it (:func:`replay_device_savings`)."""
    found = [f for name, fn in CHECKS.items() if only is None or name in only for f in fn(evidence)]
    replay_device_savings(found, evidence.timeline)
    unpredict_impossible(found, evidence.iteration_us)
    return sorted(found, key=lambda f: -(f.saved_us if f.saved_us is not None else -1.0))


def unpredict_impossible(found: list[Finding], iteration_us: float) -> None:
    """A saving of the whole iteration (the step and its wait for data) or more was mismeasured
    (a timing slowed by another process): such a finding says so and predicts nothing."""
    for f in found:
        if f.saved_us is not None and f.saved_us >= iteration_us > 0:
            f.cost_model += (f"; not predicted: it measured {f.saved_us / 1e3:.3f} ms saved of a "
                             f"{iteration_us / 1e3:.3f} ms iteration, so its timing was disturbed "
                             "(another process on this machine?): run examine again")  # fmt: skip
            f.saved_us = None


def step_device(parts: StepParts, batch: Any) -> torch.device:
    """Where the step runs: its first model's parameters, else the batch's first tensor (a model
    on the meta device, a skeleton that holds no values, is not where it runs)."""
    for model in parts.models:
        for p in model.parameters():
            if p.device.type != "meta":
                return p.device
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return default_device()


MORE_RECORDED_CALLS = 3  # after the timed one: what a step does only every few calls


def examine(step: Callable[..., Any], batch: Any = NO_BATCH, *, loader: Iterable[Any] | None = None,
            steps: int = 5, warmup: int = 3, compile: bool = False, ceilings: Any = None,
            costs: Any = None, allow_training: bool = False):  # fmt: skip
    """Examine ``step(batch)`` (or ``step()`` without a batch): profile it, record every operator
    with the line that ran it, and run every check on what was measured.

    The step runs on copies of everything it can reach and change (models, optimizers, tensors
    up to a GiB in all, containers, objects, iterators: :mod:`accel.doctor.parts`), so your model
    does not train; where something it trains cannot be copied, examining is refused unless
    ``allow_training=True`` (then it runs on your objects, and the report's first line says so).
    The random generators and the files the step writes are put back as they were; what cannot
    be (a network, a process started) is named in the report's first line, with the files.
    ``loader``: the DataLoader that feeds it (its first batch is used when ``batch`` is not
    given or None; a step of no argument draws its own from it), to measure how long the step
    waits for data.
    ``compile=True`` also lists where ``torch.compile`` would break the step (seconds to
    minutes); dynamo's trace starts from an empty cache, so the functions this process compiled
    before compile again at their next call. ``ceilings`` and ``costs``: this machine's ``lab.measure_ceilings`` and
    ``lab.measure_costs``, if at hand (else measured when a check needs them).
    """
    from accel.doctor.report import Report

    if not callable(step):
        got = type(step).__name__
        raise TypeError(f"examine() needs the training step as a callable, got {got}")
    refuse_unplain_step(step)
    if batch is None and loader is not None:  # as the command line reads a maker's None
        batch = NO_BATCH
    # a step of no argument beside a loader draws its batches from it (``next(it)`` inside)
    draws_own = batch is NO_BATCH and loader is not None and not callable_with(step, None)
    from_loader = batch is NO_BATCH and loader is not None and not draws_own
    _refuse_batch_mismatch(step, None if from_loader else batch)
    _refuse_counts_or_profiler(steps, warmup)
    _refuse_unusable_loader(loader)
    if loader is not None and _sized(loader) == 0:  # before any work, where its length tells
        raise _empty(loader)
    with contextlib.ExitStack() as kept:
        # the data set and samplers its copy reads, put back now too (below) and on leaving
        sources_back = [kept.enter_context(_sources_kept(loader))]
        session = kept.enter_context(Session())  # the random generators put back; files recorded
        kept.enter_context(loader_copies_ended())  # copies' workers end before the session
        loader = _own_loader(loader)
        if from_loader:
            batch = next(iter(loader), NO_BATCH)
            if batch is NO_BATCH:
                raise _empty(loader)
        parts = find_parts(step)
        session.watch(parts.reach.objects.values())
        for source in _served_loaders(parts, loader if draws_own else None):
            if source is not loader:  # one the step reaches: read from a copy, its own kept
                sources_back.append(kept.enter_context(_sources_kept(source)))
                source = _own_loader(source)
            _serve_from_loader(parts.reach.objects.values(), source)
        for put_back in sources_back:  # the doctor's own reads so far (a shuffle's draw), undone
            put_back()
        untouched = Untouched(parts, batch)
        runner, copied, cautions = _copy_or_own(step, parts, allow_training)
        device = step_device(copied, batch)
        call = _call(runner, own_batch(batch), _source_hint(step, batch))  # the batch: the copy's
        refuse_unplain_result(call())
        for _ in range(warmup - 1):
            call()
        bare_us = _step_us(call, device)  # before any profile: one can leave the host slower
        timeline = profile_timeline(call, device, steps=steps).at_step_time(bare_us)
        given = {"ceilings": ceilings, "costs": costs}
        evidence = Evidence(
            device=device, parts=copied, recording=record_step(call, device), timeline=timeline,
            more_calls=record_calls(call, device, MORE_RECORDED_CALLS),
            batch=batch, memory=_memory(call, device),
            loader=None if loader is None else _loader(
                loader, (lambda _: runner()) if draws_own else runner, device, timeline.step_us),
            graph_breaks=_breaks(step, parts, batch, runner is step) if compile else None,
            measure={k: (lambda v=v: v) for k, v in given.items() if v is not None},
        )  # fmt: skip
        findings = detect(evidence)
    return Report(step, batch, parts, evidence, findings, side_effects=cautions,
                  effects=session.effects(), changed=untouched.report())


def _refuse_counts_or_profiler(steps: Any, warmup: Any) -> None:
    if not isinstance(steps, int) or steps < 1 or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"steps and warmup must be ints >= 1, got {steps=}, {warmup=}")
    if torch.autograd._profiler_enabled():  # its session would end in the doctor's, emptied
        raise UsageError(
            "examine profiles the step itself, and a profiler is already running: call it "
            "outside your `with torch.profiler.profile()` block"
        )


def callable_with(fn: Callable[..., Any], *args: Any) -> bool:
    """Whether ``fn`` can be called with ``args``; True where it cannot tell (a builtin)."""
    if isinstance(fn, torch.nn.Module):  # its own signature is __call__'s (*args, **kwargs)
        fn = fn.forward
    try:
        return _binds(inspect.signature(fn), *args)
    except ValueError:  # no signature to read
        return True


def _binds(signature: inspect.Signature, *args: Any) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def _refuse_batch_mismatch(step: Callable[..., Any], batch: Any) -> None:
    """UsageError, before any work, where the step cannot be called as the doctor will call it:
    ``step(batch)``, or ``step()`` without a batch."""
    try:
        signature = inspect.signature(step)
    except ValueError:
        return
    name = getattr(step, "__qualname__", type(step).__name__)
    called = getattr(step, "__name__", "step")  # as the user's code would call it
    keyword_only = [p.name for p in signature.parameters.values()
                    if p.kind is p.KEYWORD_ONLY and p.default is p.empty]  # fmt: skip
    if keyword_only:
        said = ", ".join(repr(n) for n in keyword_only)
        raise UsageError(
            f"{name}{signature} takes {said} as keyword-only, and the doctor calls step(batch) "
            f"or step(): pass a step that takes its batch by position, e.g. "
            f"examine(lambda batch: {called}({keyword_only[0]}=batch), batch)"
        )
    if batch is NO_BATCH:
        if not _binds(signature):
            raise UsageError(
                f"{name}{signature} needs an argument and no batch was given: pass it, "
                "examine(step, batch), or a loader=..."
            )
    elif not _binds(signature, None):
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [p for p in signature.parameters.values()
                    if p.default is p.empty and p.kind in positional]  # fmt: skip
        if not required:
            raise UsageError(f"{name}{signature} takes no batch (it draws its own), but one was "
                             "given: call examine(step) without it")  # fmt: skip
        raise UsageError(f"{name}{signature} needs {len(required)} arguments and the doctor "
                         f"passes one batch: pass a step of one, e.g. examine(lambda batch: "
                         f"{called}(batch, ...), batch), or hold the inputs in one batch = (x, y)")  # fmt: skip


def _refuse_unusable_loader(loader: Any) -> None:
    if loader is not None and not isinstance(loader, Iterable):
        raise UsageError(f"loader must be an iterable of batches (a DataLoader), got "
                         f"{type(loader).__name__}")  # fmt: skip
    if isinstance(loader, Iterator):
        raise UsageError(
            f"loader must be an iterable the doctor can start again (a DataLoader), got an "
            f"iterator ({type(loader).__name__}), whose batches it would use up"
        )


def _step_us(call: Callable[[], Any], device: torch.device) -> float:
    """The step's median time without the profiler (device events on a GPU, around a few steps
    back to back, as a training loop runs them)."""
    from accel.measure.timer import interleaved

    samples = interleaved({"step": call}, device, warmup=1, repeats=5, calls_per_sample=CALLS)
    return samples.medians()["step"] * 1e3


def _call(runner: Callable[..., Any], batch: Any, hint: str = "") -> Callable[[], Any]:
    return _Repeated(runner if batch is NO_BATCH else (lambda: runner(batch_for_a_call(batch))),
                     hint)  # fmt: skip


def _serve_from_loader(objects: Iterable[Any], loader: Iterable[Any]) -> None:
    """The step's own iterators over ``loader``'s data set (or the one a generator expression
    reads) give its copies a batch of the doctor's copy of the loader, so the user's iterator is
    not advanced."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return
    ours = [o for o in map(_innermost, objects)
            if isinstance(o, Iterator) and getattr(o, "_dataset", None) is dataset]  # fmt: skip
    batch = next(iter(loader), NO_BATCH) if ours else NO_BATCH
    if batch is not NO_BATCH:
        for iterator in ours:
            serve_batch(iterator, batch)


def _served_loaders(parts: StepParts, given: Iterable[Any] | None) -> list[Iterable[Any]]:
    """The loaders whose iterators the step draws from get the copies a batch of: ``given``
    (loader=, to a step that draws its own), and each DataLoader the step reaches (to start a
    new pass, say) over another data set."""
    datasets = {id(getattr(given, "dataset", None))}
    reached = [o for o in parts.reach.objects.values()
               if isinstance(o, torch.utils.data.DataLoader) and id(o.dataset) not in datasets]  # fmt: skip
    return ([given] if given is not None else []) + reached


def _innermost(value: Any) -> Any:
    """The iterator that generator expressions over generator expressions read, in the end."""
    while (source := loop_source(value)) is not None:
        value = source
    return value


def _empty(loader: Iterable[Any]) -> UsageError:
    return UsageError(f"loader= gave no batch: the {type(loader).__name__} is empty")


def _sized(loader: Iterable[Any]) -> int | None:
    """``len(loader)`` where it has one (an iterable dataset's loader may not)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _source_hint(step: Callable[..., Any], batch: Any) -> str:
    """What to say beside a first call's error where the step is a model, or the batch a source
    of batches (a generator, a DataLoader) that the step gets as it is, not one batch of it."""
    if isinstance(step, torch.nn.Module):
        return (f"; a model ({type(step).__name__}) was given as the step: examine needs a "
                "training step, a function that runs the forward, the loss, backward and the "
                "optimizer's step and returns the loss")  # fmt: skip
    if not isinstance(batch, (Iterator, torch.utils.data.DataLoader)):
        return ""
    return (f"; the batch given is a {type(batch).__name__}, which the step gets as it is: pass "
            "one batch, examine(step, next(iter(batches))), or the loader as loader=")  # fmt: skip


class _Repeated:
    """The step called again and again, as training calls it; an error said with the step's line
    that raised, the step's own mistake on its first call, after it one that ends (a schedule or
    data that ends after a few steps)."""

    def __init__(self, call: Callable[[], Any], hint: str = "") -> None:
        self.call, self.calls, self.hint = call, 0, hint

    def __call__(self) -> Any:
        self.calls += 1
        return _said_as_usage(self.call, self._said)

    def _said(self, where: str) -> str:
        if self.calls == 1:
            return (f"the step raised on its first call, on the doctor's copies {where}"
                    f"{self.hint}. Fix the step so that one call of it runs, then examine it again")  # fmt: skip
        ran = "once" if self.calls == 2 else f"{self.calls - 1} times"
        return (f"the step ran {ran} on the doctor's copies and raised on call "
                f"{self.calls} {where}. The doctor runs it many times, as training does: what "
                "ends after a few steps (a schedule's total_steps, a finite data source) must "
                "allow more")  # fmt: skip


def _said_as_usage(call: Callable[[], Any], said: Callable[[str], str]) -> Any:
    """``call()``; what it raises said as the user's mistake, ``said(where)`` with the user's line
    that raised (a script's sys.exit() too, which would end the process)."""
    try:
        return call()
    except TooLargeToKeep as refusal:
        raise UsageError(str(refusal)) from refusal
    except (Exception, SystemExit) as error:
        raise UsageError(said(where_raised(error) + _copies_cause(error))) from error


def _copies_cause(error: BaseException) -> str:
    """Where the doctor's copies themselves may have made ``error``, what about them did ("" elsewhere)."""
    if isinstance(error, pickle.PicklingError) and "not the same object as" in str(error):
        return ("; the copies' objects are of a subclass the doctor made of their class (so that "
                "what the step keeps on the class stays yours), which pickle cannot save whole: "
                "save the model's state_dict() in the step, as PyTorch advises")  # fmt: skip
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        return ("; where the step runs on your own objects, it looks something up by an object's "
                "identity (a dict keyed by id(p)), which the copies do not share: key it by the "
                "parameter itself or by its name, which the copies follow")  # fmt: skip
    return ""


def _fed(runner: Callable[[Any], Any], loader: Iterable[Any]) -> Callable[[Any], Any]:
    """``runner`` on the loader's batches: one it cannot take is the loader's mistake, said so."""

    def said(where: str) -> str:
        return (f"the step ran on the batch given and raised on a batch of loader= (a "
                f"{type(loader).__name__}) {where}. The loader's batches must be what the step "
                "takes, as the batch given is")  # fmt: skip

    return lambda batch: _said_as_usage(lambda: runner(batch), said)


def _copy_or_own(
    step: Callable[..., Any], parts: StepParts, allow_training: bool
) -> tuple[Callable[..., Any], StepParts, list[str]]:
    """The step on copies; or, if they cannot be made and ``allow_training``, itself."""
    if not parts.all:
        warnings.warn("accel.doctor: found no model or optimizer in what the step reaches: the "
                      "fixes that change a model or optimizer cannot apply", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
    try:
        runner, copied = copy_step(step, parts)
    except TypeError as error:
        if not allow_training:
            raise UsageError(
                f"accel.doctor would train your own objects: {error}. Pass allow_training=True "
                "(--allow-training) to examine the step on them anyway, or hold what it trains "
                "where the doctor can copy it (a closure, a global, an attribute)"
            ) from error
        said = f"ran on your own objects (allow_training=True), which trained: {error}"
        return step, parts, [said]
    return runner, copied, []


def _memory(call: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """Allocator counts of steady-state steps and the device's memory (CUDA only)."""
    if device.type != "cuda":
        return {}
    from accel.memory import count_allocations

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what the doctor's own copies and measurements left reserved
    resident = torch.cuda.memory_allocated(device)
    stats = count_allocations(call, steps=3, warmup=1, device=device)
    return {
        "device_allocs": stats.device_allocs or 0.0,
        "retries": stats.retries or 0.0,
        "peak_bytes": float(stats.peak_bytes),
        "resident_bytes": float(resident),
        "reserved_bytes": float(torch.cuda.memory_reserved(device)),
        "total_bytes": float(torch.cuda.get_device_properties(device).total_memory),
    }


def _loader(loader: Iterable[Any], runner, device: torch.device, step_us: float) -> dict[str, Any]:
    """How long each batch of ``loader`` takes to arrive while the step runs on it: the wall time
    per batch of a loop over it, beyond the step's own time. Where that wait would be a finding
    and more workers would be its change, a copy of the DataLoader with them is timed the same
    way (``tried``): handing a batch between processes can cost more than making it."""
    batches, wait_us, shapes = _batches_timed(loader, runner, device, step_us)
    workers = getattr(loader, "num_workers", None)
    found = {"batches": batches, "wait_us": wait_us, "shapes": shapes, "num_workers": workers,
             "pin_memory": getattr(loader, "pin_memory", None)}  # fmt: skip
    more = proposed_workers(workers or 0)
    if (isinstance(loader, torch.utils.data.DataLoader) and more > (workers or 0)
            and wait_us > LOADER_WAIT_SHARE * step_us):  # fmt: skip
        trial = _own_loader(loader)
        trial.num_workers, trial.prefetch_factor = more, trial.prefetch_factor or 4
        found["tried"] = {"num_workers": more, "wait_us": _batches_timed(trial, runner, device, step_us)[1]}
    return found


def _batches_timed(loader: Iterable[Any], runner, device: torch.device, step_us: float):
    """(batches, the wait per batch, the batches' shapes) over a loop through the step."""
    batches, fetch_s, shapes = 0, 0.0, set()
    runner = _fed(runner, loader)
    iterator = iter(loader)
    runner(next(iterator))  # the first batch starts the workers: not a steady-state wait
    started = time.perf_counter()
    for _ in range(LOADER_BATCHES):
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        fetch_s += time.perf_counter() - t0
        shapes.add(tuple(tuple(t.shape) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)))
        runner(batch)
        batches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_us = (time.perf_counter() - started) / max(batches, 1) * 1e6
    fetch_us = fetch_s / max(batches, 1) * 1e6
    # The wait: time in next(). On a GPU only as far as the loop got longer than the step (the
    # device may still be busy with the last step meanwhile); a CPU step runs inside the loop, so
    # all of it is waiting, and the loop against a step timed apart would only add noise.
    hidden = device.type == "cuda"
    return batches, min(fetch_us, max(0.0, wall_us - step_us)) if hidden else fetch_us, shapes


@contextlib.contextmanager
def _sources_kept(loader: Iterable[Any] | None) -> Iterator[Callable[[], None]]:
    """The loader's data set and samplers (and those they wrap: :func:`_data_sources`) with their
    attributes put back after the doctor's reads: an iterable data set or a sampler may count its
    epochs or what it served on itself, a data set its reads or a cache.
    Each attribute is bound again to its value, and what one holds changed in place is put back
    (a container's items, a tensor or array up to :data:`KEPT_IN_PLACE_BYTES`: larger ones are
    the samples, read, not written), and so is a random generator's state (a shuffle's, an
    augmentation's, held by the loader or one of them), so that the user's next epoch draws
    the same. Gives what puts them back (also called before leaving)."""
    sources = _data_sources(loader)
    kept = [(vars(s), dict(vars(s))) for s in sources]
    holders = [h for h in (loader, *sources) if hasattr(h, "__dict__")]
    generators = {id(v): v for h in holders for v in vars(h).values() if kind(v) == "rng"}
    held = {id(v): v for s in sources for v in vars(s).values()}
    states = [_state_kept(g) for g in generators.values()]
    states += [k for k in map(_contents_kept, held.values()) if k is not None]

    def put_back() -> None:
        for attributes, before in kept:
            attributes.clear()
            attributes.update(before)
        for restore in states:
            restore()

    try:
        yield put_back
    finally:
        put_back()


KEPT_IN_PLACE_BYTES = 64 * 2**20  # a data set's tensor or array up to this is put back in place


def _contents_kept(value: Any) -> Callable[[], None] | None:
    """What puts ``value``'s contents back as they are now, in place (None: nothing to keep)."""
    if isinstance(value, (dict, set)):
        saved = value.copy()
        return lambda: (value.clear(), value.update(saved))
    if isinstance(value, (list, collections.deque)):
        saved = list(value)
        return lambda: (value.clear(), value.extend(saved))
    if isinstance(value, torch.Tensor) and value.layout is torch.strided and (
            value.numel() * value.element_size() <= KEPT_IN_PLACE_BYTES):  # fmt: skip
        saved = value.detach().clone()  # written back only where it differs: a write counts
        return lambda: None if _same(value, saved) else value.detach().copy_(saved)
    if is_array(value) and value.nbytes <= KEPT_IN_PLACE_BYTES and value.flags.writeable:
        saved = value.copy()
        return lambda: value.__setitem__(..., saved)
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN was."""
    return torch.equal(a, b) or (a.is_floating_point() and bool(
        torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()))  # fmt: skip


# what a data set or sampler holds of the others: a Subset's or a sampler's data set, a
# ConcatDataset's or ChainDataset's, a BatchSampler's sampler
_WRAPPED = ("dataset", "sampler", "batch_sampler")
WRAPPED_LEVELS = 16  # levels of wrapping followed at most: a longer chain is kept in part


def _data_sources(loader: Iterable[Any] | None) -> list[Any]:
    """The loader's data set and samplers, and those they wrap, each once (the attributes they
    hold them in, read without running any code of theirs)."""
    level = [getattr(loader, name, None) for name in _WRAPPED]
    found: dict[int, Any] = {}
    for _ in range(WRAPPED_LEVELS):
        level = [s for s in {id(s): s for s in level}.values()
                 if hasattr(s, "__dict__") and id(s) not in found]  # fmt: skip
        found.update((id(s), s) for s in level)
        held = [vars(s) for s in level]
        level = [a.get(name) for a in held for name in _WRAPPED]
        level += [d for a in held if isinstance(a.get("datasets"), (list, tuple))
                  for d in a["datasets"]]  # fmt: skip
    return list(found.values())


def _state_kept(generator: Any) -> Callable[[], None]:
    """What puts ``generator`` (torch's, ``random``'s or NumPy's) back in its state of now."""
    for get, put in (("get_state", "set_state"), ("getstate", "setstate")):
        if hasattr(generator, get):
            state = getattr(generator, get)()
            return lambda: getattr(generator, put)(state)
    bits = getattr(generator, "bit_generator", generator)  # NumPy's Generator, a BitGenerator
    state = bits.state
    return lambda: setattr(bits, "state", state)


def _own_loader(loader: Iterable[Any] | None) -> Iterable[Any] | None:
    """A DataLoader's copy to read from: the iterator and workers a persistent one keeps are
    then the copy's, ended when the doctor is done (``loader_copies_ended``), never the user's
    loader's."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return loader
    return without_kept_iterator(copy.copy(loader))


def _breaks(step: Callable[..., Any], parts: StepParts, batch: Any, own: bool):
    from accel.doctor.check_compile import graph_breaks

    runner, copied_parts = (step, parts) if own else copy_step(step, parts)
    if not own:  # a break inside the user's layers: dynamo's names go to the copies' own
        for model in copied_parts.models:
            own_names(model)
    scope = getattr(runner, "__globals__", None)
    copied = not own and isinstance(scope, dict) and scope is not getattr(step, "__globals__", None)
    names = list(scope) if copied else []
    try:
        return graph_breaks(_call(runner, own_batch(batch)))
    finally:  # dynamo's cleanup hooks keep the globals it traced: the copies', let go here
        for name in names:  # (what dynamo added, its hooks remove)
            scope.pop(name, None)
