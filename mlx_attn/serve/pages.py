"""The page pool's bookkeeping: which page holds what, who holds it.

Pages are numbered ``0 .. num_pages - 1``; one page number addresses the same
slot range in the K/V arrays of every layer (:mod:`mlx_attn.serve.kv_store`).
Every page is in exactly one of three states:

- **free**: holds nothing anyone may read;
- **held**: in the block table of at least one holder (a request), with a
  reference count equal to the number of times it appears in holders' tables;
- **cached**: held by nobody but indexed in the prefix cache (its tokens may
  be reused); kept in least-recently-used order and evicted (made free)
  when a fresh page is needed and no free page is left.

Prefix sharing: a *full* page is indexed under a chain hash of its tokens and
the hash of the page before it, so a page is found only when every token
before it matched too. An indexed page is immutable: a holder that must write
into an indexed page or a page someone else holds first copies it
(copy-on-write, :meth:`PagePool.make_private`). The index also keeps each
page's tokens and parent hash, so a lookup compares tokens, not only hashes.
The page after a prompt's last fully cached page may reuse the first tokens
of an indexed page hanging from the same parent that begins as the prompt's
rest does (:meth:`PagePool.lookup_partial`: the longest such run; the holder
copies the page before writing).

:meth:`PagePool.check_invariants` checks all of this; tests call it after
every operation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from mlx_attn.core.checks import check_int

__all__ = ["PagePool", "PoolExhausted", "chain_hash", "ROOT_HASH"]

ROOT_HASH = b""  # the parent hash of a sequence's first page


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full page: its tokens and its parent's key
    (BLAKE2b, 16 bytes)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


class PoolExhausted(RuntimeError):
    """No free or cached page is left (the scheduler preempts or waits)."""


@dataclass(frozen=True)
class _Indexed:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PagePool:
    """Reference-counted pages with a prefix index and LRU eviction."""

    def __init__(self, num_pages: int, page_size: int):
        num_pages = check_int("num_pages", num_pages, minimum=1)
        page_size = check_int("page_size", page_size, minimum=1)
        self.num_pages, self.page_size = num_pages, page_size
        self.refcount = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._index: dict[bytes, int] = {}
        self._indexed: dict[int, _Indexed] = {}
        self._children: dict[bytes, set[int]] = {}  # parent key -> the indexed pages after it
        self.tables: dict[Hashable, list[int]] = {}
        self.evictions = 0

    # ------------------------------------------------------------ counts
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        return len(self._cached)

    @property
    def held_pages(self) -> int:
        return self.num_pages - len(self._free) - len(self._cached)

    @property
    def available(self) -> int:
        """Pages a fresh allocation may take (free ones, then evicted cached ones)."""
        return len(self._free) + len(self._cached)

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def is_indexed(self, page: int) -> bool:
        return page in self._indexed

    def key_of(self, page: int) -> bytes:
        """The prefix-cache key of an indexed page."""
        return self._indexed[page].key

    def has_key(self, key: bytes) -> bool:
        """Whether a page is indexed under ``key``."""
        return key in self._index

    def indexed_tokens(self, page: int) -> tuple[int, ...]:
        """The tokens an indexed page holds."""
        return self._indexed[page].tokens

    def is_private(self, holder: Hashable, page: int) -> bool:
        """May ``holder`` write into ``page``: it holds it alone, unindexed."""
        return self.refcount[page] == 1 and page not in self._indexed and page in self.tables.get(holder, ())

    # ------------------------------------------------------------ prefix
    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The indexed pages holding the longest page-aligned prefix of
        ``tokens`` (read only: nothing is acquired)."""
        pages, parent, size = [], ROOT_HASH, self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            chunk = tuple(int(t) for t in tokens[start : start + size])
            key = chain_hash(parent, chunk)
            page = self._index.get(key)
            if page is None or self._indexed[page].tokens != chunk or self._indexed[page].parent != parent:
                break
            pages.append(page)
            parent = key
        return pages

    def register(self, page: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Index a full, held ``page`` holding ``tokens`` after the page keyed
        ``parent``; returns its key. A key already indexed keeps its page
        (this one stays private to its holder)."""
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) != self.page_size:
            raise ValueError(f"only full pages are indexed: {len(tokens)} tokens, page_size {self.page_size}")
        if self.refcount[page] == 0:
            raise ValueError(f"page {page} is not held: only held pages are registered")
        key = chain_hash(parent, tokens)
        if key not in self._index and page not in self._indexed:
            self._index[key] = page
            self._indexed[page] = _Indexed(key, parent, tokens)
            self._children.setdefault(parent, set()).add(page)
        return key

    def lookup_partial(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The indexed page after the page keyed ``parent`` (``ROOT_HASH``: a
        first page) whose tokens share the longest run of first tokens with
        ``tokens``, and that run's length (1 to a page): ``(page, count)``,
        or None when no such page begins with ``tokens[0]``. Its first
        ``count`` positions hold the K/V those tokens have after that prefix
        (read only: nothing is acquired)."""
        tokens = tuple(int(t) for t in tokens[: self.page_size])
        if not tokens:
            raise ValueError("a partial page lookup needs at least one token")
        best, best_count = None, 0
        for page in self._children.get(parent, ()):
            held = self._indexed[page].tokens
            count = 0
            while count < len(tokens) and held[count] == tokens[count]:
                count += 1
            if count > best_count or (count == best_count and best is not None and page < best):
                best, best_count = page, count
        return None if best is None or best_count == 0 else (best, best_count)

    # ------------------------------------------------------------ holding
    def acquire(self, holder: Hashable, pages: Sequence[int]) -> None:
        """Append existing held or cached ``pages`` to ``holder``'s table."""
        for page in pages:
            if page in self._free:
                raise ValueError(f"page {page} is free: only held or cached pages are shared")
        table = self.tables.setdefault(holder, [])
        for page in pages:
            self._cached.pop(page, None)
            self.refcount[page] += 1
            table.append(page)

    def _take_page(self) -> int:
        if self._free:
            page, _ = self._free.popitem(last=False)
            return page
        if self._cached:  # evict the least recently used cached page
            page, _ = self._cached.popitem(last=False)
            entry = self._indexed.pop(page)
            del self._index[entry.key]
            children = self._children[entry.parent]
            children.discard(page)
            if not children:
                del self._children[entry.parent]
            self.evictions += 1
            return page
        raise PoolExhausted("no free or cached page left")

    def allocate(self, holder: Hashable, count: int) -> list[int]:
        """Append ``count`` fresh private pages to ``holder``'s table (all or
        none: :class:`PoolExhausted` when fewer are available)."""
        if count > self.available:
            raise PoolExhausted(f"{count} pages wanted, {self.available} available")
        pages = [self._take_page() for _ in range(count)]
        table = self.tables.setdefault(holder, [])
        for page in pages:
            self.refcount[page] = 1
            table.append(page)
        return pages

    def make_private(self, holder: Hashable, position: int) -> tuple[int, int] | None:
        """Copy-on-write: before ``holder`` writes into entry ``position`` of its
        table, give it a private page. Returns ``(source, destination)``, the
        copy the K/V store must make, or ``None`` when the page already is
        private. :class:`PoolExhausted` when no page is available."""
        table = self.tables[holder]
        page = table[position]
        if self.is_private(holder, page):
            return None
        fresh = self._take_page()
        self.refcount[fresh] = 1
        table[position] = fresh
        self._drop(page)
        return page, fresh

    def _drop(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._indexed:
                self._cached[page] = None  # most recently used last
            else:
                self._free[page] = None

    def release(self, holder: Hashable) -> None:
        """Drop every page of ``holder``'s table, the last page first (so deep
        pages of a prefix are evicted before the pages they hang from)."""
        for page in reversed(self.tables.pop(holder, [])):
            self._drop(page)

    def truncate(self, holder: Hashable, pages: int) -> None:
        """Keep the first ``pages`` entries of ``holder``'s table."""
        table = self.tables[holder]
        while len(table) > pages:
            self._drop(table.pop())

    # ------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        counts = [0] * self.num_pages
        for table in self.tables.values():
            for page in table:
                assert 0 <= page < self.num_pages, f"table entry {page} out of range"
                counts[page] += 1
        assert counts == self.refcount, "reference counts differ from the holders' tables"
        held = {p for p in range(self.num_pages) if counts[p] > 0}
        free, cached = set(self._free), set(self._cached)
        assert not (free & held), f"pages both free and held: {sorted(free & held)}"
        assert not (cached & held), f"pages both cached and held: {sorted(cached & held)}"
        assert not (free & cached), f"pages both free and cached: {sorted(free & cached)}"
        assert len(free) + len(cached) + len(held) == self.num_pages, "free + cached + held != total"
        assert set(self._index.values()) == set(self._indexed), "index and page keys disagree"
        for page, entry in self._indexed.items():
            assert self._index[entry.key] == page, f"page {page} indexed under a key mapping elsewhere"
            assert entry.key == chain_hash(entry.parent, entry.tokens), f"page {page} key is not its chain hash"
            assert page not in free, f"indexed page {page} is free"
        assert cached <= set(self._indexed), "a cached page is not indexed"
        children = {(entry.parent, page) for page, entry in self._indexed.items()}
        assert children == {(parent, page) for parent, pages in self._children.items() for page in pages}, \
            "the parent index differs from the indexed pages"
        assert all(self.refcount[p] >= 0 for p in range(self.num_pages))
