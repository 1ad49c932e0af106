"""The resizable limit behind CLI slots, v1 admission and event streams (docs/configuring.md §Reload)."""
import threading

import pytest

from hermes_service.limits import Limiter


def test_behaves_like_a_bounded_semaphore():
    lim = Limiter(2)
    assert lim.acquire(blocking=False) and lim.acquire(timeout=0.01)
    assert not lim.acquire(blocking=False) and not lim.acquire(timeout=0.01)
    lim.release()
    assert lim.held == 1 and lim.acquire(blocking=False)
    lim.release()
    lim.release()
    with pytest.raises(ValueError):
        lim.release()


def test_shrinking_keeps_holders_and_growing_wakes_waiters():
    lim = Limiter(2)
    assert lim.acquire() and lim.acquire()
    lim.resize(1)                          # both holders keep their place
    lim.release()
    assert not lim.acquire(blocking=False)  # 1 held = the new size
    got = threading.Event()
    t = threading.Thread(target=lambda: lim.acquire() and got.set())
    t.start()
    assert not got.wait(0.05)
    lim.resize(3)                          # a waiter gets in at once
    assert got.wait(5)
    t.join(5)
    assert lim.held == 2 and lim.size == 3


def test_one_holders_share_is_a_quarter_at_least_two_never_more_than_all():
    from hermes_service.limits import share
    assert [share(n) for n in (1, 2, 3, 8, 12, 100, 1000)] == [1, 2, 2, 2, 3, 25, 250]
    assert share(12, at_least=1) == 3 and share(3, at_least=1) == 1 and share(0) == 0
