"""Where ``torch.compile`` would break the step into several graphs, with dynamo's reasons and the
lines they point at (``torch._dynamo.explain``, run on a copy of the step)."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from accel.doctor.findings import Evidence, Finding, check
from accel.doctor.recorder import Site


def graph_breaks(call: Callable[[], Any]) -> list[tuple[str, Site | None]]:
    """(reason, the user's line) of each break dynamo finds while tracing ``call`` once."""
    import torch._dynamo

    # dynamo's warnings while it traces (an optimizer's record_function ignored) are about
    # the doctor's tracing, not the user's code: kept out of their stderr
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(call)()
    finally:
        torch._dynamo.reset()
        dynamo_log.setLevel(level)
    out = []
    for reason in explained.break_reasons:
        frames = [f for f in reason.user_stack if "/torch/" not in f.filename]
        frame = frames[-1] if frames else None
        site = None if frame is None else Site(frame.filename, frame.lineno, _function(frame.name))
        out.append((str(reason.reason).splitlines()[0][:200], site))
    return out


def _function(name: str) -> str:
    """The user's function a frame stands for: dynamo names the code it resumes after a break
    ``torch_dynamo_resume_in_<function>_at_<line>``."""
    resumed = re.fullmatch(r"torch_dynamo_resume_in_(\w+?)_at_\d+", name)
    return resumed.group(1) if resumed else name


# lines every training step breaks at: the change below calls them expected
_EXPECTED_BREAKS = (".backward(", ".step(", "zero_grad(")


def _expected(site: Site | None) -> bool:
    return site is not None and any(call in site.text for call in _EXPECTED_BREAKS)


def own_breaks(breaks: list[tuple[str, Site | None]]) -> list[tuple[str, Site | None]]:
    """The breaks of ``breaks`` (reason, site) other than those every training step makes."""
    return [(reason, site) for reason, site in breaks if not _expected(site)]


@check("compile")
def compile_breaks(evidence: Evidence) -> list[Finding]:
    breaks = own_breaks(evidence.graph_breaks or [])
    if not breaks:
        return []
    expected = len(evidence.graph_breaks) - len(breaks)
    counted = Counter(breaks)
    lines = [f"{n} x {reason} at {site or 'torch'}" + (f": {site.text}" if site and site.text else "")
             for (reason, site), n in counted.most_common()]  # fmt: skip
    return [Finding(
        kind="compile",
        title=f"torch.compile breaks the step {len(breaks)} time"
        f"{'s' * (len(breaks) != 1)} (a graph each side of every break)",
        evidence="; ".join(lines[:8])
        + (f"; and {expected} where every step breaks (backward, the optimizer)" if expected else ""),
        cost_model="not predicted: each break ends a fused graph and returns to Python; "
        "the compile fix measures what compiling gains as the step stands",
        notebook="07_recipe",
        change="# keep host reads and data-dependent Python out of the compiled region;\n"
        "# loss.backward() and optimizer.step() breaks are expected: compile the model\n"
        "model = torch.compile(model)",
        sites=[s for _, s in counted if s is not None],
        fixes=("compile",),
    )]
