"""Where a model's parameters live: their shardings, dtypes and shapes as stored (`model.params`: HF names,
scanned layer runs stacked), and creating, placing and reading them. A mixin of `MoeForCausalLM`, over what the
model resolved when it was built (`mesh`, `param_layouts`, `module_tree`, `layer_stack`, `dtype`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.mesh import PP
from ..models.step_checks import NO_PARAMS

INITIALIZERS: dict[str, Callable] = {
    "normal": lambda key, shape, dtype, std: std * jax.random.normal(key, shape, dtype),
    "zeros": lambda key, shape, dtype, std: jnp.zeros(shape, dtype),
    "ones": lambda key, shape, dtype, std: jnp.ones(shape, dtype),
}


class ParameterStorage:
    """Parameter placement and storage of a built model (see the module docstring)."""

    def named_shardings(self) -> dict[str, NamedSharding]:
        """HF name -> NamedSharding of every parameter (one layer each, as checkpoints hold them)."""
        return {name: NamedSharding(self.mesh, layout.spec) for name, layout in self.param_layouts.items()}

    def storage_shardings(self) -> dict[str, NamedSharding]:
        """Storage name -> NamedSharding of `model.params` (a scanned run: its layers' spec behind an
        unsharded layer axis)."""
        shardings = {}
        stage_axis = PP if self.layer_stack.pipeline is not None else None  # pipeline rows: stage by stage
        for storage in self.layer_stack.members:
            spec = self.param_layouts[self.layer_stack.first_member(storage)].spec
            if self.layer_stack.is_stacked(storage):
                spec = P(stage_axis, *spec)
            shardings[storage] = NamedSharding(self.mesh, spec)
        return shardings

    def param_dtype(self, name: str) -> jnp.dtype:
        """The dtype parameter (or storage) `name` is held in: the model's, float32 for buffers, the declared one
        for kept-quantised codes and scales (`ParamSpec.keep_dtype`)."""
        spec = self.module_tree.params.get(name) or self.module_tree.params[self.layer_stack.first_member(name)]
        if spec.buffer:
            return jnp.dtype(jnp.float32)
        return jnp.dtype(spec.dtype) if spec.keep_dtype else self.dtype

    def storage_dtypes(self) -> dict[str, jnp.dtype]:
        """Storage name -> dtype of `model.params` (`param_dtype`)."""
        return {storage: self.param_dtype(storage) for storage in self.layer_stack.members}

    def storage_shapes(self) -> dict[str, tuple[int, ...]]:
        specs = dict(self.module_tree.named_parameters())
        stack = self.layer_stack
        return {storage: ((len(names),) if stack.is_stacked(storage) else ()) + specs[stack.first_member(storage)].shape
                for storage, names in stack.members.items()}

    def abstract_params(self) -> dict[str, jax.ShapeDtypeStruct]:
        """`model.params` as shapes, dtypes and shardings, nothing allocated: what lowering a program needs, and
        all a model on abstract target devices (`moe_jax.distributed.target_devices`) can hold."""
        self._require_mesh("abstract_params")
        shapes, dtypes, shardings = self.storage_shapes(), self.storage_dtypes(), self.storage_shardings()
        return {name: jax.ShapeDtypeStruct(shape, dtypes[name], sharding=shardings[name])
                for name, shape in shapes.items()}

    def batch_sharding(self) -> NamedSharding:
        axes = self.layout.batch_axes
        return NamedSharding(self.mesh, P(axes if axes else None, None))

    @property
    def data_parallel_size(self) -> int:
        """Number of distinct batches (the batch dimension is split into this many groups)."""
        return self.distributed_config.dp_size

    def init_params(self, seed: int = 0) -> dict:
        """Random parameters (HF's initialisation: normal(0, initializer_range), norms 1), each created
        directly in its sharding: nothing is materialised whole on one device. The values of each HF
        parameter do not depend on `scan_layers`."""
        self._require_mesh("init_params")
        specs = dict(self.module_tree.named_parameters())
        std = getattr(self.config, "initializer_range", 0.02)

        def create(key):
            params = {}
            for index, (name, spec) in enumerate(specs.items()):
                params[name] = INITIALIZERS[spec.init](jax.random.fold_in(key, index), spec.shape,
                                                       self.param_dtype(name), std)
            return self.layer_stack.stack(params)

        self.params = jax.jit(create, out_shardings=self.storage_shardings())(jax.random.key(seed))
        return self.params

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Use `params` (flat HF names, one array per layer, as checkpoints hold them), placing each in its
        sharding and stacking scanned runs; names and shapes must match."""
        self._require_mesh("set_params")
        specs = dict(self.module_tree.named_parameters())
        missing, unexpected = specs.keys() - params.keys(), params.keys() - specs.keys()
        wrong_shape = [f"{n}: {tuple(params[n].shape)} != {specs[n].shape}" for n in specs.keys() & params.keys()
                       if tuple(params[n].shape) != specs[n].shape]
        if missing or unexpected or wrong_shape:
            raise ValueError(
                f"Parameters do not match {type(self).__name__}: missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}, wrong shapes {wrong_shape}. set_params takes HF names, one array per layer "
                "(model.hf_params() gives them)."
            )
        shardings = self.named_shardings()
        placed = {name: jax.device_put(jnp.asarray(params[name], self.param_dtype(name)), shardings[name])
                  for name in specs}
        self.params = jax.jit(self.layer_stack.stack, out_shardings=self.storage_shardings())(placed)

    def hf_params(self, params: Mapping[str, Any] | None = None) -> Mapping[str, jax.Array]:
        """`params` (default `model.params`) under HF names, one array per layer, in declaration order;
        stacked layers are sliced lazily, one at a time, when looked up."""
        params = self.params if params is None else params
        if params is None:
            raise ValueError(NO_PARAMS)
        return self.layer_stack.unstack(params)
