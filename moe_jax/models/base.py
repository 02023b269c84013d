"""What every MoE causal LM shares: plans -> mesh -> shardings -> parameters -> jitted forward.

A model family (one file in this package) supplies its config class, its declared module tree with HF
names, its plans (as the HF config/model classes declare them) and `forward_math` (model math only). This
base turns a `DistributedConfig` into a mesh, resolves the plans, derives one `NamedSharding` per
parameter, creates or loads parameters directly into those shardings, builds one `ShardedExperts` per
experts module from the plans, and runs the forward under `jax.jit` with dropless dispatch.

    model = Qwen3MoeForCausalLM(config, DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4))
    model.init_params(seed=0)               # or AutoModelForCausalLM.from_pretrained(path, ...)
    logits = model(input_ids)               # [B, S, V], B padded internally to the data-parallel size
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.config import DistributedConfig
from ..distributed.dropless import DroplessRunner
from ..distributed.expert_parallel import DispatchStatistics
from ..distributed.experts import ShardedExperts, experts_mode
from ..distributed.mesh import DeviceLayout, build_mesh
from ..distributed.plans import DEFAULT_BASE_MODEL_FSDP_PLAN, PlannedModel, resolve_parallel_plans
from ..distributed.sharding import parameter_shardings
from ..distributed.tree import ModuleTree
from ..ops.routing import load_balancing_loss

MODEL_CLASSES: dict[str, type[MoeForCausalLM]] = {}


def register_model(model_class: type[MoeForCausalLM]) -> type[MoeForCausalLM]:
    """Make a model family loadable by `AutoModelForCausalLM` under its HF `model_type`."""
    MODEL_CLASSES[model_class.model_type] = model_class
    return model_class


@dataclass
class ForwardOutput:
    """logits: [B, S, V]; router_logits: per sparse layer [B*S, E]; aux_loss: the router load-balancing loss
    (HF's `load_balancing_loss_func`, unscaled: multiply by `router_aux_loss_coef` as HF does with labels);
    statistics: dispatch counts summed over layers and devices."""

    logits: jax.Array
    router_logits: list[jax.Array]
    aux_loss: jax.Array
    statistics: DispatchStatistics


jax.tree_util.register_dataclass(
    ForwardOutput, data_fields=["logits", "router_logits", "aux_loss", "statistics"], meta_fields=[]
)


def unflatten(flat: dict[str, Any]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}} (layer numbers stay string keys)."""
    return traverse_util.unflatten_dict(flat, sep=".")


def flatten(nested: dict) -> dict[str, Any]:
    return traverse_util.flatten_dict(nested, sep=".")


_INITIALIZERS: dict[str, Callable] = {
    "normal": lambda key, shape, dtype, std: std * jax.random.normal(key, shape, dtype),
    "zeros": lambda key, shape, dtype, std: jnp.zeros(shape, dtype),
    "ones": lambda key, shape, dtype, std: jnp.ones(shape, dtype),
}


class MoeForCausalLM(PlannedModel):
    """Base of the MoE causal LMs. Subclasses set the class attributes below and implement
    `declare_tree`, `sparse_layers` and `forward_math`."""

    model_type: ClassVar[str]
    config_class: ClassVar[type]
    # The HF config class's plans (`base_model_tp_plan`, ...), relative to the base model.
    base_model_tp_plan: ClassVar[dict[str, str] | None] = None
    base_model_ep_plan: ClassVar[dict[str, str] | None] = None
    base_model_fsdp_plan: ClassVar[dict[str, str]] = DEFAULT_BASE_MODEL_FSDP_PLAN
    # The HF ForCausalLM class's own rules.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _fsdp_plan = {"lm_head": "keep_full_weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config, distributed_config: DistributedConfig | dict | None = None, *,
                 devices=None, experts_backend: str | None = None, dtype=jnp.float32, abstract: bool = False):
        """`abstract=True` resolves plans and shardings without devices (no mesh): for planning tools."""
        if isinstance(config, dict):
            config = self.config_class.from_dict(config)
        if isinstance(distributed_config, dict):
            distributed_config = DistributedConfig.from_dict(distributed_config)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.module_tree: ModuleTree = self.declare_tree()
        if getattr(config, "tie_word_embeddings", False):
            self.tied_embedding_modules = ("model.embed_tokens", "lm_head")
        self.init_parallel_plans(
            {"tp": self.base_model_tp_plan, "ep": self.base_model_ep_plan, "fsdp": self.base_model_fsdp_plan}
        )
        self.distributed_config = distributed_config or DistributedConfig()
        if self.distributed_config.pp_size > 1:
            raise NotImplementedError(
                f"pp_size={self.distributed_config.pp_size}: pipeline parallelism is not implemented in moe_jax "
                "yet. Use tp_size / fsdp_size / ep_size, or pp_size=1."
            )
        self.layout = DeviceLayout.from_config(self.distributed_config)
        self.mesh = None if abstract else build_mesh(self.distributed_config, devices)
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
        self.experts_backend = experts_backend
        self.params: dict | None = None
        # One dropless runner per mode (inference / training): each keeps its capacity bucket and compiles.
        self._runners: dict[bool, DroplessRunner] = {}

    # ---- to implement per family -------------------------------------------------------------------
    def declare_tree(self) -> ModuleTree:
        raise NotImplementedError

    def sparse_layers(self) -> list[int]:
        raise NotImplementedError

    def experts_fn(self) -> Callable:
        """`experts_fn(tokens, expert_ids, weights, **experts_params) -> [N, H]` of this family."""
        raise NotImplementedError

    def forward_math(self, params: dict, input_ids, attention_mask, run_experts: dict[int, Callable],
                     inference: bool, rng: jax.Array | None = None) -> tuple[jax.Array, list, list]:
        """-> (logits [B, S, V], router_logits per sparse layer, statistics per sparse layer).
        `rng` feeds training-time randomness (Mixtral's router jitter); families without any ignore it."""
        raise NotImplementedError

    # ---- shardings -----------------------------------------------------------------------------------
    def named_shardings(self) -> dict[str, NamedSharding]:
        """Flat name -> NamedSharding of every parameter."""
        return {name: NamedSharding(self.mesh, layout.spec) for name, layout in self.param_layouts.items()}

    def batch_sharding(self) -> NamedSharding:
        axes = self.layout.batch_axes
        return NamedSharding(self.mesh, P(axes if axes else None, None))

    @property
    def data_parallel_size(self) -> int:
        """Number of distinct batches (the batch dimension is split into this many groups)."""
        return self.distributed_config.dp_size

    # ---- parameters ----------------------------------------------------------------------------------
    def init_params(self, seed: int = 0) -> dict:
        """Random parameters (HF's initialisation: normal(0, initializer_range), norms 1), each created
        directly in its sharding: nothing is materialised whole on one device."""
        specs = dict(self.module_tree.named_parameters())
        shardings = self.named_shardings()
        std = getattr(self.config, "initializer_range", 0.02)

        def create(key):
            params = {}
            for index, (name, spec) in enumerate(specs.items()):
                params[name] = _INITIALIZERS[spec.init](jax.random.fold_in(key, index), spec.shape, self.dtype, std)
            return params

        self.params = jax.jit(create, out_shardings=shardings)(jax.random.key(seed))
        self._runners = {}
        return self.params

    def set_params(self, params: dict[str, jax.Array]) -> None:
        """Use `params` (flat HF names), placing each in its sharding; names and shapes must match."""
        specs = dict(self.module_tree.named_parameters())
        missing, unexpected = specs.keys() - params.keys(), params.keys() - specs.keys()
        wrong_shape = [f"{n}: {tuple(params[n].shape)} != {specs[n].shape}" for n in specs.keys() & params.keys()
                       if tuple(params[n].shape) != specs[n].shape]
        if missing or unexpected or wrong_shape:
            raise ValueError(
                f"Parameters do not match {type(self).__name__}: missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}, wrong shapes {wrong_shape}."
            )
        shardings = self.named_shardings()
        self.params = {name: jax.device_put(jnp.asarray(params[name], self.dtype), shardings[name]) for name in specs}
        self._runners = {}

    # ---- checkpoints (implemented in moe_jax.pretrained, the layer above converters/) -----------------
    @classmethod
    def from_pretrained(cls, path, distributed_config=None, **kwargs) -> MoeForCausalLM:
        """Load an HF checkpoint directory (or hub repo id) onto the mesh of `distributed_config`."""
        from ..pretrained import from_pretrained

        return from_pretrained(path, distributed_config, model_class=cls, **kwargs)

    def save_pretrained(self, out_dir, **kwargs):
        """Write an HF checkpoint (per-expert keys, sharded safetensors, index, config.json)."""
        from ..pretrained import save_pretrained

        return save_pretrained(self, out_dir, **kwargs)

    # ---- forward -------------------------------------------------------------------------------------
    def experts_runners(self, capacity_bucket: float) -> dict[int, ShardedExperts]:
        """One runner per experts module, its mode read from the resolved plans."""
        runners = {}
        for layer in self.sparse_layers():
            module = f"model.layers.{layer}.mlp.experts"
            runners[layer] = ShardedExperts(
                mesh=self.mesh, layout=self.layout,
                mode=experts_mode(module, self.resolved_plans.tp, self.resolved_plans.ep),
                num_experts=self.config.num_experts, experts_fn=self.experts_fn(),
                ep_implementation=self.distributed_config.ep_implementation, capacity_bucket=capacity_bucket,
            )
        return runners

    def jitted_forward(self, capacity_bucket: float | None = None, *, inference: bool = True):
        """The jitted `(flat_params, input_ids [B, S], attention_mask [B, S], rng) -> ForwardOutput` for
        use inside your own programs (e.g. `jax.grad`, a train step). Shapes are static, so dispatch
        buffers have a fixed capacity: `capacity_bucket=None` takes the ladder's last rung, which never
        drops (buffers hold everything a device sends); a smaller bucket is faster and reports overflow
        in `statistics.dropped` (rerun with `DroplessRunner`, as `forward` does). B must be a multiple
        of `data_parallel_size`."""
        if capacity_bucket is None:
            capacity_bucket = float(self.layout.ep_size)
        return self._build_forward(capacity_bucket, inference)

    def _build_forward(self, capacity_bucket: float, inference: bool):
        run_experts = self.experts_runners(capacity_bucket)

        def forward(flat_params, input_ids, attention_mask, rng=None):
            logits, router_logits, statistics = self.forward_math(
                unflatten(flat_params), input_ids, attention_mask, run_experts, inference, rng=rng
            )
            total = DispatchStatistics.zeros()
            for layer_statistics in statistics:
                total = DispatchStatistics(total.dropped + layer_statistics.dropped,
                                           total.padded + layer_statistics.padded,
                                           jnp.maximum(total.capacity, layer_statistics.capacity))
            aux_loss = load_balancing_loss(
                router_logits or None, self.config.num_experts, self.config.num_experts_per_tok, attention_mask
            )
            return ForwardOutput(logits, router_logits, aux_loss, total)

        batch = self.batch_sharding()
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(forward, in_shardings=(self.named_shardings(), batch, batch, replicated))

    def forward(self, input_ids, attention_mask=None, *, params: dict | None = None,
                inference: bool = True, rng: jax.Array | None = None) -> ForwardOutput:
        """input_ids: [B, S] -> ForwardOutput (logits [B, S, V]). Dropless: an overflowing dispatch bucket is
        rerun at the next one (with the same `rng`, so the rerun is the same computation). B is padded to a
        multiple of the data-parallel size and cut back. `rng`: key for training-time randomness."""
        params = self.params if params is None else params
        if params is None:
            raise ValueError("The model has no parameters: call init_params(), set_params() or from_pretrained().")
        input_ids = np.asarray(input_ids)
        batch, sequence = input_ids.shape
        attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
        padded = -(-batch // self.data_parallel_size) * self.data_parallel_size
        if padded != batch:
            input_ids = np.concatenate([input_ids, np.zeros((padded - batch, sequence), input_ids.dtype)])
            attention_mask = np.concatenate([attention_mask, np.zeros((padded - batch, sequence), attention_mask.dtype)])
        if inference not in self._runners:
            self._runners[inference] = DroplessRunner(
                lambda bucket: self._build_forward(bucket, inference), self.layout.ep_size,
                statistics_of=lambda output: output.statistics,
            )
        output = self._runners[inference](
            params, jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32), rng
        )
        if padded != batch:
            router_logits = [r.reshape(padded, sequence, -1)[:batch].reshape(batch * sequence, -1)
                             for r in output.router_logits]
            output = ForwardOutput(output.logits[:batch], router_logits, output.aux_loss, output.statistics)
        return output

    def __call__(self, input_ids, attention_mask=None, **kwargs) -> jax.Array:
        """input_ids: [B, S] -> logits [B, S, V]."""
        return self.forward(input_ids, attention_mask, **kwargs).logits

