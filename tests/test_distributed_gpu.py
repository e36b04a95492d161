"""accel.distributed across nodes with NCCL: two torchrun agents on one host of two GPUs, each
seeing only its own GPU as a host of its own would, against one agent of two ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from accel import distributed as D

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA GPUs; this machine has {GPUS}"),
]
COMMON = {"wrapper": "ddp", "steps": 6, "warmup": 2, "preset": "gpu", "seed": 3, "timeout": 300}
# A node as its own host launches it: `distributed.launch` with its node_rank, printing its rows
AGENT = (
    "import json, sys; from accel import distributed as D; "
    "r = D.launch(**json.loads(sys.argv[1])); print(json.dumps([r.steps, r.ranks]))"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nccl_nodes_of_one_gpu_train_as_one_host_of_two(tmp_path):
    one_host = D.launch(nprocs=2, backend="nccl", **COMMON)
    node = COMMON | {"nprocs": 1, "backend": "nccl", "nnodes": 2, "rdzv_id": "two-nodes",
                     "rdzv_endpoint": f"127.0.0.1:{free_port()}"}  # fmt: skip
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    agents = [
        subprocess.Popen(
            [sys.executable, "-c", AGENT, json.dumps(node | {"node_rank": rank})],
            env=os.environ | {"CUDA_VISIBLE_DEVICES": str(rank), "PYTHONPATH": path},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    (steps0, ranks0), (steps1, ranks1) = (json.loads(out.splitlines()[-1]) for out, _ in outputs)
    assert [r["rank"] for r in ranks0] == [0] and [r["rank"] for r in ranks1] == [1]
    assert all(r["world_size"] == 2 and r["backend"] == "nccl" for r in ranks0 + ranks1)
    # the same two ranks, seeds and shares as the one host's: NCCL sums two gradients as a + b
    expected = torch.tensor([s["loss"] for s in one_host.steps])
    for steps in (steps0, steps1):  # the loss is the mean over every rank: the same on each node
        torch.testing.assert_close(torch.tensor([s["loss"] for s in steps]), expected)
    print(f"two nodes: {ranks0[0]['samples_per_s']:,.0f} samples/s on node 0; one host of two "
          f"ranks: {one_host.summary['samples_per_s']:,.0f}")  # fmt: skip
