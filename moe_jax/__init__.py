"""moe_jax: tensor, expert and fully-sharded data parallelism for mixture-of-experts models in JAX."""

from .causal_lm.auto import AutoModelForCausalLM
from .distributed.config import DistributedConfig
from .distributed.expert_parallel import EPImplementation, EPImplementationInterface

__all__ = ["AutoModelForCausalLM", "DistributedConfig", "EPImplementation", "EPImplementationInterface"]
__version__ = "0.1.0"
