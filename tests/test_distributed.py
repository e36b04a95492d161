"""accel.distributed on the CPU: 2 gloo processes under torchrun against one process.

A launch costs a few seconds (torch is imported by the launcher and by every rank), so the runs
are shared: one process, then DDP and FSDP2 on one launch (each saving a checkpoint after step 3),
then the checkpoints are loaded in this process. Every other test launches at most once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from accel import distributed as D
from accel.distributed import checkpoint, launcher, torchrun
from accel.distributed.rank import run_rank
from accel.lab.bench import BenchContext
from accel.lab.cases import distributed as bench

STEPS, SAVE_AT = 7, 3
# fp32 on both sides; only the order of the gradient sums differs (over 8 samples, or 2 x 4 then
# averaged across ranks), and AdamW's division by sqrt(v) grows that over steps
LOSS_TOL = {"rtol": 1e-4, "atol": 1e-6}

pytestmark = pytest.mark.usefixtures("one_thread")

TWO_NODES = {"wrapper": "ddp", "nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500"}  # node 0: here


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu():
    """These are tests of the CPU path: on a machine with GPUs too, launches pick gloo (nccl
    would ask for a GPU per rank; the bench runs that path)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "gpus_present", lambda: 0)
        yield


def hanging_task(preset: str, seed: int) -> D.Task:
    """The toy task whose rank 1 stops answering at step 1 (for the timeout test)."""
    task = D.toy_task(preset, seed)
    healthy = task.batch

    def batch(step, rank, world, device):
        if os.environ.get("RANK") == "1" and step >= 1:
            time.sleep(3600)
        return healthy(step, rank, world, device)

    return D.Task(task.model, batch, task.loss, task.validate)


def slow_data_task(preset: str, seed: int) -> D.Task:
    """The toy task whose every batch takes 50 ms to make (a slow sample generator)."""
    task = D.toy_task(preset, seed)
    healthy = task.batch

    def batch(step, rank, world, device):
        time.sleep(0.05)
        return healthy(step, rank, world, device)

    return D.Task(task.model, batch, task.loss, task.validate)


def steps(run: D.RunResult) -> pd.DataFrame:
    """Rank 0's per-step rows of ``run`` as a DataFrame."""
    return bench.to_frame(run.steps)


def ranks(run: D.RunResult) -> pd.DataFrame:
    """Every rank's summary of ``run`` as a DataFrame."""
    return bench.to_frame(run.ranks)


def not_a_task(preset: str, seed: int):
    return torch.nn.Linear(2, 2)


DIES_AT = 5


def dying_task(preset: str, seed: int) -> D.Task:
    """The toy task whose rank 1 is killed (SIGKILL) in step DIES_AT of a run: a crash, an OOM
    kill, a lost machine."""
    task = D.toy_task(preset, seed)
    calls = itertools.count()

    def loss(output, target):
        if os.environ.get("RANK") == "1" and next(calls) == DIES_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return task.loss(output, target)

    return dataclasses.replace(task, loss=loss)


def spawning_task(preset: str, seed: int) -> D.Task:
    """The toy task whose rank 1 starts a process in a session of its own, then hangs."""
    task = D.toy_task(preset, seed)
    healthy = task.batch

    def batch(step, rank, world, device):
        if os.environ.get("RANK") == "1" and step >= 1:
            mark = os.environ.get("ACCEL_TEST_MARK", "")  # the launching test's, for leftovers
            subprocess.Popen(
                [sys.executable, "-c", f"import time; time.sleep(600)  # {mark}"],
                start_new_session=True,
            )
            time.sleep(3600)
        return healthy(step, rank, world, device)

    return D.Task(task.model, batch, task.loss, task.validate)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    common = {"steps": STEPS, "preset": "cpu", "seed": 3, "checkpoint_at": SAVE_AT}
    wrapped = {name: {"wrapper": name, "checkpoint_dir": root / name} for name in ("ddp", "fsdp2")}
    return {
        # as one rank under torchrun (the bench's baseline); the loads below run in this process
        "one": D.launch(**common, checkpoint_dir=root / "one", in_process=False),
        # on one launch: each rank trains DDP, then FSDP2
        **D.launch_series(wrapped, nprocs=2, **common),
    }


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_two_ranks_give_the_loss_of_one_process(runs, wrapper):
    one, run = runs["one"], runs[wrapper]
    assert run.config.backend == "gloo" and list(ranks(run)["rank"]) == [0, 1]
    assert (steps(run)["samples"] == 8).all()  # the global batch: 2 shares of 4
    expected = torch.tensor(steps(one)["loss"].to_numpy())
    torch.testing.assert_close(torch.tensor(steps(run)["loss"].to_numpy()), expected, **LOSS_TOL)
    # each rank's own loss is its share's: they differ, and average to the global loss
    assert not steps(run)["local_loss"].equals(steps(run)["loss"])
    assert expected[-1] < expected[0]  # it learns
    summaries = ranks(run)
    assert summaries["final_loss"].nunique() == 1 and summaries["validation_error"].nunique() == 1
    assert summaries["validation_error"].iloc[0] == pytest.approx(
        one.summary["validation_error"], rel=1e-4
    )
    assert (summaries["samples_per_s"] > 0).all() and (summaries["median_step_ms"] > 0).all()
    assert len(steps(run)) == STEPS and steps(run)["warmup"].sum() == 2


def test_the_runs_of_one_launch_ran_on_the_same_ranks(runs):
    ddp, fsdp2 = runs["ddp"], runs["fsdp2"]
    assert ddp.config.wrapper == "ddp" and fsdp2.config.wrapper == "fsdp2"
    assert ddp.pids == fsdp2.pids and len(ddp.pids) == 2
    assert [r["pid"] for r in ddp.ranks] == [r["pid"] for r in fsdp2.ranks]
    assert ddp.config.checkpoint_dir != fsdp2.config.checkpoint_dir  # each its own settings


@pytest.mark.parametrize(
    ("series", "message"),
    [
        ({}, "runs must name at least one run"),
        (
            {"a": {"wrapper": "ddp"}, "b": {"wrapper": "ddp", "nccl_env": {"NCCL_ALGO": "Ring"}}},
            "NCCL reads its environment once per process",
        ),
        (
            {"a": TWO_NODES, "b": TWO_NODES | {"node_rank": 1}},
            r"and its nodes: their backend, nccl_env, nnodes, node_rank, rdzv_endpoint, rdzv_id",
        ),
        ({"a": {"wrapper": "ddp", "nprocs": 4}}, "'nprocs' is the series'"),
        ({"a": {"wrapper": "ddp", "stepz": 4}}, "run 'a': unexpected argument 'stepz'"),
        ({"a": {"wrapper": "ddp", "in_process": True}}, "unexpected argument 'in_process'"),
        ({"a": {"wrapper": "ddp", "steps": 0}}, "run 'a': steps must be an int >= 1, got 0"),
        ({"a": {"wrapper": "ddp"}, "b": {"wrapper": "ddp", "lr": -1}}, "run 'b': Invalid learn"),
    ],
)
def test_a_series_is_refused_before_launch_where_its_runs_cannot_share_processes(
    series, message, no_launch
):
    with pytest.raises(ValueError, match=message):
        D.launch_series(nprocs=2, runs=series, steps=3, preset="cpu")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
def test_a_failing_run_of_a_series_is_raised_with_its_own_name(tmp_path, monkeypatch):
    mark = process_mark(tmp_path, monkeypatch)
    broken = {"wrapper": "ddp", "task": "accel.distributed:broken_toy_task"}
    with pytest.raises(D.RankFailed) as caught:
        D.launch_series(nprocs=2, runs={"fine": {"wrapper": "ddp"}, "broken": broken}, steps=4)
    assert "rank 1 of 2 raised ValueError" in str(caught.value)
    assert "broken_toy_task (run 'broken')" in str(caught.value).splitlines()[0]
    assert leftovers(mark) == []
    assert left_in_temp(tmp_path) == []  # no run folder, no torchelastic_* folder


def test_results_are_plain_rows_a_frame_only_in_the_lab(runs):
    run = runs["ddp"]
    assert isinstance(run.steps, list) and all(isinstance(row, dict) for row in run.steps)
    assert [r["rank"] for r in run.ranks] == [0, 1] and run.summary == run.ranks[0]
    json.dumps({"steps": run.steps, "ranks": run.ranks})  # as the ranks wrote them
    assert list(steps(run).columns) == list(run.steps[0]) and len(ranks(run)) == 2


def test_a_run_imports_no_pandas():
    code = (
        "import sys; from accel import distributed as D; "
        "run = D.launch(steps=2, warmup=0, preset='cpu', backend='gloo'); "
        "assert run.summary['steps'] == 2; assert 'pandas' not in sys.modules"
    )
    root = str(Path(D.__file__).resolve().parents[2])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_throughput_is_samples_over_the_whole_timed_window(runs):
    s = runs["ddp"].summary
    timed = steps(runs["ddp"]).query("not warmup")
    assert s["samples_per_s"] == pytest.approx(timed["samples"].sum() / (s["window_ms"] / 1e3))
    # the window holds every timed step, and the gaps between them
    assert s["window_ms"] >= timed["step_ms"].sum() * (1 - 1e-6)


def test_batch_making_stays_out_of_the_timed_steps():
    run = D.launch(f"{__name__}:slow_data_task", steps=4, warmup=1, in_process=True)
    # the 50 ms of each batch are spent before the first step, not inside the steps
    assert run.summary["window_ms"] < 3 * 50
    assert steps(run)["loss"].notna().all()


def test_fsdp2_holds_half_the_state_of_ddp_per_rank(runs):
    ddp, fsdp = ranks(runs["ddp"]), ranks(runs["fsdp2"])
    params = int(ddp["param_count"].iloc[0])
    assert (fsdp["param_count"] == params).all()  # global count, from the sharded tensors
    assert (ddp["param_bytes"] == 4 * params).all()
    assert (fsdp["param_bytes"] == 2 * params).all()  # every toy dimension splits evenly in two
    for frame, wrapper in ((ddp, "ddp"), (fsdp, "fsdp2")):
        model = D.state_bytes_per_rank(params, 2, wrapper)
        # plus AdamW's step counters: one 4-byte scalar per parameter tensor, not sharded
        assert (frame["state_bytes"] - model).between(0, 4 * 64).all(), frame["state_bytes"]
    assert (fsdp["state_bytes"] / ddp["state_bytes"]).max() < 0.51
    assert "fully_shard on 2 blocks + root" in fsdp["notes"].iloc[0]


@pytest.mark.parametrize("saved_by", ["ddp", "fsdp2", "one"])
def test_checkpoint_saved_on_two_ranks_loads_on_one_and_continues(runs, saved_by):
    # also one process to one process; FSDP2's shards and DDP's replicas load unwrapped
    saved = runs[saved_by].config.checkpoint_dir
    meta = D.checkpoint_meta(saved)
    assert meta["step"] == SAVE_AT and meta["wrapper"] == runs[saved_by].config.wrapper
    assert meta["world_size"] == (1 if saved_by == "one" else 2)
    resumed = D.launch(steps=STEPS - SAVE_AT, preset="cpu", seed=3, load_from=saved)
    assert steps(resumed)["step"].tolist() == list(range(SAVE_AT, STEPS))
    assert resumed.summary["start_step"] == SAVE_AT
    expected = steps(runs["one"])["loss"].to_numpy()[SAVE_AT:]
    torch.testing.assert_close(
        torch.tensor(steps(resumed)["loss"].to_numpy()), torch.tensor(expected), **LOSS_TOL
    )
    # in this process or as one rank: the same metrics
    assert list(steps(resumed).columns) == list(steps(runs["one"]).columns)
    assert list(ranks(resumed).columns) == list(ranks(runs["one"]).columns)
    assert resumed.summary["backend"] == "none" and runs["one"].summary["backend"] == "gloo"


def test_loading_another_tasks_checkpoint_says_whose_it_is(runs):
    saved = runs["one"].config.checkpoint_dir
    with pytest.raises(ValueError, match=r"saved by task 'accel\.distributed:toy_task'"):
        D.launch(f"{__name__}:hanging_task", steps=1, preset="cpu", load_from=saved)


class Planted:
    """Unpickled, it makes the folder ``path``: a stand-in for code a crafted checkpoint runs."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture
def no_checkpoint_read(monkeypatch):
    """Fails the test if torch.distributed.checkpoint loads anything."""
    import torch.distributed.checkpoint as dcp

    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed.checkpoint read the checkpoint")

    monkeypatch.setattr(dcp, "load", refuse)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("planted metadata", r"\.metadata (does not match the SHA-256 digest|is truncated)"),
        ("changed data", r"__0_0\.distcp does not match the SHA-256 digest"),
        ("no accel-meta.json", "no accel-meta.json: not saved by accel.distributed"),
        ("no digests", "records no SHA-256 digest of its files"),
    ],
)
def test_a_checkpoint_not_as_its_save_wrote_it_is_refused_before_anything_is_unpickled(
    runs, tmp_path, change, message, no_checkpoint_read, no_launch
):
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["one"].config.checkpoint_dir, folder)
    ran = tmp_path / "code-ran"
    meta_path = folder / checkpoint.META
    if change == "changed data":
        data = bytearray((folder / "__0_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (folder / "__0_0.distcp").write_bytes(data)
    else:
        (folder / ".metadata").write_bytes(pickle.dumps(Planted(str(ran))))
    if change == "no accel-meta.json":
        meta_path.unlink()
    elif change == "no digests":  # as an older save wrote it
        meta = json.loads(meta_path.read_text())
        meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "sha256"}))
    with pytest.raises(ValueError, match=message):  # here, and before torchrun starts
        D.launch(steps=1, preset="cpu", seed=3, load_from=folder)
    with pytest.raises(ValueError, match=message):
        D.launch(nprocs=2, wrapper="ddp", steps=1, preset="cpu", seed=3, load_from=folder)
    assert not ran.exists()


def test_a_save_records_the_digest_of_every_file_it_wrote(runs):
    folder = Path(runs["fsdp2"].config.checkpoint_dir)
    digests = D.checkpoint_meta(folder)["sha256"]
    written = {p.name for p in folder.iterdir() if p.name != checkpoint.META}
    assert set(digests) == written and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= written
    assert digests[".metadata"] == hashlib.sha256((folder / ".metadata").read_bytes()).hexdigest()


def children_of_this_process() -> list[int]:
    me, found = str(os.getpid()), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
def test_a_failing_rank_surfaces_its_traceback_and_leaves_no_processes():
    before = children_of_this_process()
    with pytest.raises(D.RankFailed) as caught:
        D.launch("accel.distributed:broken_toy_task", nprocs=2, wrapper="ddp", steps=4)
    error = caught.value
    assert error.rank == 1 and error.exitcode != 0
    assert "ValueError: broken_toy_task: rank 1 fails on purpose at step 1" in error.traceback
    assert "rank 1 of 2 raised" in str(error) and "Traceback" in str(error)
    first_line = str(error).splitlines()[0]  # the root cause, first
    assert "ValueError: broken_toy_task: rank 1 fails on purpose at step 1" in first_line
    assert len(error.pids) == 2
    assert not any(D.process_alive(pid) for pid in error.pids)
    assert children_of_this_process() == before  # torchrun reaped: no zombie, nothing running


def leftovers(*markers: bytes) -> list[bytes]:
    """Command lines of live processes that carry any of ``markers`` (:func:`process_mark`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmdline for m in markers) and D.process_alive(int(proc.name)):
            found.append(cmdline)
    return found


def process_mark(folder: Path, patch: pytest.MonkeyPatch) -> bytes:
    """What every process of the launches that follow carries in its command line, and no other
    test's: their run folders go under ``folder`` (torchrun's and each rank's ``--config``), and
    a process a rank starts is given it (``ACCEL_TEST_MARK``). Tests in other pytest-xdist
    workers launch beside this one. ``folder`` is also the temporary folder of every process
    started (TMPDIR): what a launch leaves in it is seen."""
    patch.setattr(tempfile, "tempdir", str(folder))
    patch.setenv("TMPDIR", str(folder))
    patch.setenv("ACCEL_TEST_MARK", f"accel-test-mark {folder}")
    return str(folder).encode()


def left_in_temp(folder: Path) -> list[str]:
    """What is in the temporary folder ``folder`` but torch's compile cache, which importing
    torch._dynamo makes in any process (the launching one too: it builds the run's optimizer)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.fixture
def tests_on_rank_path(monkeypatch):
    """The ranks import this module: put tests/ on their path."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
@pytest.mark.parametrize("task", ["hanging_task", "spawning_task"])
def test_a_hanging_rank_ends_in_a_timeout_that_kills_every_process(
    task, tests_on_rank_path, tmp_path, monkeypatch
):
    mark = process_mark(tmp_path, monkeypatch)
    before = children_of_this_process()
    started = time.monotonic()
    with pytest.raises(D.LaunchTimeout, match="ran past timeout=8 s"):
        D.launch(f"{__name__}:{task}", nprocs=2, wrapper="ddp", steps=3, timeout=8)
    assert time.monotonic() - started < 25
    assert children_of_this_process() == before
    # no rank of the run, nor a process a rank started, is left anywhere
    assert leftovers(mark) == []
    assert left_in_temp(tmp_path) == []


def kill_leftovers(mark: bytes) -> None:
    """SIGKILL whatever carries ``mark``: a failed test leaves nothing running."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if mark in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                continue


def wait_for(condition, seconds: float) -> bool:
    """Whether ``condition()`` came true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
def test_the_ranks_die_with_the_process_that_launched_them(
    tests_on_rank_path, tmp_path, monkeypatch
):
    """A notebook's kernel killed (SIGKILL, out of memory) while its run hangs: torchrun, the
    ranks, what a rank started in a session of its own and the launch's folders go with it."""
    mark = process_mark(tmp_path, monkeypatch)
    code = (
        "from accel import distributed as D; "
        f"D.launch('{__name__}:spawning_task', nprocs=2, wrapper='ddp', steps=3, preset='cpu', "
        "backend='gloo')"
    )
    root = str(Path(D.__file__).resolve().parents[2])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([root, os.environ["PYTHONPATH"]])}
    kernel = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        spawned = lambda: any(b"time.sleep(600)" in line for line in leftovers(mark))  # noqa: E731
        assert wait_for(spawned, 120), "rank 1 did not reach its step 1"
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait()
        assert wait_for(lambda: not leftovers(mark), 10), leftovers(mark)
        assert wait_for(lambda: not left_in_temp(tmp_path), 5), left_in_temp(tmp_path)
    finally:
        kernel.kill()
        kill_leftovers(mark)


@pytest.fixture(scope="module")
def killed(runs, tmp_path_factory):
    """The DDP run of ``runs``, checkpointed every 2 steps, with rank 1 killed in step 5: the
    error, the checkpoints' folder and the run's :func:`process_mark`."""
    root = tmp_path_factory.mktemp("killed")
    here = str(Path(__file__).parent)
    with pytest.MonkeyPatch.context() as patch:
        mark = process_mark(tmp_path_factory.mktemp("killed-run"), patch)
        patch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        with pytest.raises(D.RankFailed) as caught:
            D.launch(
                f"{__name__}:dying_task", nprocs=2, wrapper="ddp", steps=STEPS, preset="cpu",
                seed=3, checkpoint_dir=root, checkpoint_every=2,
            )  # fmt: skip
    return caught.value, root, mark


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
def test_a_killed_rank_is_named_with_its_signal_and_nothing_is_left(killed):
    error, root, mark = killed
    first_line = str(error).splitlines()[0]
    assert "rank 1 of 2" in first_line and "SIGKILL" in first_line, first_line
    assert error.rank == 1
    assert leftovers(mark) == []
    assert left_in_temp(Path(mark.decode())) == []  # the launch's folders are gone
    steps = sorted(D.checkpoint_meta(p)["step"] for p in root.iterdir())
    assert steps == [2, 4]  # every 2 steps, until the kill in step 5
    assert D.latest_checkpoint(root).name == "step-000004"


@pytest.mark.parametrize("nprocs", [2, 1])
def test_resuming_after_the_kill_gives_the_uninterrupted_losses(runs, killed, nprocs, monkeypatch):
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    _, root, _ = killed
    resumed = D.launch(
        f"{__name__}:dying_task", nprocs=nprocs, wrapper="ddp" if nprocs > 1 else "none",
        steps=STEPS - 4, preset="cpu", seed=3, load_from=root,
    )  # fmt: skip
    assert steps(resumed)["step"].tolist() == list(range(4, STEPS))
    got = torch.tensor(steps(resumed)["loss"].to_numpy())
    expected = torch.tensor(steps(runs["ddp"])["loss"].to_numpy()[4:])
    if nprocs == 2:  # the same ranks, the same sums in the same order: bit for bit
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, expected, **LOSS_TOL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_rank_give_the_losses_of_one_host_of_two(runs, monkeypatch):
    """Two torchrun agents on this machine, node 0 serving the rendezvous at 127.0.0.1 as it
    would at its address on two hosts, each with one rank and its own out folder."""
    # each rank with the threads a rank of the two-process run had (torchrun's default there)
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    common = {
        "wrapper": "ddp", "nprocs": 1, "steps": STEPS, "preset": "cpu", "seed": 3,
        "backend": "gloo", "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}",
        "rdzv_id": "two-agents", "timeout": 120,
    }  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        node0, node1 = pool.map(lambda rank: D.launch(**common, node_rank=rank), [0, 1])
    assert list(ranks(node0)["rank"]) == [0] and list(ranks(node1)["rank"]) == [1]
    assert (ranks(node0)["world_size"] == 2).all() and (ranks(node1)["world_size"] == 2).all()
    assert (steps(node0)["samples"] == 8).all()  # the global batch, split over both nodes
    # The same two ranks with the same shares as the one-host run, and gloo sums two gradients
    # as a + b wherever they run: the same numbers bit for bit, not just within rounding.
    one_host = torch.tensor(steps(runs["ddp"])["loss"].to_numpy())
    for node in (node0, node1):  # the loss is the mean over every rank: the same on each node
        got = torch.tensor(steps(node)["loss"].to_numpy())
        torch.testing.assert_close(got, one_host, rtol=0, atol=0)
    assert steps(node0)["local_loss"].equals(steps(runs["ddp"])["local_loss"])  # rank 0's rows
    assert not steps(node1)["local_loss"].equals(steps(node0)["local_loss"])  # rank 1's own
    assert node1.summary["validation_error"] == runs["ddp"].summary["validation_error"]


def test_a_rendezvous_that_cannot_start_is_torchruns_error_not_a_rank_death():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(D.LaunchError) as caught:
            D.launch(**TWO_NODES | {"rdzv_endpoint": endpoint}, steps=1, preset="cpu", timeout=60)
    first = str(caught.value).splitlines()[0]
    assert not isinstance(caught.value, D.RankFailed)
    assert first.startswith("torchrun ended before starting any rank (ddp x1 on node 0 of 2 of")
    assert "address already in use" in first and f"rdzv_endpoint='{endpoint}'" in first


def test_several_nodes_meet_at_the_endpoint_instead_of_standalone():
    config = D.RunConfig(
        wrapper="ddp", nprocs=4, nnodes=3, node_rank=2, rdzv_endpoint="10.0.0.1:29500",
        rdzv_id="job7",
    )  # fmt: skip
    command = torchrun._torchrun_command(["torchrun"], [config], Path("config.json"))
    assert "--standalone" not in command
    flags = " ".join(command[: command.index("-m")])
    assert flags == (
        "torchrun --nnodes 3 --node-rank 2 --rdzv-backend static --rdzv-endpoint "
        "10.0.0.1:29500 --rdzv-id job7 --nproc-per-node 4"
    )
    assert config.world_size == 12 and list(config.local_ranks) == [8, 9, 10, 11]
    one_host = torchrun._torchrun_command(["torchrun"], [D.RunConfig()], Path("config.json"))
    assert one_host[1] == "--standalone"


def test_a_node_whose_world_is_not_nnodes_times_nprocs_says_so(tmp_path, monkeypatch):
    """A node launched with another nprocs than the others: the world torchrun made differs."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = D.RunConfig(wrapper="ddp", nnodes=2, nprocs=1, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"nnodes=2 x nprocs=1 ranks, but torchrun made a world"):
        run_rank([config], tmp_path)
    assert "world of 3" in json.loads((tmp_path / "rank0.error.json").read_text())["message"]


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if anything is launched."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"launched {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_more_processes_than_gpus_is_refused_before_launch(monkeypatch, no_launch):
    monkeypatch.setattr(launcher, "gpus_present", lambda: 1)
    with pytest.raises(ValueError, match=r"asked for 2 processes .* but 1 GPU\(s\) are present"):
        D.launch(nprocs=2, wrapper="ddp")  # nccl: picked because a GPU is present
    monkeypatch.setattr(launcher, "gpus_present", lambda: 0)
    with pytest.raises(ValueError, match=r"0 GPU.*present; use backend='gloo' to run on the CPU"):
        D.launch(nprocs=2, wrapper="ddp", backend="nccl")


def test_a_missing_launcher_is_a_clear_error(monkeypatch, no_launch):
    with pytest.raises(D.LauncherNotFound, match="'no-such-torchrun' not found on PATH"):
        D.launch(nprocs=2, wrapper="ddp", launcher="no-such-torchrun")
    monkeypatch.setattr(torchrun, "_torch_run_available", lambda: False)
    with pytest.raises(D.LauncherNotFound, match=r"torch.distributed.run cannot be imported"):
        D.launch(nprocs=2, wrapper="ddp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wrapper": "fsdp"}, "wrapper must be one of"),
        ({"nprocs": 2}, "wrapper 'none' trains on one process; got nprocs=2"),
        ({"nprocs": 0, "wrapper": "ddp"}, "nprocs must be an int >= 1, got 0"),
        ({"task": "accel.distributed"}, "task must be named 'module:function'"),
        ({"task": "accel.nope:task"}, "module 'accel.nope' cannot be found"),
        ({"task": "nope.deeper:task"}, "module 'nope.deeper' cannot be found"),
        ({"steps": 3, "checkpoint_at": 4}, "checkpoint_at must be within 1..steps=3, got 4"),
        ({"load_from": "/nonexistent"}, "holds no complete DCP checkpoint"),
        ({"autocast": "fp16"}, "autocast must be None or 'bf16', got 'fp16'"),
        ({"scaling": "linear"}, "scaling must be 'strong' or 'weak'"),
        ({"backend": "mpi"}, "backend must be 'nccl', 'gloo' or None"),
        ({"nnodes": 0, "wrapper": "ddp"}, "nnodes must be an int >= 1, got 0"),
        ({"node_rank": 1}, "node_rank and rdzv_endpoint are for nnodes > 1; got nnodes=1, no"),
        ({"rdzv_endpoint": "h:1"}, "node_rank and rdzv_endpoint are for nnodes > 1"),
        ({**TWO_NODES, "node_rank": 2}, "node_rank must be within 0..nnodes-1=1, got 2"),
        ({**TWO_NODES, "node_rank": -1}, "node_rank must be an int >= 0, got -1"),
        ({**TWO_NODES, "wrapper": "none"}, "wrapper 'none' trains on one process; got nnodes=2"),
        ({**TWO_NODES, "rdzv_endpoint": None}, "rdzv_endpoint must be 'host:port'.*got None"),
        ({**TWO_NODES, "rdzv_endpoint": "10.0.0.1"}, "must be 'host:port'.*got '10.0.0.1'"),
        ({**TWO_NODES, "rdzv_endpoint": "h:65536"}, "must be 'host:port'.*got 'h:65536'"),
        ({**TWO_NODES, "rdzv_endpoint": ":29500"}, "must be 'host:port'.*got ':29500'"),
        ({**TWO_NODES, "rdzv_id": "my job"}, "rdzv_id must be a name .* got 'my job'"),
        ({**TWO_NODES, "in_process": True}, "in_process runs wrapper 'none' on this host only"),
        ({**TWO_NODES, "rdzv_endpoint": "10.0.0.1:29500"},
         "node 0 serves the rendezvous at rdzv_endpoint, but '10.0.0.1' is no address of this "
         "machine: run node 0 on the host at that address"),
    ],
)
def test_bad_arguments_are_refused_before_launch(kwargs, message, no_launch):
    with pytest.raises(ValueError, match=message):
        D.launch(**kwargs)


def _saved_checkpoint(root: Path) -> Path:
    """A checkpoint of a small model saved in this process, as a rank saves it."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    directory = root / "step-000002"
    checkpoint.save(model, optimizer, D.RunConfig(), 2, 0, 1, directory)
    return directory


def test_a_checkpoint_whose_other_ranks_wrote_elsewhere_is_refused_at_its_save(tmp_path):
    """Ranks on another host wrote their shard into a folder of their own (not shared)."""
    directory = _saved_checkpoint(tmp_path)
    (own,) = [p.name for p in directory.iterdir() if p.name.endswith(".distcp")]

    def written(*names: str) -> SimpleNamespace:  # the part of DCP's metadata that is read
        return SimpleNamespace(storage_data={n: SimpleNamespace(relative_path=n) for n in names})

    checkpoint.check_every_file_here(directory, written(own))
    with pytest.raises(ValueError, match=r"__1_0\.distcp, written by other ranks, are not in"):
        checkpoint.check_every_file_here(directory, written(own, "__1_0.distcp"))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
@pytest.mark.parametrize("which", [".metadata", ".distcp"])
def test_a_damaged_checkpoint_is_refused_before_launch_naming_the_file(
    tmp_path, damage, which, no_launch
):
    directory = _saved_checkpoint(tmp_path)
    (damaged,) = [p for p in directory.iterdir() if p.name.endswith(which)]
    if damage == "missing":
        damaged.unlink()
    else:
        damaged.write_bytes(damaged.read_bytes()[:-10])
    pattern = rf"checkpoint {directory}: {damaged.name} is {damage}"
    with pytest.raises(ValueError, match=pattern):
        D.launch(load_from=tmp_path)
    with pytest.raises(ValueError, match=pattern):
        D.latest_checkpoint(directory)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"preset": "huge"}, ValueError, "unknown preset 'huge'"),
        ({"preset": "gpu"}, ValueError, "preset 'gpu'.*backend 'gloo' trains on the CPU"),
        ({"task": "accel.distributed:nope"}, ValueError, "has no function 'nope'"),
        ({"task": f"{__name__}:not_a_task"}, TypeError, "must return accel.distributed.Task"),
        ({"nprocs": 3}, ValueError, r"preset 'cpu': global batch 8 does not split over 3 ranks: use a world size that "
         r"divides 8"),
        ({**TWO_NODES, "nnodes": 3}, ValueError, "global batch 8 does not split over 6 ranks"),
        ({"checkpoint_every": 0}, ValueError, "checkpoint_every must be an int >= 1, got 0"),
        ({"checkpoint_every": 2}, ValueError, "checkpoint_every needs checkpoint_dir"),
        # what a rank would refuse, refused here first
        ({"lr": -1}, ValueError, "Invalid learning rate: -1"),
        ({"lr": float("nan")}, ValueError, "Invalid learning rate: nan"),
        ({"steps": 2.5}, TypeError, "steps must be an int >= 1, got 2.5"),
        ({"warmup": 1.5}, TypeError, "warmup must be an int >= 0, got 1.5"),
        ({"seed": "0"}, TypeError, "seed must be an int >= 0, got '0'"),
        ({"nnodes": 2.0}, TypeError, "nnodes must be an int >= 1, got 2.0"),
        ({"timeout": 0}, ValueError, "timeout must be a number of seconds > 0, got 0"),
        ({"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb must be None or > 0, got -1"),
        ({"nccl_env": {"NCCL_MIN_NCHANNELS": 4}}, ValueError, "nccl_env must map str to str"),
    ],
)
def test_task_and_sizes_are_checked_before_torchrun_starts(kwargs, error, message, no_launch):
    with pytest.raises(error, match=message):
        D.launch(**{"nprocs": 2, "wrapper": "ddp", "steps": 2, "preset": "cpu"} | kwargs)


@pytest.mark.parametrize("nprocs", [2, 1])
def test_a_refused_launch_creates_no_checkpoint_folder(nprocs, tmp_path, no_launch):
    where = tmp_path / "new" / "ckpt"
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        D.launch(
            nprocs=nprocs, wrapper="ddp" if nprocs > 1 else "none", preset="huge",
            checkpoint_dir=where,
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_loading_another_tasks_checkpoint_on_two_ranks_is_refused_before_launch(runs, no_launch):
    saved = runs["one"].config.checkpoint_dir
    with pytest.raises(ValueError, match=r"saved by task 'accel\.distributed:toy_task'"):
        D.launch(
            f"{__name__}:hanging_task", nprocs=2, wrapper="ddp", steps=1, preset="cpu",
            load_from=saved,
        )  # fmt: skip


def test_an_unwritable_checkpoint_dir_is_refused_before_launch(tmp_path, no_launch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"checkpoint_dir .*a-file/ckpt: cannot write there"):
        D.launch(nprocs=2, wrapper="ddp", steps=2, checkpoint_dir=blocker / "ckpt")


def test_a_factory_must_return_a_task():
    with pytest.raises(TypeError, match=r"must return accel\.distributed\.Task, got Linear"):
        D.launch(f"{__name__}:not_a_task", steps=1)
    with pytest.raises(ValueError, match="has no function 'nope'"):
        D.launch("accel.distributed:nope", steps=1)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        D.launch(steps=1, preset="huge")


def test_toy_task_shares_concatenate_to_the_global_batch(seed):
    task = D.toy_task("cpu", seed)
    cpu = torch.device("cpu")
    whole = task.batch(5, 0, 1, cpu)
    halves = [task.batch(5, r, 2, cpu) for r in range(2)]
    for i in range(2):
        assert torch.equal(torch.cat([h[i] for h in halves]), whole[i])
    assert not torch.equal(task.batch(6, 0, 1, cpu)[0], whole[0])  # another step, other data
    with pytest.raises(ValueError, match="global batch 8 does not split over 3 ranks"):
        task.batch(0, 0, 3, cpu)


def test_cost_model():
    assert D.allreduce_bytes(100, 2) == 100 and D.allreduce_bytes(100, 4) == 150
    assert D.fsdp_bytes(100, 2) == 150 and D.fsdp_bytes(100, 2, reshard_after_forward=False) == 100
    assert D.state_bytes_per_rank(10, 4, "ddp") == 120  # 4 B weights + 8 B AdamW moments
    assert D.state_bytes_per_rank(10, 4, "fsdp2", grads=True) == 40


def test_fsdp_units_are_module_list_elements_innermost_first():
    inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    outer = torch.nn.ModuleList([torch.nn.Sequential(inner), torch.nn.Linear(2, 2)])
    model = torch.nn.Sequential(outer, torch.nn.Linear(2, 2))
    units = D.fsdp_units(model)
    assert units[0] is inner[0] and {id(u) for u in units[1:]} == {id(m) for m in outer}
    assert D.fsdp_units(torch.nn.Linear(2, 2)) == []


def test_the_communication_settings_are_launch_arguments_away_from_the_defaults():
    config, default = D.RunConfig(**D.COMM_SETTINGS), D.RunConfig()
    assert all(getattr(config, k) != getattr(default, k) for k in D.COMM_SETTINGS)
    assert D.COMM_SETTINGS["nccl_env"]["NCCL_MIN_NCHANNELS"] == "4"


def fake_run(wrapper: str, nprocs: int, samples_per_s: float, state: float):
    config = D.RunConfig(wrapper=wrapper, nprocs=nprocs, steps=10, warmup=2)
    summary = {
        "backend": "nccl",
        "samples_per_s": samples_per_s,
        "median_step_ms": 1.0,
        "state_bytes": state * bench.MiB,
        "peak_memory_bytes": 2 * state * bench.MiB,
        "final_loss": 0.1,
        "validation_error": 0.2,
        "notes": "",
    }
    return D.RunResult(config, [], [summary | {"rank": r} for r in range(nprocs)])


def test_bench_rows_judge_the_two_gpu_targets():
    runs = {
        "one": fake_run("none", 1, 100.0, 12.0),
        "ddp": fake_run("ddp", 2, 170.0, 12.0),
        "fsdp2": fake_run("fsdp2", 2, 150.0, 8.0),
    }
    frame = bench.table(runs).set_index("config")
    assert frame.loc["ddp", "scaling_efficiency"] == pytest.approx(0.85)
    rows = {r.case: r for r in bench.rows(runs, judged=True, where="test")}
    assert rows["ddp x2 throughput"].met is False and rows["ddp x2 throughput"].speedup == 1.7
    assert rows["fsdp2 x2 throughput"].met is None  # no throughput target for FSDP2
    assert rows["fsdp2 x2 state_memory"].met is False  # 0.67x > 0.6x
    assert rows["fsdp2 x2 peak_memory"].baseline == 24.0
    runs["ddp"], runs["fsdp2"] = fake_run("ddp", 2, 190.0, 12.0), fake_run("fsdp2", 2, 150.0, 6.0)
    rows = {r.case: r for r in bench.rows(runs, judged=True, where="test")}
    assert rows["ddp x2 throughput"].met is True and rows["ddp x2 throughput"].speedup == 1.9
    assert rows["fsdp2 x2 state_memory"].met is True  # 0.5x <= 0.6x
    unjudged = bench.rows(runs, judged=False, where="cpu")
    assert all(r.met is None for r in unjudged)
    assert bench.rank_counts(2) == [2] and bench.rank_counts(4) == [2, 4]
    assert bench.rank_counts(8) == [2, 4, 8] and bench.rank_counts(3) == [2, 3]
    (skipped,) = bench.skipped_rows(2, reason="2 GPUs present")
    assert skipped.case == "ddp x4 throughput" and math.isnan(skipped.optimized)
    assert "skipped: needs 4 GPUs" in skipped.note


def test_bench_baseline_is_the_faster_of_two_launches_around_the_others(monkeypatch):
    launched = []

    def fake_measure(task, nprocs, *, preset, sizes, configs, on_run=None):
        launched.append((nprocs, tuple(configs)))
        if "one" in configs:  # the baseline: slow before, fast after
            return {"one": fake_run("none", 1, 80.0 if len(launched) == 1 else 100.0, 12.0)}
        return {k: fake_run(c["wrapper"], nprocs, 150.0 * nprocs, 12.0)
                for k, c in configs.items()}  # fmt: skip

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "pick_task", lambda: ("task", "a fake"))
    rows = {r.case: r for r in bench.run(BenchContext(torch.device("cpu"), "cpu"))}
    assert tuple(bench.CONFIGS) == ("one", "ddp", "fsdp2")
    assert launched == [(1, ("one",)), (2, ("ddp", "fsdp2")), (1, ("one",))]
    assert rows["one_gpu throughput"].optimized == 100.0
    assert rows["ddp x2 throughput"].speedup == pytest.approx(3.0)  # 300 / 100, not 300 / 80
    assert "80 and 100 samples/s, the faster is the baseline" in rows["ddp x2 throughput"].note


def test_on_four_gpus_every_wrapper_has_its_rows_at_each_count_and_one_gpu_once(monkeypatch):
    def fake_measure(task, nprocs, *, preset, sizes, configs, on_run=None):
        return {k: fake_run(c["wrapper"], 1 if c["wrapper"] == "none" else nprocs,
                            100.0 * nprocs, 12.0) for k, c in configs.items()}  # fmt: skip

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "pick_task", lambda: ("task", "a fake"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    only = BenchContext(torch.device("cuda"), "gpu", only=("wrappers",))
    cases = [r.case for r in bench.run(only)]
    assert cases.count("one_gpu throughput") == 1
    for n in (2, 4):
        for wrapper in ("ddp", "fsdp2"):
            assert f"{wrapper} x{n} throughput" in cases and f"{wrapper} x{n} state_memory" in cases


def test_on_gpus_each_ddp_setting_is_measured_alone_against_plain_ddp_in_its_launch(monkeypatch):
    launched = []

    def fake_measure(task, nprocs, *, preset, sizes, configs, series=False, on_run=None):
        launched.append((nprocs, tuple(configs), series))
        first, last = bench.PLAIN_DDP
        rate = {"one": 100.0, "ddp": 150.0 * nprocs, first: 140.0 * nprocs, last: 150.0 * nprocs}
        return {k: fake_run(c["wrapper"], 1 if c["wrapper"] == "none" else nprocs,
                            rate.get(k, 160.0 * nprocs), 12.0)
                for k, c in configs.items()}  # fmt: skip

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "pick_task", lambda: ("task", "a fake"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    rows = {r.case: r for r in bench.run(BenchContext(torch.device("cuda"), "gpu"))}
    alone = bench.setting_configs()
    assert next(iter(alone)) == bench.PLAIN_DDP[0] and list(alone)[-1] == bench.PLAIN_DDP[1]
    assert set(alone) - set(bench.PLAIN_DDP) == {f"ddp {k} alone" for k in bench.DDP_SETTINGS}
    assert (4, tuple(alone), True) in launched  # one series, at the largest count only
    assert not any(set(alone) & set(c) for n, c, _ in launched if n == 2)
    for key in bench.DDP_SETTINGS:
        row = rows[f"ddp {key} alone x4 throughput"]
        assert row.baseline == 600.0 and row.speedup == pytest.approx(640.0 / 600.0)
        assert row.met is None and f"{key}=" in row.note  # the faster plain run is the baseline
        assert "560 and 600 samples/s, the faster is the baseline" in row.note
    assert alone["ddp static_graph alone"] == {"wrapper": "ddp", "static_graph": True}
    assert "ddp bucket_cap_mb alone x2 throughput" not in rows
    launched.clear()  # each part alone
    only = BenchContext(torch.device("cuda"), "gpu", only=("settings",))
    assert [n for n, *_ in launched] == [] and len(bench.run(only)) == len(bench.DDP_SETTINGS)
    assert launched == [(4, tuple(alone), True)]


def test_measure_as_series_launches_once_per_nccl_setting_and_keeps_the_order(monkeypatch):
    launched = []

    def fake_launch(task, nprocs, *, wrapper, **options):
        launched.append(("launch", nprocs, wrapper))
        return fake_run(wrapper, nprocs, 100.0, 12.0)

    def fake_series(runs, task, nprocs, **common):
        launched.append(("series", nprocs, tuple(runs)))
        return {k: fake_run(r["wrapper"], nprocs, 150.0, 12.0) for k, r in runs.items()}

    monkeypatch.setattr(D, "launch", fake_launch)
    monkeypatch.setattr(D, "launch_series", fake_series)
    sizes = bench.BENCH_SIZES["cpu"]
    seen = []
    runs = bench.measure(
        "task", 2, preset="cpu", sizes=sizes, series=True, on_run=lambda k, r: seen.append(k)
    )
    assert launched == [("launch", 1, "none"), ("series", 2, ("ddp", "fsdp2"))]
    assert list(runs) == list(bench.CONFIGS) and sorted(seen) == sorted(bench.CONFIGS)


def test_the_cause_is_the_killed_rank_then_the_raising_one_never_torchruns_sigterm(tmp_path):
    summary = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "Failures:\n[1]:\n  rank      : {a} (local_rank: {a})\n  exitcode  : {code} (pid: 11)\n"
        "  traceback : {why}\n------\nRoot Cause (first observed failure):\n[0]:\n"
        "  rank      : {b} (local_rank: {b})\n  exitcode  : 1 (pid: 10)\n"
    )
    config = D.RunConfig(nprocs=2, wrapper="ddp", out_dir=str(tmp_path))

    def failure(output, raised_by=None):
        for path in tmp_path.glob("*.error.json"):
            path.unlink()
        if raised_by is not None:
            error = {"rank": raised_by, "time": 0.0, "type": "ValueError", "message": "bad batch",
                     "traceback": "Traceback ...\nValueError: bad batch"}  # fmt: skip
            (tmp_path / f"rank{raised_by}.error.json").write_text(json.dumps(error))
        return torchrun.rank_failure(config, output, 1, (), what="ddp x2 of a task")

    sigterm = summary.format(a=0, code=-15, why="Signal 15 (SIGTERM) received by PID 11", b=1)
    sigkill = summary.format(a=1, code=-9, why="Signal 9 (SIGKILL) received by PID 11", b=0)
    # rank 1 raised; torchrun then ended rank 0 with SIGTERM: rank 1's error is the cause
    assert failure(sigterm, raised_by=1).rank == 1
    assert str(failure(sigterm, raised_by=1)).startswith("rank 1 of 2 raised ValueError: bad batch")
    # rank 1 was killed; rank 0 raised on the lost connection: the kill is the cause
    assert failure(sigkill, raised_by=0).rank == 1
    assert "SIGKILL" in str(failure(sigkill, raised_by=0)).splitlines()[0]
    # nothing raised, only torchrun's SIGTERM is known: that is said
    assert "SIGTERM" in str(failure(sigterm)).splitlines()[0]
