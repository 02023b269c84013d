"""The paged cache's host book (`PageBook`: whole pages per request, per data-parallel group) and its device
pools (`init_page_pools`, `pool_bytes`)."""

from __future__ import annotations

import jax
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.inference import PageBook, init_page_pools
from moe_jax.kv_cache import pool_bytes
from tests.inference.hf_generation import MODELS


def test_a_request_takes_whole_pages():
    book = PageBook(groups=1, pages_per_group=8, page_size=4)
    assert [book.pages_for(tokens) for tokens in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_a_request_needing_exactly_the_free_pages_gets_them():
    """The boundary of admission: with one slot, a request that would wait for exactly the free pages would wait
    forever."""
    book = PageBook(groups=1, pages_per_group=3, page_size=4)
    assert book.allocate(0, 12) == [0, 1, 2]
    assert book.free_pages() == 0
    assert book.allocate(0, 1) is None


def test_too_few_free_pages_take_nothing():
    book = PageBook(groups=1, pages_per_group=3, page_size=4)
    assert book.allocate(0, 13) is None
    assert book.free_pages() == 3 and book.allocate(0, 5) == [0, 1]


def test_groups_have_their_own_pages_and_released_pages_come_back_lowest_first():
    book = PageBook(groups=2, pages_per_group=4, page_size=2)
    first, second = book.allocate(1, 4), book.allocate(1, 2)
    assert (first, second) == ([0, 1], [2]) and book.free_pages(0) == 4 and book.free_pages(1) == 1
    book.release(1, first)
    assert book.free_pages() == 7 and book.allocate(1, 6) == [0, 1, 3]
    book.release(1, second)
    with pytest.raises(RuntimeError, match="released twice"):
        book.release(1, second)


def test_pool_bytes_are_the_bytes_of_the_pools_made():
    model = AutoModelForCausalLM.from_pretrained(MODELS / "qwen3_moe", devices=jax.devices()[:1], progress=False)
    keys, values = init_page_pools(model, pages_per_group=5, page_size=3)
    made = sum(pool.nbytes for pools in (keys, values) for pool in pools.values())
    assert made == pool_bytes(model, pages_per_group=5, page_size=3) > 0
    assert {pool.shape[2:4] for pools in (keys, values) for pool in pools.values()} == {(5, 3)}
