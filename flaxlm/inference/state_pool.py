"""The recurrent-state slots of a model with linear attention on the host's side (the device
keeps them beside the KV pages, `models/state_slots.py`): the slot each running sequence
holds, and the prefix cache's state snapshots.

Pages hold keys and values, not the recurrent state after them: a cached prompt prefix
(`pages.PagePool`) is of use to such a model only with the state after it. So when a prefill
chunk ends where a full prompt page ends, the scheduler copies the row's state into a
snapshot slot tied to that page's prefix-cache key; a later prompt with that prefix takes
the pages and a copy of the snapshot, and reads on from there (vLLM keeps Mamba states at
block boundaries alike). A snapshot lives as long as its key: freed when its page is evicted
(`PagePool(on_evict=...)`), or all of them when the scheduler is reset.

Slot 0 is the padding rows' scratch, slots `1..rows` the running sequences', the next
`snapshots` the snapshots'. When every snapshot slot is taken, a new snapshot replaces the
least recently used one whose page no sequence holds; when each is held, none is taken
(`skipped` counts them): the prefix is read again by a later prompt, nothing else changes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence


class StatePool:
    """`rows` running sequences' state slots and `snapshots` snapshot slots."""

    def __init__(self, rows: int, snapshots: int):
        self.rows = rows
        self.snapshots = snapshots
        self.free: list[int] = list(range(rows, 0, -1))  # running sequences' slots not held
        self._free_snapshots = list(range(rows + snapshots, rows, -1))
        # prefix-cache key -> its snapshot's slot, least recently used first.
        self._by_key: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.skipped = 0  # snapshots not taken: every snapshot slot held

    def take(self) -> int:
        """A slot for a sequence that starts running."""
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        """`slot`'s sequence has ended."""
        self.free.append(slot)

    def held(self) -> int:
        """Snapshots kept."""
        return len(self._by_key)

    def has(self, key: bytes) -> bool:
        """Whether a snapshot is kept after the page `key` names."""
        return key in self._by_key

    def longest(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (cached pages of a prompt, in order) end at a snapshot, most
        first: the prefix a prompt can resume after (0: none)."""
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in self._by_key:
                self._by_key.move_to_end(keys[n - 1])
                return n
        return 0

    def slot_of(self, key: bytes) -> int:
        """The slot of the snapshot after the page `key` names."""
        return self._by_key[key]

    def snapshot(self, key: bytes, held: Callable[[bytes], bool]) -> int | None:
        """The slot to copy the state after the page `key` names into; None when it has a
        snapshot already, or when every snapshot slot is taken and `held` (whether a
        sequence holds a key's page) is true of each one's key (counted in `skipped`)."""
        if key in self._by_key:
            return None
        if not self._free_snapshots:
            old = next((k for k in self._by_key if not held(k)), None)
            if old is None:
                self.skipped += 1
                return None
            self.forget(old)
        slot = self._free_snapshots.pop()
        self._by_key[key] = slot
        return slot

    def forget(self, key: bytes) -> None:
        """The page `key` names leaves the prefix cache: its snapshot's slot is free."""
        slot = self._by_key.pop(key, None)
        if slot is not None:
            self._free_snapshots.append(slot)
