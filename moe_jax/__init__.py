"""moe_jax: tensor, expert and fully-sharded data parallelism for mixture-of-experts models in JAX."""

from .distributed.config import DistributedConfig

__all__ = ["DistributedConfig"]
__version__ = "0.1.0"
