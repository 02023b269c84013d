"""The HF-shaped model users hold: plans -> mesh -> shardings -> parameters -> the core's pure step.

A family (`moe_jax.models.<family>`: data and free functions) says what its model is; this facade, one class
built on it by composition, turns a `DistributedConfig` into a mesh, resolves the plans, derives one
`NamedSharding` per parameter, creates or loads parameters directly into those shardings, builds the
`ModelCore` (one `ShardedExperts` per experts module from the plans) and exposes the step:

    model = Qwen3MoeForCausalLM(config, DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4))
    model.init_params(seed=0)                 # or AutoModelForCausalLM.from_pretrained(path, ...)
    out = model.apply(model.params, ids)      # pure: jit / grad / scan it; capacity is the caller's
    logits = model(ids)                       # eager and exact: [B, S, V], B padded internally

The step is one pure function, `moe_jax.models.core.step_math` (`model.step_math` binds the core), jitted by
whoever calls it: `apply` (eager callers; its
compilations are cached per static key (capacity, inference, return_hidden, compute_dtype) and per input
shapes, dtypes and shardings, so a step called again never recompiles), the train step, the generator's
programs and the NNX face, each once, at its boundary, where it also runs `check_step`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ..distributed.activations import UNCONSTRAINED, ActivationLayouts, LogicalAxisRules
from ..distributed.capacity import CapacitySchedule, CapacityTracker
from ..distributed.config import DistributedConfig
from ..distributed.context import ContextLayout
from ..distributed.experts import ShardedExperts
from ..distributed.mesh import DeviceLayout, build_mesh, model_devices
from ..distributed.plans import PlannedModel, resolve_parallel_plans
from ..distributed.sharding import parameter_shardings
from ..distributed.targets import is_compile_only
from ..host_memory import warn_without_huge_pages
from ..inference.generate import Generator
from ..inference.generation_config import GenerationConfig
from ..models.core import ModelCore, model_axis_rules, nested_weights, step_math
from ..models.decoder import declare_tree, head_logits
from ..models.family import Family
from ..models.layer_stack import LayerStack, resolve_scan_option
from ..models.mtp import check_mtp_layers
from ..models.outputs import DroplessOutput, ModelOutput
from ..models.pipeline_layout import check_pipeline_options
from ..models.routing_replay import check_routing
from ..models.step_checks import NO_PARAMS, check_batch, check_cache, check_params
from ..models.step_options import REMAT_POLICIES
from ..models.weight_only import WeightQuantization, kept_quantized, weight_only_family
from ..module_tree import ModuleTree
from ..ops.grouped_matmul import default_backend
from ..parameter_dtypes import parameter_dtype
from ..pretrained import from_pretrained, save_pretrained
from .adapters import AdapterMixin
from .generation import GenerationMixin
from .parameters import ParameterStorage
from .placement import ExpertPlacementMixin


class MoeForCausalLM(ParameterStorage, GenerationMixin, AdapterMixin, ExpertPlacementMixin, PlannedModel):
    """The causal LM of one family (`family`, a `moe_jax.models.family.Family`): each family's class
    (`moe_jax.causal_lm.families`) sets only that attribute."""

    family: ClassVar[Family]
    model_type: ClassVar[str]
    config_class: ClassVar[type]
    # The HF ForCausalLM class's own rules.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _fsdp_plan = {"lm_head": "keep_full_weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            cls.model_type, cls.config_class = cls.family.model_type, cls.family.config_class

    def __init__(self, config, distributed_config: DistributedConfig | dict | None = None, *,
                 devices=None, experts_backend: str | None = None, dtype=jnp.float32, abstract: bool = False,
                 scan_layers: bool | str | None = "auto", remat: str = "none",
                 pipeline_microbatches: int | None = None, pipeline_schedule: str = "gpipe",
                 pipeline_repeats: int = 1, num_redundant_experts: int = 0, kept_quantization: str | None = None,
                 weight_quantization: WeightQuantization | None = None, mtp_layers: int = 0):
        """The family's model on the mesh of `distributed_config`, its parameters unset (`init_params`).

        Args:
            config: the family's config dataclass, or its config.json dict.
            distributed_config: the layout, a `DistributedConfig` or its dict (default: one device).
            devices: the mesh's devices in rank order (default: the first that many of `jax.devices()`).
            experts_backend: the experts' grouped matmul, "ragged_dot", "tiled" or "tokamax" (default: platform's).
            dtype: the parameters' dtype, "float32" (default), "bfloat16" or "float16".
            abstract: resolve plans and shardings without devices or a mesh, for planning tools (default False).
            scan_layers: run each run of identical layers as one `jax.lax.scan`: True, False or "auto" (from 16).
            remat: what each layer keeps for the backward pass: "none" (default), "full" or "dots_saveable".
            pipeline_microbatches: with pp_size > 1 (`models.pipeline`), the M microbatches of a batch (default pp).
            pipeline_schedule: "gpipe" (the reference's split of the layers) or "circular" (needs M >= pp_size).
            pipeline_repeats: with a circular schedule, the chunks of layers per stage (default 1).
            num_redundant_experts: R extra expert slots per sparse layer over the ep ranks ((E + R) % ep_size == 0,
                ep_size > 1, pp_size == 1) for replicas of busy experts (`set_expert_placement`).
            kept_quantization: a checkpoint's `quant_method` kept on the devices (dequantize=False); inference only.
            weight_quantization: weight-only int8 / fp8 of a plain checkpoint's experts (and `modules`), quantised
                as it is read (`from_pretrained(..., quantize=...)` sets it; `models.weight_only`); inference only.
            mtp_layers: the multi-token-prediction layers held (DeepSeek-V3; `from_pretrained`: the checkpoint's)."""
        if isinstance(config, dict):
            config = self.config_class.from_dict(config)
        if isinstance(distributed_config, dict):
            distributed_config = DistributedConfig.from_dict(distributed_config)
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not a remat policy; use one of {sorted(REMAT_POLICIES)}.")
        self.config = config
        self.dtype = parameter_dtype(dtype)
        self.remat = remat
        self.kept_quantization, self.weight_quantization = kept_quantization, weight_quantization
        if kept_quantization is not None:
            if weight_quantization is not None:
                raise ValueError(f"The checkpoint is already quantised ({kept_quantization}) and kept so; quantize="
                                 f"{weight_quantization.scheme!r} applies to unquantised checkpoints only.")
            self.family, self.weight_quantization = kept_quantized(self.family, config, kept_quantization)
        elif weight_quantization is not None:
            self.family = weight_only_family(self.family, weight_quantization)
        family = self.family
        self.mtp_layers = check_mtp_layers(family, config, mtp_layers)
        self.module_tree: ModuleTree = declare_tree(family, config, self.mtp_layers)
        if getattr(config, "tie_word_embeddings", False):
            self.tied_embedding_modules = ("model.embed_tokens", "lm_head")
        self.init_parallel_plans({"tp": family.tp_plan, "ep": family.ep_plan, "fsdp": family.fsdp_plan})
        self.distributed_config = distributed_config or DistributedConfig()
        self.layout = DeviceLayout.from_config(self.distributed_config)
        self._init_expert_placement(num_redundant_experts)
        self.mesh = None if abstract else build_mesh(self.distributed_config,
                                                       model_devices(self.distributed_config, devices))
        if self.mesh is not None and self.mesh.devices.flat[0].platform == "cpu":
            warn_without_huge_pages()  # XLA:CPU's buffers on 4 KiB pages: say how to start Python (host_memory)
        self.resolved_plans = resolve_parallel_plans(self, self.distributed_config)
        self.param_layouts = parameter_shardings(self.module_tree, self.resolved_plans, self.distributed_config)
        if self.resolved_plans.ep and "ep_dispatch_experts" not in self.resolved_plans.ep.values():
            # The reference silently skips such a plan; we follow it but say so.
            warnings.warn(
                f"ep_size={self.distributed_config.ep_size} but the EP plan has no `ep_dispatch_experts` rule: expert "
                "weights are sharded by its parameter rules and gathered to run on every device, without token "
                "dispatch. Add `'<...>.mlp.experts': 'ep_dispatch_experts'` to ep_plan to dispatch tokens.",
                UserWarning, stacklevel=2,
            )
        self.pipeline_microbatches = check_pipeline_options(self.layout.pp_size, pipeline_microbatches,
                                                            pipeline_schedule, pipeline_repeats)
        if self.layout.pp_size > 1:
            self.layer_stack = LayerStack.plan_pipeline(self.module_tree, config.num_hidden_layers,
                                                        self._layer_signature, self.layout.pp_size,
                                                        pipeline_repeats, pipeline_schedule)
        else:
            self.layer_stack = LayerStack.plan(
                self.module_tree, config.num_hidden_layers,
                resolve_scan_option(scan_layers, config.num_hidden_layers), self._layer_signature,
            )
        self.experts_backend = experts_backend
        self.activation_layouts = ActivationLayouts(self.mesh, self.logical_axis_rules)
        # The model's one capacity ladder and schedule; its EP implementations are built with it, once.
        self.capacity_schedule = CapacitySchedule.for_ep(self.layout.ep_size)
        self.sharded_experts: dict[int, ShardedExperts] = {} if abstract else self._build_sharded_experts()
        self.core = ModelCore(family=family, config=config, layer_stack=self.layer_stack,
                              sharded_experts=self.sharded_experts, layouts=self.activation_layouts, remat=remat,
                              dispatches=self.layout.ep_size > 1, microbatches=self.pipeline_microbatches,
                              ep_size=self.layout.ep_size if self.layout.ep_size > 1 and any(
                                  module.implementation is not None for module in self.sharded_experts.values())
                              else 1, num_redundant_experts=self.num_redundant_experts, mtp_layers=self.mtp_layers,
                              device=None if self.mesh is None else self.mesh.devices.flat[0],
                              context=ContextLayout.of(self.mesh, self.layout, self.distributed_config.cp_strategy))
        self.params: dict | None = None
        # `apply`'s own jit, for eager callers; programs that own their jit trace `step_math` directly.
        self._apply_jit = self._new_apply_jit()
        self.generation_config = GenerationConfig.from_values(self.config.raw)  # from_pretrained: the checkpoint's
        self._generator: Generator | None = None
        # `forward`'s capacity per mode (inference / training), moved by `capacity_schedule`.
        self.forward_capacity = {inference: CapacityTracker(self.capacity_schedule) for inference in (True, False)}

    @property
    def config(self):
        """The family's config dataclass. Assigning a changed copy (`model.config = dataclasses.replace(
        model.config, router_jitter_noise=0.1)`) applies it to every layer from the next call on: the experts
        modules and the step are rebuilt and this model's compiled programs (`apply`, `generate`,
        `generate_batch`) dropped. Programs built from the model before (a train step, an `Evaluator`, a
        `ServingEngine`) keep what they traced: build them after the change. A change to what the model was
        built from (parameter shapes, the layers' kinds, tied embeddings) raises ValueError: build a new model
        with that config instead."""
        return self._config

    @config.setter
    def config(self, config) -> None:
        if getattr(self, "core", None) is None:   # while __init__ builds the model from it
            self._config = config
            return
        self._check_same_structure(config)
        self._config = config
        self.sharded_experts = {} if self.mesh is None else self._build_sharded_experts()
        self.core = dataclasses.replace(self.core, config=config, sharded_experts=self.sharded_experts)
        self._apply_jit = self._new_apply_jit()
        self._generator = None
        self._batch_engine = None

    def _check_same_structure(self, config) -> None:
        """Refuse a config the built model cannot follow: another class, other parameters, other layer kinds."""
        built = self._config
        if type(config) is not type(built):
            raise ValueError(f"model.config must stay a {type(built).__name__}, got {type(config).__name__}.")
        changed = sorted(name for name in built.field_names() if getattr(config, name) != getattr(built, name))
        layers = config.num_hidden_layers == built.num_hidden_layers and all(
            self.family.layer_signature(config, layer) == self.family.layer_signature(built, layer)
            for layer in range(built.num_hidden_layers))
        same_tie = bool(getattr(config, "tie_word_embeddings", False)) == bool(
            getattr(built, "tie_word_embeddings", False))
        if not (layers and same_tie and declare_tree(self.family, config, self.mtp_layers) == self.module_tree):
            raise ValueError(
                f"this change of model.config ({', '.join(changed)}) changes what the model was built from (its "
                "parameters' shapes or its layers' kinds), which a built model cannot follow: build a new model "
                f"with the changed config, e.g. {type(self).__name__}(config, distributed_config), then "
                "set_params / load_weights.")

    def _new_apply_jit(self):
        return jax.jit(self.step_math, static_argnames=("capacity", "inference", "return_hidden", "compute_dtype",
                                                        "return_mtp_logits", "return_routing"))

    @property
    def capacity_schedule(self) -> CapacitySchedule:
        """The dispatch capacity ladder and schedule (`moe_jax.distributed.capacity`): one per model, shared
        by `apply`'s checks, `forward`, the train loop and the EP implementations."""
        return self._capacity_schedule

    @capacity_schedule.setter
    def capacity_schedule(self, schedule: CapacitySchedule) -> None:
        # The EP implementations report required capacities on the ladder they were built with.
        built = getattr(self, "_capacity_schedule", None)
        if built is not None and schedule.ladder != built.ladder:
            raise ValueError(
                f"The capacity ladder is fixed when the model is built ({list(built.ladder)}); a new "
                f"schedule may change its patience only, not the ladder {list(schedule.ladder)}.")
        self._capacity_schedule = schedule
        for tracker in getattr(self, "forward_capacity", {}).values():
            tracker.schedule = schedule

    # ---- the family's structure, for this config ---------------------------------------------------
    def sparse_layers(self) -> list[int]:
        return self.family.sparse_layers(self.config)

    def attention_options(self, layer: int) -> dict:
        """Keyword arguments of the layer's attention besides shapes (window, q/k norm kind, ...)."""
        return self.family.attention_options(self.config, layer)

    def cache_heads(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of what one layer's cache stores per token: its keys', then its values'."""
        return self.family.cache_heads(self.config)

    @property
    def experts_forward(self) -> Callable:
        """`experts_forward(tokens, expert_ids, weights, **experts_params) -> [N, H]` of this family."""
        return self.family.experts_forward(self.config, self.experts_backend_name)

    @property
    def platform(self) -> str:
        """The platform of the devices the model is placed on ("cpu", "gpu", "tpu"): abstract target devices
        (`moe_jax.distributed.target_devices`) count as theirs. Unplaced (`abstract=True`): JAX's default."""
        return jax.default_backend() if self.mesh is None else self.mesh.devices.flat[0].platform

    @property
    def compiles_only(self) -> bool:
        """Whether the model is placed on abstract target devices (`moe_jax.distributed.target_devices`):
        programs compile for them, nothing is placed or run; parameters, adapters and expert placements are
        their shapes in their shardings."""
        return self.mesh is not None and is_compile_only(self.mesh.devices.flat[0])

    @property
    def experts_backend_name(self) -> str:
        """The grouped-matmul backend the experts run: `experts_backend`, or the default for the platform of the
        model's devices (not JAX's default backend: a model placed on abstract GPUs from a CPU machine compiles
        the GPU's choice)."""
        return default_backend(self.platform) if self.experts_backend is None else self.experts_backend

    @property
    def logical_axis_rules(self) -> LogicalAxisRules:
        """The logical axes' mesh axes on this model's layout, from its resolved TP plan."""
        return model_axis_rules(self.family, self.layout, self.resolved_plans.tp, self.plan_names(),
                                self.base_model_prefix, self._head_rows_axes())

    def _head_rows_axes(self) -> tuple[str, ...]:
        """The tp axes the LM head's weight (the tied embedding's when tied) splits its vocab rows over."""
        name = (f"{self.base_model_prefix}.embed_tokens.weight" if getattr(self.config, "tie_word_embeddings", False)
                else "lm_head.weight")
        spec = self.param_layouts[name].spec
        entry = spec[0] if len(spec) else None
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return tuple(axis for axis in axes if axis in self.layout.tp_axes)

    def nested_weights(self, params: Mapping[str, Any], adapter: Mapping[str, Any] | None = None) -> dict:
        """params (storage layout) nested by module, an adapter's factors beside the weights they adapt: what the
        family's math and `head_logits` walk (`moe_jax.models.core.nested_weights`)."""
        return nested_weights(self.core, params, adapter)

    def head_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """params: nested (`layer_stack.nest`); hidden: [B, S, H] after the final norm -> logits [B, S, V] with the
        batch over the data axes (the vocab as the compiler chooses: split over tp, a vocab-parallel loss, where
        the head's weight is). Left free, XLA:CPU ran the loss's lm_head under FSDP vocab-parallel over the
        whole batch, with a slow transposed copy of the logits' gradient (fsdp4/ep4 train step +10%). Where tp
        splits the head's rows the logits stay split as they are (`head_rows`): a decode step's few rows never
        make XLA gather the whole weight."""
        vocab = "head_rows" if self.activation_layouts.rules.mesh_axes("head_rows") else UNCONSTRAINED
        return self.activation_layouts.constrain(head_logits(self.config, params, hidden),
                                                 ("batch", "length", vocab))

    # ---- layout --------------------------------------------------------------------------------------
    def _layer_signature(self, layer: int) -> tuple:
        prefix = f"model.layers.{layer}."
        specs = tuple(str(layout.spec) for name, layout in self.param_layouts.items() if name.startswith(prefix))
        return self.family.layer_signature(self.config, layer), specs

    def _require_mesh(self, what: str) -> None:
        if self.mesh is None:
            raise ValueError(
                f"{type(self).__name__} was built with abstract=True (no mesh), so {what} has no devices to "
                "place parameters on. Build it with a DistributedConfig and devices instead."
            )

    # ---- checkpoints (moe_jax.pretrained: converters/ applied to a model) -----------------------------
    @classmethod
    def from_pretrained(cls, path, distributed_config=None, **kwargs) -> MoeForCausalLM:
        """Load an HF checkpoint directory (or hub repo id) onto the mesh of `distributed_config`; the options
        are `AutoModelForCausalLM.from_pretrained`'s."""
        return from_pretrained(path, distributed_config, model_class=cls, **kwargs)

    def save_pretrained(self, out_dir, **kwargs):
        """Write an HF checkpoint (per-expert keys, sharded safetensors, index, config.json) of `params=`
        (default `model.params`)."""
        return save_pretrained(self, out_dir, **kwargs)

    # ---- the step ------------------------------------------------------------------------------------
    def apply(self, params: Mapping[str, Any], input_ids, *, attention_mask=None, positions=None, cache=None,
              capacity: float | None = None, rng: jax.Array | None = None, inference: bool = True,
              return_hidden: bool = False, compute_dtype=None, segment_ids=None,
              adapter: Mapping[str, Any] | None = None, expert_placement=None,
              return_mtp_logits: bool = False, routing=None, return_routing: bool = False) -> ModelOutput:
        """The model as a pure function: traceable under `jax.jit`, `jax.grad`, `jax.lax.scan`; eager calls
        run one cached compilation per static key (of `step_math`, after `check_step`'s checks). Never
        reads a device value on the host.

        params: `model.params` layout (storage names: scanned runs stacked; `model.hf_params()` / `set_params`
            convert from HF names). input_ids: [B, S] ints, numpy or jax (global arrays spanning processes
            too); B must be a multiple of `data_parallel_size`. attention_mask: [B, S], 1 = real token.
        positions: [B, S] RoPE positions (default 0..S-1, after the cache's tokens with a cache). cache: a
            `moe_jax.inference.KVCache` (`init_cache`): the new tokens attend to the stored ones and are
            written to slots [length, length + S); the extended cache is `output.cache`. capacity: the dispatch capacity in force, a value
            of `model.capacity_schedule.ladder` (None: the largest, which never drops but has the largest
            buffers); overflow shows in `statistics.dropped` / `statistics.required_capacity`, and a call
            that dropped pairs must be recomputed at a larger capacity (`CapacitySchedule`). rng: key for
            training-time randomness (Mixtral's router jitter). return_hidden: return the final hidden states
            instead of logits (for a chunked loss that never holds [B, S, V]). compute_dtype: the activations'
            dtype (None: the parameters'); parameters wider than it are float32 masters of mixed precision,
            applied in it with gradients in float32 (`moe_jax.nn.precision`). segment_ids: [B, S] packed rows
            (documents numbered 1, 2, ... per row, 0 for padding): attention stays within each document and
            positions restart at each (`moe_jax.models.core.step_math`). adapter: a LoRA adapter's arrays in the
            storage layout of `model.adapter_layout` (e.g. `model.adapter`), applied beside the base weights, which
            are not copied (None: the base model alone). expert_placement: with redundant expert slots, the
            `ExpertPlacement` to run (e.g. `model.expert_placement`; None: the identity), an input: no recompile.
            return_mtp_logits: also `output.mtp_logits` [D, B, S, V] of the multi-token-prediction layers
            (`mtp_hidden_states` [D, B, S, H] with return_hidden; `models.core.step_math`). routing: [B, L, S, K]
            expert ids to replay (L sparse layers, -1: the router picks); return_routing: `output.routing` holds
            the ids each sparse layer ran, in that layout (`models.routing_replay`).
        """
        capacity, compute_dtype = self.check_step(params, input_ids.shape, capacity=capacity, cache=cache,
                                                  compute_dtype=compute_dtype, adapter=adapter, routing=routing)
        return self._apply_jit(params, input_ids, attention_mask=attention_mask, positions=positions,
                               cache=cache, capacity=capacity, rng=rng, inference=inference, segment_ids=segment_ids,
                               return_hidden=return_hidden, compute_dtype=compute_dtype, adapter=adapter,
                               expert_placement=self._placement_argument(expert_placement),
                               return_mtp_logits=return_mtp_logits, routing=routing, return_routing=return_routing)

    def check_step(self, params, shape, *, capacity: float | None = None, cache=None,
                   compute_dtype=None, microbatches: int | None = None,
                   adapter: Mapping[str, Any] | None = None, routing=None) -> tuple[float | None, jnp.dtype | None]:
        """`apply`'s checks of one call on the host, shapes only: params in storage layout, input_ids' shape
        (`shape`: [B, S], B split over the data-parallel groups), capacity on the ladder, the cache. Returns
        (capacity, compute_dtype) as the step's static arguments: capacity None without dispatch buffers
        (ep 1: one compilation whatever the caller holds). A caller that jits `step_math` itself runs this
        at its own boundary, once per call. microbatches: the pipeline microbatches the caller's step cuts a
        batch into (default the model's). adapter: an adapter's arrays, checked against `model.adapter_layout`."""
        self._require_mesh("apply")
        check_params(params, self.layer_stack, self.param_layouts.keys())
        if adapter is not None:
            self._require_adapter("an adapter argument").check(adapter)
        check_batch(shape, self.data_parallel_size, microbatches or self.pipeline_microbatches)
        capacity = self.capacity_schedule.check(capacity) if capacity is not None else None
        if self.layout.ep_size == 1:
            capacity = None
        if cache is not None:
            check_cache(cache, shape, self.layer_stack)
        if routing is not None:   # replayed routing [B, L, S, K] (`models.routing_replay`)
            check_routing(routing, shape, len(self.sparse_layers()), self.config.num_experts_per_tok,
                          self.config.num_experts, type(self).__name__)
        return capacity, None if compute_dtype is None else jnp.dtype(compute_dtype)

    def step_math(self, params: Mapping[str, Any], input_ids, *, attention_mask=None, positions=None,
                  cache=None, capacity: float | None = None, rng: jax.Array | None = None,
                  inference: bool = True, return_hidden: bool = False, compute_dtype=None,
                  segment_ids=None, adapter: Mapping[str, Any] | None = None, expert_placement=None,
                  return_mtp_logits: bool = False, final_norm: bool = True, routing=None,
                  return_routing: bool = False, context_order: bool = False) -> ModelOutput:
        """`apply` without its checks and its jit: the pure step, traced into the caller's program. The train
        step, the generator's prefill / decode and an NNX step each own the one jit around it and run
        `check_step` at their boundary; called eagerly it would run op by op (call `apply` instead)."""
        return step_math(self.core, params, input_ids, attention_mask=attention_mask, positions=positions,
                         cache=cache, capacity=capacity, rng=rng, inference=inference, return_hidden=return_hidden,
                         compute_dtype=compute_dtype, segment_ids=segment_ids, adapter=adapter,
                         expert_placement=expert_placement, return_mtp_logits=return_mtp_logits, final_norm=final_norm,
                         routing=routing, return_routing=return_routing, context_order=context_order)

    def forward(self, input_ids, attention_mask=None, *, params: Mapping | None = None, positions=None,
                inference: bool = True, rng: jax.Array | None = None, return_hidden: bool = False) -> DroplessOutput:
        """input_ids: [B, S] -> a `DroplessOutput` (fields as `ModelOutput`: logits [B, S, V], ...), exact.

        Runs `apply` at the model's current capacity for this mode and returns at once; the first field
        read checks the call's dispatch statistics (two scalars) and, if it overflowed, recomputes it at the
        capacity it required (same `rng`: the same computation), so results are always those of the
        unsharded model. B is padded to a multiple of the data-parallel size (times the pipeline microbatches) and
        cut back. The model's adapter (`model.adapter`), if any, is applied.
        """
        params = self.params if params is None else params
        if params is None:
            raise ValueError(NO_PARAMS)
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, sequence], got shape {tuple(input_ids.shape)}.")
        batch = input_ids.shape[0]
        padding = -batch % (self.data_parallel_size * self.pipeline_microbatches)
        # No mask stays None (attention then needs only the causal mask) unless filler rows need one.
        if attention_mask is not None or padding:
            attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
        if padding:
            pad = lambda array: jnp.pad(array, ((0, padding), (0, 0)))  # noqa: E731
            input_ids, attention_mask = pad(input_ids), pad(attention_mask)
            positions = None if positions is None else pad(jnp.asarray(positions))
        call = partial(self.apply, params, input_ids, attention_mask=attention_mask, positions=positions,
                       rng=rng, inference=inference, return_hidden=return_hidden, adapter=self.adapter,
                       expert_placement=self.expert_placement)
        return DroplessOutput(self, call, inference, batch)

    def __call__(self, input_ids, attention_mask=None, **kwargs) -> jax.Array:
        """input_ids: [B, S] -> logits [B, S, V]."""
        return self.forward(input_ids, attention_mask, **kwargs).logits


