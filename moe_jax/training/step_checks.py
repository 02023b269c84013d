"""What a train step refuses before it is built: host offload where the backend has no host memory, and kept
quantised codes among the trained arrays."""

from __future__ import annotations

OFFLOAD_MEMORY_KIND = "pinned_host"


def check_offload_supported(model) -> None:
    """CPU offload keeps state in `pinned_host` memory: a clear error where the backend has none."""
    device = model.mesh.devices.flat[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    if OFFLOAD_MEMORY_KIND not in kinds:
        raise NotImplementedError(
            f"fsdp_cpu_offload=True needs the '{OFFLOAD_MEMORY_KIND}' memory kind, which the {device.platform} "
            f"backend ({device.device_kind}) does not offer (it has {sorted(kinds)}). Train without CPU offload."
        )


def check_no_quantized_codes_trained(model, selected) -> None:
    """Quantised codes and scales (`dequantize=False`, `quantize=`) stay frozen: an adapter or the unquantised
    parameters may train on them (QLoRA's way), they may not."""
    quantization = getattr(model, "weight_quantization", None)
    kept = getattr(model, "kept_quantization", None) or (quantization and quantization.scheme)
    if kept is None:
        return
    stored = {name for name, spec in model.module_tree.params.items() if spec.keep_dtype}
    trained = [name for storage in selected.base for name in model.layer_stack.members[storage] if name in stored]
    if selected.everything or trained:
        raise ValueError(f"the model keeps its {kept} weights quantised ({trained[0] if trained else 'every weight'} "
                         "selected), which cannot be trained: train a LoRA adapter on the frozen quantised base "
                         "(model.add_adapter(LoraConfig(...)); `moe-jax train --lora-rank R`), select trainable "
                         "parameters that are not quantised, or load with dequantize=True (without quantize=) to "
                         "train every weight.")
