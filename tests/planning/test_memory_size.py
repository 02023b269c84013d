"""Memory sizes as people write them: GB is 10^9 bytes, GiB 2^30, and a bad one names itself and the fix."""

import pytest

from moe_jax.planning.memory_size import describe_memory_size, parse_memory_size


@pytest.mark.parametrize(("text", "size"), [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5TB", 1.5e12), ("1e9", 10**9), ("4096", 4096), (" 80 GiB ", 80 * 2**30),
])
def test_units(text, size):
    assert parse_memory_size(text) == int(size)


def test_gb_and_gib_are_told_apart_in_words():
    assert describe_memory_size("80GB") == "80GB = 80 x 10^9 bytes (74.5 GiB)"
    assert describe_memory_size("80GiB") == "80GiB = 80 x 2^30 bytes (85.9 GB)"


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "-5GB", "eighty"])
def test_a_bad_size_names_itself_and_the_fix(text):
    with pytest.raises(ValueError, match="memory size") as error:
        parse_memory_size(text)
    assert repr(text) in str(error.value)
    assert "80GiB (80 x 2^30 bytes)" in str(error.value) and "80GB (80 x 10^9 bytes)" in str(error.value)


def test_a_size_of_nothing_is_refused():
    with pytest.raises(ValueError, match="'0GiB' must be more than 0 bytes"):
        parse_memory_size("0GiB")
