"""The overhead phase's rows: the host time a component adds, judged round by round."""

import pytest
import torch


def _host_rows(plain_us, ours_us):
    from accel.lab.bench import BenchContext
    from accel.lab.cases import overhead
    from accel.measure.timer import Comparison, Timing

    ms = lambda us: tuple(u / 1e3 for u in us)  # noqa: E731
    timing = Comparison(
        {"F.sdpa": Timing("F.sdpa", ms(plain_us)), "sdpa": Timing("sdpa", ms(ours_us))},
        "F.sdpa",
        schedule=(),
    )
    ctx = BenchContext(torch.device("cuda"), "gpu")  # judged; nothing runs
    return overhead.host_rows(ctx, "sdpa full", timing, "sdpa", added_us=3)


def test_the_host_time_added_is_a_row_of_its_own_judged_round_by_round():
    """The host's pace drifts between rounds: the time added is taken within each round (here
    +2, +2, +2, +11, -8 us: 2 us) and not as a difference of medians (31 - 20 = 11 us); the
    number judged is the row's own, so a reader of the results can check the verdict. It gives
    the share of the baseline's host time, which holds across hosts of other paces."""
    per_call, added = _host_rows(plain_us=(20, 30, 30, 20, 20), ours_us=(22, 32, 32, 31, 12))
    assert per_call.metric == "host time per call"
    assert (per_call.optimized, per_call.baseline) == (31, 20)
    assert per_call.met is None and per_call.target == ""
    assert added.metric == "host time added per call" and added.optimized == pytest.approx(2)
    assert added.met is True and added.target == "<= 3 us over F.sdpa"
    assert "over F.sdpa's 20.0 us (10% of it)" in added.note  # the host's pace: its share
    _, slower = _host_rows(plain_us=(20, 30, 25, 21, 22), ours_us=(25, 35, 30, 26, 27))
    assert slower.met is False and slower.optimized == pytest.approx(5)
