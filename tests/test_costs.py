"""The launch queue's depth: how many launches the device holds before the host waits."""

from __future__ import annotations

import itertools
import time

import torch
from conftest import requires_cuda

from accel.measure import costs


def test_the_launches_before_the_first_that_waited_are_counted():
    calls = itertools.count()

    def launch():  # the seventh call waits, as a launch into a full queue does
        if next(calls) == 6:
            time.sleep(0.01)

    assert costs._launches_before_a_wait(launch, most=100) == 6
    assert costs._launches_before_a_wait(lambda: None, most=100) == 0  # none waited


def test_a_cpu_has_no_launch_queue():
    assert costs.launch_queue_depth("cpu") == 0


@requires_cuda
def test_the_device_queue_holds_some_launches_and_the_same_each_time():
    depth = costs.launch_queue_depth(torch.device("cuda"))
    assert 16 <= depth < 4096
    assert costs.launch_queue_depth("cuda:0") == depth
