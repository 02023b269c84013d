"""A Flax NNX face for moe_jax models: `nnx.Module` objects whose `nnx.Param` variables are the sharded
parameters::

    from flax import nnx
    import moe_jax.nnx

    model = moe_jax.nnx.AutoModelForCausalLM.from_pretrained(path, DistributedConfig(fsdp_size=4, ep_size=4))
    logits = model(input_ids)                                   # [B, S, V]: the engine's `apply`
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param), model)

The pure API (`model.apply`, `moe_jax.training`) stays the core; this is a thin face over it.
"""

from .auto import AutoModelForCausalLM
from .module import MoeCausalLM
from .updates import commit_to_mesh, update_unless_dropped
from .variables import Buffer, DispatchStats

__all__ = ["AutoModelForCausalLM", "Buffer", "DispatchStats", "MoeCausalLM", "commit_to_mesh", "update_unless_dropped"]
