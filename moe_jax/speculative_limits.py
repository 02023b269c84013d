"""Speculative decoding's settings and their checks, apart from the engine (no JAX: the command line's flags read
them before anything heavy is imported; `inference.speculative` drafts and verifies)."""

from __future__ import annotations

# The drafts a verification step may check per row (its rows are this plus one tokens long).
MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_METHODS = ("ngram", "mtp")


def check_speculative(method: str | None, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
    """The errors a speculative configuration raises, naming the value and the fix."""
    if method is None:
        return
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative={method!r}: expected one of {SPECULATIVE_METHODS} or None.")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens={num_tokens!r} must be an int in [1, {MAX_SPECULATIVE_TOKENS}] "
                         "(the drafts a verification step checks per request).")
    if method == "ngram" and not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"ngram_min={ngram_min} and ngram_max={ngram_max}: prompt lookup needs 1 <= ngram_min <= "
                         "ngram_max (the lengths of the context's tail it looks up).")
