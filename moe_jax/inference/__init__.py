"""Inference: the KV cache, next-token rules and `generate` (prefill + decode steps, cache donated)."""

from .cache import KVCache, bucket_length, cache_shardings, init_cache
from .generate import GenerationResult, GenerationTimings, Generator, prompt_positions
from .generation_config import GenerationConfig
from .sampling import Sampling, next_tokens, warp

__all__ = [
    "GenerationConfig", "GenerationResult", "GenerationTimings", "Generator", "KVCache", "Sampling",
    "bucket_length", "cache_shardings", "init_cache", "next_tokens", "prompt_positions", "warp",
]
