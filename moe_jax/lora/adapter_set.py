"""`AdapterSet`: several LoRA adapters on one model at once, each token taking its own (vLLM's multi-LoRA).

    model.load_adapters({"sql": "adapters/sql/", "chat": "adapters/chat/"})
    model.adapter_names                      # ("sql", "chat"): adapter k + 1 is names[k], 0 is the base
    adapter = {**model.adapter, ADAPTER_INDEX: index}       # index [B, S] int32: each token's adapter
    model.apply(model.params, ids, adapter=adapter)          # row b runs with adapter index[b] (0: the base)

Each adapted weight's factors are stacked on a leading adapter axis (behind a scanned run's layer axis):

    model.layers.self_attn.q_proj.weight.lora_A      [L, K + 1, r, I]     r: the largest rank of the set
    model.layers.self_attn.q_proj.weight.lora_B      [L, K + 1, O, r]

Adapter 0 is all zeros (the base); a smaller rank is zero-padded and a weight an adapter does not target holds
zero factors, so each token's update is exactly its adapter's (`moe_jax.ops.lora.per_token_low_rank`); the
scalings stay per adapter. Without an `ADAPTER_INDEX` entry every token runs as the base.

The fused expert weights' factors ([L, K + 1, E, r, I], split over ep by whole experts as their weights are) reach
the experts with each token's index, which follows the token: through the dispatch over ep (the EP
implementation's `adapter_index`: all_to_all sends it with the token, all_reduce's ranks each hold the batch), to
a redundant expert slot (which takes its logical expert's factors), and through the sort by expert
(`moe_jax.ops.lora.ExpertAdapterRows`: the adapters' ranks side by side, all but the row's zeroed between the two
grouped matmuls). So ep, tp, fsdp and redundant expert slots all serve them.

Every family's experts take them (SwiGLU, gpt-oss's biased clamped ones, Llama 4's [E, in, out] ones, FP8 weights
kept quantised). Limits, each refused by name: where tokens are dispatched over ep, only with an EP implementation
that carries the index (one whose `__call__` takes no `adapter_index` is refused here). No pipeline stages. An
adapter set is served, not trained, saved or merged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ops.lora import ADAPTER_INDEX, AdapterRows
from .layout import AdapterLayout, Attachment, _with_factors
from .peft_files import read_adapter_config, read_adapter_tensors


def _check_experts_carry_adapters(model, layouts: Mapping[str, AdapterLayout]) -> None:
    """ValueError naming an adapter of the fused expert weights where an experts module cannot bring each token's
    adapter index to its experts (an EP implementation that takes no `adapter_index`)."""
    refusing = next((module for module in getattr(model, "sharded_experts", {}).values()
                     if not module.carries_adapters), None)
    for name, layout in layouts.items():
        experts = [target.parameter for target in layout.targets if target.experts is not None]
        if experts and refusing is not None:
            raise ValueError(f"adapter {name!r} adapts the fused expert weights ({experts[0]}, ...): several adapters "
                             f"at once there need an EP implementation that carries each token's adapter index "
                             f"(`adapter_index`; all_to_all and all_reduce do), not "
                             f"{type(refusing.implementation).__name__}; serve it alone (--adapter) or merge it "
                             "(--merge-adapter).")


class AdapterSet:
    """The layout of several adapters on one built model (`core.adapter` of a model holding them): the union of
    their dense targets, each stacked on an adapter axis."""

    def __init__(self, model, layouts: Mapping[str, AdapterLayout]):
        if not layouts:
            raise ValueError("an adapter set needs at least one adapter.")
        if model.layer_stack.pipeline is not None:
            raise ValueError("several adapters at once: not with pipeline stages (pp_size > 1).")
        _check_experts_carry_adapters(model, layouts)
        self.names = tuple(layouts)
        self.layouts = dict(layouts)
        self.scales = (0.0,) + tuple(layout.scaling for layout in layouts.values())
        self.rank = max(layout.config.r for layout in layouts.values())
        self.dtype = model.dtype
        self.mesh = model.mesh
        self.config = None   # no single LoraConfig
        # (module path, weight) -> the attachment under the set's storage names.
        self.attachments: dict[tuple, Attachment] = {}
        self._stacked: dict[str, bool] = {}
        self._spec: dict[str, P] = {}
        for layout in layouts.values():
            for attachment in layout.attachments:
                key = (attachment.module_path, attachment.weight)
                if key in self.attachments:
                    continue
                storage = ".".join(attachment.module_path + (attachment.weight,))
                a, b = f"{storage}.lora_A", f"{storage}.lora_B"
                self.attachments[key] = Attachment(attachment.module_path, attachment.weight, a, b)
                stacked = layout.stack.is_stacked(attachment.a)
                shardings = layout.storage_shardings()
                for name, single in ((a, attachment.a), (b, attachment.b)):
                    spec = tuple(shardings[single].spec) + (None,) * (len(layout.storage_shapes()[single])
                                                                      - len(shardings[single].spec))
                    axis = 1 if stacked else 0
                    self._spec[name] = P(*spec[:axis], None, *spec[axis:])
                    self._stacked[name] = stacked

    @property
    def storage_names(self) -> list[str]:
        return list(self._spec)

    def storage_shardings(self) -> dict[str, NamedSharding]:
        return {name: NamedSharding(self.mesh, spec) for name, spec in self._spec.items()}

    def stacked(self, adapters: Mapping[str, Mapping[str, Any]]) -> dict[str, jax.Array]:
        """Each adapter's arrays (its own layout's storage) -> the set's: zero adapter first, ranks padded to the
        largest, missing targets zero."""
        out = {}
        for (path, weight), attachment in self.attachments.items():
            for name, side in ((attachment.a, "a"), (attachment.b, "b")):
                out[name] = self._stack_factor(path, weight, side, adapters)
        shardings = self.storage_shardings()
        return {name: jax.device_put(value, shardings[name]) for name, value in out.items()}

    def _stack_factor(self, path, weight, side: str, adapters) -> jax.Array:
        pieces, shape = [], None
        for name, layout in self.layouts.items():
            single = next((att for att in layout.attachments if (att.module_path, att.weight) == (path, weight)),
                          None)
            if single is None:
                pieces.append(None)
                continue
            value = np.asarray(jax.device_get(adapters[name][single.a if side == "a" else single.b]), np.float32)
            rank_axis = -2 if side == "a" else -1
            pad = [(0, 0)] * value.ndim
            pad[rank_axis] = (0, self.rank - value.shape[rank_axis])
            value = np.pad(value, pad)
            shape = value.shape
            pieces.append(value)
        pieces = [np.zeros(shape, np.float32)] + [np.zeros(shape, np.float32) if p is None else p for p in pieces]
        stacked = self._stacked[f"{'.'.join(path + (weight,))}.lora_{side.upper()}"]
        return jnp.asarray(np.stack(pieces, axis=1 if stacked else 0), self.dtype)

    def check(self, adapter: Mapping[str, Any]) -> None:
        missing = sorted(set(self._spec) - adapter.keys())
        unexpected = sorted(adapter.keys() - set(self._spec) - {ADAPTER_INDEX})
        if missing or unexpected:
            raise ValueError(f"the adapters do not fit the model's adapter set: missing {missing[:4]}, unexpected "
                             f"{unexpected[:4]}.")

    def attach(self, nested: dict, adapter: Mapping[str, Any]) -> dict:
        """The nested base parameters with each adapted weight's `AdapterRows` (the token index broadcast over a
        scanned run's layers, which the scan slices with the factors)."""
        index = adapter.get(ADAPTER_INDEX)
        for attachment in self.attachments.values():
            a, b = adapter[attachment.a], adapter[attachment.b]
            rows = index
            if index is not None and self._stacked[attachment.a]:
                rows = jnp.broadcast_to(index, (a.shape[0],) + tuple(index.shape))
            factors = AdapterRows(a, b, rows, self.scales)
            nested = _with_factors(nested, attachment.module_path, attachment.weight, factors)
        return nested

    def __getattr__(self, name):
        if name in ("merged", "init", "place", "per_layer", "storage_shapes", "abstract", "stack", "targets"):
            raise ValueError(f"a model holding several adapters ({', '.join(self.names)}) only serves them: "
                             f"{name} needs one adapter (load_adapter).")
        raise AttributeError(name)


def load_adapter_set(model, paths: Mapping[str, Any]) -> tuple[AdapterSet, dict[str, jax.Array]]:
    """name -> PEFT adapter directory => (the set's layout, its stacked arrays)."""
    layouts = {name: AdapterLayout(model, read_adapter_config(path)) for name, path in paths.items()}
    adapter_set = AdapterSet(model, layouts)   # refuses what it cannot serve before any tensor is read
    arrays = {name: layout.place(read_adapter_tensors(paths[name], layout)) for name, layout in layouts.items()}
    return adapter_set, adapter_set.stacked(arrays)
