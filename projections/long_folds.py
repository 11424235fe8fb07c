"""A fold of a whole log keeps what it has built out of the garbage collector's full passes.

A rebuild holds every row it folded until it returns: 100,000 jobs are some
million objects the cyclic garbage collector tracks (the rows, their ids,
their requirements and placements). Each time those grow by a quarter, the
collector's full pass walks all of them again, and it runs in one go, holding
the event loop. Measured over 300,000 events (100,000 jobs): 18 full passes
took 5.5-6.2 s of a 15 s rebuild, up to 0.7 s each, and 20 held a ``verify``
for up to 1.5 s at a time, in a server process whose lock-holding
transactions PostgreSQL ends after 2 s idle. With what was built set aside:
no full pass; the rebuild took 8.4 s, ``verify`` 15.9 s instead of 25.2, and
neither held the loop longer than 70 ms (docs/PERFORMANCE.md).

What a fold has built is a tree of values decoded from JSON: it holds no
reference cycle, so nothing in it is the collector's to find, and reference
counting frees it all once the fold's caller drops it. :func:`long_fold` lets
a fold set what it built so far aside (``gc.freeze``): the collector then walks
only what came after. When the last long fold of the process ends, everything
set aside goes back to the collector (``gc.unfreeze``). Meanwhile the
collector also leaves alone whatever else of the process was set aside with it;
garbage among that which only the collector could free (a cycle) waits until
then: seconds, not a leak.

A server sets aside what its startup made (``api.server``), for good. Given
back with the rest, it would be walked by every full pass again; so where the
process had set something aside before its first long fold began, the last to
end collects once (the garbage of the fold's seconds, cycles included) and
sets aside again what is left: what startup made, and what is alive then.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Callable, Iterator


#: Events folded, or rows made into values, between two turns a long fold gives the event loop. A page
#: of 1,000 holds it about 30 ms here (5,000: about 175 ms), and costs no measurable throughput: a
#: rebuild of 300,000 events took 8.6 s in pages of 1,000 and 8.8 s in pages of 5,000.
FOLD_PAGE = 1000

#: Long folds under way in this process (event loops in several threads may each run one): the last to end
#: gives back what they set aside.
_under_way = 0
#: Whether the process had set objects aside before the first of the folds under way began.
_set_aside_before = False
_counting = threading.Lock()


@contextlib.contextmanager
def long_fold() -> Iterator[Callable[[], None]]:
    """For the length of a fold of many events; gives a function to call after each page or chunk, which sets
    aside what the process has built so far. Folds may nest and interleave: the last to end gives all back
    (and, in a process that had set its startup aside, sets aside again what is left once it has collected)."""
    global _under_way, _set_aside_before
    with _counting:
        if _under_way == 0:
            _set_aside_before = gc.get_freeze_count() > 0
        _under_way += 1
    try:
        yield gc.freeze
    finally:
        with _counting:
            _under_way -= 1
            if _under_way == 0:
                gc.unfreeze()
                if _set_aside_before:
                    gc.collect()
                    gc.freeze()
