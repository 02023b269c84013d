"""The host's page book with prefix caching (`PageBook(caching=True)`, `page_digests`): digests name prefixes,
cached pages are shared, held pages are never evicted, idle ones are evicted least recently used (a sequence's
last pages first) only when no page is free."""

from __future__ import annotations

import pytest

from moe_jax.kv_cache import PageBook, page_digests, root_digest


def test_a_page_digest_names_its_tokens_and_every_page_before_it():
    first = page_digests([1, 2, 3, 4, 5, 6, 7, 8, 9], page_size=4)
    assert len(first) == 2                                            # full pages only
    assert page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4) == first
    changed_first_page = page_digests([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert changed_first_page[0] != first[0] and changed_first_page[1] != first[1]   # same second page's tokens
    assert page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, root=root_digest("other model")) != first
    assert root_digest("m", None) == root_digest("m") != root_digest("m", "salt")
    known = first[:1]
    assert page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, digests=known) is known and known == first


def test_a_released_registered_page_is_matched_and_shared_by_later_requests():
    book = PageBook(groups=1, pages_per_group=6, page_size=4, caching=True)
    digests = page_digests(range(8), 4)
    pages = book.allocate(0, 10)
    assert pages == [0, 1, 2] and book.match(0, digests) == []
    book.register(0, digests[0], pages[0])
    book.register(0, digests[1], pages[1])
    assert book.match(0, digests) == [0, 1] and book.cached_pages() == 2
    shared = book.allocate(0, 12, prefix=book.match(0, digests))      # held by two requests now
    assert shared == [0, 1, 3]
    book.release(0, pages)
    assert book.free_pages() == 6 - 3                                  # 0, 1 still held by the second
    book.release(0, shared)
    assert book.free_pages() == 6 and book.cached_pages() == 2 and book.match(0, digests) == [0, 1]


def test_idle_cached_pages_are_evicted_only_when_no_page_is_free_last_pages_first():
    book = PageBook(groups=1, pages_per_group=4, page_size=2, caching=True)
    digests = page_digests(range(6), 2)
    pages = book.allocate(0, 6)
    for digest, page in zip(digests, pages):
        book.register(0, digest, page)
    book.release(0, pages)
    assert book.allocate(0, 2) == [3]                                  # the free page first, nothing evicted
    assert book.match(0, digests) == [0, 1, 2]
    assert book.allocate(0, 2) == [2]                                  # then the sequence's last page
    assert book.match(0, digests) == [0, 1]
    assert book.allocate(0, 6) is None and book.match(0, digests) == [0, 1]   # too few: nothing taken or evicted


def test_a_page_held_by_a_request_is_never_evicted():
    book = PageBook(groups=1, pages_per_group=2, page_size=2, caching=True)
    digests = page_digests([7, 7], 2)
    holder = book.allocate(0, 2)
    book.register(0, digests[0], holder[0])
    assert book.allocate(0, 4) is None and book.allocate(0, 2) == [1]
    assert book.match(0, digests) == holder


def test_a_digest_cached_already_keeps_its_page_and_the_copy_is_freed():
    book = PageBook(groups=1, pages_per_group=4, page_size=2, caching=True)
    digest = page_digests([5, 6], 2)[0]
    first, second = book.allocate(0, 2), book.allocate(0, 2)           # two requests prefilled the same page
    book.register(0, digest, first[0])
    book.register(0, digest, second[0])
    book.release(0, second)
    assert book.match(0, [digest]) == first and book.cached_pages() == 1 and book.free_pages() == 3


def test_without_caching_nothing_is_matched_and_released_pages_are_free():
    book = PageBook(groups=1, pages_per_group=2, page_size=2)
    digest = page_digests([1, 2], 2)[0]
    pages = book.allocate(0, 2)
    book.register(0, digest, pages[0])
    book.release(0, pages)
    assert book.match(0, [digest]) == [] and book.cached_pages() == 0 and book.free_pages() == 2
    with pytest.raises(RuntimeError, match="released twice"):
        book.release(0, pages)


def test_a_page_named_twice_in_one_release_is_refused_and_nothing_is_freed():
    book = PageBook(groups=1, pages_per_group=4, page_size=2)
    pages = book.allocate(0, 4)                      # two pages, the one holder of each
    with pytest.raises(RuntimeError, match="released twice"):
        book.release(0, [pages[0], pages[0]])        # would drop the holder below zero, freeing it twice
    assert book.free_pages() == 2
    book.release(0, pages)
    assert book.free_pages() == 4
