"""Which decoder layers run as one `jax.lax.scan`, and how their parameters are stored for it.

Contiguous layers with the same structure (the same parameters, shapes and shardings, and the same
attention options) form a *run*. A scanned run stores each parameter once, stacked on a new leading
layer axis that is never sharded, under a storage name that spells the run's layers:

    HF names (plans, checkpoints, `moe-jax plan`)      storage (model.params, apply, train state)
    model.layers.1.mlp.experts.gate_up_proj [8, 32, 32]
    model.layers.2.mlp.experts.gate_up_proj [8, 32, 32] -> model.layers.1-2.mlp.experts.gate_up_proj [2, 8, 32, 32]
    model.layers.0.mlp.gate_proj.weight                 -> model.layers.0.mlp.gate_proj.weight (a run of one)

Multi-token-prediction layers after the decoder layers (`models.mtp`) are never scanned nor pipelined: each is
stored under its HF names.

Everything HF-facing keeps per-layer names: the converters stack while loading (each device still reads
only its slices) and unstack while exporting; `LayerStack.stack` / `unstack` convert in memory.

With pipeline stages (`LayerStack.plan_pipeline`) the layers are stored by `PipelineLayout` groups instead
(`model.layers.pp0-3.<rest>`, rows ordered stage by stage; rows a stage does not use are zeros, member None).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import jax.numpy as jnp

from ..module_tree import ModuleTree, NestedView
from .pipeline_layout import PipelineLayout

LAYERS_PREFIX = "model.layers"
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# "auto" scans when the model has at least this many layers. A scanned layer copies its slice of every stacked
# expert weight out of the stack (the slice feeds the grouped matmul's loop, so XLA materialises it) and writes
# its gradients back into stacked buffers: unrolled train steps are faster at every depth measured, while the
# unrolled compile grows with each layer and the scanned one does not (docs/benchmarks.md, "Train-step choices"
# and "Compile time"). From 16 layers the scan's constant compile time wins.
AUTO_SCAN_MIN_LAYERS = 16


@dataclass(frozen=True)
class LayerRun:
    """Layers [start, stop); `scanned` runs store stacked parameters under `key`."""

    start: int
    stop: int
    scanned: bool

    @property
    def key(self) -> str:
        """The layers' segment in storage names: "3" for one unrolled layer, "1-47" for a scanned run."""
        return f"{self.start}-{self.stop - 1}" if self.scanned else str(self.start)

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


def split_layer_name(name: str) -> tuple[int, str] | None:
    """"model.layers.3.self_attn.q_proj.weight" -> (3, "self_attn.q_proj.weight"); None outside layers."""
    match = _LAYER_NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def module_path(storage_or_hf_name: str) -> str:
    """The name without its layer segment ("model.layers.1-3.mlp.gate.weight" -> "model.layers.*.mlp.gate.weight");
    names outside the layers unchanged: what a parameter is, whichever layout stores it."""
    parts = storage_or_hf_name.split(".")
    if storage_or_hf_name.startswith(LAYERS_PREFIX + ".") and len(parts) > 3:
        return ".".join(parts[:2] + ["*"] + parts[3:])
    return storage_or_hf_name


def unstacked_rows(values: Mapping[str, object], saved_members: Mapping[str, Sequence[str | None]]
                   ) -> dict[str, object]:
    """`values` stored by some layer layout (`saved_members`: its storage name -> the HF name of each row, None for
    a zero row) -> HF name -> value, one layer each (traceable; rows are sliced)."""
    per_layer = {}
    for storage, value in values.items():
        names = saved_members[storage]
        if not stack_rows(storage):
            per_layer[names[0]] = value
            continue
        for row, name in enumerate(names):
            if name is not None:
                per_layer[name] = value[row]
    return per_layer


def stack_rows(storage: str) -> bool:
    """Whether storage name `storage` (of any layer layout) holds stacked layers: a layer entry named by a scanned
    run ("1-3") or a pipeline group ("pp0", "pp0-3k1")."""
    parts = storage.split(".")
    return storage.startswith(LAYERS_PREFIX + ".") and ("-" in parts[2] or parts[2].startswith("pp"))


def resolve_scan_option(scan_layers: bool | str | None, num_layers: int) -> bool:
    """`scan_layers`: True, False, or "auto"/None (scan from AUTO_SCAN_MIN_LAYERS layers on)."""
    if scan_layers in (None, "auto"):
        return num_layers >= AUTO_SCAN_MIN_LAYERS
    if isinstance(scan_layers, bool):
        return scan_layers
    raise ValueError(f"scan_layers={scan_layers!r}: use True, False or 'auto'.")


def layer_signatures(tree: ModuleTree, num_layers: int, layer_signature: Callable[[int], Hashable]) -> list:
    """Per layer: its parameters (names, shapes, dtypes) and `layer_signature(layer)`; equal for layers that can
    share one program."""
    shapes: dict[int, list] = {layer: [] for layer in range(num_layers)}
    for name, spec in tree.named_parameters():
        parts = split_layer_name(name)
        if parts is not None and parts[0] < num_layers:   # not the MTP layers after them (`models.mtp`)
            shapes[parts[0]].append((parts[1], spec.shape, spec.dtype))
    return [(tuple(shapes[layer]), layer_signature(layer)) for layer in range(num_layers)]


class LayerStack:
    """The runs of a model's layers (or its pipeline groups) and the map between HF parameter names and storage
    names. `pipeline`: the `PipelineLayout` when the layers are stored by pipeline groups (then `runs` is
    empty)."""

    def __init__(self, runs: tuple[LayerRun, ...], tree: ModuleTree, pipeline: PipelineLayout | None = None):
        self.runs = runs
        self.pipeline = pipeline
        self._run_of_layer = {layer: run for run in runs for layer in run.layers}
        # storage name -> HF names it holds (one, or one per row of a stacked entry, in row order; None: a
        # zero row of a pipeline group)
        self.members: dict[str, tuple[str | None, ...]] = {}
        self._storage_of: dict[str, str] = {}
        pipelined = self._pipeline_members(tree) if pipeline is not None else {}
        in_groups = {name for names in pipelined.values() for name in names}
        for name, _ in tree.named_parameters():
            if name in in_groups:
                continue
            storage = self.storage_name(name)
            self.members[storage] = (*self.members.get(storage, ()), name)
            self._storage_of[name] = storage
        for storage, names in pipelined.items():
            self.members[storage] = names
            self._storage_of.update((name, storage) for name in names if name is not None)
        self._storage_of = {name: self._storage_of[name] for name, _ in tree.named_parameters()}  # declared order
        self._nested = NestedView(self.members)

    def _pipeline_members(self, tree: ModuleTree) -> dict[str, tuple[str | None, ...]]:
        """Pipeline storage name -> the HF name of each row (None: zeros), for every layer parameter."""
        per_layer: dict[int, list[str]] = {}
        for name, _ in tree.named_parameters():
            if (parts := split_layer_name(name)) is not None:
                per_layer.setdefault(parts[0], []).append(parts[1])
        members = {}
        for group in self.pipeline.groups:
            for index, kind in enumerate(group.kinds):
                rows = self.pipeline.members(group, index)
                for rest in per_layer.get(kind.representative, ()):   # (a LoRA adapter's tree may skip a kind)
                    members[f"{LAYERS_PREFIX}.{group.key(index)}.{rest}"] = tuple(
                        None if layer is None else f"{LAYERS_PREFIX}.{layer}.{rest}" for layer in rows)
        return members

    @classmethod
    def plan_pipeline(cls, tree: ModuleTree, num_layers: int, layer_signature: Callable[[int], Hashable],
                      stages: int, repeats: int = 1, schedule: str = "gpipe") -> LayerStack:
        """The layers stored by the groups of `PipelineLayout.plan` (`moe_jax.models.pipeline_layout`)."""
        signatures = layer_signatures(tree, num_layers, layer_signature)
        return cls((), tree, PipelineLayout.plan(num_layers, stages, repeats, schedule, signatures))

    @classmethod
    def plan(cls, tree: ModuleTree, num_layers: int, scan: bool,
             layer_signature: Callable[[int], Hashable]) -> LayerStack:
        """Maximal runs of consecutive layers whose parameters (names, shapes, `layer_signature`) agree;
        runs of two or more layers are scanned when `scan`."""
        signatures = layer_signatures(tree, num_layers, layer_signature)
        runs, start = [], 0
        for layer in range(1, num_layers + 1):
            if layer == num_layers or signatures[layer] != signatures[start]:
                if scan and layer - start > 1:
                    runs.append(LayerRun(start, layer, scanned=True))
                else:
                    runs.extend(LayerRun(single, single + 1, scanned=False) for single in range(start, layer))
                start = layer
        return cls(tuple(runs), tree)

    def cache_entries(self) -> list[tuple[str, int, int]]:
        """(key, a layer of it, rows) of each KV-cache entry: one per layer run, or per pipeline group and kind
        (rows ordered as its parameters' rows)."""
        if self.pipeline is None:
            return [(run.key, run.start, run.stop - run.start) for run in self.runs]
        return [(group.key(index), kind.representative, len(self.pipeline.members(group, index)))
                for group in self.pipeline.groups for index, kind in enumerate(group.kinds)]

    @property
    def scanned(self) -> bool:
        return any(run.scanned for run in self.runs)

    def storage_name(self, name: str) -> str:
        if name in self._storage_of:
            return self._storage_of[name]
        parts = split_layer_name(name)
        if parts is None:
            return name
        layer, rest = parts
        if layer not in self._run_of_layer:
            return name   # an MTP layer after the decoder layers (`models.mtp`): stored under its own name
        return f"{LAYERS_PREFIX}.{self._run_of_layer[layer].key}.{rest}"

    def storage_of(self, name: str) -> str:
        """The storage name holding HF parameter `name`."""
        if name not in self._storage_of:
            raise KeyError(f"{name!r} is not a parameter of this model.")
        return self._storage_of[name]

    def first_member(self, storage_name: str) -> str:
        """The first HF parameter `storage_name` holds (a pipeline group's rows may start with zero rows)."""
        return next(name for name in self.members[storage_name] if name is not None)

    def is_stacked(self, storage_name: str) -> bool:
        """Whether `storage_name` holds several layers on a leading axis (a scanned run, a pipeline group)."""
        return stack_rows(storage_name)

    def nest(self, params: Mapping[str, object]) -> dict:
        """Storage layout -> nested dicts by module (`params["model"]["layers"]["1-3"]...`), the view a
        family's math walks; the structure was computed with the stack, so no name is parsed per trace."""
        return self._nested(params)

    def stack(self, params: Mapping[str, object]) -> dict[str, object]:
        """HF-named parameters -> storage layout (stacked runs: `jnp.stack` over the run's layers)."""
        return {storage: self.stack_entry(storage, params) for storage in self.members}

    def stack_entry(self, storage: str, params: Mapping[str, object]):
        """Storage entry `storage` from HF-named `params` (a stacked entry's zero rows as zeros)."""
        names = self.members[storage]
        if not self.is_stacked(storage):
            return params[names[0]]
        like = params[self.first_member(storage)]
        return jnp.stack([jnp.zeros_like(like) if name is None else params[name] for name in names])

    def unstack(self, params: Mapping[str, object]) -> Mapping[str, object]:
        """Storage layout -> HF-named parameters in declaration order. Lazy: a stacked run's layer is sliced
        when it is looked up, so an exporter walking the names holds one extra layer at a time."""
        return UnstackedParams(self, params)


class UnstackedParams(Mapping):
    """HF-named view of storage-layout parameters (see `LayerStack.unstack`)."""

    def __init__(self, stack: LayerStack, params: Mapping[str, object]):
        self._stack, self._params = stack, params

    def __getitem__(self, name: str):
        storage = self._stack.storage_of(name)
        if not self._stack.is_stacked(storage):
            return self._params[storage]
        return self._params[storage][self._stack.members[storage].index(name)]

    def __iter__(self):
        return iter(self._stack._storage_of)

    def __len__(self) -> int:
        return len(self._stack._storage_of)
