"""Gradient accumulation against the large batch it stands for: the same gradients and update
within float32 rounding, NaN where the large batch has NaN, the scale right for uneven and
token-counted micro-batches, no host read inside, DDP's all-reduce only on the last."""

from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from accel import accumulate as acc

# float32 sums in another order: a few units of rounding of the largest term
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _model(seed: int, norm: type[nn.Module] = nn.LayerNorm) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), norm(32), nn.GELU(), nn.Linear(32, 5))


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)


def _mse(model):
    return lambda b: F.mse_loss(model(b[0]), b[1])


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _both(model, batch, k, *, uneven=False, **kwargs):
    """(large batch's loss and gradients, accumulated loss and gradients) from one start."""
    twin = copy.deepcopy(model)
    big = acc.large_batch(_mse(model), batch)
    micro = acc.split_batch(batch, k, uneven=uneven)
    small = acc.accumulate(_mse(twin), micro, model=twin, **kwargs)
    return (big, _grads(model)), (small, _grads(twin))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradients_and_update_equal_the_large_batch(k, seed):
    model = _model(seed)
    (big, big_grads), (small, small_grads) = _both(model, _data(seed, 24), k)
    torch.testing.assert_close(small, big, **GRAD_TOL)
    for a, b in zip(small_grads, big_grads, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)
        assert b.abs().max() > 1e-3  # a real gradient, not zeros compared with zeros
    # the update: one AdamW step from each, on gradients that agree within rounding
    updated = []
    for grads in (big_grads, small_grads):
        twin = copy.deepcopy(model)
        for p, g in zip(twin.parameters(), grads, strict=True):
            p.grad = g
        torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9).step()
        updated.append(list(twin.parameters()))
    for a, b in zip(*updated, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


@pytest.mark.parametrize("size,k", [(10, 3), (7, 2), (9, 4)])
def test_uneven_micro_batches_are_weighted_by_their_size(size, k):
    model = _model(2)
    batch = _data(2, size)
    (big, big_grads), (small, small_grads) = _both(model, batch, k, uneven=True)
    torch.testing.assert_close(small, big, **GRAD_TOL)
    for a, b in zip(small_grads, big_grads, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)
    # plain 1/k, the usual loop's scale, is not the large batch's mean here
    naive = copy.deepcopy(model)
    micro = acc.split_batch(batch, k, uneven=True)
    acc.accumulate(_mse(naive), micro, counts=[1] * k)
    assert not torch.allclose(naive[0].weight.grad, big_grads[0], **GRAD_TOL)


def _token_loss(model, reduction):
    def loss(b):
        inputs, labels = b
        logits = model(inputs).flatten(0, 1)
        return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction=reduction)

    return loss


def _token_batch(*, empty_micro_batch: bool):
    g = torch.Generator().manual_seed(7)
    inputs = torch.randn(6, 5, 12, generator=g)
    labels = torch.randint(0, 5, (6, 5), generator=g)
    labels[0, 1:] = -100  # micro-batches hold different numbers of valid tokens
    if empty_micro_batch:
        labels[2:4] = -100  # the second micro-batch of 2 holds none
    return inputs, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_token_counts_on_the_device_give_the_token_mean(reduction):
    """A mean over valid tokens: each micro-batch weighted by its token count (0-dim tensors,
    no host read); with "sum", a micro-batch without a valid token is fine too."""
    model = _model(3)
    batch = _token_batch(empty_micro_batch=reduction == "sum")
    twin = copy.deepcopy(model)
    big = acc.large_batch(_token_loss(model, "mean"), batch)
    micro = acc.split_batch(batch, 3)
    counts = [(b[1] != -100).sum() for b in micro]
    small = acc.accumulate(
        _token_loss(twin, reduction), micro, model=twin, counts=counts, reduction=reduction
    )
    torch.testing.assert_close(small, big, **GRAD_TOL)
    for a, b in zip(_grads(twin), _grads(model), strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def test_nan_in_one_micro_batch_spreads_as_in_the_large_batch():
    model = _model(4)
    inputs, targets = _data(4, 16)
    inputs[9, 3] = float("nan")  # in the third of four micro-batches
    (big, big_grads), (small, small_grads) = _both(model, (inputs, targets), 4)
    assert small.isnan() and big.isnan()
    for a, b in zip(small_grads, big_grads, strict=True):
        assert a.isnan().any()
        torch.testing.assert_close(a, b, equal_nan=True, **GRAD_TOL)


def test_batchnorm_is_warned_of_and_differs():
    model = _model(5, norm=nn.BatchNorm1d)
    with pytest.warns(acc.BatchStatisticsWarning, match="own mean and variance"):
        (_, big_grads), (_, small_grads) = _both(model, _data(5, 16), 4)
    # micro-batch statistics: a real difference, far beyond rounding
    assert (small_grads[0] - big_grads[0]).abs().max() > 1e-3
    model.eval()  # running statistics: no batch statistics, so equal again and no warning
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (_, big_grads), (_, small_grads) = _both(model, _data(5, 16), 4)
    for a, b in zip(small_grads, big_grads, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def test_no_host_read_inside(monkeypatch):
    """What a host read goes through on any device, made an error for the call (the GPU test
    below checks the same with CUDA's sync debug mode)."""
    model = _model(6)
    inputs, labels = _token_batch(empty_micro_batch=True)
    micro = acc.split_batch((inputs, labels), 2)
    counts = [(b[1] != -100).sum() for b in micro]

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside accumulate")

    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss = acc.accumulate(_token_loss(model, "sum"), micro, counts=counts, reduction="sum")
    monkeypatch.undo()
    assert loss.isfinite()


class _ShardedStandIn(nn.Module):
    """What accumulate sees of an FSDP2 module: ``set_requires_gradient_sync``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.syncs, self.seen = inner, [], []

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.syncs.append(requires)

    def forward(self, x):
        self.seen.append(self.syncs[-1])
        return self.inner(x)


def test_fsdp2_syncs_only_on_the_last_micro_batch():
    model = _ShardedStandIn(_model(7))
    acc.accumulate(_mse(model), acc.split_batch(_data(7, 8), 4), model=model)
    assert model.seen == [False, False, False, True]


WORLD = 2


def _ddp_rank(rank: int, store: str, out: str) -> None:
    """Each rank: 4 micro-batches under DDP beside its large batch; which micro-batches asked
    for the gradient sync, how many all-reduces ran, and the gradients of both."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        batch = _data(20 + rank, 16)  # each rank its own samples
        seen, reduces = [], {}
        models = {}
        for kind in ("large", "accumulated"):
            model = nn.parallel.DistributedDataParallel(_model(12))

            def count(state, bucket, kind=kind):
                reduces[kind] = reduces.get(kind, 0) + 1
                return default_hooks.allreduce_hook(None, bucket)

            model.register_comm_hook(None, count)
            models[kind] = model

        def loss_fn(b):
            seen.append(models["accumulated"].require_backward_grad_sync)
            return _mse(models["accumulated"])(b)

        acc.large_batch(_mse(models["large"]), batch)
        acc.accumulate(loss_fn, acc.split_batch(batch, 4), model=models["accumulated"])
        grads = {k: [p.grad.tolist() for p in m.parameters()] for k, m in models.items()}
        result = {"seen": seen, "reduces": reduces, "grads": grads} | _fsdp2(batch)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        # every collective of both ranks done, and the DDP reducers gone, before the group is:
        # a rank tearing down while the other still talks to it aborts under load
        dist.barrier()
        models.clear()
    finally:
        dist.destroy_process_group()
    # gloo's threads may still be winding down when the interpreter exits, and a joinable
    # std::thread destroyed then aborts the rank ("terminate called without an active
    # exception") after its results are written: a rank that got here leaves at once
    os._exit(0)


def _fsdp2(batch) -> dict:
    """The same under FSDP2 (``fully_shard``): the sync asked for on each micro-batch, and the
    full gradients of both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))  # on the CPU under gloo, also where CUDA is present
    models = {kind: fully_shard(_model(12), mesh=mesh) for kind in ("large", "accumulated")}
    asked = []
    model = models["accumulated"]
    switch = model.set_requires_gradient_sync
    model.set_requires_gradient_sync = lambda on, **kw: asked.append(on) or switch(on, **kw)
    acc.large_batch(_mse(models["large"]), batch)
    acc.accumulate(_mse(model), acc.split_batch(batch, 4), model=model)
    full = {k: [p.grad.full_tensor().tolist() for p in m.parameters()] for k, m in models.items()}
    return {"fsdp2_asked": asked, "fsdp2_grads": full}


@pytest.mark.usefixtures("one_thread")
def test_ddp_and_fsdp2_sync_only_on_the_last_micro_batch(tmp_path):
    out = tmp_path / "rank"
    mp.spawn(_ddp_rank, args=(str(tmp_path / "store"), str(out)), nprocs=WORLD)
    per_rank = [json.loads(out.with_name(f"rank.{r}").read_text()) for r in range(WORLD)]
    for seen in per_rank:
        assert seen["seen"] == [False, False, False, True]
        # one all-reduce per bucket, as the large batch: not one per micro-batch
        assert seen["reduces"]["accumulated"] == seen["reduces"]["large"] >= 1
        for a, b in zip(seen["grads"]["accumulated"], seen["grads"]["large"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **GRAD_TOL)
    # after the all-reduce every rank holds the same (averaged) gradients
    first, second = (torch.tensor(r["grads"]["accumulated"][0]) for r in per_rank)
    torch.testing.assert_close(first, second)
    for seen in per_rank:  # FSDP2: the sync off but on the last, the large batch's gradients
        assert seen["fsdp2_asked"] == [False, False, False, True]
        large, accumulated = seen["fsdp2_grads"]["large"], seen["fsdp2_grads"]["accumulated"]
        for a, b in zip(accumulated, large, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **GRAD_TOL)


def test_split_batch_returns_views_of_every_tensor():
    inputs, targets = _data(8, 12)
    parts = acc.split_batch({"x": inputs, "y": [targets], "note": "kept"}, 3)
    assert [p["x"].shape[0] for p in parts] == [4, 4, 4]
    assert parts[1]["x"].data_ptr() == inputs[4:].data_ptr()  # a view: nothing copied
    assert parts[2]["note"] == "kept" and torch.equal(parts[2]["y"][0], targets[8:])
    assert [len(p) for p in acc.split_batch(inputs, 4, uneven=True)] == [3, 3, 3, 3]
    assert [len(p) for p in acc.split_batch(inputs[:10], 4, uneven=True)] == [3, 3, 2, 2]


def test_split_batch_takes_any_mapping_as_a_tokenizer_returns_it():
    """A tokenizer's BatchEncoding is a Mapping, not a dict: its tensors are split all the same."""
    from collections import UserDict

    inputs, targets = _data(8, 12)
    parts = acc.split_batch(UserDict(input_ids=inputs, labels=targets), 2)
    assert [p["input_ids"].shape[0] for p in parts] == [6, 6]
    assert torch.equal(parts[1]["labels"], targets[6:])


def test_split_batch_keeps_a_namedtuple_and_a_mapping_type():
    """A loss that reads ``batch.inputs`` (a namedtuple, a tokenizer's BatchEncoding) runs on the
    micro-batches as on the whole batch."""
    from collections import OrderedDict, UserDict, namedtuple

    class Encoding(UserDict):  # attribute access, as a tokenizer's BatchEncoding
        def __getattr__(self, name):
            try:
                return self.data[name]
            except KeyError:
                raise AttributeError(name) from None

    Pair = namedtuple("Pair", "inputs targets")
    inputs, targets = _data(9, 12)
    for batch in (Pair(inputs, targets), Encoding(inputs=inputs, targets=targets)):
        parts = acc.split_batch(batch, 3)
        assert all(type(p) is type(batch) for p in parts)
        assert torch.equal(parts[2].inputs, inputs[8:]) and torch.equal(parts[1].targets, targets[4:8])
        assert torch.equal(batch.inputs, inputs)  # the caller's batch as it was
    parts = acc.split_batch(OrderedDict(x=inputs, y=targets), 2)
    assert type(parts[0]) is OrderedDict and list(parts[0]) == ["x", "y"]
    model = _model(9)
    loss = acc.accumulate(lambda b: F.mse_loss(model(b.inputs), b.targets),
                          acc.split_batch(Pair(inputs, targets), 4))
    torch.testing.assert_close(loss, F.mse_loss(model(inputs), targets).detach(), **GRAD_TOL)


@pytest.mark.parametrize(
    "k,error,match",
    [
        (0, ValueError, r"micro_batches\) must be an int >= 1, got 0"),
        (True, TypeError, "must be an int"),
        (2.0, TypeError, "must be an int"),
        (13, ValueError, "more than the batch's 12 samples"),
        (5, ValueError, r"does not split into 5 equal micro-batches; pick .*\[1, 2, 3, 4, 6, 12\]"),
    ],
)
def test_split_batch_refuses_bad_counts(k, error, match):
    with pytest.raises(error, match=match):
        acc.split_batch(_data(9, 12), k)


def test_split_batch_refuses_what_is_not_a_batch():
    with pytest.raises(ValueError, match=r"share their first .* \[\(4, 2\), \(5, 2\)\]"):
        acc.split_batch((torch.randn(4, 2), torch.randn(5, 2)), 2)
    with pytest.raises(TypeError, match="without a tensor"):
        acc.split_batch([1, 2, 3], 2)


def test_accumulate_refuses_bad_arguments():
    model = _model(10)
    micro = acc.split_batch(_data(10, 8), 2)
    with pytest.raises(TypeError, match="list or tuple of micro-batches"):
        acc.accumulate(_mse(model), torch.randn(8, 12))
    with pytest.raises(ValueError, match="is empty"):
        acc.accumulate(_mse(model), [])
    with pytest.raises(ValueError, match="3 counts for 2 micro-batches"):
        acc.accumulate(_mse(model), micro, counts=[1, 2, 3])
    with pytest.raises(ValueError, match="counts sum to 0"):
        acc.accumulate(_mse(model), micro, counts=[0, 0])
    with pytest.raises(ValueError, match="reduction must be one of"):
        acc.accumulate(_mse(model), micro, reduction="max")
    with pytest.raises(ValueError, match=r"0-dim loss tensor, got \(4, 5\)"):
        acc.accumulate(lambda b: model(b[0]), micro)
    with pytest.raises(ValueError, match="does not require grad"):
        acc.accumulate(lambda b: F.mse_loss(model(b[0]), b[1]).detach(), micro)
    with pytest.raises(TypeError, match="function to call"):
        acc.accumulate(model(micro[0][0]), micro)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        acc.accumulate(_mse(model), micro, model="model")
    assert all(p.grad is None for p in model.parameters())  # refused before any work


@pytest.mark.gpu
def test_on_cuda_without_a_sync_and_inside_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from accel import graphs, sync

    model = _model(11).cuda()
    inputs, targets = (t.cuda() for t in _data(11, 64))
    twin = copy.deepcopy(model)
    acc.large_batch(_mse(model), (inputs, targets))
    with sync.no_sync():  # any host-device sync inside is an error
        acc.accumulate(_mse(twin), acc.split_batch((inputs, targets), 8), model=twin)
    for a, b in zip(_grads(twin), _grads(model), strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)

    for p in twin.parameters():
        p.grad.zero_()  # gradients the graph adds into, kept at fixed addresses

    def step(x, y):
        for p in twin.parameters():
            p.grad.zero_()
        return acc.accumulate(_mse(twin), acc.split_batch((x, y), 8), model=twin)

    graphed = graphs.GraphedStep(step, fallback="raise")
    for _ in range(5):  # warm-up, capture, replays
        loss = graphed(inputs, targets)
    torch.testing.assert_close(loss, acc.large_batch(_mse(copy.deepcopy(model)), (inputs, targets)))
    for a, b in zip(_grads(twin), _grads(model), strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def test_a_bad_loss_after_the_first_micro_batch_says_what_the_gradients_hold():
    model = _model(10)
    micro = acc.split_batch(_data(10, 8), 4)

    def loss_fn(batch):  # the last micro-batch's loss keeps a dimension
        loss = F.mse_loss(model(batch[0]), batch[1])
        return loss.reshape(1) if batch is micro[-1] else loss

    with pytest.raises(ValueError, match=r"\(1,\).*\.grad holds micro-batches 0-2 of 4"):
        acc.accumulate(loss_fn, micro)

