"""`IncrementalDecoder`: generated ids -> their text, decoding only the last few tokens at each new one.

    decoder = IncrementalDecoder(tokenizer.decode)
    new_text = decoder.extend(ids)          # ids: every id so far; -> the text they settled

Decoding every id at every token costs O(n) a token, O(n^2) a request: at a long context that is most of the
host's time, and the engine's thread and the server's event loop both do it per request. A token's text can
depend on its neighbours (merged pieces, a UTF-8 character split over byte tokens, a tokenizer that strips the
first token's leading space), so each step decodes a window: the ids from the previous step's start
(`prefix_offset`) on, minus the text of that window up to the last settled id (`read_offset`). Text ending in
an incomplete character ("\ufffd") waits for the next ids; `final=True` settles it as it is. The text equals
`decode(ids)` for byte-level and SentencePiece tokenizers (what vLLM's incremental detokenizer relies on too).
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""            # the settled text of ids[:read_offset]
        self.prefix_offset = 0    # where the decoding window starts
        self.read_offset = 0      # the ids whose text is settled

    def extend(self, ids: list[int], final: bool = False) -> str:
        """`ids`: every id so far (the ones seen before, then new ones) -> the text settled by the new ones."""
        if len(ids) <= self.read_offset:
            return ""
        settled = self.decode(list(ids[self.prefix_offset:self.read_offset]))
        window = self.decode(list(ids[self.prefix_offset:]))
        if len(window) <= len(settled) or (window.endswith(REPLACEMENT) and not final):
            return ""   # no whole character yet: wait for the next ids
        new = window[len(settled):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return new
