"""A turn's usage bounded by the pass-through's count (hermes_service/openai_api/usage.py):
Hermes's counters live in the sandbox's state.db and may lie."""
import sqlite3

from hermes_service.openai_api.usage import PassThroughCount, capped


def t(inp, out):
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}


def test_counters_that_lie_are_capped_at_what_the_pass_through_saw():
    assert capped(t(10, 5), 100) == t(10, 5)                  # honest: unchanged
    assert capped(t(10**30, 5), 100) == t(100, 0)             # inflated
    assert capped(t(60, 10**12), 100) == t(60, 40)
    assert capped(t(-5, -7), 30) == t(30, 0)                  # negative or zeroed: the count
    assert capped(t(0, 0), 0) == t(0, 0)


class Store:
    def __init__(self):
        self.value, self.broken = 1000, False

    def spent(self, user, day=None):
        if self.broken:
            raise sqlite3.OperationalError("database disk image is malformed")
        return self.value


def test_the_count_is_taken_around_the_turn():
    store = Store()
    counted = PassThroughCount(store, "alice")
    store.value += 42
    assert counted.since() == 42
    assert counted.bound(t(30, 12)) == t(30, 12)
    assert counted.bound(t(10**9, 12)) == t(42, 0)


def test_an_unreadable_count_leaves_hermes_counters(caplog):
    store = Store()
    store.broken = True
    counted = PassThroughCount(store, "alice")
    assert counted.bound(t(3, 4)) == t(3, 4)
    assert "unreadable" in caplog.text
