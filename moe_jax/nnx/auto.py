"""`moe_jax.nnx.AutoModelForCausalLM`: the family from config.json, as an NNX module."""

from __future__ import annotations

import os

from ..causal_lm.auto import AutoModelForCausalLM as EngineAuto
from .module import MoeCausalLM


class AutoModelForCausalLM:
    """`moe_jax.AutoModelForCausalLM`'s entry points, returning `MoeCausalLM` modules.

    Keyword arguments go to the model (`dtype`, `devices`, `scan_layers`, `remat`, `experts_backend`,
    `progress`, ...), except `capacity`, `deterministic` and `compute_dtype`, which go to the module."""

    @staticmethod
    def from_pretrained(path: str | os.PathLike, distributed_config=None, *, capacity: float | None = None,
                        deterministic: bool = True, compute_dtype=None, **kwargs) -> MoeCausalLM:
        """Load an HF checkpoint directly into the shardings of `distributed_config`."""
        engine = EngineAuto.from_pretrained(path, distributed_config, **kwargs)
        return MoeCausalLM(engine, capacity=capacity, deterministic=deterministic, compute_dtype=compute_dtype)

    @staticmethod
    def from_config(config: dict | str | os.PathLike, distributed_config=None, *, seed: int = 0,
                    capacity: float | None = None, deterministic: bool = True, compute_dtype=None,
                    **kwargs) -> MoeCausalLM:
        """A randomly initialised model (HF's initialisation), each parameter created in its sharding.
        Under `nnx.eval_shape` nothing is allocated: the variables hold `ShapeDtypeStruct` values with their
        shardings (a restore target)."""
        engine = EngineAuto.from_config(config, distributed_config, **kwargs)
        engine.init_params(seed)
        return MoeCausalLM(engine, capacity=capacity, deterministic=deterministic, compute_dtype=compute_dtype)
