"""The host side of a paged KV cache: which pages are free, referenced or cached.

Pages move between three states:

- **free**: hold nothing anyone wants;
- **referenced**: in some running sequence's page table (a reference count each);
- **cached**: unreferenced, but full of a known token prefix, so a later sequence
  with the same prefix can take them instead of recomputing them. They are evicted,
  least recently used first, when a page is needed and none is free.

A full page is keyed by a digest of every token up to and including it (a chain
of digests: page `j`'s key covers tokens `[0, (j + 1) * page_size)`), so two
sequences share page `j` only if their first `(j + 1) * page_size` tokens agree.
The chain starts from a `namespace` (for example the LoRA adapter that computed
the keys/values): sequences of different namespaces never share pages.

Admission promises pages: `promise(n)` succeeds only if `n` pages can be had
(free or evictable) beyond those already promised, so a sequence that was admitted
never runs out of pages and a full pool makes new sequences wait instead.
"""

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


def _page_keys(tokens: Sequence[int], page_size: int, pages: int, namespace: int) -> list[bytes]:
    keys, key = [], namespace.to_bytes(8, "little", signed=True)
    for j in range(pages):
        chunk = np.asarray(tokens[j * page_size : (j + 1) * page_size], np.int64).tobytes()
        key = hashlib.blake2b(key + chunk, digest_size=16).digest()
        keys.append(key)
    return keys


class PagePool:
    """Free list, reference counts, prefix cache and promises of `num_pages` pages."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = collections.deque(range(num_pages))
        self._refs = [0] * num_pages
        self._key_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._promised = 0

    @property
    def available(self) -> int:
        """Pages that can still be promised."""
        return len(self._free) + len(self._evictable) - self._promised

    @property
    def referenced(self) -> int:
        """Pages in some sequence's page table."""
        return self.num_pages - len(self._free) - len(self._evictable)

    @property
    def cached(self) -> int:
        """Unreferenced pages kept for their prefix."""
        return len(self._evictable)

    def promise(self, n: int) -> bool:
        """Promise `n` pages to a sequence if they can be had; returns whether they were."""
        if n > self.available:
            return False
        self._promised += n
        return True

    def unpromise(self, n: int) -> None:
        """Give back `n` promised pages that were not taken."""
        assert 0 <= n <= self._promised
        self._promised -= n

    def take(self) -> int:
        """One promised page: a free one, else the least recently used cached one."""
        assert self._promised > 0, "take() without a promise"
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            key = self._key_of[page]
            assert key is not None
            del self._page_of[key]
            self._key_of[page] = None
        self._promised -= 1
        self._refs[page] = 1
        return page

    def cached_pages(self, tokens: Sequence[int], max_pages: int, *, namespace: int = 0) -> int:
        """How many leading full pages of `tokens` (at most `max_pages`) are cached."""
        n = 0
        for key in _page_keys(tokens, self.page_size, max_pages, namespace):
            if key not in self._page_of:
                break
            n += 1
        return n

    def share(self, tokens: Sequence[int], max_pages: int, *, namespace: int = 0) -> list[int]:
        """Reference the cached pages holding the longest prefix of `tokens` (at most
        `max_pages` pages); the caller's promise shrinks by as many pages."""
        pages = []
        for key in _page_keys(tokens, self.page_size, max_pages, namespace):
            page = self._page_of.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                self._evictable.pop(page)
            self._refs[page] += 1
            pages.append(page)
        self.unpromise(len(pages))
        return pages

    def register(self, tokens: Sequence[int], pages: Sequence[int], *, namespace: int = 0) -> None:
        """Key each of `pages` that is full of `tokens` (page `j` holds tokens
        `[j * page_size, (j + 1) * page_size)`) for later sharing."""
        full = min(len(tokens) // self.page_size, len(pages))
        for key, page in zip(_page_keys(tokens, self.page_size, full, namespace), pages):
            if key not in self._page_of and self._key_of[page] is None:
                self._page_of[key] = page
                self._key_of[page] = key

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page: unreferenced keyed pages stay cached (most
        recently used last), the others become free."""
        for page in pages:
            assert self._refs[page] > 0
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._key_of[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def forget(self) -> None:
        """Drop every key (the keys/values they name are stale, e.g. new weights):
        cached pages become free, referenced ones are no longer shared."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._key_of = [None] * self.num_pages
