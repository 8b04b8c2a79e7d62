"""The KV cache's pages on the host's side: which of the device pool's pages are free, who
holds each (reference counts: sequences with a common prefix share its pages), and the
prefix cache (full prompt pages found again by their tokens, kept after their sequences
end until the space is needed).

Page 0 is never handed out: padding tokens write there and no page table reads it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np

NULL_PAGE = 0


def pages_for(slots: int, page_size: int) -> int:
    """How many pages hold `slots` slots."""
    return -(-slots // page_size)


def prefix_keys(tokens: Sequence[int], page_size: int, count: int) -> list[bytes]:
    """The prefix cache's keys of the first `count` full pages of `tokens`: each names its
    page's tokens and every token before them (a chain of hashes)."""
    keys, key = [], b""
    ids = np.asarray(tokens, np.int64)
    for i in range(count):
        key = hashlib.sha1(key + ids[i * page_size : (i + 1) * page_size].tobytes()).digest()
        keys.append(key)
    return keys


class PagePool:
    """Allocation, sharing and release of `num_pages` pages (page 0 reserved), and the
    prefix cache over them.

    A page is free when no sequence holds it; a free page that holds a registered prompt
    prefix stays findable (`lookup`) until `allocate` needs it (least recently released
    first). `on_evict(key)` is told when the page `key` names leaves the prefix cache (a
    model with recurrent state frees the state snapshot it kept after that page)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        on_evict: Callable[[bytes], None] = lambda key: None,
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}.")
        self.num_pages = num_pages
        self.page_size = page_size
        self.on_evict = on_evict
        self.refs = np.zeros(num_pages, np.int64)
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        # Free pages that still hold a cached prefix, least recently released first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.shared = 0  # pages handed to a sequence that another sequence wrote

    @property
    def capacity(self) -> int:
        """Pages a sequence may ever hold (all but page 0)."""
        return self.num_pages - 1

    def available(self) -> int:
        """Pages `allocate` can hand out now (free, or holding a prefix no one uses)."""
        return len(self._free) + len(self._evictable)

    def in_use(self) -> int:
        return int((self.refs > 0).sum())

    def allocate(self, n: int) -> list[int]:
        """`n` pages, each held once; a ValueError if fewer are available."""
        if n > self.available():
            raise ValueError(f"{n} pages asked for, {self.available()} available.")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                key = self._key_of.pop(page)
                del self._by_key[key]
                self.on_evict(key)
            self.refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each of `pages` (a cached prefix, or a fork's prompt)."""
        for page in pages:
            if self.refs[page] == 0:
                self._evictable.pop(page)
            self.refs[page] += 1
            self.shared += 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder fewer of each of `pages`; a page no one holds is free again."""
        for page in pages:
            if self.refs[page] <= 0:
                raise ValueError(f"Page {page} released more often than it was held.")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys` (not yet held: `share` them)."""
        pages = []
        for key in keys:
            page = self._by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, key: bytes, page: int) -> None:
        """Records that `page` holds the full prompt page `key` names (the first page that
        does stays the one found)."""
        if key not in self._by_key and page not in self._key_of:
            self._by_key[key] = page
            self._key_of[page] = key

    def held(self, key: bytes) -> bool:
        """Whether a sequence holds the cached page `key` names."""
        page = self._by_key.get(key)
        return page is not None and self.refs[page] > 0

    def cached(self) -> int:
        """Pages that hold a registered prefix."""
        return len(self._key_of)
