"""Helpers for parity tests against the PyTorch reference: torch modules -> HF-named JAX parameter dicts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def to_jax(tensor, dtype=None):
    """A torch tensor as a JAX array (bf16 goes through float32, which numpy lacks, and back)."""
    import torch

    source_dtype = tensor.dtype
    array = jnp.asarray(tensor.detach().to(torch.float32).numpy())
    if dtype is None and source_dtype == torch.bfloat16:
        dtype = jnp.bfloat16
    return array if dtype is None else array.astype(dtype)


def to_numpy(x) -> np.ndarray:
    """A JAX array or torch tensor as a float32 numpy array, for comparisons."""
    if hasattr(x, "detach"):
        import torch

        return x.detach().to(torch.float32).numpy()
    return np.asarray(jnp.asarray(x, jnp.float32))


def params_of(module, dtype=None) -> dict:
    """The module's parameters as a nested dict keyed by HF names: `{"q_proj": {"weight": ...}, ...}`."""
    tree: dict = {}
    for name, parameter in module.named_parameters():
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = to_jax(parameter, dtype)
    return tree


def randomize_(module, seed: int, scale: float = 0.2) -> None:
    """Overwrite every parameter with seeded noise; norm weights stay near 1 so the scale of activations holds."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                parameter.copy_(1.0 + 0.1 * noise)
            else:
                parameter.copy_(scale * noise)


def max_abs_diff(a, b, where=None) -> float:
    """Largest absolute difference, optionally only over entries where `where` (broadcastable) is True."""
    diff = np.abs(to_numpy(a) - to_numpy(b))
    if where is not None:
        diff = diff[np.broadcast_to(np.asarray(where), diff.shape)]
    return float(diff.max())
