"""The host's book of the paged KV cache: which pages of each data-parallel group's pool are free, which are held
(and by how many requests), and which hold a cached prompt prefix that a new request may reuse.

    book = PageBook(groups=2, pages_per_group=256, page_size=16)
    digests = page_digests(prompt_ids, page_size=16)          # one per full page: its tokens and every page before
    shared = book.match(group=0, digests)                     # the cached pages of the longest cached prefix
    pages = book.allocate(0, tokens=300, prefix=shared)        # those pages (one more reference each) + new ones
    book.register(0, digests[i], pages[i])                    # page i's keys and values are stored: reusable
    book.release(0, pages)

Automatic prefix caching, as vLLM's: a full page is named by a digest of its tokens and the digest of the page
before it (the first page's, of a root naming the model, adapter and any salt), so equal digests mean equal
prefixes and equal keys and values. A page is reference-counted while requests hold it; released with a digest
it stays cached (least recently used first out) and is evicted only when a request needs a page and no page is
free. Only full pages are shared, and a request writes only after the prefix it reused, so a shared page is never
written. Nothing here touches the device.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

DIGEST_BYTES = 16


def root_digest(*names: str | None) -> bytes:
    """The digest a sequence's first page chains from: the model, adapter and salt the keys and values depend
    on (None parts are left out)."""
    text = "\x00".join(name for name in names if name is not None)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def page_digests(tokens, page_size: int, root: bytes = b"", digests: list[bytes] | None = None) -> list[bytes]:
    """The digest of each full page of `tokens`, each chaining the one before: `digests` (the first pages' digests,
    already known) extended in place to every full page, and returned."""
    digests = [] if digests is None else digests
    tokens = np.asarray(tokens, np.int32)
    for page in range(len(digests), len(tokens) // page_size):
        parent = digests[-1] if digests else root
        chunk = tokens[page * page_size:(page + 1) * page_size].tobytes()
        digests.append(hashlib.blake2b(parent + chunk, digest_size=DIGEST_BYTES).digest())
    return digests


class PageBook:
    """Free, held and cached pages per group. Pages are handed out whole and returned whole; with `caching`, a
    released page whose prefix was registered stays cached until its page is needed."""

    def __init__(self, groups: int, pages_per_group: int, page_size: int, *, caching: bool = False):
        self.groups, self.pages_per_group, self.page_size = groups, pages_per_group, page_size
        self.caching = caching
        # Lowest pages first: a freshly started server fills its pools from the front.
        self._free = [list(range(pages_per_group - 1, -1, -1)) for _ in range(groups)]
        self._holders: list[dict[int, int]] = [{} for _ in range(groups)]          # page -> requests holding it
        self._page_of: list[dict[bytes, int]] = [{} for _ in range(groups)]        # digest -> cached page
        self._digest_of: list[dict[int, bytes]] = [{} for _ in range(groups)]      # cached page -> digest
        # Cached pages nobody holds, least recently released first: what is evicted when no page is free.
        self._idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(groups)]
        self.evictions = 0   # cached pages evicted for a new page, since the start

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def free_pages(self, group: int | None = None) -> int:
        """Pages a request can take: free ones and cached ones nobody holds (evicted when taken)."""
        groups = range(self.groups) if group is None else [group]
        return sum(len(self._free[g]) + len(self._idle[g]) for g in groups)

    def cached_pages(self, group: int | None = None) -> int:
        """Pages holding a registered prefix (held or not)."""
        groups = range(self.groups) if group is None else [group]
        return sum(len(self._digest_of[g]) for g in groups)

    @property
    def total_pages(self) -> int:
        return self.groups * self.pages_per_group

    def match(self, group: int, digests: list[bytes]) -> list[int]:
        """The cached pages of group `group` holding the longest prefix of `digests` (empty without caching)."""
        pages = []
        if self.caching:
            for digest in digests:
                page = self._page_of[group].get(digest)
                if page is None:
                    break
                pages.append(page)
        return pages

    def allocate(self, group: int, tokens: int, prefix: list[int] = ()) -> list[int] | None:
        """Pages of group `group` for `tokens` tokens: the `prefix` pages (`match`'s, one more holder each) and new
        ones after them (free pages first, then the least recently used cached ones, evicted), or None (nothing
        taken) when too few are free."""
        count = self.pages_for(tokens) - len(prefix)
        idle = self._idle[group]
        available = len(self._free[group]) + len(idle) - sum(page in idle for page in prefix)
        if count < 0 or count > available:
            return None
        for page in prefix:
            idle.pop(page, None)
            self._hold(group, page)
        fresh = [self._take(group) for _ in range(count)]
        return list(prefix) + fresh

    def _take(self, group: int) -> int:
        page = self._free[group].pop() if self._free[group] else self._evict(group)
        self._hold(group, page)
        return page

    def _evict(self, group: int) -> int:
        page, _ = self._idle[group].popitem(last=False)
        self.evictions += 1
        del self._page_of[group][self._digest_of[group].pop(page)]
        return page

    def _hold(self, group: int, page: int) -> None:
        holders = self._holders[group]
        holders[page] = holders.get(page, 0) + 1

    def register(self, group: int, digest: bytes, page: int) -> None:
        """Page `page` (held) stores the full page named `digest`: later requests may reuse it. A digest cached
        already keeps its page (two requests that prefilled the same prefix at once: the later copy is not
        cached, and is freed with its request)."""
        if not self.caching or digest in self._page_of[group] or page in self._digest_of[group]:
            return
        if page not in self._holders[group]:
            raise RuntimeError(f"page {page} of group {group} is registered but nobody holds it.")
        self._page_of[group][digest] = page
        self._digest_of[group][page] = digest

    def release(self, group: int, pages: list[int]) -> None:
        """A request lets go of its pages: each is free, or cached and idle when it holds a registered prefix and
        no other request holds it. The last pages go first into the idle order (evicted first: a deeper page is of
        no use without the pages before it)."""
        holders = self._holders[group]
        if any(page not in holders for page in pages) or len(set(pages)) != len(pages):
            raise RuntimeError(f"pages {pages} of group {group} released twice.")
        freed = []
        for page in reversed(pages):
            holders[page] -= 1
            if holders[page]:
                continue
            del holders[page]
            if page in self._digest_of[group]:
                self._idle[group][page] = None
            else:
                freed.append(page)
        self._free[group].extend(sorted(freed, reverse=True))
