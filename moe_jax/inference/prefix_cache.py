"""The scheduler's side of automatic prefix caching: which of a request's prompt pages a cached prefix may supply,
registering the pages a request has filled, and the hit counters (the pages themselves: `kv_cache.PageBook`).

    prefix = PrefixCache(book, page_size=16, enabled=True, namespace="model")
    shared = book.match(group, prefix.reusable(request))     # admission: the cached pages of its prompt's prefix
    prefix.admitted(request, shared)                         # it starts prefilling after them
    prefix.stored(request, tokens)                           # its first `tokens` tokens' keys and values are stored
"""

from __future__ import annotations

from ..kv_cache import PageBook, page_digests, root_digest
from .requests import Request


class PrefixCache:
    def __init__(self, book: PageBook, *, page_size: int, enabled: bool, namespace: str | None = None):
        """namespace: what the keys and values depend on besides the tokens (the model, its adapter): part of
        every page's digest, with the request's `cache_salt`."""
        self.book, self.page_size, self.enabled, self.namespace = book, page_size, enabled, namespace
        self.weights_version = 0        # bumped by new weights: no later request matches an earlier page
        self.prompt_tokens = 0          # prompt tokens of the admitted requests
        self.cached_prompt_tokens = 0   # of those, the tokens whose keys and values came from the cache

    def root(self, request: Request) -> bytes:
        """The request's digest root: the namespace, its `cache_salt` and its LoRA adapter in the model's set (the
        keys and values of one adapter's tokens are not another's), and the weights' version (`new_weights`)."""
        adapter, version = request.settings.adapter, self.weights_version
        return root_digest(self.namespace, request.cache_salt, f"\x01adapter {adapter}" if adapter else None,
                           f"\x02weights {version}" if version else None)

    def new_weights(self) -> None:
        """The engine's weights changed: the pages cached so far hold the old weights' keys and values, so no
        later request may reuse them (they are evicted as pages are needed). A running request keeps chaining its
        own digests from its old root, so the pages it registers later are never matched either."""
        self.weights_version += 1

    def reusable(self, request: Request) -> list[bytes]:
        """The digests of the prompt's full pages before its last token (the pages a cached prefix may supply:
        the last token is always prefilled, to sample the first new one); none when caching is off, for a
        request with a repetition penalty (its prompt's ids are marked on the device as its prompt is prefilled),
        or for one that records its routing (its prompt's expert ids come from prefilling it; its pages are still
        registered for others)."""
        if not self.enabled or request.settings.repetition_penalty != 1.0 or request.settings.return_routing:
            return []
        reusable = (len(request.prompt_ids) - 1) // self.page_size
        page_digests(request.prompt_ids[:reusable * self.page_size], self.page_size, self.root(request),
                     request.page_digests)
        return request.page_digests[:reusable]

    def admitted(self, request: Request, shared: list[int]) -> None:
        """`request` took its pages, the first `shared` from the cache: it prefills from after them."""
        request.prefilled = request.output.cached_tokens = len(shared) * self.page_size
        request.registered = len(shared)
        self.prompt_tokens += len(request.prompt_ids)
        self.cached_prompt_tokens += request.prefilled

    def stored(self, request: Request, stored: int) -> None:
        """The first `stored` tokens of `request` (prompt, then generated) have their keys and values in its
        pages: register its pages that are full now, for later requests to reuse."""
        full = min(stored // self.page_size, len(request.pages))
        if not self.enabled or full <= request.registered:
            return
        tokens = request.prompt_ids + request.output.generated_tokens
        digests = page_digests(tokens[:full * self.page_size], self.page_size, self.root(request),
                               request.page_digests)
        for page in range(request.registered, full):
            self.book.register(request.group, digests[page], request.pages[page])
        request.registered = full

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens admitted (0 before any)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
