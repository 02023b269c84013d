"""A layout's step time guessed from its sizes alone, without compiling: the order in which layouts are compiled.

    guess = analytic_step_seconds(candidate, state, request, profile, devices_per_node=8)

Compute is the same on every layout of N devices (active parameters x tokens x 2 FLOPs per pass, split over
all of them), and so nearly is the memory traffic (each device reads the weights it computes with and its
tokens' activations, `ACTIVATION_TRAFFIC` hidden-wide buffers per layer and pass); the pipeline bubble idles a
share of both. What tells layouts apart is what each
moves: FSDP gathers the weights it holds a 1/fsdp share of (forward and backward) and scatters their
gradients; HSDP replicas all-reduce the gradients; tp all-reduces two activations per layer and pass; expert
parallelism sends each token's top-k rows out and back (all_to_all) or all-reduces the expert outputs
(all_reduce); pipeline stages pass activations on; context parallelism (cp) exchanges each attention layer's
keys and values between the cp ranks (the same volume gathered or passed around the ring, forward, and their
gradients backward) and all-reduces the gradients over cp (the parameters are replicated over it). Each volume
goes over the link its group uses, at the profile's rate. A guess to order the compiles by, never shown as a step time: the ranking reads the compiled
program (`step_time`).
"""

from __future__ import annotations

import math

import numpy as np

from .hardware import HardwareProfile
from .layouts import Candidate
from .request import PlanRequest
from .state_bytes import StateBytes

# Hidden-wide buffers a layer reads or writes per token and pass (norms, residuals, projections' inputs and
# outputs): a round figure, enough to weigh memory traffic against collectives when ordering compiles.
ACTIVATION_TRAFFIC = 16
# The pipeline loop copies its carried buffers (stage inputs, outputs, the stacked stage state) on every
# iteration: compiled pipeline steps move several times the memory traffic of flat layouts of the same sizes.
# A round factor on their memory traffic, so that the guess does not put them first for gathering nothing.
PIPELINE_MEMORY_FACTOR = 4


def _passes(request: PlanRequest) -> float:
    """Passes over the layers per step: forward, backward (twice the forward's work), and a recomputed
    forward under full remat."""
    if request.mode == "serve":
        return 1.0
    return 3.0 + (1.0 if request.remat == "full" else 0.0)


def _parameter_bytes(model) -> tuple[float, float, float]:
    """(dense bytes, expert bytes, active parameters: dense + the top-k share of the experts) of the model."""
    shapes, dtypes = model.storage_shapes(), model.storage_dtypes()
    dense = expert = dense_count = expert_count = 0.0
    for name, shape in shapes.items():
        count = math.prod(shape)
        size = count * np.dtype(dtypes[name]).itemsize
        if ".experts." in name:
            expert, expert_count = expert + size, expert_count + count
        else:
            dense, dense_count = dense + size, dense_count + count
    config = model.config
    active = dense_count + expert_count * config.num_experts_per_tok / max(config.num_experts, 1)
    return dense, expert, active


def _ring(group: int) -> float:
    return (group - 1) / group


def kv_bytes_per_token(config, itemsize: int) -> float:
    """Bytes of one token's keys and values in one attention layer (all KV heads)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * heads * head_dim * itemsize


# Hidden-wide buffers per token and layer the forward pass keeps for the backward one (norm inputs, attention
# and MLP inputs and outputs, the residual): a round figure, as ACTIVATION_TRAFFIC.
ACTIVATIONS_KEPT = 8


def activation_bytes_guess(candidate: Candidate, request: PlanRequest) -> float | None:
    """The activations one device keeps for the backward pass (bytes; None when serving): its tokens (the
    batch over the data-parallel groups, the sequence over cp, the hidden width over tp) x the layers of its stage
    x `ACTIVATIONS_KEPT`, a layer's input alone under full remat; under cp with "all_gather", each attention
    layer's keys and values gathered whole from the cp group are kept too (the ring keeps only its own)."""
    if request.mode != "train":
        return None
    layout, config = candidate.layout, candidate.model.config
    itemsize = np.dtype(request.compute_dtype).itemsize
    rows = request.batch_size / request.grad_accum / layout.data_parallel
    local_tokens = rows * request.seq_len / layout.cp
    layers = config.num_hidden_layers / layout.pp
    kept = 1 if request.remat == "full" else ACTIVATIONS_KEPT
    total = local_tokens * config.hidden_size * itemsize * kept * layers / layout.tp
    if layout.cp > 1 and layout.cp_strategy == "all_gather" and request.remat != "full":
        total += rows * request.seq_len * kv_bytes_per_token(config, itemsize) / layout.tp * layers
    return total


def analytic_step_seconds(candidate: Candidate, state: StateBytes, request: PlanRequest, profile: HardwareProfile,
                          devices_per_node: int) -> float:
    """The guessed step time of `candidate` (seconds): compute and memory traffic stretched by the bubble, plus
    every collective's bytes over its link."""
    layout, model = candidate.layout, candidate.model
    config = model.config
    dense, expert, active = _parameter_bytes(model)
    passes = _passes(request)
    training = request.mode == "train"
    activation_bytes = np.dtype(request.compute_dtype).itemsize
    layers, sparse = config.num_hidden_layers / layout.pp, len(model.sparse_layers()) / layout.pp
    tokens_per_group = request.tokens / layout.data_parallel / layout.cp   # a tp group shares its tokens
    compute = 2 * active * request.tokens * passes / layout.devices / profile.flops_per_second(request.compute_dtype)
    weights_read = dense / (layout.tp * layout.pp) + expert / (layout.ep * layout.pp)
    activations = (tokens_per_group / layout.tp * layers * config.hidden_size * activation_bytes
                   * ACTIVATION_TRAFFIC)
    memory = passes * (weights_read + activations) / profile.hbm_bytes_per_second
    memory *= PIPELINE_MEMORY_FACTOR if layout.pp > 1 else 1
    busy = (compute + memory) / (1 - layout.bubble_fraction)
    expert_fsdp = max(layout.fsdp * layout.tp // layout.ep, 1)      # experts: ep x expert-fsdp = fsdp x tp
    gathers = 3 if training else 1                                  # forward, backward; gradients scattered
    moved = {                                                       # group size -> bytes one device sends
        layout.tp * layout.cp * layout.fsdp: gathers * (dense / (layout.tp * layout.pp) * _ring(layout.fsdp)
                                            + expert / (layout.ep * layout.pp) * _ring(expert_fsdp)),
    }
    if training and layout.dp_replicate > 1:
        moved[layout.devices] = 2 * state.gradients * _ring(layout.dp_replicate)
    if layout.cp > 1:       # cp ranks lie between fsdp and tp: a cp group spans cp x tp consecutive devices
        kv = tokens_per_group * kv_bytes_per_token(config, activation_bytes) / layout.tp
        # forward: (cp - 1) ranks' keys and values in every attention layer; backward: their gradients back
        volume = (layers * (2 if training else 1) * (layout.cp - 1) * kv
                  + (2 * state.gradients * _ring(layout.cp) if training else 0.0))
        moved[layout.cp * layout.tp] = moved.get(layout.cp * layout.tp, 0.0) + volume
    if layout.tp > 1:
        moved[layout.tp] = moved.get(layout.tp, 0.0) + 2 * layers * passes * 2 * _ring(layout.tp) * (
            tokens_per_group * config.hidden_size * activation_bytes)
    if layout.ep > 1:
        rows = tokens_per_group / layout.tp * config.num_experts_per_tok
        if layout.ep_implementation == "all_reduce":
            per_layer = 2 * _ring(layout.ep) * tokens_per_group * config.hidden_size * activation_bytes
        else:
            per_layer = 2 * _ring(layout.ep) * rows * config.hidden_size * activation_bytes
        moved[layout.ep] = moved.get(layout.ep, 0.0) + sparse * passes * per_layer
    if layout.pp > 1:
        moved[layout.devices] = moved.get(layout.devices, 0.0) + (2 if training else 1) * (
            tokens_per_group * config.hidden_size * activation_bytes)
    collectives = sum(volume / profile.link(group > devices_per_node).bytes_per_second
                      for group, volume in moved.items() if group > 1)
    return busy + collectives
