"""What a train step refuses: before it is built, host offload where the backend has no host memory and kept
quantised codes among the trained arrays; at each call, a batch of unknown keys or shapes."""

from __future__ import annotations

import numpy as np

from ..models.routing_replay import check_routing

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


def check_batch_keys(batch: dict, keys: tuple[str, ...], replay_model=None, objective=None) -> tuple[int, int]:
    """[B, S] of a batch of known `keys` (ValueError naming what is wrong otherwise). replay_model: the model of a
    step with routing replay, whose batches must hold a "routing" that fits it; None: a step without replay.
    objective: the step's token objective, whose `batch_keys` every batch holds as [B, S] arrays."""
    unknown = set(batch) - set(keys)
    if unknown or "input_ids" not in batch:
        extra = "" if objective is None else f" / {' / '.join(repr(k) for k in objective.batch_keys)} ([B, S])"
        raise ValueError(f"A batch is a dict with 'input_ids' and optionally 'attention_mask' / 'labels' / "
                         f"'segment_ids' / 'positions' (all [B, S]) / 'routing' ([B, L, S, K], with routing_replay)"
                         f"{extra}; got keys {sorted(batch)}.")
    shape = tuple(np.shape(batch["input_ids"]))
    if len(shape) != 2:
        raise ValueError(f"input_ids must be [batch, sequence], got shape {shape}.")
    for key in () if objective is None else objective.batch_keys:
        if key not in batch:
            raise ValueError(f"the {objective.name!r} objective needs batch[{key!r}] [B, S] = {list(shape)}, aligned "
                             f"with the predictions (position t: the token at t + 1); the batch has {sorted(batch)}.")
        if tuple(np.shape(batch[key])) != shape:
            raise ValueError(f"batch[{key!r}] has shape {list(np.shape(batch[key]))}; the {objective.name!r} "
                             f"objective needs [B, S] = {list(shape)}, like input_ids.")
    if replay_model is None and "routing" in batch:
        raise ValueError("the batch holds 'routing', but this train step does not replay it: build it with "
                         "make_train_step(..., routing_replay=True), or drop the key.")
    if replay_model is not None:
        if "routing" not in batch:
            raise ValueError("a train step with routing_replay=True needs batch['routing'] [B, L, S, K]: the expert "
                             "ids the sampler's forward returned (ModelOutput.routing with return_routing=True).")
        config = replay_model.config
        check_routing(batch["routing"], shape, len(replay_model.sparse_layers()), config.num_experts_per_tok,
                      config.num_experts, type(replay_model).__name__)
    return shape
