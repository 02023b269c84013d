"""A LoRA adapter on a built model, with Transformers' integration names: `add_adapter`, `load_adapter`,
`save_adapter`, `merge_adapter`, `delete_adapter`. A mixin of `MoeForCausalLM`.

    model.add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))   # B = 0: the base
    model.load_adapter("adapter/")            # PEFT's adapter_config.json + adapter_model.safetensors
    logits = model(ids)                       # the base parameters with the adapter applied beside them
    model.apply(model.params, ids, adapter=model.adapter)    # the pure step, the adapter an argument
    model.save_adapter("out/")                # PEFT's files (PeftModel.from_pretrained reads them)
    model.merge_adapter()                     # model.params := W + scaling * B A; the adapter is dropped

    model.load_adapters({"sql": "a/", "chat": "b/"})   # several, each token its own (`moe_jax.lora.AdapterSet`)

One adapter at a time (`adapter_name` is PEFT's "default"), or a served set of several (`load_adapters`).
`model.adapter` holds its arrays in the storage
layout of `model.adapter_layout` (`moe_jax.lora.AdapterLayout`); `model.params` are never changed by an
adapter, except by `merge_adapter`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ..lora import (AdapterLayout, AdapterSet, LoraConfig, load_adapter_set, read_adapter_config,
                    read_adapter_tensors, save_adapter_files)
from ..models.step_checks import NO_PARAMS

DEFAULT_ADAPTER = "default"


class AdapterMixin:
    """add_adapter, load_adapter, save_adapter, merge_adapter, merged_params, delete_adapter, set_adapter_params."""

    adapter: dict | None = None
    adapter_layout: AdapterLayout | AdapterSet | None = None

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The names of a loaded adapter set (`load_adapters`), in index order from 1; () otherwise."""
        return self.adapter_layout.names if isinstance(self.adapter_layout, AdapterSet) else ()

    @property
    def adapter_config(self) -> LoraConfig | None:
        return None if self.adapter_layout is None else self.adapter_layout.config

    def add_adapter(self, adapter_config: LoraConfig, adapter_name: str = DEFAULT_ADAPTER, *, seed: int = 0) -> None:
        """A new adapter, initialised as PEFT does (B = 0: the model's outputs are unchanged until it is trained)."""
        layout = self._new_layout(adapter_config, adapter_name)
        # On abstract target devices the adapter is its shapes in their shardings: a LoRA step compiles for them.
        self._use_adapter(layout, layout.abstract() if self.compiles_only else layout.init(seed))

    def load_adapter(self, path, adapter_name: str = DEFAULT_ADAPTER) -> None:
        """The PEFT adapter in directory `path` (`adapter_config.json`, `adapter_model.safetensors`), each factor
        read into its sharding. An adapter for another model is refused, listing the shapes that differ."""
        config = read_adapter_config(path)
        layout = self._new_layout(config, adapter_name)
        self._use_adapter(layout, layout.place(read_adapter_tensors(path, layout)))

    def load_adapters(self, paths: Mapping[str, Any]) -> None:
        """Several PEFT adapters at once, name -> directory: a batch's tokens each take their own (the serving
        engine's requests name theirs); the names are `adapter_names`. What the set cannot serve is refused
        naming the adapter (`moe_jax.lora.AdapterSet`: its limits); served only, not trained, saved or merged."""
        self._require_mesh("adapters")
        if self.adapter_layout is not None:
            raise ValueError("the model already has an adapter; delete_adapter() first.")
        if not paths:
            raise ValueError("load_adapters needs at least one name -> directory.")
        self._use_adapter(*load_adapter_set(self, paths))

    def save_adapter(self, directory, *, adapter: Mapping[str, Any] | None = None) -> Path:
        """Write `adapter` (default `model.adapter`) in PEFT's format into `directory`."""
        layout = self._require_adapter("save_adapter")
        adapter = self.adapter if adapter is None else adapter
        layout.check(adapter)
        return save_adapter_files(directory, layout, adapter)

    def set_adapter_params(self, adapter: Mapping[str, Any]) -> None:
        """Use `adapter` (the storage layout of `model.adapter`, e.g. a train state's; numpy or jax arrays) as the
        model's adapter, each array placed in its sharding."""
        layout = self._require_adapter("set_adapter_params")
        layout.check(adapter)
        shardings = layout.storage_shardings()
        self.adapter = {name: jax.device_put(jnp.asarray(adapter[name], layout.dtype), shardings[name])
                        for name in layout.storage_names}

    def merged_params(self, params: Mapping[str, Any] | None = None,
                      adapter: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`params` (default `model.params`) with the adapter (default `model.adapter`) merged into the weights it
        adapts, W + scaling * B A as PEFT's `merge_and_unload`; the model is not changed."""
        layout = self._require_adapter("merged_params")
        params = self.params if params is None else params
        if params is None:
            raise ValueError(NO_PARAMS)
        adapter = self.adapter if adapter is None else adapter
        layout.check(adapter)
        return layout.merged(params, adapter, self.layer_stack, self.storage_shardings())

    def merge_adapter(self) -> None:
        """Merge the adapter into `model.params` and drop it: the model then computes what it computed with the
        adapter (up to rounding), with no adapter to apply (`save_pretrained` writes the merged weights)."""
        self.params = self.merged_params()
        self.delete_adapter()

    def delete_adapter(self, adapter_name: str = DEFAULT_ADAPTER) -> None:
        """Remove the adapter; the model is the base model again."""
        self._require_adapter("delete_adapter")
        self._use_adapter(None, None)

    # ---- internals ----------------------------------------------------------------------------------------
    def _new_layout(self, config: LoraConfig, adapter_name: str) -> AdapterLayout:
        self._require_mesh("an adapter")
        if not isinstance(config, LoraConfig):
            raise TypeError(f"add_adapter takes a moe_jax.lora.LoraConfig, got {type(config).__name__}.")
        if adapter_name != DEFAULT_ADAPTER:
            raise ValueError(f"adapter_name={adapter_name!r}: a model holds one adapter, {DEFAULT_ADAPTER!r}.")
        if self.adapter_layout is not None:
            raise ValueError("the model already has an adapter; delete_adapter() (or merge_adapter()) first: one "
                             "adapter at a time.")
        if config.base_model_name_or_path is None and getattr(self, "name_or_path", None):
            config = dataclasses.replace(config, base_model_name_or_path=self.name_or_path)
        return AdapterLayout(self, config)

    def _require_adapter(self, what: str) -> AdapterLayout:
        if isinstance(self.adapter_layout, AdapterSet) and what != "an adapter argument" and what != "delete_adapter":
            raise ValueError(f"{what}: the model holds several adapters ({', '.join(self.adapter_names)}), which it "
                             "only serves; load one with load_adapter for this.")
        if self.adapter_layout is None:
            raise ValueError(f"{what}: the model has no adapter; add_adapter(LoraConfig(...)) or load_adapter(dir) "
                             "first.")
        return self.adapter_layout

    def _use_adapter(self, layout: AdapterLayout | None, adapter: dict | None) -> None:
        """Install (or remove) an adapter; the step and every program traced with the old one are rebuilt."""
        self.adapter_layout, self.adapter = layout, adapter
        self.core = dataclasses.replace(self.core, adapter=layout)
        self._apply_jit = self._new_apply_jit()
        self._generator = None
        self._batch_engine = None
