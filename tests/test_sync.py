"""accel.sync: each fast version against its reference, the sync counter and the guard."""

from __future__ import annotations

import warnings

import pytest
import torch

from accel import errors, sync

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: syncs exist only there")
cpu_only = pytest.mark.skipif(CUDA, reason="checks the no-CUDA behaviour")


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which once-per-process warnings were given, so this test sees them."""
    monkeypatch.setattr(errors, "_warned", set())


def randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# ---- reading scalars and accumulating -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_read_scalars_equals_reference(gen, dtype):
    values = {f"m{i}": (randn(gen, 1) * 100).to(dtype).reshape(()) for i in range(5)}
    assert sync.read_scalars(values) == sync.read_scalars_reference(values)


def test_read_scalars_mixed_dtypes_and_shapes_are_exact(gen):
    values = {
        "a": randn(gen, 1),
        "b": randn(gen, (), dtype=torch.float64),
        "c": torch.tensor([[123456789]]),
    }
    assert sync.read_scalars(values) == sync.read_scalars_reference(values)
    assert sync.read_scalars({}) == {}


def test_read_scalars_rejects_bad_values(gen):
    with pytest.raises(ValueError, match="'v': expected one element, got shape \\(2,\\)"):
        sync.read_scalars({"v": randn(gen, 2)})
    with pytest.raises(TypeError, match="'f': expected a tensor, got float"):
        sync.read_scalars({"f": 1.5})


@pytest.mark.parametrize("adds", [1, 7, 50])
def test_accumulator_equals_reference_and_host_sum(gen, adds):
    acc = sync.MetricAccumulator(["loss", "norm", "acc"])
    rows = randn(gen, adds, 3) + 2
    for loss, norm, a in rows:
        acc.add(loss=loss, norm=norm, acc=a)
    assert acc.count == adds
    assert acc.read() == acc.read_reference()
    expected = rows.double().mean(0)
    # fp32 sums on the device against a float64 mean: a few ulps per add.
    torch.testing.assert_close(
        torch.tensor(list(acc.read().values()), dtype=torch.float64), expected, rtol=1e-6, atol=1e-6
    )
    acc.reset()
    assert acc.count == 0 and acc.read() == {"loss": 0.0, "norm": 0.0, "acc": 0.0}


def test_accumulator_rejects_bad_names(gen):
    with pytest.raises(ValueError, match="distinct metric names"):
        sync.MetricAccumulator(["a", "a"])
    acc = sync.MetricAccumulator(["a", "b"])
    with pytest.raises(KeyError, match=r"exactly the metrics \['a', 'b'\]"):
        acc.add(a=randn(gen, ()))


def test_progress_log_keeps_rows_in_order(gen):
    log = sync.ProgressLog(["x", "y"], capacity=3)
    rows = randn(gen, 5, 2)
    scales = [0.5, 0.25, 2.0, 1.0, 3.0]
    for i, (row, scale) in enumerate(zip(rows, scales, strict=True)):
        log.record({"x": row[0], "y": row[1]}, scale=scale)
        if i in (2, 4):
            log.flush()
    log.flush()  # nothing recorded since: no-op
    got = torch.tensor([[r["x"], r["y"]] for r in log.collect(wait=True)])
    torch.testing.assert_close(got, rows * torch.tensor(scales)[:, None], rtol=0, atol=0)
    with pytest.raises(ValueError, match="full \\(3 rows\\)"):
        for _ in range(4):
            log.record({"x": rows[0, 0], "y": rows[0, 1]})


def test_progress_log_names_the_columns_a_row_lacks(gen):
    log = sync.ProgressLog(["x", "y"], capacity=2)
    with pytest.raises(KeyError, match=r"record\(\) needs the columns \['x', 'y'\], got \['x', 'z'\]"):
        log.record({"x": randn(gen, ()), "z": randn(gen, ())})
    with pytest.raises(TypeError, match=r"expected a mapping of column names to tensors.*got list"):
        log.record([randn(gen, ()), randn(gen, ())])
    x = randn(gen, ())
    log.record({"x": x, "y": randn(gen, ()), "extra": randn(gen, ())})  # extra values are ignored
    log.flush()
    assert [r["x"] for r in log.collect(wait=True)] == [x.item()]  # the refused rows left no row


# ---- counting and forbidding syncs --------------------------------------------------------------
@cpu_only
def test_count_syncs_without_cuda_returns_none_and_warns_once(gen, fresh_warnings):
    calls = []
    with pytest.warns(sync.SyncCheckUnavailableWarning, match="no CUDA device"):
        assert sync.count_syncs(calls.append, 1) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        assert sync.count_syncs(calls.append, 2) is None
    assert calls == [1, 2]  # fn still ran


@cpu_only
def test_guard_without_cuda_raises_nothing_and_warns_once(gen, fresh_warnings):
    x = randn(gen, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with sync.no_sync():
                x.sum().item()
    assert [type(w.message) for w in caught] == [sync.SyncCheckUnavailableWarning]
    assert "cannot be checked" in str(caught[0].message)


@pytest.mark.gpu
@needs_cuda
def test_count_syncs_counts_planted_items(gen):
    x = randn(gen, 64, device="cuda")
    assert sync.count_syncs(lambda: x * 2) == 0
    assert sync.count_syncs(lambda: x.sum().item()) == 1
    assert sync.count_syncs(lambda: [x[i].item() for i in range(3)]) == 3
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


@pytest.mark.gpu
@needs_cuda
def test_guard_raises_on_sync_and_restores_mode(gen):
    x = randn(gen, 64, device="cuda")
    with sync.no_sync():
        y = (x * 2).sum()  # no sync: fine
    with pytest.raises(sync.HostSyncError, match="inside no_sync"), sync.no_sync():
        y.item()
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.gpu
@needs_cuda
def test_sync_free_components_pass_the_guard(gen):
    planes = sync.check_planes([[[0, 3], [1, 2]], [[4, 0], [2, 5]]], 6).cuda()
    theta, v = randn(gen, 2, 2, device="cuda"), randn(gen, 8, 6, device="cuda")
    acc, log = (
        sync.MetricAccumulator(["a"], device="cuda"),
        sync.ProgressLog(["a"], 2, device="cuda"),
    )
    sync.apply_givens(v, planes, theta)  # the planes' one check, a host read
    torch.cuda.synchronize()
    with sync.no_sync():
        v = sync.apply_givens(v, planes, theta)
        sync.update_rotor_angles(theta, planes, v[0], v[1, 1], 0.1)
        acc.add(a=v.sum())
        log.record({"a": v.sum()})
        log.flush()
        log.collect()
    assert len(log.collect(wait=True)) == 1


# ---- rotations in planes --------------------------------------------------------------------------
PLANE_CASES = {
    "one plane": (5, [[[1, 3]]]),
    "all coordinates": (6, [[[0, 5], [4, 1], [2, 3]]]),
    "two layers": (9, [[[0, 8], [2, 4]], [[8, 2], [1, 7]]]),
    "odd dim, three layers": (7, [[[6, 0]], [[0, 6]], [[3, 5]]]),
}
TOLERANCES = {  # cos/sin of a 0-d tensor and of a vector may differ by an ulp
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("lead", [(), (1,), (4,), (3, 5)])
@pytest.mark.parametrize("case", list(PLANE_CASES))
def test_apply_givens_equals_loop_reference(gen, case, lead, dtype):
    dim, pairs = PLANE_CASES[case]
    planes = sync.check_planes(pairs, dim)
    theta = randn(gen, *planes.shape[:2]) * 3
    v = randn(gen, *lead, dim, dtype=dtype)
    fast = sync.apply_givens(v, planes, theta)
    torch.testing.assert_close(
        fast, sync.apply_givens_reference(v, planes, theta), **TOLERANCES[dtype]
    )
    if dtype != torch.bfloat16:  # a rotation keeps the norm
        torch.testing.assert_close(fast.norm(dim=-1), v.norm(dim=-1))


def test_apply_givens_on_non_contiguous_input(gen):
    planes = sync.check_planes([[[0, 2], [3, 1]]], 4)
    theta = randn(gen, 1, 2)
    v = randn(gen, 4, 6)[:, ::2].T  # (3, 4), strided both ways
    assert not v.is_contiguous()
    fast = sync.apply_givens(v, planes, theta)
    torch.testing.assert_close(
        fast,
        sync.apply_givens_reference(v.contiguous(), planes, theta),
        **TOLERANCES[torch.float32],
    )


def test_apply_givens_rejects_bad_arguments(gen):
    planes = sync.check_planes([[[0, 1]]], 3)
    v, theta = randn(gen, 2, 3), randn(gen, 1, 1)
    with pytest.raises(TypeError, match=r"planes must be torch\.long"):
        sync.apply_givens(v, planes.int(), theta)
    with pytest.raises(ValueError, match=r"theta must have shape \(layers, k\) = \(1, 1\)"):
        sync.apply_givens(v, planes, randn(gen, 1, 2))
    with pytest.raises(TypeError, match="floating-point"):
        sync.apply_givens(v.long(), planes, theta)


def test_apply_givens_refuses_planes_that_overlap_or_leave_the_vector(gen):
    v = randn(gen, 3, 4)
    overlapping = torch.tensor([[[0, 1], [1, 2]]])  # not through check_planes
    with pytest.raises(ValueError, match=r"layer 0 uses coordinate\(s\) \[1\] in more than one"):
        sync.apply_givens(v, overlapping, randn(gen, 1, 2))
    with pytest.raises(ValueError, match=r"coordinates must be in 0\.\.3"):
        sync.apply_givens(v, torch.tensor([[[0, 4]]]), randn(gen, 1, 1))
    planes = torch.tensor([[[0, 1], [2, 3]]])
    sync.apply_givens(v, planes, randn(gen, 1, 2))  # disjoint: fine, and remembered
    planes[0, 1, 0] = 1  # changed in place: checked again
    with pytest.raises(ValueError, match="must be disjoint"):
        sync.apply_givens(v, planes, randn(gen, 1, 2))


@pytest.mark.parametrize(
    ("pairs", "dim", "error", "match"),
    [
        ([[[0, 4]]], 4, ValueError, r"coordinates must be in 0\.\.3"),
        ([[[-1, 2]]], 4, ValueError, r"0\.\.3 .* got values in -1\.\.2"),
        ([[[2, 2]]], 4, ValueError, "must differ"),
        ([[[0, 1], [1, 2]]], 4, ValueError, r"layer 0 uses coordinate\(s\) \[1\]"),
        ([[[0, 1], [2, 3], [4, 0]]], 5, ValueError, r"layer 0 uses coordinate\(s\) \[0\]"),
        ([[0.0, 1.0]], 4, TypeError, "integer coordinates"),
        ([0, 1], 4, ValueError, r"shape \(layers, k, 2\)"),
    ],
)
def test_check_planes_names_the_problem(pairs, dim, error, match):
    with pytest.raises(error, match=match):
        sync.check_planes(pairs, dim)


@pytest.mark.parametrize("signal_kind", ["tensor", "float"])
@pytest.mark.parametrize("case", list(PLANE_CASES))
def test_update_rotor_angles_equals_loop_reference(gen, case, signal_kind):
    dim, pairs = PLANE_CASES[case]
    planes = sync.check_planes(pairs, dim)
    theta = randn(gen, *planes.shape[:2])
    v_diff = randn(gen, dim)
    v_diff[pairs[0][0][0]] = 0.0  # a plane with one zero coordinate: atan2 on an axis
    signal = randn(gen, ()) if signal_kind == "tensor" else 0.75
    fast = sync.update_rotor_angles(theta.clone(), planes, v_diff, signal, 0.3)
    ref = sync.update_rotor_angles_reference(theta.clone(), planes, v_diff, signal, 0.3)
    # float32 on the device against float64 arithmetic on the host
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fast, theta)


@pytest.mark.gpu
@needs_cuda
def test_apply_givens_on_cuda_equals_cpu_reference(gen):
    planes = sync.check_planes([[[0, 5], [3, 1]], [[2, 4], [5, 0]]], 6)
    theta, v = randn(gen, 2, 2), randn(gen, 16, 6)
    fast = sync.apply_givens(v.cuda(), planes.cuda(), theta.cuda())
    torch.testing.assert_close(
        fast.cpu(), sync.apply_givens_reference(v, planes, theta), rtol=1e-5, atol=1e-6
    )


def test_metric_accumulator_refuses_what_it_would_lose_before_any_work():
    with pytest.raises(ValueError, match=r"floating dtype.*torch.int64"):
        sync.MetricAccumulator(["a"], dtype=torch.int64)  # 0.7 would be summed as 0
    with pytest.raises(ValueError, match=r"cannot hold its sums on 'banana'"):
        sync.MetricAccumulator(["a"], device="banana")
    acc = sync.MetricAccumulator(["a"])
    with pytest.raises(ValueError, match=r"'a' is on meta.*accumulator's on cpu"):
        acc.add(a=torch.ones((), device="meta"))
    assert acc.count == 0 and acc.totals.tolist() == [0.0]


def test_read_scalars_of_one_integer_dtype_are_the_items_exactly():
    values = {"step": torch.tensor(2**60 + 1), "tokens": torch.tensor(5)}
    assert sync.read_scalars(values) == {"step": 2**60 + 1, "tokens": 5}
    assert sync.read_scalars(values) == sync.read_scalars_reference(values)
    assert all(type(v) is int for v in sync.read_scalars(values).values())

