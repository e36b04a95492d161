"""The ladder of training scripts on a CPU: each version learns, a twin starts from its first
version's weights, the ground-truth markers sit on the lines they name, the doctor examines
every first version (finding a written-out attention at its line), and no script leaves the
caller's random state or ``torch.backends`` settings changed."""

from __future__ import annotations

import ast
import functools
import math
import os
import re
from pathlib import Path

import pytest
import torch

from accel import doctor
from accel.doctor import ladder
from accel.doctor.parts import find_parts

pytestmark = pytest.mark.usefixtures("one_thread")

VERSIONS = [(name, optimized) for name in ladder.SCRIPTS for optimized in (False, True)]
IDS = [
    f"{name}-{'hand_optimized' if optimized else 'first_written'}" for name, optimized in VERSIONS
]
MARKED = {
    "gpt2": {"odd_shape", "attention", "fusion", "optimizer_unfused", "input", "precision", "sync"},
    "resnet": {"fusion", "optimizer_unfused", "input", "precision", "conv_layout", "sync"},
    "bert": {"odd_shape", "attention", "fusion", "optimizer_unfused", "input", "precision", "sync"},
    "vit": {"attention", "fusion", "optimizer_unfused", "input", "precision", "clip_loop", "sync"},
    "rnn_lm": {"input", "precision", "tensor_loop", "sync"},
}
LINE_SAYS = {  # what the line of each kind must hold
    "precision": r"\bmodel\(",
    "conv_layout": r"\bmodel\(",
    "attention": r"(@ |torch\.matmul\().*\.transpose\(-[12], -[12]\)",
    "sync": r"\.item\(\)",
    "input": r"\.to\(device\)",
    "fusion": r"^\s*model = \w+\(",
    "odd_shape": r"vocab_size: int = \d+",
    "optimizer_unfused": r"= torch\.optim\.\w+\(\s*model\.parameters\(\)",
    "tensor_loop": r"for p in|p\.data\.add_\(p\.grad",
    "clip_loop": r"clip_grad_norm_\(\[p\]",
}


def script_file(name: str) -> Path:
    return Path(ladder.__file__).parent / f"{name}.py"


@pytest.fixture
def eager_compile(monkeypatch):
    """``torch.compile`` with Dynamo's eager backend: a twin's model is traced as on a GPU,
    without Inductor's minute of code generation on this CPU."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


def global_state() -> tuple:
    return (
        torch.random.get_rng_state(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )


def the_model(script: ladder.Script) -> torch.nn.Module:
    """The network the step trains (the loss modules it also reaches hold no parameters)."""
    (model,) = [m for m in find_parts(script.step).models if any(True for _ in m.parameters())]
    return getattr(model, "_orig_mod", model)  # a compiled model's own


@pytest.mark.parametrize(("name", "optimized"), VERSIONS, ids=IDS)
@pytest.mark.usefixtures("eager_compile")
def test_each_version_learns_and_leaves_the_callers_state(name, optimized):
    before = global_state()
    script = ladder.build(name, optimized=optimized, device="cpu", preset="cpu")
    assert (script.name, script.compiled) == (name, optimized and name != "rnn_lm")
    losses = [script.step(script.batch).item() for _ in range(2)]
    after = global_state()
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[1] < losses[0], losses  # the same batch twice: the second step fits it better
    assert torch.equal(before[0], after[0]), "the script drew from the global random state"
    assert before[1:] == after[1:]


@pytest.mark.parametrize("name", ladder.SCRIPTS)
@pytest.mark.usefixtures("eager_compile")
def test_the_twin_starts_from_the_first_versions_weights(name):
    first, twin = (
        ladder.build(name, optimized=o, device="cpu", preset="cpu") for o in (False, True)
    )
    a, b = the_model(first), the_model(twin)
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for key, p in params_a.items():
        q = params_b[key]
        if q.shape != p.shape:  # a vocabulary padded to a multiple of 64: rows added at the end
            assert q.shape[1:] == p.shape[1:] and q.shape[0] % 64 == 0 < q.shape[0] - p.shape[0]
        assert torch.equal(q[: p.shape[0]], p), key
    buffers_b = dict(b.named_buffers())
    for key, t in a.named_buffers():  # running statistics; the causal mask only where written out
        assert key not in buffers_b or torch.equal(buffers_b[key], t), key
    if params_a.keys() and all(params_b[k].shape == p.shape for k, p in params_a.items()):
        # same shapes: on a CPU (no autocast, no TF32) the twin's first loss is the same number
        assert twin.step(twin.batch).item() == pytest.approx(first.step(first.batch).item(), 1e-5)


def statement_at(source: str, line: int) -> str:
    """The statement that starts on ``line`` (a call may run on over more lines), comments
    left out."""
    starts = [
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt) and n.lineno == line
    ]
    text = ast.get_source_segment(source, min(starts, key=lambda n: n.end_lineno))
    return "\n".join(part.split("#")[0] for part in text.splitlines())


@pytest.mark.parametrize("name", ladder.SCRIPTS)
def test_ground_truth_markers_sit_on_the_lines_they_name(name):
    truth = ladder.ground_truth(name)
    assert set(truth) == MARKED[name]
    source = script_file(name).read_text()
    marked = {i for i, line in enumerate(source.splitlines(), 1) if "# ground truth:" in line}
    assert marked == {n for numbers in truth.values() for n in numbers}
    for kind, numbers in truth.items():
        assert len(numbers) == 1, (kind, numbers)
        text = statement_at(source, numbers[0])
        assert re.search(LINE_SAYS[kind], text), (kind, text)
        if kind == "odd_shape":
            assert int(text.split("=")[1]) % 64 != 0, text
        if kind == "optimizer_unfused":
            assert "fused" not in text and "foreach" not in text, text


@pytest.mark.parametrize("name", ladder.SCRIPTS)
def test_the_doctor_examines_each_first_version(name):
    script = ladder.build(name, device="cpu", preset="cpu")
    report = doctor.examine(script.step, script.batch, steps=1, warmup=1)
    here = os.path.realpath(script_file(name))
    truth = ladder.ground_truth(name)

    def found_at(kind: str) -> set[int]:
        sites = (s for f in report.findings if f.kind == kind for s in f.sites)
        return {s.line for s in sites if os.path.realpath(s.file) == here}

    assert found_at("sync") and found_at("sync") <= set(truth["sync"]), str(report)
    if name in ("gpt2", "bert", "vit"):
        assert found_at("attention") and found_at("attention") <= set(truth["attention"])


def test_tuned_backends_hold_for_the_call_only():
    before = global_state()
    with pytest.raises(RuntimeError, match="inside"), ladder.tuned_backends(cudnn_benchmark=True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
        raise RuntimeError("inside")
    assert global_state()[1:] == before[1:]


def test_a_wrong_name_or_preset_is_named():
    with pytest.raises(ValueError, match=r"unknown ladder script 'gpt3'.*gpt2, resnet"):
        ladder.build("gpt3")
    with pytest.raises(ValueError, match="unknown ladder script 'gpt3'"):
        ladder.ground_truth("gpt3")
    with pytest.raises(ValueError, match=r"unknown preset 'tiny'.*expected one of cpu, gpu"):
        ladder.build("gpt2", device="cpu", preset="tiny")
