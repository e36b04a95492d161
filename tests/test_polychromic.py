"""The polychromic workload: deterministic, and every flag keeps the baseline's result.

Fixed seeds, not the per-test random one: batched decoding must reproduce one-at-a-time
decoding token for token, and a fixed seed keeps a (rare, legitimate) near-tie from making the
test flaky; :func:`polychromic.tokens_agree` is tested on its own below.
"""

import dataclasses
import functools
import importlib.util

import pytest
import torch

from accel import triton_support
from accel.workloads import polychromic as pc
from accel.workloads.flags import describe, unavailable

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
SIZES = pc.Sizes(prompts=2, replies=3, prompt_len=5, reply_len=7, vocab=48, width=32)
FLAG_SETS = [pc.Flags(**{i.name: True}) for i in describe(pc.Flags)]
FLAG_SETS.append(pc.Flags(True, True, True))


def run(flags, seed, steps=2, device="cpu"):
    step = pc.build(flags, SIZES, device=device, seed=seed)
    for _ in range(steps):
        step()
    return step.result()


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def baseline(seed, device="cpu"):
    return run(pc.Flags(), seed, device=device)


@pytest.fixture
def triton_here(monkeypatch):
    """Lets triton_diversity run: the interpreter on a CPU machine, compiled on CUDA."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cuda" if CUDA else "cpu")


def test_same_seed_same_result_and_another_seed_differs():
    a, b, c = (run(pc.Flags(), s) for s in (11, 11, 12))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tokens"], c["tokens"])


def test_replies_to_one_prompt_differ_and_scores_are_finite():
    r = run(pc.Flags(), 5)
    tokens = r["tokens"]  # (B, N, L)
    assert tokens.shape == (SIZES.prompts, SIZES.replies, SIZES.reply_len)
    assert not torch.equal(tokens[:, 0], tokens[:, 1])
    assert r["embeddings"].shape == (SIZES.prompts, SIZES.replies, SIZES.embed_dim)
    assert ((r["diversity"] > 0) & (r["diversity"] < 2)).all()
    assert (r["quality"] < 0).all() and r["reward"].isfinite().all()


@pytest.mark.parametrize(
    "flags",
    [pytest.param(f, marks=pytest.mark.triton) if f.triton_diversity else f for f in FLAG_SETS],
    ids=lambda f: "+".join(k for k, v in dataclasses.asdict(f).items() if v),
)
@pytest.mark.parametrize("seed", [3, 4])
def test_every_flag_keeps_the_baseline_result(flags, seed, request):
    device = request.getfixturevalue("triton_here") if flags.triton_diversity else "cpu"
    base, fast = baseline(seed, str(device)), run(flags, seed, device=device)
    assert torch.equal(fast["tokens"], base["tokens"]), "batched greedy changed a token"
    pc.compare_results(fast, base, flags, sizes=SIZES, steps=2)


def test_tokens_agree_allows_only_near_ties():
    a = run(pc.Flags(), 7)
    b = {k: v.clone() for k, v in a.items()}
    b["tokens"][0, 1, 3] += 1
    b["margin"][0, 1, 3] = 1.0
    a["margin"][0, 1, 3] = 1.0
    assert not pc.tokens_agree(a, b)  # a clear winner changed: a real difference
    a["margin"][0, 1, 3] = pc.TIE_MARGIN / 2
    b["tokens"][0, 1, 5:] += 1  # what follows a broken tie may differ too
    assert pc.tokens_agree(a, b)


def test_flags_contract_and_presets():
    infos = {i.name: i for i in describe(pc.Flags)}
    assert set(infos) == {"batched_generation", "batched_encoding", "triton_diversity"}
    assert infos["triton_diversity"].requires == "triton"
    assert pc.Sizes.preset("cpu").width < pc.Sizes.preset("gpu").width
    assert pc.Sizes.preset("gpu").embed_dim == 384


@pytest.mark.triton
def test_triton_flag_unavailable_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # the reason is the one place's that decides: Triton missing, or no GPU and no interpreter
    assert unavailable(pc.Flags, "cpu")["triton_diversity"] == triton_support.unavailable("cpu")


def test_result_before_a_step_is_an_error():
    with pytest.raises(RuntimeError, match="at least once"):
        pc.build(pc.Flags(), SIZES).result()
