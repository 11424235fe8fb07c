"""``projections.long_folds``: what a long fold built is kept out of the collector's passes, and given back."""

from __future__ import annotations

import gc
import weakref

import pytest

from umbra.projections.long_folds import long_fold

pytestmark = pytest.mark.anyio


class Built:  # an object the collector tracks, as a fold's rows are
    def __init__(self, n: int) -> None:
        self.n = n


@pytest.fixture
def nothing_set_aside():
    """A process that set nothing aside before (a server sets its startup aside: ``api.server``)."""
    gc.unfreeze()


def test_what_is_set_aside_is_out_of_the_collectors_generations_until_the_fold_ends(nothing_set_aside):
    with long_fold() as set_aside:
        built = [Built(n) for n in range(1000)]
        set_aside()
        assert gc.get_freeze_count() >= len(built)
        assert not any(obj is built for obj in gc.get_objects())  # the collector's generations no longer hold it
    assert gc.get_freeze_count() == 0
    assert any(obj is built for obj in gc.get_objects())


def test_folds_that_nest_or_interleave_give_back_only_when_the_last_ends(nothing_set_aside):
    outer = long_fold()
    set_aside = outer.__enter__()
    with long_fold() as inner_set_aside:
        inner_set_aside()
    set_aside()
    assert gc.get_freeze_count() > 0  # the inner fold ended; the outer one still runs
    outer.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0


def test_a_fold_that_fails_gives_back_all_the_same(nothing_set_aside):
    with pytest.raises(RuntimeError):
        with long_fold() as set_aside:
            set_aside()
            raise RuntimeError("the read failed")
    assert gc.get_freeze_count() == 0


def test_in_a_process_that_set_its_startup_aside_the_fold_collects_then_sets_aside_again(nothing_set_aside):
    """A server's startup stays set aside after a fold; a cycle that became garbage while the fold had it set
    aside is collected when the fold ends, not kept for good."""
    started = [Built(n) for n in range(100)]  # what startup made
    gc.freeze()
    try:
        with long_fold() as set_aside:
            cycle = Built(0)
            cycle.me = cycle
            gone = weakref.ref(cycle)
            set_aside()
            del cycle  # garbage now, which only the collector can free, and set aside
            gc.collect()
            assert gone() is not None
        assert gone() is None
        assert gc.get_freeze_count() >= len(started)
        assert not any(obj is started for obj in gc.get_objects())
    finally:
        gc.unfreeze()
