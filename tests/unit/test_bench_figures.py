"""The benchmarks' steady rate: what the drain targets are judged on."""

from __future__ import annotations

import math

from bench.common import steady_rate


def test_the_steady_rate_leaves_out_a_slow_start_and_a_slow_finish() -> None:
    start = [0.5 * i for i in range(10)]  # ten jobs over the first 4.5 s: workers still starting
    busy = [5.0 + 0.001 * i for i in range(80)]  # eighty at a thousand a second
    finish = [6.0 + 0.5 * i for i in range(10)]  # the last ten trickle out
    times = start + busy + finish
    whole = len(times) / (times[-1] - times[0])
    assert whole < 10
    assert steady_rate(times) == 79 / (busy[-1] - busy[0])  # about 1,000 jobs/s


def test_the_steady_rate_needs_completions_to_measure() -> None:
    assert math.isnan(steady_rate([]))
    assert math.isnan(steady_rate([1.0, 1.0, 1.0]))
