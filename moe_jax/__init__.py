"""moe_jax: tensor, expert and fully-sharded data parallelism for mixture-of-experts models in JAX."""

from .distributed.config import DistributedConfig
from .distributed.expert_parallel import EPImplementation, EPImplementationInterface
from .models.auto import AutoModelForCausalLM

__all__ = ["AutoModelForCausalLM", "DistributedConfig", "EPImplementation", "EPImplementationInterface"]
__version__ = "0.1.0"
