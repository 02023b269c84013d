"""Transformers' generation verbs on a built model: `generate` (prefill / decode programs of its own,
`moe_jax.inference.Generator`), `generate_batch` and the continuous-batching manager and engine
(`moe_jax.inference`). A mixin of `MoeForCausalLM`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..inference.batch import generate_batch, speculative_sequences
from ..inference.continuous import ContinuousBatchingConfig, ServingEngine
from ..inference.generate import Generator
from ..inference.generation_config import GenerationConfig
from ..inference.manager import ContinuousBatchingManager


class GenerationMixin:
    """generate, generate_batch, init_continuous_batching, continuous_batching_engine, generator."""

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int | None = None,
                 max_length: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
                 pad_token_id: int | None = None, seed: int = 0, params: Mapping | None = None, streamer=None,
                 speculative: str | None = None, num_speculative_tokens: int = 4, return_routing: bool = False):
        """Transformers' `generate` (greedy or sampling): input_ids [B, S] left-padded, attention_mask [B, S]
        -> numpy [B, S + n], the prompts followed by the new tokens (after a row's EOS: `pad_token_id`).

        Unset arguments come from `self.generation_config` (the checkpoint's generation_config.json, else
        config.json's special tokens, else Transformers' defaults: max_length 20, greedy). `seed` fixes
        sampling; `streamer(step, ids [B])` sees each step's new ids as they arrive. Details and timings:
        `moe_jax.inference.Generator`. speculative ("ngram" or "mtp", up to `num_speculative_tokens` drafts a
        step): the rows run through continuous batching with speculative decoding (`inference.speculative`; the
        same greedy tokens; no pipeline stages, no streamer). return_routing: -> (sequences, routing [B, L, S + n,
        K]): each sparse layer's expert ids for every token read, aligned with the sequences (-1 at padding, after
        a row's EOS, and at the last token, which no step reads): what `apply(..., routing=)` and the train step's
        routing replay take for the sequences."""
        config = self.generation_config.updated(
            max_new_tokens=max_new_tokens, max_length=max_length, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )
        if speculative is not None:
            if streamer is not None:
                raise ValueError("generate(speculative=...) takes no streamer: its steps yield several tokens per "
                                 "row; stream with the continuous-batching manager instead.")
            input_ids = np.asarray(input_ids)
            mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
            return speculative_sequences(self, input_ids, mask, config, speculative=speculative,
                                         num_speculative_tokens=num_speculative_tokens, seed=seed, params=params,
                                         return_routing=return_routing)
        result = self.generator.generate(input_ids, attention_mask, config=config, seed=seed, params=params,
                                         on_tokens=streamer, return_routing=return_routing)
        return (result.sequences, result.routing) if return_routing else result.sequences

    def generate_batch(self, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                       continuous_batching_config=None, *, progress_bar: bool = False, params=None, **kwargs):
        """Transformers' `generate_batch`: prompts (token-id lists, no padding) through continuous batching ->
        {request id: GenerationOutput} in input order (`moe_jax.inference.batch`)."""
        return generate_batch(self, inputs, generation_config, continuous_batching_config,
                              progress_bar=progress_bar, params=params, **kwargs)

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None,
                                 continuous_batching_config=None, *, params=None, decode=None,
                                 max_queued: int | None = None, queue_timeout: float | None = None,
                                 num_redundant_experts: int | None = None, **config_fields):
        """A `ContinuousBatchingManager` (Transformers' verbs: start, add_request, get_result,
        request_id_iter, cancel_request, stop) over this model; config_fields: `ContinuousBatchingConfig`'s
        (max_slots, page_size, max_model_len, num_pages, prefill_chunk, prefill_rows, rebalance_every, ...);
        max_queued and queue_timeout bound the requests waiting for a slot (`ContinuousBatchingManager`).
        num_redundant_experts: the redundant expert slots to serve with, which must be the model's (they are fixed
        when it is built: `from_pretrained(..., num_redundant_experts=R)`); None: the model's."""
        if num_redundant_experts is not None and num_redundant_experts != self.num_redundant_experts:
            raise ValueError(
                f"num_redundant_experts={num_redundant_experts}, but this model was built with "
                f"{self.num_redundant_experts} redundant expert slots: the slots are fixed when the model is built "
                f"(its parameters and programs are laid out over them); pass num_redundant_experts="
                f"{num_redundant_experts} to from_pretrained (or the model's constructor) instead.")
        config = continuous_batching_config or ContinuousBatchingConfig(**config_fields)
        return ContinuousBatchingManager(self, generation_config, config, params=params, decode=decode,
                                         max_queued=max_queued, queue_timeout=queue_timeout)

    def continuous_batching_engine(self, config, *, params=None):
        """The `ServingEngine` for `config` (kept, with its compiled programs and page pools, for the next call
        with the same config; one at a time)."""
        self._require_mesh("generate_batch")
        engine = getattr(self, "_batch_engine", None)
        if engine is None or engine.config != config or engine.has_work():
            self._batch_engine = None   # the old pools are freed before the new ones are made
            engine = self._batch_engine = ServingEngine(self, config)
        engine.update_parameters(self.params if params is None else params)
        return engine

    @property
    def generator(self) -> Generator:
        """This model's prefill / decode programs (compiled on first use, kept for the next call)."""
        if self._generator is None:
            self._require_mesh("generate")
            self._generator = Generator(self)
        return self._generator
