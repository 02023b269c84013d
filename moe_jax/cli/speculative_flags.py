"""The speculative-decoding flags `serve` and `generate` share: --speculative, --num-speculative-tokens,
--ngram-min, --ngram-max (`ContinuousBatchingConfig`'s fields of the same names)."""

from __future__ import annotations

import argparse

from ..speculative_limits import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, check_speculative


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                        help="speculative decoding: ngram drafts the next tokens from the request's own context "
                             "(prompt lookup: what followed the latest earlier occurrence of its last tokens), mtp "
                             "from the checkpoint's multi-token-prediction layers; a decode step verifies every "
                             "request's drafts at once, and the tokens are plain decoding's (default: off)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help=f"with --speculative: drafts verified per request and step, 1 to "
                             f"{MAX_SPECULATIVE_TOKENS} (default 4)")
    parser.add_argument("--ngram-min", type=int, default=2,
                        help="with --speculative ngram: the shortest tail of the context looked up (default 2)")
    parser.add_argument("--ngram-max", type=int, default=4,
                        help="with --speculative ngram: the longest tail of the context looked up (default 4)")


def speculative_fields(args) -> dict:
    """The flags as `ContinuousBatchingConfig` fields, checked (a bad value raises ValueError naming its flag)."""
    try:
        check_speculative(args.speculative, args.num_speculative_tokens, args.ngram_min, args.ngram_max)
    except ValueError as error:
        message = str(error)
        for field in ("num_speculative_tokens", "ngram_min", "ngram_max", "speculative"):
            message = message.replace(f"{field}=", f"--{field.replace('_', '-')} ")
        raise ValueError(message) from None
    return dict(speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                ngram_min=args.ngram_min, ngram_max=args.ngram_max)
