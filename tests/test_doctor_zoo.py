"""The doctor on every zoo model on a CPU: each planted problem found at its marked line, the
clean twins without findings, the user's tensors untouched."""

from __future__ import annotations

import os

import pytest
import torch

from accel import doctor
from accel.doctor import recorder, zoo
from accel.doctor.parts import find_parts
from accel.doctor.untouched import Untouched

pytestmark = pytest.mark.usefixtures("one_thread")

ZOO_FILE = os.path.realpath(zoo.__file__)
PLANTED = zoo.planted_lines()
_examined: dict[tuple[str, bool], tuple] = {}


def examined(name: str, planted: bool):
    """(case, report, tensors before, their values and versions, Untouched) of one zoo model,
    examined once per session."""
    key = (name, planted)
    if key not in _examined:
        case = zoo.build(name, planted)
        parts = find_parts(case.step)
        tensors = [t for m in parts.models for t in m.state_dict(keep_vars=True).values()]
        before = [(t.detach().clone(), t._version) for t in tensors]
        untouched = Untouched(parts)
        report = doctor.examine(case.step, case.batch, loader=case.loader)
        _examined[key] = (case, report, tensors, before, untouched)
    return _examined[key]


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_planted_problems_are_found_and_nothing_else(name):
    case, report, *_ = examined(name, True)
    assert case.expected, f"{name} plants nothing a CPU can see"
    expected = case.expected
    tried = (report.evidence.loader or {}).get("tried")
    if tried is not None and tried["wait_us"] >= report.evidence.loader["wait_us"]:
        # workers are proposed as measured on a copy of the loader: on a host whose cores are
        # all busy (tests run in parallel) they do not pay, and the doctor says nothing
        expected = expected - {"input"}
    assert report.kinds() == expected, str(report)


def test_an_attention_the_rewrite_cannot_read_is_given_no_automatic_fix():
    # the zoo's GPT softmaxes inside its values' product: the change says how to write it,
    # and no fix claims to apply it
    _, report, *_ = examined("gpt", True)
    (found,) = [f for f in report.findings if f.kind == "attention"]
    assert "not rewritten for you" in found.change and found.fixes == ()
    assert "sdpa_attention" not in report.fixes()


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_findings_point_at_the_planted_lines(name):
    _, report, *_ = examined(name, True)
    for f in report.findings:
        if f.sites and f.kind in PLANTED:
            at = {s.line for s in f.sites if os.path.realpath(s.file) == ZOO_FILE}
            assert at & set(PLANTED[f.kind]), (f.kind, [str(s) for s in f.sites])


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_clean_twin_has_no_findings(name):
    case, report, *_ = examined(name, False)
    assert case.expected == frozenset()
    assert report.findings == [], str(report)


@pytest.mark.parametrize("planted", [True, False], ids=["planted", "clean"])
@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_examine_never_changes_the_users_tensors(name, planted):
    _, report, tensors, before, untouched = examined(name, planted)
    assert tensors, "no model found in the zoo step"
    for (value, version), t in zip(before, tensors, strict=True):
        assert t._version == version
        assert torch.equal(t, value)
    assert untouched.changed() == []
    assert report.parts.models and all(
        m is p for m, p in zip(report.parts.models, find_parts(report.step).models, strict=True)
    )


ALONE = [
    (name, kind)
    for name, (_, plantable) in zoo.MODELS.items()
    if len(plantable) > 1
    for kind in sorted(plantable - zoo.GPU_ONLY)
]


@pytest.mark.parametrize(("name", "kind"), ALONE)
def test_one_problem_planted_alone_is_the_only_finding(name, kind):
    case = zoo.build(name, {kind})
    report = doctor.examine(case.step, case.batch, loader=case.loader, steps=2, warmup=2)
    assert report.kinds() == case.expected == {zoo.FINDING_OF.get(kind, kind)}, str(report)


def test_every_kind_a_cpu_sees_is_planted_on_a_marked_line():
    for name, (_, plantable) in zoo.MODELS.items():
        for kind in plantable - zoo.GPU_ONLY - {"shapes"}:
            assert PLANTED.get(kind), f"{name} plants {kind} on no marked line"


def test_clipping_is_recorded_at_its_planted_line():
    case = zoo.build("gpt", {"clip_loop"})
    recording = recorder.record_step(lambda: case.step(case.batch), torch.device("cpu"))
    lines = {o.site.line for o in recording.ops if any("clip_grad" in e for e in o.library)}
    assert lines and lines <= set(PLANTED["clip_loop"])


def test_the_gpts_masked_attention_is_recognised_as_causal():
    case = zoo.build("gpt", {"attention"})
    report = doctor.examine(case.step, case.batch, steps=1, warmup=1)
    (found,) = [f for f in report.findings if f.kind == "attention"]
    assert "causal" in found.cost_model and "is_causal=True" in found.change
