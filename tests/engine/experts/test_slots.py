"""The slot table the three expert tiers share: exact slots, victims and rollbacks."""

from __future__ import annotations

from engine.experts.policy import make_policy
from engine.experts.slots import SlotTable


def lru_table(n: int) -> SlotTable:
    return SlotTable(n, make_policy("lru"))


def fill(t: SlotTable, keys) -> list[int]:
    slots = []
    for k in keys:
        t.tick()
        slot, victim = t.reserve(k)
        assert victim is None
        t.loading[k] = "future"
        t.loaded(k)
        slots.append(slot)
    return slots


def test_free_slots_go_out_in_order_then_the_least_recent_is_evicted():
    t = lru_table(3)
    assert fill(t, [(0, 1), (0, 2), (0, 3)]) == [0, 1, 2]
    t.tick()
    t.hit((0, 1))  # (0, 2) is now the least recently used
    t.tick()
    assert t.reserve((1, 7)) == (1, (0, 2))
    assert t.slot_of == {(0, 1): 0, (0, 3): 2, (1, 7): 1}


def test_pinned_loading_and_protected_keys_are_never_victims():
    t = lru_table(3)
    fill(t, [(0, 1), (0, 2), (0, 3)])
    t.pin((0, 1))
    t.loading[(0, 2)] = "in flight"
    assert t.reserve((1, 1), protect={(0, 3)}) is None
    assert t.slot_of == {(0, 1): 0, (0, 2): 1, (0, 3): 2}  # nothing changed
    assert t.reserve((1, 1)) == (2, (0, 3))
    t.pin((0, 1))
    assert t.unpin((0, 1)) is False and t.unpin((0, 1)) is True and t.pins == {}
    assert not t.resident((0, 2)) and t.resident((0, 1))


def test_rollback_frees_the_slot_only_if_the_key_still_holds_it():
    t = lru_table(2)
    t.tick()
    slot, _ = t.reserve((0, 5))
    t.loading[(0, 5)] = "f"
    assert t.rollback((0, 5), slot=slot + 1) is None and t.loading == {}  # another slot: kept
    assert t.slot_of == {(0, 5): slot}
    assert t.rollback((0, 5), slot=slot) == slot
    assert t.slot_of == {} and sorted(t.free_slots) == [0, 1]
    assert t.rollback((0, 5)) is None
    t.tick()
    assert t.reserve((0, 6)) == (slot, None)  # the freed slot is handed out again


def test_placed_keys_sit_outside_the_policy():
    t = lru_table(2)
    assert t.place((3, 3)) == 0
    fill(t, [(0, 1)])
    t.tick()
    assert t.reserve((0, 2)) == (1, (0, 1))  # the policy never saw (3, 3), so never picks it
    assert t.slot_of == {(3, 3): 0, (0, 2): 1}


class CountingPolicy:
    """An LRU that counts the calls the table makes to it."""

    def __init__(self) -> None:
        self.inner, self.calls = make_policy("lru"), 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if callable(attr):
            def counted(*a, **kw):
                self.calls += 1
                return attr(*a, **kw)
            return counted
        return attr


def test_a_table_with_a_slot_for_every_key_never_consults_its_policy():
    keys = [(layer, e) for layer in range(2) for e in range(4)]
    full, short = CountingPolicy(), CountingPolicy()
    tables = {"full": SlotTable(8, full, keys=8), "short": SlotTable(6, short, keys=8)}
    for table in tables.values():
        for rnd in range(3):
            table.tick()
            for k in keys:
                if table.resident(k):
                    table.hit(k)
                else:
                    assert table.reserve(k) is not None
                    table.loaded(k)
    # every key fits: one reserve each, never a victim, and no bookkeeping for one
    assert full.calls == 0 and len(tables["full"].slot_of) == 8 and not tables["full"].free_slots
    # fewer slots than keys: the policy sees every insert and hit and picks the victims
    assert short.calls > 0 and len(tables["short"].slot_of) == 6
