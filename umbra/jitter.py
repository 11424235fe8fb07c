"""Random spreads of delays (poll intervals, retry backoffs), drawn from the process's own generator.

Delays are spread so that many waiters, retries or processes do not act in
step. The draws come from a generator of this module's own, not the
``random`` module's shared one: a program that runs the server in its own
process (a test harness; a property-based test, which checks that nothing
else draws from the shared generator while it generates examples) keeps its
own sequence of draws whatever the server's timers do meanwhile.
"""

from __future__ import annotations

import random

_generator = random.Random()


def uniform(low: float, high: float) -> float:
    """A number between ``low`` and ``high``, evenly likely."""
    return _generator.uniform(low, high)
