"""Retry backoff for a failure the agent reports as retryable.

The delay doubles with each attempt so a job that keeps failing stops
hammering whichever node is unlucky enough to claim it, and is capped so a job
that has failed many times is still retried within minutes rather than hours.
``attempt`` is the 1-based attempt that just failed (it is incremented when the
job is claimed, so the first failure is attempt 1).
"""

from __future__ import annotations

#: Delay after the first failed attempt, in seconds.
BACKOFF_BASE_SECONDS = 5
#: The delay never exceeds this, in seconds (ten minutes).
BACKOFF_CEILING_SECONDS = 600


def backoff_seconds(attempt: int) -> int:
    """``min(5 s × 2^(attempt−1), 600 s)``; attempts below 1 count as the first."""
    exponent = max(attempt, 1) - 1
    if exponent >= 8:  # 5 × 2^7 = 640 already exceeds the ceiling; avoid huge ints
        return BACKOFF_CEILING_SECONDS
    return min(BACKOFF_BASE_SECONDS * 2**exponent, BACKOFF_CEILING_SECONDS)


def should_retry(*, retry_requested: bool, attempt: int, max_attempts: int) -> bool:
    """A retryable failure goes back to the queue while attempts remain."""
    return retry_requested and attempt < max_attempts
