"""Inference: next-token rules, `generate` (prefill + decode steps, cache donated) and continuous
batching over a paged cache (`ServingEngine`, `ContinuousBatchingManager`, `generate_batch`), structured output's
grammars (`json_schema_grammar`, `json_object_grammar`, `regex_grammar`: `RequestSettings.grammar`). The cache
itself is `moe_jax.kv_cache`'s; its public names are exported here too."""

from ..kv_cache import KVCache, PageBook, bucket_length, cache_shardings, init_cache, init_page_pools
from .batch import generate_batch
from .continuous import (
    ContinuousBatchingConfig,
    GenerationOutput,
    Request,
    RequestSettings,
    RequestStatus,
    ServingEngine,
    StepEvent,
)
from .generate import GenerationResult, GenerationTimings, Generator, prompt_positions
from .generation_config import GenerationConfig
from .grammar import json_object_grammar, json_schema_grammar, regex_grammar
from .manager import ContinuousBatchingManager
from .sampling import Sampling, next_tokens, next_tokens_per_row, warp, warp_per_row

__all__ = [
    "ContinuousBatchingConfig", "ContinuousBatchingManager", "GenerationConfig", "GenerationOutput",
    "GenerationResult", "GenerationTimings", "Generator", "KVCache", "PageBook", "Request", "RequestSettings",
    "RequestStatus", "Sampling", "ServingEngine", "StepEvent", "bucket_length", "cache_shardings",
    "generate_batch", "init_cache", "init_page_pools", "json_object_grammar", "json_schema_grammar", "next_tokens",
    "next_tokens_per_row", "prompt_positions", "regex_grammar", "warp", "warp_per_row",
]
