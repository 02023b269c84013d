"""`moe_jax.serving.text`: streamed deltas add up to the final text, never end in half a character, and never
show text at or past a stop string (no server, no model: a byte-level decode of ids)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.serving.text import TextStream, cut_at_stop


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream(text_bytes: bytes, stops=None, finish_at: int | None = None) -> list[str]:
    """The deltas of a request generating `text_bytes` one byte per token (finished after `finish_at`)."""
    ids, deltas = list(text_bytes), []
    text = TextStream(decode, stops)
    end = len(ids) if finish_at is None else finish_at
    for count in range(1, end + 1):
        deltas.append(text.update(ids[:count], finished=count == end))
    return deltas


def test_multi_byte_characters_are_sent_whole():
    data = "né € 🙂!".encode()
    deltas = stream(data)
    assert "".join(deltas) == "né € 🙂!"
    assert all("\ufffd" not in delta for delta in deltas)
    assert deltas[deltas.index("🙂") - 1] == ""   # the emoji's first three bytes sent nothing


def test_bytes_that_never_make_a_character_are_sent_at_the_end_or_when_text_follows():
    assert "".join(stream(b"a\xffb")) == decode(list(b"a\xffb"))
    assert stream(b"a\xe2\x82")[-1] == "\ufffd"   # finished on an incomplete character: sent as it decodes


def test_a_stop_string_is_never_sent_even_across_tokens():
    data = b"hello STOP world"
    deltas = stream(data, stops=["STOP", "zzz"])
    assert "".join(deltas) == "hello "
    assert all("S" not in delta for delta in deltas)
    # A possible start that turns out not to be one is sent when it is settled.
    assert "".join(stream(b"a STEP b", stops=["STOP"])) == "a STEP b"
    assert cut_at_stop("one two three", ["three", "two"]) == "one "


def test_each_update_decodes_a_few_ids_whatever_the_length_so_far():
    """A long output costs the same per token at its end as at its start (no decode of every id each time)."""
    lengths = []

    def counting_decode(ids):
        lengths.append(len(ids))
        return decode(ids)

    data = ("long text é " * 400).encode()
    text = TextStream(counting_decode, ["never"])
    deltas = [text.update(list(data[:count]), finished=count == len(data)) for count in range(1, len(data) + 1)]
    assert "".join(deltas) == data.decode()
    assert max(lengths) <= 4   # the window: the last settled ids and the new one (a 2-byte character's bytes)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=60), st.integers(1, 4))
def test_streamed_text_equals_decoding_every_id_at_once(data, tokens_per_update):
    """Random bytes (split characters, invalid bytes) delivered a few at a time add up to the whole decode."""
    text, deltas = TextStream(decode), []
    counts = list(range(tokens_per_update, len(data), tokens_per_update)) + [len(data)]
    for count in counts:
        deltas.append(text.update(data[:count], finished=count == len(data)))
    assert "".join(deltas) == decode(data)
