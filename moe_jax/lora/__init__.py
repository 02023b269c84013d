"""LoRA adapters in PEFT's format: attention and other Linear projections, and the fused expert weights per
expert (PEFT's `target_parameters`), sharded with what they adapt::

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model.add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], target_parameters=experts))
    model.save_adapter("adapter/")          # adapter_config.json + adapter_model.safetensors, as PEFT writes them
    model.load_adapter("adapter/")          # PEFT's files, or ours

`config` (the settings), `targets` (which weights, matched as PEFT matches), `layout` (names, shapes, shardings,
how a step attaches the factors), `peft_files` (PEFT's keys and files), `adapter_set` (several adapters at once,
each token its own, for serving). The math is `moe_jax.ops.lora`'s.
"""

from .adapter_set import ADAPTER_INDEX, AdapterSet, load_adapter_set
from .config import LoraConfig
from .layout import AdapterLayout
from .peft_files import read_adapter_config, read_adapter_tensors, save_adapter_files

# LoraConfig first: the API reference lists the members in this order.
__all__ = ["LoraConfig", "read_adapter_config", "read_adapter_tensors", "save_adapter_files", "AdapterLayout",
           "AdapterSet", "load_adapter_set", "ADAPTER_INDEX"]
