"""Generated ids -> the text a client sees: cut before a stop string, streamed as deltas that never change.

Each update decodes every id generated so far (a token's text can depend on its neighbours: merged or
multi-byte tokens), and the delta is what is new. While streaming, two things are held back until later ids
settle them: a trailing "\ufffd" (an incomplete UTF-8 character, completed by the next bytes) and a tail
that could begin a stop string. Once a stop string shows up, the text ends before it (OpenAI's semantics),
so no text past a stop string is ever sent.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


def stop_index(text: str, stops: list[str]) -> int | None:
    """Where the first stop string in `text` begins, or None."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None


def cut_at_stop(text: str, stops: list[str]) -> str:
    index = stop_index(text, stops)
    return text if index is None else text[:index]


def _stop_prefix_tail(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that is the start of a stop string (0: none)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextStream:
    """One request's text: `update(ids, finished)` -> the new text to send (possibly "")."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None):
        self.decode = decode
        self.stops = list(stops or [])
        self.sent = ""

    def visible(self, ids: list[int], finished: bool) -> str:
        """The text that may be sent after `ids`: all of it once finished, else without what is held back."""
        text = self.decode(list(ids))
        index = stop_index(text, self.stops)
        if index is not None:
            return text[:index]
        if finished:
            return text
        text = text.rstrip(REPLACEMENT)
        return text[:len(text) - _stop_prefix_tail(text, self.stops)]

    def update(self, ids: list[int], finished: bool) -> str:
        text = self.visible(ids, finished)
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
