"""Generated ids -> the text a client sees: cut before a stop string, streamed as deltas that never change.

Each update decodes the last few ids (`moe_jax.inference.detokenize`: a token's text can depend on its
neighbours, merged or multi-byte tokens), and the delta is what is new. While streaming, two things are held
back until later ids settle them: a trailing "\ufffd" (an incomplete UTF-8 character, completed by the next
bytes) and a tail that could begin a stop string. Once a stop string shows up, the text ends before it (OpenAI's semantics),
so no text past a stop string is ever sent.
"""

from __future__ import annotations

from collections.abc import Callable

from ..inference.detokenize import IncrementalDecoder


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
    """One request's text: `update(ids, finished)` -> the new text to send (possibly ""). Each update decodes a
    few tokens (`IncrementalDecoder`) and scans only the text not sent yet for stop strings, so a token costs
    the same at the end of a long output as at its start."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None):
        self.decoder = IncrementalDecoder(decode)
        self.stops = list(stops or [])
        self.sent = 0          # characters of the decoder's text sent
        self.stopped = False   # a stop string was found: nothing more is sent

    def update(self, ids: list[int], finished: bool) -> str:
        if self.stopped:
            return ""
        self.decoder.extend(ids, final=finished)
        text = self.decoder.text
        # Nothing sent ends with the start of a stop string (held back below), so a stop string starts in the
        # unsent text.
        unsent = text[self.sent:]
        index = stop_index(unsent, self.stops)
        if index is not None:
            self.stopped = True
            end = index
        elif finished:
            end = len(unsent)
        else:
            end = len(unsent) - _stop_prefix_tail(unsent, self.stops)
        self.sent += end
        return unsent[:end]
