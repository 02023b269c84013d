"""Which compiler plans the layouts: XLA:GPU for a GPU target when JAX's CUDA plugin is installed, else XLA:CPU;
an explicit choice the hardware cannot take is one error."""

import pytest

from moe_jax.distributed import targets
from moe_jax.planning.search import resolve_compiler


def test_the_default_is_the_target_where_the_plugin_and_a_target_exist(monkeypatch):
    monkeypatch.setattr(targets, "cuda_plugin_available", lambda: True)
    assert resolve_compiler(None, "h100") == "target" and resolve_compiler(None, "b200") == "target"
    assert resolve_compiler(None, "tpu-v5p") == "cpu" and resolve_compiler(None, "cpu") == "cpu"
    monkeypatch.setattr(targets, "cuda_plugin_available", lambda: False)
    assert resolve_compiler(None, "h100") == "cpu"
    assert resolve_compiler("cpu", "h100") == "cpu"


def test_a_target_compile_needs_a_gpu_target():
    with pytest.raises(ValueError, match="--hardware tpu-v5p has none: use --compiler cpu"):
        resolve_compiler("target", "tpu-v5p")
    with pytest.raises(ValueError, match="--compiler 'gpu'"):
        resolve_compiler("gpu", "h100")
