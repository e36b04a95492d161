"""The doctor inside a real process group: two CPU processes train a DDP model over gloo, and
each rank's examine finds the gradients' all-reduce, its share of the step and its overlap."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from accel import doctor

WORLD = 2
pytestmark = pytest.mark.usefixtures("one_thread")


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        layers = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
        model = nn.parallel.DistributedDataParallel(layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(batch):
            loss = model(batch).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = doctor.examine(step, torch.randn(64, 256))
        t = report.evidence.timeline
        found = [f for f in report.findings if f.kind == "communication"]
        with open(f"{out}.{rank}", "w") as f:
            json.dump(
                {
                    "comm_us": t.comm_us,
                    "overlap_us": t.comm_overlap_us,
                    "step_us": t.step_us,
                    "titles": [f.title for f in found],
                    "saved_us": [f.saved_us for f in found],
                },
                f,
            )
    finally:
        dist.destroy_process_group()


def test_each_rank_sees_its_all_reduce_and_how_much_compute_hides_it(tmp_path):
    out = tmp_path / "rank"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=WORLD)
    for rank in range(WORLD):
        seen = json.loads(out.with_name(f"rank.{rank}").read_text())
        assert 0 < seen["comm_us"] < seen["step_us"], seen
        assert 0 <= seen["overlap_us"] <= seen["comm_us"], seen
        (title,) = seen["titles"]
        assert title.startswith("communication takes ") and "overlapped with compute" in title
        (saved,) = seen["saved_us"]
        assert saved == seen["comm_us"] - seen["overlap_us"]
