"""The slot bookkeeping every expert tier shares: the device cache (engine.experts.cache), the
host RAM tier (engine.experts.tiers) and a loader's shared-memory tier (services.expert_loader).

A tier owns ``num_slots`` equal slots of bytes; this table says which expert key each slot holds,
which keys are *pinned* (being read by a step or copied out: never evicted), which are *loading*
(bytes in flight: never evicted, never read), and asks the eviction policy for a victim when no
slot is free. It holds no bytes and no threads: each tier calls it under its own lock, or on its
one event loop, and keeps its own futures in ``loading`` (concurrent.futures or asyncio).

Life of a key:  reserve -> loading[key] = future -> loaded  (resident; a hit: hit)
                                                 -> rollback (a failed load: slot freed)
                reserve(admit=True) -> (None, victim): declined, never recorded here
                a resident key is evicted by a later reserve that picks it as the victim.
"""

from __future__ import annotations

from typing import Any, Iterable

Key = tuple[int, int]  # (layer, expert)


class SlotTable:
    """``keys``: how many distinct keys there can be (the store's experts), when known. A table
    with a slot for each never evicts, so it does not keep the policy informed: a hit is then a
    dict lookup, not the policy's bookkeeping (measured: the sweep policy's on_hit was a quarter
    of a decode step's time with every expert resident, demo store, int8 dense)."""

    def __init__(self, num_slots: int, policy, keys: int | None = None) -> None:
        self.num_slots = num_slots
        self.policy = policy
        self.tracks = keys is None or num_slots < keys  # False: every key has a slot, no victim ever
        self.slot_of: dict[Key, int] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.pins: dict[Key, int] = {}
        self.loading: dict[Key, Any] = {}  # key -> the tier's future for its load
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def resident(self, key: Key) -> bool:
        """Its bytes are complete in its slot."""
        return key in self.slot_of and key not in self.loading

    def hit(self, key: Key) -> None:
        if self.tracks:
            self.policy.on_hit(key, self.clock)

    def pin(self, key: Key) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: Key) -> bool:
        """Drop one pin; True when it was the last (the slot may be evicted again)."""
        n = self.pins.get(key, 0) - 1
        if n > 0:
            self.pins[key] = n
            return False
        self.pins.pop(key, None)
        return True

    def reserve(self, key: Key, protect: Iterable[Key] = (),
                admit: bool = False) -> tuple[int | None, Key | None] | None:
        """A slot for ``key``: a free one, else the policy's victim among the resident keys that
        are neither pinned, loading nor in ``protect`` (forgotten: returned as the second item).
        ``key`` is recorded in the slot; the caller marks it loading and fills the bytes.
        None: every resident key is protected.

        ``admit``: admission control. Before a victim is evicted the policy's
        ``admit(key, victim, clock)`` (policies without one always admit) decides; a declined
        ``key`` returns ``(None, victim)`` and changes nothing here (the victim stays; the policy
        has counted the use of ``key``): the caller serves it without caching it."""
        victim = None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            guarded = set(self.pins) | set(self.loading)
            guarded.update(protect)
            victim = self.policy.victim(self.slot_of.keys(), guarded, self.clock)
            if victim is None:
                return None
            decide = getattr(self.policy, "admit", None) if admit else None
            if decide is not None and not decide(key, victim, self.clock):
                return None, victim
            slot = self.slot_of.pop(victim)
            self.policy.on_remove(victim)
        self.slot_of[key] = slot
        if self.tracks:
            self.policy.on_insert(key, self.clock)
        return slot, victim

    def place(self, key: Key) -> int:
        """A free slot for a key placed outside the policy (always-resident pinned experts)."""
        slot = self.free_slots.pop()
        self.slot_of[key] = slot
        return slot

    def loaded(self, key: Key) -> None:
        """The bytes of ``key`` are complete in its slot."""
        self.loading.pop(key, None)

    def rollback(self, key: Key, slot: int | None = None) -> int | None:
        """A failed load: forget ``key`` (only if it still holds ``slot``, when given) and free its
        slot, whose bytes are not the expert's. Returns the freed slot, or None."""
        self.loading.pop(key, None)
        if key not in self.slot_of or (slot is not None and self.slot_of[key] != slot):
            return None
        freed = self.slot_of.pop(key)
        if self.tracks:
            self.policy.on_remove(key)
        self.free_slots.append(freed)
        return freed
