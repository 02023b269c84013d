"""moe_jax: tensor, expert and fully-sharded data parallelism for mixture-of-experts models in JAX.

The names below and the subpackages (`moe_jax.distributed`, `moe_jax.training`, `moe_jax.inference`,
`moe_jax.nnx`, ...) are imported on first use (PEP 562), as `jax.distributed` is: `import moe_jax` then
`moe_jax.distributed.initialize()` works, and what needs no JAX (`moe-jax launch`, `moe-jax --help`,
`moe_jax.distributed.config`) starts without importing it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from . import verbosity as _verbosity

if TYPE_CHECKING:
    from .causal_lm.auto import AutoModelForCausalLM
    from .distributed.config import DistributedConfig
    from .distributed.expert_parallel import EPImplementation, EPImplementationInterface

_EXPORTS = {
    "AutoModelForCausalLM": ".causal_lm.auto",
    "DistributedConfig": ".distributed.config",
    "EPImplementation": ".distributed.expert_parallel",
    "EPImplementationInterface": ".distributed.expert_parallel",
}

# Subpackages and modules that `moe_jax.<name>` imports on first access.
_SUBMODULES = frozenset({
    "causal_lm", "chat_template", "checkpoint_files", "cli", "distributed", "host_devices", "host_memory",
    "inference", "models", "module_tree", "nn", "nnx", "ops", "parameter_dtypes", "pretrained", "reporting",
    "serving", "tokenization", "training", "verbosity",
})

__all__ = ["AutoModelForCausalLM", "DistributedConfig", "EPImplementation", "EPImplementationInterface"]
__version__ = "0.1.0"

# Transformers (for tokenizers) announces a missing torch when imported; moe_jax needs none (`verbosity`).
_verbosity.quiet_transformers_notice()


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import sets it as an attribute of moe_jax
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    """The public names, the module's dunders and its subpackages (not its own helpers: importlib,
    TYPE_CHECKING)."""
    subpackages = [name for name, value in globals().items()
                   if isinstance(value, ModuleType) and value.__name__.startswith(__name__ + ".")]
    return sorted({*__all__, *_SUBMODULES, *subpackages, *(name for name in globals() if name.startswith("__"))})
